"""Embedding vectors after the worker: the pooling a model asks for by default, and a pooled vector made into
what the request asked (`dimensions` kept, L2-normalised, float32 or OpenAI's base64) — one code for the
gateway and the in-process engine, so both answer the same bits."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np

from hetero.v1 import common_pb2
from hetero_common.errors import ValidationError

# An embedding request's sampling parameters downstream: one sample, nothing sampled (the scheduler still
# validates them as a generation's). The gateway's Submit and the in-process engine send these.
EMBEDDING_PARAMS = common_pb2.SamplingParams(max_tokens=1, temperature=0.0, n=1)
POOLING_BY_NAME = {"last": common_pb2.POOLING_LAST, "mean": common_pb2.POOLING_MEAN, "cls": common_pb2.POOLING_CLS}
POOLING_NAMES = {value: name for name, value in POOLING_BY_NAME.items()}
# sentence-transformers' 1_Pooling/config.json: `pooling_mode` (version 6) or a flag per mode (before).
_SENTENCE_TRANSFORMERS_NAMES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
_SENTENCE_TRANSFORMERS_MODES = (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
                                ("pooling_mode_cls_token", "cls"), ("pooling_mode_max_tokens", None),
                                ("pooling_mode_mean_sqrt_len_tokens", None), ("pooling_mode_weightedmean_tokens", None))


def model_pooling(model_path: Path) -> str | None:
    """The pooling a sentence-transformers model directory declares (`modules.json` naming a Pooling module,
    its `config.json`), or None: no such files, or a mode this server does not compute (max, weighted mean)."""
    if not model_path.is_dir() or not (model_path / "modules.json").is_file():
        return None
    try:
        modules = json.loads((model_path / "modules.json").read_text())
        pooling = next((m for m in modules if str(m.get("type", "")).endswith("Pooling")), None)
        if pooling is None:
            return None
        config = json.loads((model_path / pooling.get("path", "") / "config.json").read_text())
    except (OSError, ValueError, AttributeError, TypeError):
        return None
    mode = config.get("pooling_mode")  # sentence-transformers 6: one name (or a list); before: a flag per mode
    if mode is not None:
        modes = [mode] if isinstance(mode, str) else list(mode) if isinstance(mode, list) else []
        chosen = [_SENTENCE_TRANSFORMERS_NAMES.get(str(m)) for m in modes]
    else:
        chosen = [name for key, name in _SENTENCE_TRANSFORMERS_MODES if config.get(key)]
    return chosen[0] if len(chosen) == 1 else None


def default_pooling(configured: str, model_path: Path | None) -> int:
    """serving.embedding.pooling resolved: `auto` = the model directory's own, else last."""
    if configured != "auto":
        return POOLING_BY_NAME[configured]
    return POOLING_BY_NAME[(model_pooling(model_path) if model_path is not None else None) or "last"]


def finish_vector(pooled: np.ndarray | list[float], dimensions: int, normalize: bool) -> np.ndarray:
    """The pooled vector's first `dimensions` values (0: all), L2-normalised when `normalize` (Matryoshka
    models: truncated, then renormalised); float32."""
    vector = np.asarray(pooled, dtype=np.float32)
    if dimensions > vector.shape[0]:
        raise ValidationError(f"dimensions is {dimensions}; this model's embeddings have {vector.shape[0]} values",
                              "dimensions")
    if dimensions:
        vector = vector[:dimensions]
    if normalize:
        norm = float(np.linalg.norm(vector.astype(np.float64)))
        vector = (vector / norm if norm > 0 else vector).astype(np.float32)
    return vector


def to_base64(vector: np.ndarray) -> str:
    """OpenAI's `encoding_format: base64`: the float32 values, little-endian, base64."""
    return base64.b64encode(np.ascontiguousarray(vector, dtype="<f4").tobytes()).decode("ascii")
