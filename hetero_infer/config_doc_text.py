"""The hand-written prose of docs/configuration.md, around the tables config_doc.py generates
from the config object. Edit it here, then run `python -m hetero_infer.config_doc --write`."""

INTRO = """\
# Configuration

hetero-infer has one configuration object, `Config` in
[hetero_common/config.py](../hetero_common/config.py): every knob, its default, its meaning
and its validation. [hetero_infer/config_sources.py](../hetero_infer/config_sources.py) reads
it from its sources. Every command that runs something (`serve`, `gateway`, `scheduler`,
`worker`, `generate`) takes the same keys; `serve` hands the resolved object to the processes
it starts in a JSON file, so they all see the same values. A bad value stops start-up with a
message that names the key and the rule, e.g.
`config key 'block_size' = 0 must be in 1..128`; an unknown key in a file is an error too.

This page is generated from the config object: the defaults and types from the dataclasses, the
meanings from each field's `doc(...)`, the rules from the validators, the names from
`config_sources.py`. After changing a key, run `python -m hetero_infer.config_doc --write`
(`tests/unit/hetero_infer/test_config_doc.py` fails until the page matches).

## Sources and precedence

Highest first:

1. **CLI flags**: `--block-size 32`, `--serving-port 6000`;
2. **`HETERO_*` environment variables**: `HETERO_BLOCK_SIZE=32`, `HETERO_SERVING_PORT=6000`;
3. **a JSON file**: `--config c.json` (or `HETERO_CONFIG=c.json`);
4. **a named preset**: `--preset low_latency` (or `HETERO_PRESET`, or `"preset"` in the file);
5. **the defaults** below.

A nested key such as `serving.port` is an object in the file (`{"serving": {"port": 6000}}`),
`_` between its parts in the environment (`HETERO_SERVING_PORT`) and `-` in its flag
(`--serving-port`). Values from the environment and flags are parsed by the key's type:
booleans as `true`/`false` (also `1`/`0`, `yes`/`no`, `on`/`off`), lists as a JSON list or
comma-separated, and `""`, `none` or `null` as null where a key may be null.
`HETERO_MAX_BLOCKS` is accepted as the seed's short name of `max_num_blocks`, and
`local_engine` as the seed's name of the `scheduler` backend.

A file holds any subset of the keys, nested like the tables' dotted names:

```json
{"preset": "low_latency",
 "model": "/models/SmolLM2-135M-Instruct",
 "max_model_len": 4096,
 "data_parallel_size": 2,
 "serving": {"port": 50051, "http_port": 8000, "api_keys_file": "/etc/hetero/keys",
             "tls": {"cert_file": "/etc/hetero/tls.crt", "key_file": "/etc/hetero/tls.key"}},
 "tokenizer": {"kind": "auto"}}
```

```bash
HETERO_LOG_LEVEL=debug hetero-infer serve --config c.json --max-batch-size 16
```

Here the flag sets `max_batch_size` over the preset's 8, `HETERO_LOG_LEVEL` sets `log_level`,
the file the rest, and every key not named keeps its default.
"""

PRESETS_INTRO = """\
## Presets

The seed's named presets set the block and batch sizes together; any source above a preset
(the file's own keys, the environment, flags) still overrides a key it sets.
"""

KEYS_INTRO = """\
## Keys

One table per group. *Values* is the key's type and the rules the validators check (as the
error would state them; a rule that names another key shows that key's default). Durations
(`*_s`) are in seconds.
"""

NOTES = """\
## Notes on some keys

- **`dtype`** `auto`: bfloat16 on GPUs. On a CPU, bfloat16 where it has `amx_bf16`, or
  `avx512_bf16` where the C linear kernel runs (`cpu_kernels` and `weight_prepack` on), or
  else where a matrix product timed at start-up runs at least 1.5x faster than in float32;
  otherwise float32 (`gpu_worker/cpu/worker_setup.py`). The choice is logged. `float32` is the
  exact mode: greedy output matches `transformers` token for token.
- **`attention_backend`** `auto` picks FlashInfer when it imports, the device is CUDA sm75 or
  newer, the head size is 64, 128 or 256 and the dtype is bfloat16 or float16; otherwise the
  torch paged reference. Naming `flashinfer` where it cannot run fails at start-up with the
  reason.
- **`cpu_kernels`**: the C kernels in `kernels/native/` are built on first use with the host's
  `cc` into `~/.cache/hetero-infer/native` (or `$HETERO_CACHE_DIR`), in about a second
  (`kernels/native/lib.py`). They cover paged attention that reads each sequence's K/V rows in
  place (decodes, and prompt rows where the AVX512-BF16 path runs), fused RMSNorm (with the
  residual add), RoPE and SiLU·mul, the bfloat16 linear layers on CPUs with AVX512-BF16 (AMX
  tile kernels where the CPU has AMX), AMX prompt attention, greedy sampling's argmax, and,
  where every kernel of a layer is C and there is no tensor parallelism, all decoder layers in
  one C call with the same results bit for bit. float32 always runs the torch code.
- **`deterministic`** (default on): in bfloat16 on the C kernels (CPUs with AVX512-BF16), a
  token's K/V and logits are the same bits whether it was computed alone, in a decode batch, in a
  prompt chunk of any length at any offset, or as a decode: a recompute after preemption or after
  a replica's failover continues every stream exactly (tests/unit/gpu_worker/test_row_invariance.py,
  tests/model/test_bf16_invariance.py). The linear layers and the element-wise kernels compute
  each row alone, and the attention kernel's per-row path and its 16-row prompt tiles share one
  arithmetic (`kernels/native/attention_order.h`), so on CPUs without AMX invariance costs nothing
  and `false` changes nothing. On AMX CPUs `false` sends prompt chunks to the AMX prompt kernel
  (or SDPA) and products of more than a few rows to oneDNN, whose last bits follow the row count;
  how much faster that is there is not measured yet (docs/performance.md, "Invariant numerics").
  float32 runs the torch code, invariant already; on CUDA it does nothing yet.
- **`quantization`** (which formats run natively where, and how to choose; figures in
  docs/performance.md, "Quantized weights"):

  | value | weights held | where it runs | batch-1 decoding (time) | steps of 16+ rows (time) |
  |---|---|---|---|---|
  | `none` (default) | the checkpoint dequantized to `dtype` | everywhere | bfloat16's | bfloat16's |
  | `auto` | a GGUF file's Q4_0, Q4_1, Q8_0 blocks as they are (others dequantized) | CPUs with AVX512-VNNI, bfloat16 on the C kernels | about 0.5x | about 1.2x |
  | `int8` | every linear weight as int8 (Q8_0 blocks: a scale per 32 weights of a row) | the same CPUs (other CPUs: refused); CUDA as W8A8 through torch._int_mm, a scale per channel | about 0.6x (CPU) | about 1.3x (CPU) |
  | `fp8` | the layers' linear weights as float8 e4m3 (a scale per output channel) | CUDA (torch._scaled_mm); the CPU's torch reference for tests | not measured | not measured |

  Choose `auto` (for a GGUF file) or `int8` to serve one request at a time faster and in about a
  third of the weight memory (the default model: 98 MB against 326 MB); keep `none` for throughput
  under many concurrent requests, where the products are compute-bound and bfloat16's are faster.
  Both keep the mean log-likelihood of a fixed text within 0.1% of float32's and as many of its
  greedy tokens as bfloat16 does (83-85%, `benchmarks/quant_accuracy.py`). `fp8` (float8 weights
  and activations through `torch._scaled_mm`) is for large models on CUDA GPUs of compute capability
  8.9+ (not yet measured on one); on SmolLM2 it costs 0.96% of the log-likelihood and half the greedy
  tokens, and on the CPU it runs torch's slow reference.
- **`kv_cache_dtype`** (figures in docs/performance.md, "Quantized KV cache"): `int8` (CPUs with
  AVX512-BF16) stores each token's K and V per head as int8 with a float32 scale, `fp8` (those CPUs
  and CUDA) as float8 e4m3. A long-context decode step reads about half the bytes: 1.3x the speed
  at 16 sequences of 4,000 tokens, and the pool holds 1.88x (`int8`) or 2x (`fp8`) the blocks in
  the same `kv_cache_memory_gb`. On the CPU choose `int8`: it keeps the fixed text's
  log-likelihood within 0.1% of float32's and as many greedy tokens as bfloat16 (83% against 84%),
  where `fp8` keeps 55%.
- **`weight_prepack`**: the linear layers' weights are re-laid out once at load instead of on
  every product (`gpu_worker/cpu/packed_linear.py`). In float32 the products move from MKL to
  oneDNN (last-bit differences; the oracle tests stay token-exact); in bfloat16 results are
  bit-identical. A tied LM head costs one extra copy of the embedding. `false` gives plain
  `F.linear`, exactly `transformers`' float32 products.
- **Threads** (`num_threads`, `reserved_cpus`, `omp_wait_policy`): with `num_threads` 0 each
  worker process takes an equal share of the host's cores less `reserved_cpus`.
  `reserved_cpus` -1 (auto) reserves cores for the gateway and scheduler only under `serve` on
  hosts with enough cores (`hetero_common/host_cores.py`); a worker started alone, or the
  in-process engine, reserves none. `omp_wait_policy: passive` lets torch's threads sleep
  instead of spinning after each parallel region, which leaves the cores to the other
  processes and costs a wake-up per region: it helps many streams of a small model and slows a
  single stream.
- **`serving.stream_interval`** N > 1: fewer, larger messages per stream; a message holds
  fewer than N tokens only at a sample's end or before an error, and the samples of an `n` > 1
  request are grouped each apart. A stop string is matched as its message is made, so the
  engine may compute up to N-1 tokens past it.
- **`async_scheduling`**: output is the same token for token as one step at a time; a sequence
  that ends with EOS or a stop id has one token computed in vain.
- **`speculative_method`** `ngram` (prompt lookup; figures in docs/performance.md, "Speculative
  decoding"): a decode proposes up to `num_speculative_tokens` tokens that followed its last
  `prompt_lookup_max` down to `prompt_lookup_min` tokens where those occurred before in the same
  sequence; the step computes them with the decode's token, samples every position as decoding one
  token at a time would (a seeded row with its own output index's noise) and keeps the drafts equal
  to those samples, then the model's own token: greedy and seeded outputs are token for token the
  same, unseeded ones follow the same distribution. It pays
  where outputs repeat their input (rewriting or continuing a passage or a code file, extracting,
  agent loops); each sequence adapts (a proposal at most one longer than what it last kept; one
  whose drafts all fail waits 2-64 decodes, and none proposes while the worker's measured step cost
  says the batch is compute-bound for its acceptance). Penalties, logit_bias, min_tokens, min_p and
  logprobs apply at every drafted position as if one token were decoded at a time, and so does
  structured output (each position is masked by the grammar's state after the drafts before it; the
  grammar advances only by the tokens kept).
  While a running decode's text repeats (its last tokens have occurred before), the next step is
  not planned ahead of the one in flight (`async_scheduling`): lookups need the real last token.
- **`speculative_method`** `draft`: `speculative_model` (a directory or a .gguf file with the served
  model's tokenizer; a wider padded vocabulary is cut to the served one) runs on every worker, in the
  served dtype and `quantization`, and proposes greedily, within the grammar for structured output;
  the proposals are verified as above, so outputs are the served model's whatever the draft says.
  Its K/V sits in its own cache tensor in the same blocks as the served model's: each block's bytes
  count both when `kv_cache_memory_gb` or `gpu_memory_utilization` is divided into blocks, so the
  pool has fewer blocks. It costs a draft forward over every computed token (prompts too) plus
  `num_speculative_tokens` - 1 one-token passes per drafted step: it pays when the draft is much
  cheaper than the served model and agrees with it often. With tensor parallelism every rank runs
  the whole draft and rank 0's proposals are used. A swapped-out sequence's or a suspended
  cache's draft K/V is recomputed from the tokens. Steps that carry drafts are never planned ahead.
- **`lora_modules`**, **`max_loras`**, **`max_lora_rank`** (issue 41; [lora.md](lora.md)): PEFT LoRA
  adapters loaded on every worker at start, slot i + 1 the i-th; more are loaded and unloaded at run time
  (`LoadLoraAdapter`, `POST /v1/load_lora_adapter`) by an admin key, from under `lora_root` only
  ([security.md](security.md#lora-adapters)). `max_loras` slots hold adapters at once, counting
  replaced or unloaded ones still finishing their requests; `max_lora_rank` bounds an adapter's rank
  without costing anything (a step pays its adapters' own ranks). An adapter that asks for what this
  engine would not compute exactly (DoRA, biases, per-module ranks, `modules_to_save`, shapes of another
  base model) is refused with an error naming it. A request's `model` names the adapter that serves it
  (the in-process engine: `submit_request(..., lora=NAME)`, `lora_modules` only). One step mixes
  sequences of different adapters and of the base model; prefix-cache blocks are never shared between
  adapters; with tensor parallelism each rank holds its share. Steps with an adapter run eagerly on
  CUDA (no CUDA graph); the command bridge serves no adapter.
- **`tp_init_method`** (ranks of one replica on several hosts): start each rank with
  `hetero-infer worker --tp-rank R`, all with the same config and rank 0's `worker_address`,
  and point the scheduler at rank 0 alone; rank 0 serves the TCP store (gloo on the CPU, NCCL
  on GPUs). With gloo the interface that routes to rank 0 is used unless `GLOO_SOCKET_IFNAME`
  is set. `serve` refuses it with `data_parallel_size` > 1.
- **`worker_dns`**: an address that appears joins after a `Describe`, with its own block pool;
  one that vanishes is handled as a dead worker (its sequences recomputed elsewhere); a name
  with no records means no such replicas.
- **`worker_step_timeout_s`**: a hung worker (alive but silent) answers `Describe` only behind
  its stuck step, so its replica rejoins once it computes again.

## The seed's config.json and `tokenizer.kind: simple`

The seed README's `config.json` loads verbatim:

```json
{"block_size": 16, "max_num_blocks": 1024, "max_batch_size": 32, "max_num_seqs": 256, "max_model_len": 2048,
 "max_total_tokens": 4096, "memory_threshold": 0.9, "max_retry_attempts": 2,
 "tokenizer": {"kind": "simple", "path": null},
 "serving": {"host": "127.0.0.1", "port": 3000, "model_name": "hetero-infer",
             "backend": {"kind": "local_engine", "command": null}}}
```

Every key means what the tables say: `serving.port` 3000 is the gateway's gRPC port (HTTP
stays on `serving.http_port`), `backend.kind: local_engine` is the model served by the
scheduler and workers (the alias of `scheduler`), and `tokenizer.kind: simple` is the seed's
`SimpleTokenizer` (`hetero_common/simple_tokenizer.py`): byte-level, **259 ids: 0-255 are the
UTF-8 bytes, then PAD 256, BOS 257, EOS 258**. Encoding puts BOS first (no EOS after a prompt),
any text round-trips exactly, text that spells a special token stays bytes, decoding drops the
special ids, and there is no chat template (prompts are sent as they are). It serves the
command bridge (no model is loaded or checked when the bridge is the only backend) and models
whose vocabulary it matches (259 ids, e.g. `make_tiny_byte_llama` in
`tests/helpers/tiny_models.py`). With any other model, start-up stops before the model
loads, naming the key: `tokenizer.kind simple is a byte-level tokenizer of 259 ids (...); model
'...SmolLM2...gguf' has a vocabulary of 49152: use tokenizer.kind auto`. So the seed's config
with the default model fails clearly; with `HETERO_MODEL` (or `"model"`) naming a 259-id model
it generates and serves.

The seed's command-bridge config works with either tokenizer:

```json
{"serving": {"backend": {"kind": "command_bridge",
                         "command": {"program": "/bin/sh", "args": ["-c", "printf 'bridge:%s' \\"$HETERO_PROMPT\\""]}}}}
```

## Logging

Logs are structlog lines, JSON when not on a terminal (`log_format`), with `service` and (per
request) `request_id` bound; the scheduler logs each step's size and timings at `debug`.
"""
