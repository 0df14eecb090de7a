"""The command bridge backend: an external program answers a request instead of the engine.

The program runs once per request (once per sample when n > 1) as an argv list (never
through a shell), with the prompt in `HETERO_PROMPT` and the sampling parameters in
`HETERO_*` variables; its stdout is streamed back as text. A timeout, an output cap and a
non-zero exit (reported with the tail of its stderr) bound what a misbehaving program can do.
`CommandBridgeBackend` puts the program behind the gateway's backend interface.
"""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
import json
import os
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator

import structlog

from gateway.backends.backend import EmbeddingCall, EmbeddingOutput, SampleOutput
from gateway.text.chat import render_chat
from gateway.validation import PreparedRequest
from hetero.v1 import common_pb2, inference_pb2
from hetero_common.config import BackendConfig
from hetero_common.errors import (
    CommandBridgeError,
    CommandBridgeNotFoundError,
    DeadlineExceededError,
    ModelNotFoundError,
    UnsupportedError,
    ValidationError,
)
from hetero_common.sampling import Sampling, sample_seed
from hetero_common.tokenizer import TextTokenizer
from hetero_common.tenancy import client_id

log = structlog.get_logger("gateway.backends.command_bridge")
STDERR_TAIL_BYTES = 2000
READ_CHUNK_BYTES = 4096


@dataclass
class TextChunk:
    """A piece of a backend's answer; the last one has `finished` set (and `truncated` when cut,
    `aborted` when an Abort killed the program)."""

    text: str
    finished: bool = False
    truncated: bool = False
    aborted: bool = False


def bridge_environment(request_id: str, prompt: str, sampling: Sampling, model: str, index: int = 0) -> dict[str, str]:
    """The program's environment: ours minus our own HETERO_* settings, plus the request's."""
    if "\x00" in prompt:
        raise ValidationError("prompt holds a NUL character, which the command bridge cannot pass in HETERO_PROMPT")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETERO_")}
    env.update({
        "HETERO_PROMPT": prompt,
        "HETERO_REQUEST_ID": request_id,
        "HETERO_MODEL": model,
        "HETERO_MAX_TOKENS": str(sampling.max_tokens),
        "HETERO_TEMPERATURE": repr(float(sampling.temperature)),
        "HETERO_TOP_P": repr(float(sampling.top_p)),
        "HETERO_TOP_K": str(sampling.top_k),
        "HETERO_STOP": json.dumps(list(sampling.stop)),
        "HETERO_SAMPLE_INDEX": str(index),  # which of the request's n samples this run answers
    })
    if sampling.seed is not None:
        env["HETERO_SEED"] = str(sampling.seed)
    return env


# SamplingParams controls that act on the model's logits, which the program never shows us: a request
# that sets one (to other than its default) is refused rather than answered as if it had been honoured.
_LOGITS_CONTROL_DEFAULTS = (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0),
                            ("min_p", 0.0), ("min_tokens", 0), ("logit_bias", {}))


def refuse_logits_controls(sampling: Sampling) -> None:
    for name, default in _LOGITS_CONTROL_DEFAULTS:
        if getattr(sampling, name) != default:
            raise ValidationError(f"params.{name} is not supported by the command bridge backend "
                                  "(serving.backend.kind command_bridge); leave it unset")
    if sampling.constraint is not None:  # a program's text cannot be constrained token by token
        raise ValidationError(f"{sampling.constraint.field} (constrained decoding) is not supported by the command "
                              "bridge backend (serving.backend.kind command_bridge); leave the constraint unset",
                              sampling.constraint.kind)


def refuse_tools_and_constraints(request: inference_pb2.GenerateRequest) -> None:
    """A program answers in free text: it can neither be constrained nor asked for tool calls."""
    chat = request.chat if request.WhichOneof("input") == "chat" else None
    if chat is not None and chat.tools and chat.tool_choice != "none":
        raise ValidationError("tools: tool calls (chat.tools) are not served by the command_bridge backend "
                              "(serving.backend.kind command_bridge); send tool_choice none or no tools", "tools")
    kind = request.params.WhichOneof("constraint")
    if kind is not None:
        raise ValidationError(f"params.{kind}: structured output is not served by the command_bridge backend "
                              "(serving.backend.kind command_bridge)", f"params.{kind}")


@dataclass
class _ProgramRun:
    """One run of the program: its process, the task keeping its stderr's tail, the decoder of its
    stdout (UTF-8 split across reads), its deadline (loop time), and whether its last chunk went out."""

    request_id: str
    process: asyncio.subprocess.Process
    stdout: asyncio.StreamReader
    stderr_tail: asyncio.Task[str]
    deadline: float
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))
    finished: bool = False

    def remaining(self) -> float:
        return self.deadline - asyncio.get_running_loop().time()


class CommandBridge:
    name = "command_bridge"

    def __init__(self, backend: BackendConfig) -> None:
        assert backend.command is not None and backend.command.program
        self.program = backend.command.program
        self.args = list(backend.command.args)
        self.timeout_s = backend.command_timeout_s
        self.max_output_bytes = backend.command_max_output_bytes
        self.processes: dict[str, asyncio.subprocess.Process] = {}  # request id -> its program running now
        self.aborted: set[str] = set()

    def abort(self, request_id: str, any_tenant: bool = False) -> bool:
        """Kill the request's program (`request_id`: its scoped id; with `any_tenant` a client id, in
        every tenant's namespace); its stream then ends with a chunk marked `aborted`."""
        ids = [i for i in self.processes if client_id(i) == request_id] if any_tenant else [request_id]
        found = False
        for rid in ids:
            process = self.processes.get(rid)
            if process is None:
                continue
            found = True
            self.aborted.add(rid)
            if process.returncode is None:
                process.kill()
        return found

    async def stream(self, request_id: str, prompt: str, sampling: Sampling, model: str,
                     index: int = 0) -> AsyncIterator[TextChunk]:
        run = await self._start(request_id, bridge_environment(request_id, prompt, sampling, model, index))
        try:
            async with aclosing(self._output(run)) as chunks:
                async for chunk in chunks:
                    run.finished = chunk.finished  # set before the yield: the client may stop at the last chunk
                    yield chunk
            if not run.finished:
                last = await self._last_chunk(run)
                run.finished = True
                yield last
        except asyncio.TimeoutError:
            raise DeadlineExceededError(f"command bridge program {self.program!r} ran longer than "
                                        f"serving.backend.command_timeout_s ({self.timeout_s:g} s); raise it or fix "
                                        "the program") from None
        finally:
            await self._release(run)

    async def _start(self, request_id: str, env: dict[str, str]) -> _ProgramRun:
        """The program started for the request, its stderr read in the background, its deadline set."""
        try:
            process = await asyncio.create_subprocess_exec(
                self.program, *self.args, env=env, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        except (FileNotFoundError, PermissionError, NotADirectoryError) as exc:
            raise CommandBridgeNotFoundError(
                f"command bridge program {self.program!r} cannot be run ({exc.strerror or exc}); "
                "fix serving.backend.command.program") from exc
        assert process.stdout is not None and process.stderr is not None
        self.processes[request_id] = process
        return _ProgramRun(request_id, process, process.stdout, asyncio.create_task(self._stderr_tail(process.stderr)),
                           asyncio.get_running_loop().time() + self.timeout_s)

    async def _output(self, run: _ProgramRun) -> AsyncIterator[TextChunk]:
        """The program's stdout as text until it ends, or until the output cap (that chunk is the
        last: finished and truncated). Raises asyncio.TimeoutError past the deadline."""
        written = 0
        while True:
            remaining = run.remaining()
            if remaining <= 0:
                raise asyncio.TimeoutError
            data = await asyncio.wait_for(run.stdout.read(READ_CHUNK_BYTES), remaining)
            if not data:
                return
            if written + len(data) > self.max_output_bytes:
                # A character cut by the cap is dropped, not replaced.
                text = run.decoder.decode(data[: self.max_output_bytes - written])
                log.warning("bridge output over the cap; program killed", max_output_bytes=self.max_output_bytes)
                yield TextChunk(text, finished=True, truncated=True)
                return
            written += len(data)
            text = run.decoder.decode(data)
            if text:
                yield TextChunk(text)

    async def _last_chunk(self, run: _ProgramRun) -> TextChunk:
        """After stdout's end: the program's exit. An Abort's kill ends the stream `aborted`; any
        other non-zero exit is an error carrying the tail of stderr."""
        code = await asyncio.wait_for(run.process.wait(), max(0.1, run.remaining()))
        tail = await run.stderr_tail
        if run.request_id in self.aborted:
            return TextChunk(run.decoder.decode(b"", final=True), finished=True, aborted=True)
        if code != 0:
            raise CommandBridgeError(f"command bridge program {self.program!r} exited with code {code}; "
                                     f"stderr tail: {tail or '(empty)'}")
        return TextChunk(run.decoder.decode(b"", final=True), finished=True)

    async def _release(self, run: _ProgramRun) -> None:
        """Forget the run, and kill the program if it still runs (timeout, output cap, or the client went away)."""
        self.processes.pop(run.request_id, None)
        self.aborted.discard(run.request_id)
        if run.process.returncode is None:
            run.process.kill()
            # Read stdout to its end: a pipe whose reading is paused (a full buffer) never
            # reports EOF, and asyncio's wait() waits for every pipe to close.
            while await run.stdout.read(READ_CHUNK_BYTES):
                pass
            await run.process.wait()
        if not run.stderr_tail.done():
            run.stderr_tail.cancel()
        if not run.finished:
            log.info("bridge request ended early", pid=run.process.pid)

    @staticmethod
    async def _stderr_tail(stream: asyncio.StreamReader) -> str:
        tail = b""
        while chunk := await stream.read(READ_CHUNK_BYTES):
            tail = (tail + chunk)[-STDERR_TAIL_BYTES:]
        return tail.decode("utf-8", errors="replace").strip()


def bridge_prompt(request: inference_pb2.GenerateRequest, tokenizer: TextTokenizer) -> str:
    """The prompt as text for the program: as sent, the rendered chat, or decoded token ids."""
    kind = request.WhichOneof("input")
    if kind == "prompt":
        return request.prompt
    if kind == "chat":
        return render_chat(tokenizer, request.chat)
    return tokenizer.decode(list(request.prompt_token_ids.ids))


class CommandBridgeBackend:
    """The program's text as responses marked backend="command_bridge". With n > 1 the program
    runs once per sample, one after another, each with the sample's seed (as the engine derives
    it) and HETERO_SAMPLE_INDEX. Stop strings are the program's to honour (HETERO_STOP)."""

    def __init__(self, bridge: CommandBridge, tokenizer: TextTokenizer, model_name: str) -> None:
        self.bridge = bridge
        self.tokenizer = tokenizer
        self.model_name = model_name

    async def max_model_len(self) -> int | None:
        return None  # the program's model is its own business

    async def server_info(self) -> inference_pb2.ServerInfo:
        return inference_pb2.ServerInfo(backend=self.bridge.name)

    async def abort(self, request_id: str, any_tenant: bool = False) -> bool:
        return self.bridge.abort(request_id, any_tenant)

    serves_lora = False

    async def lora_adapters(self) -> list[common_pb2.LoraAdapter]:
        return []

    async def load_lora_adapter(self, request: common_pb2.LoadLoraAdapterRequest,
                                timeout: float | None) -> common_pb2.LoraAdapter:
        raise ValidationError("the command_bridge backend serves no LoRA adapters (serving.backend.kind: scheduler does)")

    async def unload_lora_adapter(self, request: common_pb2.UnloadLoraAdapterRequest,
                                  timeout: float | None) -> common_pb2.UnloadLoraAdapterResponse:
        raise ModelNotFoundError(f"no LoRA adapter named {request.name!r} is loaded: the command_bridge backend "
                                 "serves none", "name")

    async def embed(self, call: EmbeddingCall, timeout: float | None) -> EmbeddingOutput:
        raise UnsupportedError("the command_bridge backend computes no embeddings (serving.backend.kind: scheduler does)")

    async def generate(self, request: inference_pb2.GenerateRequest, prepared: PreparedRequest,
                       timeout: float | None) -> AsyncIterator[SampleOutput]:
        # `timeout` is not passed on: serving.backend.command_timeout_s bounds each run.
        if request.params.HasField("prompt_logprobs"):  # a program answers in text: it has no logits
            raise ValidationError("params.prompt_logprobs is not served by the command_bridge backend")
        refuse_logits_controls(prepared.sampling)
        refuse_tools_and_constraints(request)
        if prepared.adapter:
            raise ValidationError(f"model {prepared.adapter!r} is a LoRA adapter, which the command_bridge backend "
                                  "does not serve", "model")
        prompt, sampling = bridge_prompt(request, self.tokenizer), prepared.sampling
        for index in range(sampling.n):
            if index and sampling.seed is not None:
                sampling = dataclasses.replace(prepared.sampling, seed=sample_seed(prepared.sampling.seed, index))
            text: list[str] = []
            async for chunk in self.bridge.stream(prepared.scoped_id, prompt, sampling, self.model_name, index):
                text.append(chunk.text)
                response = inference_pb2.GenerateResponse(request_id=prepared.request_id, text=chunk.text, index=index,
                                                          model=self.model_name, backend=self.bridge.name)
                tokens = 0
                if chunk.finished:  # the program's text has no token ids: count the sample's by encoding it
                    response.finish_reason = (common_pb2.FINISH_REASON_ABORT if chunk.aborted else
                                              common_pb2.FINISH_REASON_LENGTH if chunk.truncated
                                              else common_pb2.FINISH_REASON_STOP)
                    tokens = len(self.tokenizer.encode("".join(text), add_special_tokens=False))
                yield SampleOutput(response, tokens)
                if chunk.aborted:  # the request's later samples are aborted too
                    for later in range(index + 1, sampling.n):
                        yield SampleOutput(inference_pb2.GenerateResponse(
                            request_id=prepared.request_id, index=later, model=self.model_name,
                            backend=self.bridge.name, finish_reason=common_pb2.FINISH_REASON_ABORT))
                    return
