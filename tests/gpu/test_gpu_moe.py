"""A mixture of experts on a CUDA device (issue 59): the experts stacked and computed by torch's grouped products
with no host read-back (gpu_worker/models/moe.GroupedExperts), against the CPU's per-expert loop in float32, and
greedy generation in eager steps against CUDA graphs. Marked `gpu`, skipped without a CUDA device;
`scripts/gpu_run.sh` runs them on the GPU machine."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from gpu_worker.models.checkpoint import load_checkpoint
from gpu_worker.models.model import LlamaModel
from tests.helpers.oracle import make_prompts
from tests.helpers.tiny_models import make_head64_qwen3_moe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device (none is visible); run scripts/gpu_run.sh on the GPU machine"),
]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_head64_qwen3_moe(tmp_path_factory.mktemp("gpu-qwen3-moe"))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def test_grouped_experts_match_the_cpu_loop(moe_dir: Path) -> None:
    config, weights = load_checkpoint(moe_dir)
    cpu = LlamaModel(config, weights, torch.device("cpu"), torch.float32, max_positions=256)
    cuda = LlamaModel(config, weights, torch.device("cuda"), torch.bfloat16, max_positions=256)
    assert cuda.layers[0]["moe"].grouped is not None and not cuda.layers[0]["moe"].experts
    x = cpu._embed(torch.arange(2, 100)) * 30
    reference, reference_load = cpu.layers[0]["moe"](x, silu_mul)
    out, load = cuda.layers[0]["moe"](x.to("cuda", torch.bfloat16), silu_mul)
    assert torch.equal(load.cpu(), reference_load)
    rel = float((out.float().cpu() - reference).norm() / reference.norm())
    assert rel < 2e-2, rel


def _greedy(model_dir: Path, graphs: bool) -> list[list[int]]:
    from hetero_common.config import Config
    from hetero_infer.engine import GenerationParams, InferenceEngine

    engine = InferenceEngine(Config(model=str(model_dir), device="cuda", dtype="bfloat16", block_size=16,
                                    max_total_tokens=256, max_num_blocks=256, enable_cuda_graphs=graphs).validate())
    params = GenerationParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ids = [engine.submit_request(p, params) for p in make_prompts()]
    done = {r.request_id: r.output_token_ids for r in engine.run()}
    assert engine.get_memory_stats().used_blocks == 0
    outputs = [done[i] for i in ids]
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return outputs


def test_cuda_graphs_give_the_eager_steps_tokens(moe_dir: Path) -> None:
    """The routing, the sort by expert and the grouped products are captured in the decode graphs: the same
    kernels on the same inputs, so the same tokens."""
    eager = _greedy(moe_dir, graphs=False)
    assert all(len(t) == NEW_TOKENS for t in eager)
    assert _greedy(moe_dir, graphs=True) == eager
