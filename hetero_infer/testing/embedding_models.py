"""Embedding models for tests and benchmarks, made from a Llama-family checkpoint: the same directory with
sentence-transformers' module files beside the weights, so that sentence-transformers loads it as an embedding
model (Transformer, Pooling, Normalize) and this server serves it, reading the pooling from the same files."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np

_MODULE_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "1_Pooling",
                 "2_Normalize")
_MODES = {"last": "lasttoken", "mean": "mean", "cls": "cls"}
_TEXT_ONLY = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}


def make_sentence_transformers_dir(model_dir: Path, out: Path, pooling: str) -> Path:
    """`out`: a copy of `model_dir` that sentence-transformers loads with `pooling` (last | mean | cls) and
    normalisation; returns it."""
    from sentence_transformers import SentenceTransformer, models

    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    # Plain text in, as the server takes `text` (sentence-transformers 6 would render it with the chat template).
    transformer = models.Transformer(str(model_dir), modality_config=_TEXT_ONLY, module_output_name="token_embeddings")
    size = getattr(transformer, "get_embedding_dimension", None) or transformer.get_word_embedding_dimension
    pool = models.Pooling(size(), pooling_mode=_MODES[pooling])
    with tempfile.TemporaryDirectory() as saved:
        SentenceTransformer(modules=[transformer, pool, models.Normalize()], device="cpu").save(saved)
        for name in _MODULE_FILES:
            source = Path(saved) / name
            if source.is_dir():
                shutil.copytree(source, out / name, dirs_exist_ok=True)
            elif source.is_file():
                shutil.copy(source, out / name)
    return out


def load_sentence_transformer(model_dir: Path, dtype: str = "float32"):  # -> SentenceTransformer
    """sentence-transformers' model of `model_dir` on the CPU; a tokenizer without a padding token pads with EOS
    (batches of mixed lengths need one; the attention mask keeps it out of every vector)."""
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu", model_kwargs={"dtype": getattr(torch, dtype)})
    if model.tokenizer.pad_token is None:
        model.tokenizer.pad_token = model.tokenizer.eos_token
    model.max_seq_length = 1 << 16
    return model


def cosine(a: np.ndarray | list[float], b: np.ndarray | list[float]) -> float:
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a64 @ b64 / (np.linalg.norm(a64) * np.linalg.norm(b64)))
