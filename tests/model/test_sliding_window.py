"""Windows over every layer (Mistral v0.1's, Phi-3-mini-4k's, Mixtral's `sliding_window` below the context)
against `transformers` on the same weights: greedy tokens on prompts several windows long, whole and in chunks
over cached prefixes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from gpu_worker.models.checkpoint import load_checkpoint
from hetero_infer.bench.harness import save_tiny_model
from tests.helpers.oracle import engine_greedy, hf_greedy, make_prompts

WINDOW = 8


def _windowed_copy(source: Path, directory: Path) -> Path:
    directory = shutil.copytree(source, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "sliding_window": WINDOW}))
    return directory


@pytest.fixture(scope="module")
def windowed_dirs(tmp_path_factory: pytest.TempPathFactory, tiny_phi3_dir: Path,
                  tiny_moe_dirs: dict[str, Path]) -> dict[str, Path]:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(5)
    mistral = MistralForCausalLM(MistralConfig(
        vocab_size=512, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=512, sliding_window=WINDOW, bos_token_id=1, eos_token_id=0,
        tie_word_embeddings=False, torch_dtype="float32")).eval()
    root = tmp_path_factory.mktemp("windowed")
    return {"mistral": save_tiny_model(mistral, root / "mistral"),
            "phi3": _windowed_copy(tiny_phi3_dir, root / "phi3"),
            "mixtral": _windowed_copy(tiny_moe_dirs["mixtral"], root / "mixtral")}


def prompts() -> list[list[int]]:
    generator = np.random.default_rng(4)
    return make_prompts() + [generator.integers(2, 384, 61).tolist()]


@pytest.mark.parametrize("family", ["mistral", "phi3", "mixtral"])
def test_every_layer_attends_within_the_window(windowed_dirs: dict[str, Path], family: str) -> None:
    config, _ = load_checkpoint(windowed_dirs[family])
    assert (config.sliding_window, config.sliding_layers) == (WINDOW, tuple(range(config.num_hidden_layers)))
    expected = hf_greedy(windowed_dirs[family], prompts())
    context = {"max_model_len": 256}  # Phi-3's LongRoPE: its short factors, as transformers' on these prompts
    assert engine_greedy(windowed_dirs[family], prompts(), block_size=5, **context) == expected
    assert engine_greedy(windowed_dirs[family], prompts() + prompts(), block_size=4, max_total_tokens=7,
                         **context) == expected + expected
