"""Fast tests of the interface pieces: API keys, config keys, OpenAI translation, metrics, top-N logprobs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError as PydanticValidationError

from gateway.auth import ApiKeys
from gateway.metrics import GatewayMetrics
from gateway.openai import schema as oa
from gpu_worker.sampling.sampler import top_logprobs
from hetero.v1 import common_pb2
from hetero_common.config import Config
from hetero_common.errors import AuthenticationError, ConfigError, ValidationError
from hetero_infer.config_sources import load_config


def test_api_keys(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# comment\n\nfile-key\n")
    config = Config()
    config.serving.api_keys, config.serving.api_keys_file = ["k1"], str(keys_file)
    keys = ApiKeys.from_config(config)
    keys.check("Bearer k1")
    keys.check("bearer file-key")
    for bad in (None, "", "Bearer", "Basic k1", "Bearer k2", "Bearer # comment"):
        with pytest.raises(AuthenticationError):
            keys.check(bad)
    open_keys = ApiKeys([])
    assert not open_keys.enabled
    open_keys.check(None)


def test_interface_config_keys(tmp_path: Path) -> None:
    c = load_config(env={"HETERO_SERVING_API_KEYS": "a, b", "HETERO_SERVING_HTTP_PORT": "0",
                         "HETERO_INTERNAL_BIND_HOST": "0.0.0.0"})
    assert c.serving.api_keys == ["a", "b"] and c.serving.http_port == 0 and c.internal_bind_host == "0.0.0.0"
    assert load_config(cli_overrides={"serving.api_keys": '["x"]'}).serving.api_keys == ["x"]
    with pytest.raises(ConfigError, match="serving.http_port"):
        load_config(cli_overrides={"serving.http_port": "50051"})
    with pytest.raises(ConfigError, match="serving.tls.key_file"):
        load_config(cli_overrides={"serving.tls.cert_file": __file__})
    with pytest.raises(ConfigError, match="internal_tls.ca_file"):
        load_config(cli_overrides={"internal_tls.cert_file": __file__, "internal_tls.key_file": __file__})
    with pytest.raises(ConfigError, match="serving.api_keys_file"):
        load_config(cli_overrides={"serving.api_keys_file": str(tmp_path / "missing")})
    with pytest.raises(ConfigError) as bad:
        load_config(cli_overrides={"serving.api_keys": {"secret-value": 1}})
    assert "secret-value" not in str(bad.value)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from hetero_common.tokenizer import load_tokenizer
    from hetero_infer.bench.harness import make_tokenizer

    directory = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(directory)
    return load_tokenizer(directory)


def test_completion_requests_ask_the_engine_for_n_samples_per_prompt(tokenizer) -> None:
    body = oa.CompletionBody(prompt="hi", n=3, seed=5, max_tokens=4, stop="x", logprobs=2, temperature=0.7)
    (req,) = oa.completion_requests(body, "rid", tokenizer)
    p = req.params
    assert req.request_id == "rid-0" and p.n == 3 and p.seed == 5  # the engine derives each sample's seed
    assert p.max_tokens == 4 and list(p.stop) == ["x"] and p.logprobs == 2 and p.temperature == pytest.approx(0.7)
    assert not p.HasField("top_p")
    assert not oa.completion_requests(oa.CompletionBody(prompt="hi"), "r", tokenizer)[0].params.HasField("n")
    batch = oa.completion_requests(oa.CompletionBody(prompt=["a", "b"], n=2), "r", tokenizer)
    assert [(r.request_id, r.prompt, r.params.n) for r in batch] == [("r-0", "a", 2), ("r-1", "b", 2)]
    ids = oa.completion_requests(oa.CompletionBody(prompt=[5, 6, 7]), "r", tokenizer)
    assert list(ids[0].prompt_token_ids.ids) == [5, 6, 7] and ids[0].params.max_tokens == 16
    for bad in ({"n": 0}, {"n": 17}, {"prompt": []}):
        with pytest.raises((ValidationError, PydanticValidationError)):
            oa.CompletionBody(**{"prompt": "a", **bad})
    # usage: each request counts its prompt once and all its samples; prompts add up
    usage = oa.usage([common_pb2.Usage(prompt_tokens=3, completion_tokens=8), common_pb2.Usage(prompt_tokens=2, completion_tokens=6)])
    assert usage == {"prompt_tokens": 5, "completion_tokens": 14, "total_tokens": 19}


def test_chat_requests(tokenizer) -> None:
    body = oa.ChatBody(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}], max_tokens=9,
                       max_completion_tokens=3, logprobs=True, top_logprobs=4)
    req = oa.chat_request(body, "c", tokenizer)
    assert req.chat.messages[0].content == "hi" and req.params.max_tokens == 3 and req.params.logprobs == 4
    plain = oa.chat_request(oa.ChatBody(messages=[{"role": "user", "content": "x"}]), "c", tokenizer)
    assert not plain.params.HasField("logprobs") and not plain.params.HasField("max_tokens")
    assert oa.chat_request(oa.ChatBody(messages=[{"role": "user", "content": "x"}], n=2), "c", tokenizer).params.n == 2
    with pytest.raises(ValidationError, match="top_logprobs"):
        oa.ChatBody(messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    assert oa.finish_reason(common_pb2.FINISH_REASON_STOP) == "stop"
    assert oa.finish_reason(common_pb2.FINISH_REASON_LENGTH) == "length"


def test_metrics_record_a_request() -> None:
    m = GatewayMetrics()
    timer = m.start_request()
    timer.on_tokens(1, queue_seconds=0.01)
    timer.on_tokens(2)
    timer.finish(common_pb2.FINISH_REASON_LENGTH, common_pb2.Usage(prompt_tokens=7, completion_tokens=3))
    timer.finish(common_pb2.FINISH_REASON_LENGTH, common_pb2.Usage(prompt_tokens=7))  # recorded once
    m.update_pool(common_pb2.PoolStats(used_blocks=3, total_blocks=10, usage=0.3, num_running=1),
                  common_pb2.ServiceStats(num_workers_up=1))
    samples = {s.name + str(sorted(s.labels.items())): s.value
               for f in text_string_to_metric_families(m.exposition().decode()) for s in f.samples}
    assert samples["hetero_prompt_tokens_total[]"] == 7
    assert samples["hetero_generation_tokens_total[]"] == 3
    assert samples["hetero_time_to_first_token_seconds_count[]"] == 1
    assert samples["hetero_time_per_output_token_seconds_count[]"] == 1
    assert samples["hetero_request_success_total[('finish_reason', 'length')]"] == 1
    assert samples["hetero_kv_blocks_used[]"] == 3 and samples["hetero_kv_cache_usage_ratio[]"] == pytest.approx(0.3)
    assert samples["hetero_kv_blocks[]"] == 10  # the pool's size (a gauge: no `_total`, which says counter)
    assert samples["hetero_gateway_requests_in_flight[]"] == 0


def test_top_logprobs_are_the_best_of_log_softmax() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    ids, values = top_logprobs(logits, 4)
    full = torch.log_softmax(logits, dim=-1)
    assert ids.shape == values.shape == (3, 4)
    assert torch.equal(ids[:, 0], logits.argmax(dim=-1))
    assert torch.allclose(values, full.gather(1, ids))
    assert bool((values[:, :-1] >= values[:, 1:]).all())
    assert top_logprobs(logits[:, :2], 5)[0].shape == (3, 2)  # never more than the vocabulary
