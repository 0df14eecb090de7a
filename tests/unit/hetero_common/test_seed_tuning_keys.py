"""The seed configuration guide's tuning and monitoring keys ("Performance Tuning", "Monitoring"), loaded
from the guide's own shapes: `cuda_graph`, `fp16`, `kv_cache_dtype`, `pin_memory`, `enable_metrics` and
`metrics_port`; each honoured or refused naming itself (issue 39)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from hetero_common.config import Config
from hetero_common.errors import ConfigError
from hetero_infer.config_sources import add_config_arguments, config_from_args, load_config
from hetero_infer.engine import GenerationParams, InferenceEngine
from hetero_infer.bench.harness import make_random_llama

SEED_GPU = {"cuda_graph": True, "fp16": True, "kv_cache_dtype": "fp16"}  # "GPU Optimization", verbatim
SEED_CPU = {"num_threads": 8, "pin_memory": True}  # "CPU Optimization", verbatim
SEED_MONITORING = {"enable_metrics": True, "metrics_port": 9090}  # "Monitoring", as a JSON file


def from_file(tmp_path: Path, data: dict, env: dict[str, str] | None = None) -> Config:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return load_config(path, env or {})


def test_the_guides_gpu_block_loads_as_float16_with_graphs(tmp_path: Path) -> None:
    c = from_file(tmp_path, SEED_GPU)
    assert c.dtype == "float16" and c.kv_cache_dtype == "fp16" and c.enable_cuda_graphs is True
    assert from_file(tmp_path, {"cuda_graph": False}).enable_cuda_graphs is False


def test_the_guides_cpu_and_monitoring_blocks_load(tmp_path: Path) -> None:
    c = from_file(tmp_path, SEED_CPU)
    assert c.num_threads == 8 and c.pin_memory is True
    c = from_file(tmp_path, SEED_MONITORING)
    assert c.enable_metrics is True and c.metrics_port == 9090
    defaults = Config()
    assert (defaults.enable_metrics, defaults.pin_memory, defaults.fp16, defaults.kv_cache_dtype) == (False, True, False, "auto")


def test_cuda_graph_is_an_alias_in_env_and_flags_and_disagreement_is_refused(tmp_path: Path) -> None:
    assert load_config(env={"HETERO_CUDA_GRAPH": "false"}).enable_cuda_graphs is False
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    assert config_from_args(parser.parse_args(["--cuda-graph", "false"]), env={}).enable_cuda_graphs is False
    with pytest.raises(ConfigError, match="'cuda_graph' and 'enable_cuda_graphs' .* disagree"):
        from_file(tmp_path, {"cuda_graph": False, "enable_cuda_graphs": True})
    assert from_file(tmp_path, {"cuda_graph": True, "enable_cuda_graphs": True}).enable_cuda_graphs is True


@pytest.mark.parametrize("data, key", [
    ({"fp16": True, "dtype": "bfloat16"}, "fp16"),
    ({"kv_cache_dtype": "fp16"}, "kv_cache_dtype"),  # a bfloat16 or float32 model: refused, not converted
    ({"kv_cache_dtype": "int4"}, "kv_cache_dtype"),
    ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype"),
    ({"metrics_port": 0}, "metrics_port"),
    ({"enable_metrics": True, "metrics_port": 8000}, "metrics_port"),  # the HTTP API's port
])
def test_what_is_not_served_is_refused_naming_the_key(tmp_path: Path, data: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=f"'{key}'"):
        from_file(tmp_path, data)


def test_fp16_serves_a_model_in_float16_with_a_float16_cache(tmp_path: Path) -> None:
    model = make_random_llama(tmp_path / "llama", hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, seed=1)
    engine = InferenceEngine(from_file(tmp_path, {**SEED_GPU, "model": str(model), "device": "cpu"}))
    assert engine.runner.dtype == torch.float16 and engine.runner.kv_cache.dtype == torch.float16
    engine.submit_request([5, 6, 7, 8], GenerationParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    (result,) = engine.run()
    assert len(result.output_token_ids) == 6
