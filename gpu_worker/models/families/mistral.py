"""Mistral: Llama's layout under its own model_type (llama.cpp writes its GGUF files as `llama`), with a sliding
window over every layer where `sliding_window` is below the context (v0.1's 4096)."""

from __future__ import annotations

from typing import Any

from gpu_worker.models.families.family import Family, sliding_window_fields


class Mistral(Family):
    architecture = "mistral"
    hf_model_types = ("mistral",)

    def config_fields(self, cfg: dict[str, Any], where: str) -> dict[str, Any]:
        super().config_fields(cfg, where)
        return sliding_window_fields(cfg, where)


FAMILY = Mistral()
