"""LoRA adapters in PEFT's format (gpu_worker/lora/lora_adapter.py, issue 41): what one adds to each target is
PEFT's own (its merged weights are the oracle: base + scaling * B @ A, with lora_alpha / r or rsLoRA's
lora_alpha / sqrt(r)), for ranks 8 and 64 and different target sets; every adapter this engine would not
compute exactly is refused with an error naming what is wrong."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from gpu_worker.lora.lora_adapter import LoraAdapterError, load_lora_adapter
from gpu_worker.models.checkpoint import load_checkpoint
from hetero_infer.bench.harness import make_random_llama, make_tiny_llama
from tests.helpers.tiny_models import make_lora_adapter


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("lora-base"), seed=1)


def merged_delta(base: Path, adapter: Path, module: str) -> torch.Tensor:
    """PEFT's merged weight of `module` minus the base's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    before = dict(model.named_parameters())[f"{module}.weight"].detach().clone()
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    return dict(merged.named_parameters())[f"{module}.weight"].detach() - before


@pytest.mark.parametrize("rank,targets,rslora", [(8, ["q_proj", "v_proj"], False),
                                                 (64, ["o_proj", "gate_proj", "up_proj", "down_proj", "k_proj"], True)])
def test_an_adapter_adds_what_peft_merges(base: Path, tmp_path: Path, rank: int, targets: list[str],
                                          rslora: bool) -> None:
    directory = make_lora_adapter(base, tmp_path / "adapter", rank, targets, seed=rank, alpha=32, rslora=rslora)
    config, _ = load_checkpoint(base)
    adapter = load_lora_adapter("a", directory, config, max_rank=64)
    assert adapter.rank == rank and adapter.targets == set(targets)
    assert adapter.scaling == pytest.approx(32 / rank ** 0.5 if rslora else 32 / rank)
    for target in targets:
        kind = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        a, b = adapter.weights[(1, target)]
        expected = merged_delta(base, directory, f"model.layers.1.{kind}.{target}")
        torch.testing.assert_close(adapter.scaling * b @ a, expected, rtol=1e-4, atol=1e-5)


def edit_config(directory: Path, **changes) -> None:
    path = directory / "adapter_config.json"
    settings = json.loads(path.read_text())
    settings.update(changes)
    path.write_text(json.dumps(settings))


@pytest.mark.parametrize("changes,words", [
    (dict(r=16), "lora_A (8, 64)"),  # the file's shapes are rank 8's
    (dict(use_dora=True), "DoRA is not served"),
    (dict(bias="all"), "bias = 'all'"),
    (dict(target_modules=["q_proj", "lm_head"]), "['lm_head'] are not modules of the served model"),
    (dict(target_modules=["q_proj", "k_proj"]), "targets ['k_proj']"),
    (dict(peft_type="PREFIX_TUNING"), "peft_type 'PREFIX_TUNING'"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(rank_pattern={"q_proj": 4}), "per-module ranks"),
])
def test_an_adapter_asking_for_what_is_not_served_is_refused(base: Path, tmp_path: Path, changes: dict,
                                                             words: str) -> None:
    directory = make_lora_adapter(base, tmp_path / "adapter", 8, ["q_proj"])
    edit_config(directory, **changes)
    config, _ = load_checkpoint(base)
    with pytest.raises(LoraAdapterError, match="LoRA adapter 'bad'.*" + re.escape(words)):
        load_lora_adapter("bad", directory, config, max_rank=64)


def test_missing_files_a_rank_over_the_limit_and_another_base_are_refused(base: Path, tmp_path: Path) -> None:
    config, _ = load_checkpoint(base)
    with pytest.raises(LoraAdapterError, match="adapter_config.json.* is missing"):
        load_lora_adapter("gone", tmp_path / "nowhere", config, max_rank=64)
    directory = make_lora_adapter(base, tmp_path / "big", 32, ["q_proj"])
    with pytest.raises(LoraAdapterError, match=r"rank 32 is over max_lora_rank \(16\)"):
        load_lora_adapter("big", directory, config, max_rank=16)
    (directory / "adapter_model.safetensors").unlink()
    with pytest.raises(LoraAdapterError, match="adapter_model.safetensors' is missing"):
        load_lora_adapter("big", directory, config, max_rank=64)
    other = make_random_llama(tmp_path / "other", hidden=96, intermediate=128, layers=2, heads=4, kv_heads=2,
                              vocab=512)
    foreign = make_lora_adapter(other, tmp_path / "foreign", 8, ["q_proj"])
    with pytest.raises(LoraAdapterError, match="trained for another base model"):
        load_lora_adapter("foreign", foreign, config, max_rank=64)
