"""Checkpoints already in fp8 (gpu_worker/models/fp8_checkpoint.py): the `fp8` / `compressed-tensors` layouts (fp8
weights, a `weight_scale` per tensor or per output channel) load; `quantization: fp8` serves the file's own
bytes and scales, `none` their dequantized values (the same logits as a bfloat16 checkpoint of those values);
block-wise scales are refused, naming the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_worker.models.checkpoint import CheckpointError, load_checkpoint
from hetero_common.config import Config
from hetero_infer.engine import InferenceEngine
from hetero_infer.bench.harness import make_random_llama
from kernels import fp8_linear
from kernels.fp8_linear import FP8, Fp8Weight
from tests.helpers.prompt_logits import engine_prompt_logits

pytestmark = pytest.mark.skipif(fp8_linear.unavailable_reason(torch.device("cpu"), torch.bfloat16) is not None,
                                reason="torch._scaled_mm does not run on this CPU build")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def as_fp8_checkpoint(source: Path, target: Path, per_channel: bool) -> tuple[Path, Path]:
    """source's checkpoint with its projections in fp8 (target), and one holding the same values in bfloat16."""
    state = load_file(source / "model.safetensors")
    fp8_state, values = {}, {}
    for name, tensor in state.items():
        if name.split(".")[-2] in PROJECTIONS:
            w = tensor.float()
            scale = (w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().max()) / 448
            q = (w / scale).to(FP8)
            fp8_state[name], fp8_state[name + "_scale"] = q, scale.float()
            values[name] = (q.float() * scale).to(torch.bfloat16)
        else:
            fp8_state[name] = values[name] = tensor
    config = json.loads((source / "config.json").read_text())
    for directory, tensors, quantized in ((target, fp8_state, True), (target.with_suffix(".values"), values, False)):
        directory.mkdir()
        for extra in source.iterdir():
            if extra.name not in ("model.safetensors", "config.json"):
                (directory / extra.name).write_bytes(extra.read_bytes())
        save_file(tensors, directory / "model.safetensors")
        cfg = {**config, "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}} if quantized else config
        (directory / "config.json").write_text(json.dumps(cfg))
    return target, target.with_suffix(".values")


@pytest.mark.parametrize("per_channel", [True, False], ids=["per-channel", "per-tensor"])
def test_an_fp8_checkpoint_serves_its_bytes_or_its_values(tmp_path: Path, per_channel: bool) -> None:
    source = make_random_llama(tmp_path / "llama", hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, seed=6)
    fp8_dir, values_dir = as_fp8_checkpoint(source, tmp_path / "fp8", per_channel)
    _, weights = load_checkpoint(fp8_dir)
    q_proj = weights["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q_proj, Fp8Weight) and q_proj.scale.shape == (1, 128)

    def engine(path: Path, quantization: str) -> InferenceEngine:
        return InferenceEngine(Config(model=str(path), dtype="bfloat16", block_size=16,
                                      quantization=quantization).validate())

    served = engine(fp8_dir, "fp8").runner.model.layers[0]["qkv"]  # q, k, v stacked, the file's bytes
    k_proj, v_proj = (weights[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "kv")
    assert torch.equal(served.weight.view(torch.uint8),
                       torch.cat([q_proj.weight, k_proj.weight, v_proj.weight]).view(torch.uint8))
    assert torch.equal(served.scale, torch.cat([q_proj.scale, k_proj.scale, v_proj.scale], dim=1))
    prompt = list(range(3, 30))
    assert torch.equal(engine_prompt_logits(engine(fp8_dir, "none"), prompt),
                       engine_prompt_logits(engine(values_dir, "none"), prompt))


def test_block_wise_fp8_is_refused(tmp_path: Path) -> None:
    source = make_random_llama(tmp_path / "llama", hidden=64, intermediate=128, layers=1, heads=2, kv_heads=1, seed=7)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="block-wise fp8 scales"):
        load_checkpoint(source)
