"""The vector a request gets from the pooled one (dimensions, L2 norm, base64), and the default pooling read
from a sentence-transformers model directory in both of its formats."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest

from hetero.v1 import common_pb2
from hetero_common.embedding_vectors import default_pooling, finish_vector, model_pooling, to_base64
from hetero_common.errors import ValidationError


def test_dimensions_are_cut_then_renormalised() -> None:
    pooled = [3.0, 4.0, 12.0]
    np.testing.assert_allclose(finish_vector(pooled, 0, True), np.array([3, 4, 12]) / 13, rtol=1e-7)
    np.testing.assert_allclose(finish_vector(pooled, 2, True), [0.6, 0.8], rtol=1e-7)
    np.testing.assert_array_equal(finish_vector(pooled, 2, False), [3.0, 4.0])
    assert finish_vector(pooled, 3, True).dtype == np.float32


def test_a_zero_vector_stays_zero_and_too_many_dimensions_are_refused() -> None:
    np.testing.assert_array_equal(finish_vector([0.0, 0.0], 0, True), [0.0, 0.0])
    with pytest.raises(ValidationError, match="dimensions is 4; this model's embeddings have 3") as refused:
        finish_vector([1.0, 2.0, 3.0], 4, True)
    assert refused.value.param == "dimensions"


def test_base64_is_openais_little_endian_float32() -> None:
    vector = np.array([1.5, -2.25, 1e-3], dtype=np.float32)
    decoded = np.frombuffer(base64.b64decode(to_base64(vector)), dtype="<f4")
    np.testing.assert_array_equal(decoded, vector)


def _write(directory: Path, pooling_config: dict, pooling_type: str = "sentence_transformers.models.Pooling") -> Path:
    (directory / "1_Pooling").mkdir(parents=True)
    (directory / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": pooling_type}]))
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    return directory


@pytest.mark.parametrize("config, expected", [
    ({"pooling_mode": "lasttoken"}, "last"), ({"pooling_mode": "mean"}, "mean"), ({"pooling_mode": "cls"}, "cls"),
    ({"pooling_mode": "max"}, None), ({"pooling_mode": ["mean", "max"]}, None),
    ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}, "mean"),
    ({"pooling_mode_lasttoken": True}, "last"), ({"pooling_mode_cls_token": True}, "cls"),
    ({"pooling_mode_max_tokens": True}, None), ({"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True}, None),
])
def test_the_models_pooling_is_read_from_either_format(tmp_path: Path, config: dict, expected: str | None) -> None:
    assert model_pooling(_write(tmp_path, config)) == expected


def test_no_or_broken_module_files_mean_last_unless_configured(tmp_path: Path) -> None:
    assert model_pooling(tmp_path) is None
    (tmp_path / "modules.json").write_text("not json")
    assert model_pooling(tmp_path) is None
    assert default_pooling("auto", tmp_path) == common_pb2.POOLING_LAST
    assert default_pooling("auto", None) == common_pb2.POOLING_LAST
    mean_dir = _write(tmp_path / "m", {"pooling_mode": "mean"})
    assert default_pooling("auto", mean_dir) == common_pb2.POOLING_MEAN
    assert default_pooling("cls", mean_dir) == common_pb2.POOLING_CLS  # the config wins
    assert model_pooling(tmp_path / "model.gguf") is None
