#!/usr/bin/env node
// Streams a generation from hetero-infer's gateway, with stubs built at run time from protos/.
//
//   npm install
//   node stream.js "What is the capital of France?" [--address 127.0.0.1:50051] [--max-tokens 64]
//                  [--temperature 0] [--raw] [--ca ca.pem] [--json-schema SCHEMA]
//
// HETERO_API_KEY, when set, is sent as `authorization: Bearer <key>`. --raw sends the text as a
// plain prompt instead of a chat message. --json-schema constrains the answer to JSON valid
// against SCHEMA (JSON text, or @file.json): SamplingParams.json_schema, structured output. Text is written to stdout as it arrives; the finish
// reason and token usage go to stderr.
"use strict";

const fs = require("fs");
const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

function parseArgs(argv) {
  const opts = { address: "127.0.0.1:50051", maxTokens: 64, temperature: 0, raw: false, ca: null, prompt: null,
                 jsonSchema: null };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (a === "--address") opts.address = argv[++i];
    else if (a === "--max-tokens") opts.maxTokens = Number(argv[++i]);
    else if (a === "--temperature") opts.temperature = Number(argv[++i]);
    else if (a === "--ca") opts.ca = argv[++i];
    else if (a === "--raw") opts.raw = true;
    else if (a === "--json-schema") opts.jsonSchema = argv[++i];
    else if (opts.prompt === null) opts.prompt = a;
    else throw new Error(`unexpected argument ${a}`);
  }
  if (!opts.prompt) throw new Error("usage: node stream.js PROMPT [--address HOST:PORT] [--max-tokens N] [--raw]");
  return opts;
}

function loadInference(protoRoot) {
  const definition = protoLoader.loadSync(path.join(protoRoot, "hetero/v1/inference.proto"), {
    includeDirs: [protoRoot],
    keepCase: true, // field names as in the .proto (finish_reason, max_tokens)
    longs: String,
    enums: String,
    defaults: false,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).hetero.v1.Inference;
}

function main() {
  const opts = parseArgs(process.argv.slice(2));
  const protoRoot = process.env.HETERO_PROTOS || path.resolve(__dirname, "../../protos");
  const Inference = loadInference(protoRoot);
  const credentials = opts.ca ? grpc.credentials.createSsl(fs.readFileSync(opts.ca)) : grpc.credentials.createInsecure();
  const client = new Inference(opts.address, credentials);

  const metadata = new grpc.Metadata();
  if (process.env.HETERO_API_KEY) metadata.set("authorization", `Bearer ${process.env.HETERO_API_KEY}`);
  const params = { max_tokens: opts.maxTokens, temperature: opts.temperature };
  if (opts.jsonSchema !== null) {
    const text = opts.jsonSchema.startsWith("@") ? fs.readFileSync(opts.jsonSchema.slice(1), "utf8") : opts.jsonSchema;
    params.json_schema = JSON.stringify(JSON.parse(text)); // the constraint oneof's JSON Schema (as JSON text)
  }
  const request = {
    params,
    ...(opts.raw ? { prompt: opts.prompt } : { chat: { messages: [{ role: "user", content: opts.prompt }] } }),
  };

  const call = client.Generate(request, metadata);
  call.on("data", (message) => {
    process.stdout.write(message.text || ""); // proto3: an empty string is not sent
    if (message.finish_reason && message.finish_reason !== "FINISH_REASON_UNSPECIFIED") {
      const u = message.usage || {};
      process.stderr.write(`\n[finish_reason=${message.finish_reason} prompt_tokens=${u.prompt_tokens} ` +
                           `completion_tokens=${u.completion_tokens}]\n`);
    }
  });
  call.on("error", (err) => {
    process.stderr.write(`\nerror: ${err.code} ${err.details}\n`);
    process.exitCode = 1;
    client.close();
  });
  call.on("end", () => client.close());
}

main();
