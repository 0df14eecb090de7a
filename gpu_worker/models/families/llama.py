"""Llama (and its GGUF files, whose Q/K rows llama.cpp permutes): the layout every other family starts from."""

from __future__ import annotations

from gpu_worker.models.families.family import Family


class Llama(Family):
    architecture = "llama"
    hf_model_types = ("llama",)
    # llama.cpp writes Mistral models under "llama" too; they compute alike
    gguf_architectures = ("llama",)
    gguf_rotary_permuted = True


FAMILY = Llama()
