"""Config `quantization`: what is not served is refused naming the key, never quietly dequantized."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetero_common.config import Config
from hetero_common.errors import ConfigError
from hetero_infer.engine import InferenceEngine
from hetero_infer.testing.tiny_models import make_random_llama


def test_fp8_is_refused_at_validation() -> None:
    with pytest.raises(ConfigError, match="'quantization'.*fp8 is not built yet"):
        Config(quantization="fp8").validate()


def test_int8_without_its_kernel_path_is_refused_at_start(tmp_path: Path) -> None:
    """float32 runs the torch code, which has no int8 products: the worker says so instead of serving float32."""
    model = make_random_llama(tmp_path / "llama", hidden=64, intermediate=128, layers=1, heads=2, kv_heads=1, seed=2)
    with pytest.raises(ConfigError, match="'quantization' = 'int8' cannot be served"):
        InferenceEngine(Config(model=str(model), dtype="float32", quantization="int8").validate())
