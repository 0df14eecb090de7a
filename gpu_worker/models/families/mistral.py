"""Mistral: Llama's layout under its own model_type (llama.cpp writes its GGUF files as `llama`)."""

from __future__ import annotations

from gpu_worker.models.families.family import Family


class Mistral(Family):
    architecture = "mistral"
    hf_model_types = ("mistral",)


FAMILY = Mistral()
