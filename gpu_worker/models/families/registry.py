"""The registry of model families: which family a config.json `model_type` or a GGUF architecture names."""


from __future__ import annotations

from gpu_worker.models.families import gemma3, llama, mistral, mixtral, olmoe, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe
from gpu_worker.models.families.family import CheckpointError, Family

FAMILIES: tuple[Family, ...] = (llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, phi3.FAMILY, mixtral.FAMILY,
                                qwen2_moe.FAMILY, qwen3_moe.FAMILY, olmoe.FAMILY, gemma3.FAMILY)

_BY_HF_TYPE = {t: f for f in FAMILIES for t in f.hf_model_types}
_BY_GGUF_ARCH = {(a, f.gguf_with_experts): f for f in FAMILIES for a in f.gguf_architectures}
_BY_NAME = {f.architecture: f for f in FAMILIES}


def hf_model_types() -> tuple[str, ...]:
    return tuple(_BY_HF_TYPE)


def for_hf_model_type(model_type: str, where: str) -> Family:
    """The family of a config.json's `model_type`; CheckpointError naming the supported ones otherwise."""
    if model_type not in _BY_HF_TYPE:
        raise CheckpointError(f"Unsupported architecture {model_type!r} in {where}: supported are "
                              f"{', '.join(_BY_HF_TYPE)}.")
    return _BY_HF_TYPE[model_type]


def for_gguf_architecture(arch: str, where: str, experts: bool = False) -> Family:
    """The family of a GGUF file's `general.architecture`, with experts or without (`{arch}.expert_count`)."""
    if (arch, experts) not in _BY_GGUF_ARCH:
        archs = dict.fromkeys(a for a, _ in _BY_GGUF_ARCH)
        kind = "with experts" if experts else "without experts"
        raise CheckpointError(f"Unsupported architecture {arch!r} {kind} in {where}: supported GGUF architectures are "
                              f"{', '.join(archs)}." if arch not in archs else
                              f"{where} is a {arch!r} file {kind}, which is not supported.")
    return _BY_GGUF_ARCH[(arch, experts)]


def for_architecture(architecture: str) -> Family:
    """The family of a loaded ModelConfig's `architecture`."""
    return _BY_NAME[architecture]
