"""Shared fixtures: tiny seeded checkpoints, built once per session in temporary directories.
Helpers live in plain modules, never here (conftest is pytest's, not an importable module): those the
benchmarks share in `hetero_infer/bench/harness.py`, the tests' own in `tests/helpers/`."""

from __future__ import annotations

from pathlib import Path

import pytest

# The helper modules hold assertions of their own: rewrite them so a failure shows its values,
# as it did when they lived in test files.
pytest.register_assert_rewrite("tests.helpers.oracle", "hetero_infer.bench.harness", "tests.helpers.stack_requests",
                               "tests.helpers.scheduler_driver")

from hetero_infer.bench.harness import make_tiny_llama  # noqa: E402
from tests.helpers.tiny_models import (  # noqa: E402
    make_tiny_gemma3,
    make_tiny_mixtral,
    make_tiny_olmoe,
    make_tiny_phi3,
    make_tiny_qwen2,
    make_tiny_qwen2_moe,
    make_tiny_qwen3,
    make_tiny_qwen3_moe,
)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=1)


@pytest.fixture(scope="session")
def long_context_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Generations long enough to outlast a deadline or a client's patience (the shared tiny
    model stops at 512 positions; 400 tokens take about a second through the stack)."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-4k"), seed=1, max_position_embeddings=4096)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"), seed=2)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), seed=6)


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_phi3(tmp_path_factory.mktemp("tiny-phi3"), seed=8)


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"), seed=9)


# The mixtures of experts (tests/helpers/tiny_models.py), by family name: tests/model/test_moe.py and the stack's.
MOE_MAKERS = {"mixtral": make_tiny_mixtral, "qwen3_moe": make_tiny_qwen3_moe, "qwen2_moe": make_tiny_qwen2_moe,
              "olmoe": make_tiny_olmoe}


@pytest.fixture(scope="session")
def tiny_moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each tiny mixture of experts, made on first use."""
    class Made(dict):
        def __missing__(self, family: str) -> Path:
            self[family] = MOE_MAKERS[family](tmp_path_factory.mktemp(f"tiny-{family}"), seed=3)
            return self[family]
    return Made()
