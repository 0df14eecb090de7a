"""The gateway's metrics page passes Prometheus' own linter, `promtool check metrics` (naming:
a counter ends in `_total` and nothing else does, base units, help on every family, ...).

The page is a real `GatewayMetrics` with every metric touched through the paths that feed it
(a request timer, the scheduler's pool stats, the event-loop watch, the embedding meters), so
every family is on it, and the real /metrics route of the HTTP app. promtool is Debian's
`prometheus` package (scripts/test.sh installs it); without it these tests fail under CI and
skip elsewhere. A planted gauge named like a counter shows the check can fail.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import LOOP_LAG_INTERVAL, METRICS, NAMESPACE, GatewayMetrics
from hetero.v1 import common_pb2
from hetero_common.errors import DeadlineExceededError
from hetero_common.expert_load import ExpertLoad
from hetero_common.tokenizer import TextTokenizer, load_tokenizer
from hetero_infer.bench.harness import make_tokenizer
from tests.helpers.http_app import bridge_http_client

PROMTOOL_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is not None:
        return path
    why = "promtool is not on PATH (Debian: apt-get install prometheus; scripts/test.sh installs it)"
    if os.environ.get("CI"):
        pytest.fail(f"{why}; CI is set, so the metrics lint may not be skipped")
    pytest.skip(why)


def lint(promtool: str, page: bytes) -> tuple[bool, str]:
    """`promtool check metrics` on `page`: whether it passed, and what promtool said."""
    done = subprocess.run([promtool, "check", "metrics"], input=page, capture_output=True,
                          timeout=PROMTOOL_TIMEOUT_S)
    said = (done.stdout + done.stderr).decode(errors="replace").strip()
    return done.returncode == 0, said


async def watch_the_loop_briefly(metrics: GatewayMetrics) -> None:
    watch = asyncio.create_task(metrics.watch_loop())
    await asyncio.sleep(LOOP_LAG_INTERVAL * 5)  # a few wake-ups: the lag histogram and its maximum move
    watch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await watch


def touched_metrics() -> GatewayMetrics:
    """A GatewayMetrics with every metric touched at least once, through the calls that feed it."""
    metrics = GatewayMetrics()
    served = metrics.start_request()
    served.adapter = "sql-lora"  # the per-adapter counters too
    served.tenant = "key-0123456789ab"  # and the per-tenant ones
    served.on_tokens(1, queue_seconds=0.02)
    served.on_tokens(2)
    served.finish(common_pb2.FINISH_REASON_STOP, common_pb2.Usage(prompt_tokens=5, cached_prompt_tokens=2))
    metrics.start_request().fail(DeadlineExceededError("too slow"))
    load = ExpertLoad()  # a mixture of experts' two steps, as the scheduler counts them
    load.observe([3, 0, 1, 4])
    load.observe([2, 2, 2, 2])
    pool = common_pb2.PoolStats(num_running=1, used_blocks=3, total_blocks=10, usage=0.3)
    load.fill(pool)
    metrics.update_pool(pool, common_pb2.ServiceStats(num_workers_up=1, lora_adapters_loaded=1))
    metrics.embedding_requests.inc()  # as Embeddings._meter does
    metrics.embedding_inputs.inc(2)
    metrics.embedding_tokens.inc(7)
    metrics.embedding_latency.observe(0.05)
    asyncio.run(watch_the_loop_briefly(metrics))
    return metrics


def test_every_declared_metric_is_an_attribute_of_its_type() -> None:
    metrics = GatewayMetrics()
    declared = set(GatewayMetrics.__annotations__) - {"registry"}
    assert declared == {spec.attribute for spec in METRICS}
    for spec in METRICS:
        assert isinstance(getattr(metrics, spec.attribute), spec.kind), spec.attribute


def test_every_metric_family_is_on_the_touched_page() -> None:
    page = touched_metrics().exposition().decode()
    families = {f.name: f for f in text_string_to_metric_families(page)}
    for spec in METRICS:
        family = families.get(f"{NAMESPACE}_{spec.name}")
        assert family is not None and family.samples, f"{spec.name} is not on the page"


def test_the_metrics_page_passes_promtool(promtool: str) -> None:
    page = generate_latest(touched_metrics().registry)
    passed, said = lint(promtool, page)
    assert passed, f"promtool check metrics flags the gateway's metrics page:\n{said}"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> TextTokenizer:
    directory: Path = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(directory)
    return load_tokenizer(directory)


def test_the_metrics_route_passes_promtool(promtool: str, tokenizer: TextTokenizer) -> None:
    """What a scraper reads: the HTTP app's /metrics after a request, with no scheduler answering."""
    with bridge_http_client(tokenizer, max_model_len=64) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        answer = client.post("/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 4})
        assert answer.status_code == 200, answer.text
        page = client.get("/metrics")
    assert page.status_code == 200
    assert f"{NAMESPACE}_request_success_total" in page.text and f"{NAMESPACE}_scheduler_up 0.0" in page.text
    passed, said = lint(promtool, page.content)
    assert passed, f"promtool check metrics flags GET /metrics:\n{said}"


def test_promtool_flags_a_gauge_named_like_a_counter(promtool: str) -> None:
    registry = CollectorRegistry()
    Gauge("planted_blocks_total", "A gauge named like a counter", namespace=NAMESPACE, registry=registry).set(1)
    passed, said = lint(promtool, generate_latest(registry))
    assert not passed
    assert f"{NAMESPACE}_planted_blocks_total" in said and "_total" in said, said


def test_the_expert_load_histogram_is_the_schedulers() -> None:
    """Two replicas' step counts merged as the scheduler merges pools, then shown: per-expert totals, and the
    histogram's cumulative buckets, count and sum; a dense model's page has no such histogram."""
    from scheduler_svc.core.stats import merge_pools

    first, second = ExpertLoad(), ExpertLoad()
    first.observe([3, 0, 1, 4])
    second.observe([2, 2, 2, 2, 9, 0])
    pools = [common_pb2.PoolStats(), common_pb2.PoolStats()]
    first.fill(pools[0])
    second.fill(pools[1])
    merged = merge_pools(pools)
    assert list(merged.expert_tokens) == [5, 2, 3, 6, 9, 0] and merged.expert_step_tokens_sum == 25
    metrics = GatewayMetrics()
    metrics.update_pool(merged, common_pb2.ServiceStats())
    families = {f.name: f for f in text_string_to_metric_families(metrics.exposition().decode())}
    samples = {(s.name, s.labels.get("le") or s.labels.get("expert")): s.value
               for s in families["hetero_moe_expert_step_tokens"].samples + families["hetero_moe_expert_tokens"].samples}
    assert samples[("hetero_moe_expert_step_tokens_bucket", "0.0")] == 2  # the two zeros
    assert samples[("hetero_moe_expert_step_tokens_bucket", "2.0")] == 7  # the zeros, the one, the four twos
    assert samples[("hetero_moe_expert_step_tokens_count", None)] == 10
    assert samples[("hetero_moe_expert_step_tokens_sum", None)] == 25
    assert samples[("hetero_moe_expert_tokens", "4")] == 9
    dense = GatewayMetrics()
    dense.update_pool(common_pb2.PoolStats(), common_pb2.ServiceStats())
    assert "hetero_moe_expert_step_tokens" not in dense.exposition().decode()
