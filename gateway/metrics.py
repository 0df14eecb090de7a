"""Prometheus metrics of the gateway (`hetero_` namespace), served at GET /metrics.

Per-request figures (tokens, TTFT, time per output token, end-to-end latency, queue time)
are measured here, in the one generation path that gRPC and HTTP share. Pool figures
(running / waiting / preempted, KV blocks, prefix cache) belong to the scheduler: they are
read from its GetStats at scrape time, so they are never stale.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import accumulate

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for the HTTP app)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import HistogramMetricFamily

from hetero.v1 import common_pb2
from hetero_common.expert_load import STEP_TOKEN_BUCKETS
from hetero_common.finish_reasons import finish_reason_name

NAMESPACE = "hetero"
# Seconds; from a fast GPU decode step to a long CPU generation.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LOOP_LAG_INTERVAL = 0.01  # seconds between the lag monitor's wake-ups
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)


Kind = type[Counter] | type[Gauge] | type[Histogram]
Metric = Counter | Gauge | Histogram


@dataclass(frozen=True)
class MetricSpec:
    """One metric of the page, declared as data; `GatewayMetrics` holds it as `attribute`."""

    attribute: str
    kind: Kind
    name: str  # without the namespace; a counter's without the `_total` prometheus_client adds
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None  # histograms only

    def build(self, registry: CollectorRegistry) -> Metric:
        extra = {"buckets": self.buckets} if self.buckets is not None else {}
        return self.kind(self.name, self.help, self.labels, namespace=NAMESPACE, registry=registry, **extra)


# Every metric of the page. Names must pass `promtool check metrics` (a gauge never ends in
# `_total`: tests/unit/gateway/test_metrics_lint.py). Gauges marked monotonic are the scheduler's
# counters, copied at scrape time: a gauge, since the gateway only sets them.
METRICS: tuple[MetricSpec, ...] = (
    # Per request, measured in the generation path.
    MetricSpec("prompt_tokens", Counter, "prompt_tokens", "Prompt tokens of finished requests"),
    MetricSpec("generation_tokens", Counter, "generation_tokens", "Generated tokens"),
    MetricSpec("cached_prompt_tokens", Counter, "cached_prompt_tokens", "Prompt tokens served from the prefix cache"),
    MetricSpec("requests", Counter, "request_success", "Finished requests, by finish reason", ("finish_reason",)),
    MetricSpec("request_errors", Counter, "request_errors", "Requests that failed, by error type", ("error",)),
    MetricSpec("ttft", Histogram, "time_to_first_token_seconds", "Arrival at the gateway to the first token",
               buckets=LATENCY_BUCKETS),
    MetricSpec("tpot", Histogram, "time_per_output_token_seconds",
               "Mean time between tokens after the first, per request", buckets=TOKEN_LATENCY_BUCKETS),
    MetricSpec("e2e", Histogram, "e2e_request_latency_seconds", "Arrival to the last token, by finish reason",
               ("finish_reason",), LATENCY_BUCKETS),
    MetricSpec("queue", Histogram, "request_queue_time_seconds", "Scheduler arrival to first admission",
               buckets=LATENCY_BUCKETS),
    MetricSpec("in_flight", Gauge, "gateway_requests_in_flight", "Requests the gateway is streaming"),
    # The scheduler's pool, refreshed by `update_pool` at scrape time.
    MetricSpec("running", Gauge, "num_requests_running", "Sequences admitted to the engine"),
    MetricSpec("waiting", Gauge, "num_requests_waiting", "Requests waiting for admission"),
    MetricSpec("swapped", Gauge, "num_requests_swapped", "Sequences whose KV blocks are in host memory"),
    MetricSpec("preempted", Gauge, "num_preemptions", "Preemptions since the scheduler started (monotonic)"),
    MetricSpec("blocks_used", Gauge, "kv_blocks_used", "KV blocks in use"),
    MetricSpec("blocks_total", Gauge, "kv_blocks", "KV blocks in the pool"),
    MetricSpec("usage", Gauge, "kv_cache_usage_ratio", "Fraction of KV blocks in use (0-1)"),
    MetricSpec("prefix_queries", Gauge, "prefix_cache_queries",
               "Prompt tokens looked up in the prefix cache (monotonic)"),
    MetricSpec("prefix_hits", Gauge, "prefix_cache_hits", "Prompt tokens found in the prefix cache (monotonic)"),
    MetricSpec("steps", Gauge, "engine_steps", "Engine steps planned (monotonic; the most of any replica)"),
    MetricSpec("steps_ahead", Gauge, "engine_steps_planned_ahead", "Of those, steps planned while the step before "
               "was in flight (async_scheduling; summed over replicas, monotonic)"),
    MetricSpec("spec_drafts", Gauge, "spec_decode_draft_tokens", "Speculative draft tokens proposed (monotonic)"),
    MetricSpec("spec_accepted", Gauge, "spec_decode_accepted_tokens", "Of those, kept by the model (monotonic)"),
    MetricSpec("spec_decodes", Gauge, "spec_decode_drafted_decodes", "Decodes that carried draft tokens (monotonic)"),
    # A mixture of experts' load (hetero_common/expert_load.py); hetero_moe_expert_step_tokens, the histogram of
    # the tokens an expert took in one step, is copied whole from the scheduler (`ExpertStepTokens`).
    MetricSpec("expert_tokens", Gauge, "moe_expert_tokens", "Tokens routed to each expert of a mixture of experts, "
               "summed over its MoE layers (monotonic)", ("expert",)),
    # The gateway's own event loop (`watch_loop`).
    MetricSpec("loop_lag", Histogram, "gateway_event_loop_lag_seconds", "How late the gateway's event loop ran a "
               f"timer due every {LOOP_LAG_INTERVAL * 1000:g} ms: how long any request waited for the loop",
               buckets=LOOP_LAG_BUCKETS),
    MetricSpec("loop_lag_max", Gauge, "gateway_event_loop_max_lag_seconds",
               "The largest such lag since the gateway started"),
    MetricSpec("workers_up", Gauge, "workers_up", "Workers answering the scheduler"),
    # LoRA adapters (issue 41): per adapter (its name, as requests give it), and the workers' slots.
    MetricSpec("lora_requests", Counter, "lora_request_success", "Finished requests served with a LoRA adapter",
               ("adapter",)),
    MetricSpec("lora_prompt_tokens", Counter, "lora_prompt_tokens",
               "Prompt tokens of finished requests, per LoRA adapter", ("adapter",)),
    MetricSpec("lora_generation_tokens", Counter, "lora_generation_tokens", "Generated tokens, per LoRA adapter",
               ("adapter",)),
    # Tenants (API keys on): by the key's label (hetero_common/tenancy.py), never the key.
    MetricSpec("tenant_requests", Counter, "tenant_requests", "Requests ended, per tenant (API key label)",
               ("tenant",)),
    MetricSpec("tenant_generation_tokens", Counter, "tenant_generation_tokens",
               "Generated tokens, per tenant (API key label)", ("tenant",)),
    MetricSpec("lora_loaded", Gauge, "lora_adapters_loaded", "LoRA adapters requests may name"),
    MetricSpec("lora_slots", Gauge, "lora_slots_in_use", "Worker LoRA slots holding an adapter (of max_loras)"),
    # Embedding requests (Embed, /v1/embeddings): a request, its inputs, their tokens, its latency.
    MetricSpec("embedding_requests", Counter, "embedding_request_success", "Finished embedding requests"),
    MetricSpec("embedding_inputs", Counter, "embedding_inputs",
               "Inputs of finished embedding requests (one vector each)"),
    MetricSpec("embedding_tokens", Counter, "embedding_prompt_tokens", "Tokens of finished embedding requests' inputs"),
    MetricSpec("embedding_latency", Histogram, "embedding_request_latency_seconds", "Arrival to the last vector",
               buckets=LATENCY_BUCKETS),
    MetricSpec("scheduler_up", Gauge, "scheduler_up", "1 when the last GetStats succeeded"),
)


class GatewayMetrics:
    """One registry per gateway (tests can run several gateways in a process), holding each of
    `METRICS` under its `attribute` (the annotations below, which must match them)."""

    registry: CollectorRegistry
    prompt_tokens: Counter
    generation_tokens: Counter
    cached_prompt_tokens: Counter
    requests: Counter
    request_errors: Counter
    ttft: Histogram
    tpot: Histogram
    e2e: Histogram
    queue: Histogram
    in_flight: Gauge
    running: Gauge
    waiting: Gauge
    swapped: Gauge
    preempted: Gauge
    blocks_used: Gauge
    blocks_total: Gauge
    usage: Gauge
    prefix_queries: Gauge
    prefix_hits: Gauge
    steps: Gauge
    steps_ahead: Gauge
    spec_drafts: Gauge
    spec_accepted: Gauge
    spec_decodes: Gauge
    expert_tokens: Gauge
    loop_lag: Histogram
    loop_lag_max: Gauge
    workers_up: Gauge
    lora_requests: Counter
    lora_prompt_tokens: Counter
    lora_generation_tokens: Counter
    tenant_requests: Counter
    tenant_generation_tokens: Counter
    lora_loaded: Gauge
    lora_slots: Gauge
    embedding_requests: Counter
    embedding_inputs: Counter
    embedding_tokens: Counter
    embedding_latency: Histogram
    scheduler_up: Gauge

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        for spec in METRICS:
            setattr(self, spec.attribute, spec.build(self.registry))
        self.expert_step_tokens = ExpertStepTokens()
        self.registry.register(self.expert_step_tokens)

    def update_pool(self, pool: common_pb2.PoolStats | None, service: common_pb2.ServiceStats | None) -> None:
        self.scheduler_up.set(0 if pool is None else 1)
        if pool is None or service is None:
            return
        self.running.set(pool.num_running)
        self.waiting.set(pool.num_waiting)
        self.swapped.set(pool.num_swapped)
        self.preempted.set(pool.num_preemptions)
        self.blocks_used.set(pool.used_blocks)
        self.blocks_total.set(pool.total_blocks)
        self.usage.set(pool.usage)
        self.prefix_queries.set(pool.prefix_cache_queries)
        self.prefix_hits.set(pool.prefix_cache_hits)
        self.steps.set(pool.steps)
        self.steps_ahead.set(pool.steps_planned_ahead)
        self.spec_drafts.set(pool.spec_draft_tokens)
        self.spec_accepted.set(pool.spec_accepted_tokens)
        self.spec_decodes.set(pool.spec_drafted_decodes)
        for expert, tokens in enumerate(pool.expert_tokens):
            self.expert_tokens.labels(str(expert)).set(tokens)
        self.expert_step_tokens.pool = pool
        self.workers_up.set(service.num_workers_up)
        self.lora_loaded.set(service.lora_adapters_loaded)
        self.lora_slots.set(service.lora_slots_in_use)

    async def watch_loop(self) -> None:
        """Measure the event loop's lag (work that holds it, e.g. tokenizing on it) until cancelled."""
        worst = 0.0
        while True:
            asleep = time.perf_counter()
            await asyncio.sleep(LOOP_LAG_INTERVAL)
            lag = max(0.0, time.perf_counter() - asleep - LOOP_LAG_INTERVAL)
            self.loop_lag.observe(lag)
            if lag > worst:
                worst = lag
                self.loop_lag_max.set(lag)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def start_request(self) -> "RequestTimer":
        self.in_flight.inc()
        return RequestTimer(self)


class ExpertStepTokens:
    """hetero_moe_expert_step_tokens: the scheduler's histogram of the tokens one expert took in one step
    (PoolStats.expert_step_token_buckets), as of the last scrape's pool; absent for a dense model."""

    def __init__(self) -> None:
        self.pool = common_pb2.PoolStats()

    def collect(self) -> Iterator[HistogramMetricFamily]:
        counts = list(self.pool.expert_step_token_buckets)
        if not counts:
            return
        bounds = [str(float(b)) for b in STEP_TOKEN_BUCKETS] + ["+Inf"]
        yield HistogramMetricFamily(f"{NAMESPACE}_moe_expert_step_tokens",
                                    "Tokens one expert of a mixture of experts took in one engine step",
                                    buckets=list(zip(bounds, accumulate(counts))),
                                    sum_value=self.pool.expert_step_tokens_sum)


@dataclass
class RequestTimer:
    """Times one request through the generation path; `finish` records it exactly once."""

    metrics: GatewayMetrics
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    done: bool = False
    adapter: str = ""  # the LoRA adapter serving the request, once known ("" = the base model)
    tenant: str = ""  # the caller's key label ("" = no keys configured)

    def on_tokens(self, count: int, queue_seconds: float = 0.0) -> None:
        if not count:
            return
        now = time.perf_counter()
        if self.first_token is None:
            self.first_token = now
            self.metrics.ttft.observe(now - self.arrival)
            self.metrics.queue.observe(queue_seconds)
        self.last_token = now
        self.tokens += count
        self.metrics.generation_tokens.inc(count)
        if self.adapter:
            self.metrics.lora_generation_tokens.labels(self.adapter).inc(count)

    def finish(self, reason: int, usage: common_pb2.Usage) -> None:
        if self.done:
            return
        self.done = True
        self.metrics.in_flight.dec()
        label = finish_reason_name(reason)
        self.metrics.requests.labels(label).inc()
        self.metrics.prompt_tokens.inc(usage.prompt_tokens)
        self.metrics.cached_prompt_tokens.inc(usage.cached_prompt_tokens)
        if self.adapter:
            self.metrics.lora_requests.labels(self.adapter).inc()
            self.metrics.lora_prompt_tokens.labels(self.adapter).inc(usage.prompt_tokens)
        self.metrics.e2e.labels(label).observe(time.perf_counter() - self.arrival)
        self._count_tenant()
        if self.tokens > 1 and self.first_token is not None and self.last_token is not None:
            self.metrics.tpot.observe((self.last_token - self.first_token) / (self.tokens - 1))

    def fail(self, error: BaseException) -> None:
        if self.done:
            return
        self.done = True
        self.metrics.in_flight.dec()
        self.metrics.request_errors.labels(type(error).__name__).inc()
        self._count_tenant()

    def _count_tenant(self) -> None:
        """Once per request, at its end: the per-token path stays as cheap with keys on as off."""
        if self.tenant:
            self.metrics.tenant_requests.labels(self.tenant).inc()
            self.metrics.tenant_generation_tokens.labels(self.tenant).inc(self.tokens)
