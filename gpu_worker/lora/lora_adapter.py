"""A LoRA adapter in PEFT's format, read from its directory and checked against the served model (issue 41).

PEFT saves `adapter_config.json` (`r`, `lora_alpha`, `use_rslora`, `target_modules`, ...) and
`adapter_model.safetensors`, whose tensors are named `base_model.model.<module>.lora_A.weight` ([r, in]) and
`...lora_B.weight` ([out, r]). A target's output gains `scaling * B @ (A @ x)`, with scaling `lora_alpha / r`,
or `lora_alpha / sqrt(r)` with rsLoRA.

Everything an adapter could ask for that this engine would not compute is refused with an error naming it:
a missing file, a module the served model lacks, shapes that do not fit it, a rank over `max_lora_rank`,
DoRA, biases, per-module ranks, `modules_to_save`, `fan_in_fan_out`. An adapter that loads is exactly what
PEFT computes; one that does not leaves the served model and the other adapters as they were.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from gpu_worker.model_config import ModelConfig
from hetero_common.errors import ValidationError

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoraAdapterError(ValidationError):
    """An adapter that cannot be served: the message says which file, key or shape, and what would fit."""


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    rank: int
    scaling: float
    targets: frozenset[str]  # the module names it adapts (q_proj, ..., down_proj)
    # (layer, target) -> (A [rank, in], B [out, rank]), float32
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def target_shape(config: ModelConfig, target: str) -> tuple[int, int]:
    """(out, in) of one of the served model's linear layers."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    h, inter = config.hidden_size, config.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (inter, h),
            "up_proj": (inter, h), "down_proj": (h, inter)}[target]


def load_lora_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """The adapter `name` in `path`, checked against the served model's `config` and `max_rank`."""
    directory = Path(path)
    settings = _read_settings(name, directory)
    rank, targets = _check_settings(name, settings, max_rank)
    weights = _read_weights(name, directory, config, rank)
    found = {target for _, target in weights}
    if missing := targets - found:
        raise LoraAdapterError(f"LoRA adapter {name!r}: adapter_config.json targets {sorted(missing)} but "
                               "adapter_model.safetensors holds no weights for them", "lora")
    alpha = float(settings.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    return LoraAdapter(name, rank, scaling, frozenset(found), weights)


def _read_settings(name: str, directory: Path) -> dict:
    config_file = directory / "adapter_config.json"
    if not config_file.is_file():
        raise LoraAdapterError(f"LoRA adapter {name!r}: {str(config_file)!r} is missing (a PEFT adapter directory "
                               "holds adapter_config.json and adapter_model.safetensors)", "lora")
    try:
        settings = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise LoraAdapterError(f"LoRA adapter {name!r}: {str(config_file)!r} is not valid JSON: {exc}", "lora") from exc
    if not isinstance(settings, dict):
        raise LoraAdapterError(f"LoRA adapter {name!r}: {str(config_file)!r} must hold a JSON object", "lora")
    return settings


def _check_settings(name: str, settings: dict, max_rank: int) -> tuple[int, set[str]]:
    """(its rank, the modules it targets), or the first setting this engine does not serve."""
    def refuse(why: str) -> LoraAdapterError:
        return LoraAdapterError(f"LoRA adapter {name!r}: {why}", "lora")

    if str(settings.get("peft_type", "LORA")).upper() != "LORA":
        raise refuse(f"peft_type {settings.get('peft_type')!r} is not served (only LORA)")
    rank = settings.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise refuse(f"r = {rank!r} must be a positive integer")
    if rank > max_rank:
        raise refuse(f"rank {rank} is over max_lora_rank ({max_rank}); raise max_lora_rank or use a smaller rank")
    for key, why in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out weights"),
                     ("modules_to_save", "modules_to_save (full copies of modules)"),
                     ("rank_pattern", "per-module ranks (rank_pattern)"), ("alpha_pattern", "per-module alphas"),
                     ("layers_to_transform", "layers_to_transform"), ("lora_bias", "LoRA biases (lora_bias)"),
                     ("layer_replication", "layer_replication"), ("target_parameters", "target_parameters"),
                     ("trainable_token_indices", "trainable tokens"), ("alora_invocation_tokens", "aLoRA"),
                     ("use_qalora", "QA-LoRA"), ("use_bdlora", "BD-LoRA")):
        if settings.get(key):
            raise refuse(f"{why} is not served")
    if settings.get("bias", "none") != "none":
        raise refuse(f"bias = {settings.get('bias')!r} is not served (only none)")
    modules = settings.get("target_modules")
    if isinstance(modules, str):  # a regex over module names, as PEFT allows
        targets = {t for t in TARGETS if re.search(modules, t)}
    elif isinstance(modules, list) and all(isinstance(m, str) for m in modules):
        names = {m.rsplit(".", 1)[-1] for m in modules}
        if unknown := names - set(TARGETS):
            raise refuse(f"target_modules {sorted(unknown)} are not modules of the served model "
                         f"(it has {', '.join(TARGETS)})")
        targets = names
    else:
        raise refuse(f"target_modules = {modules!r} must be a list of module names or a regex")
    if not targets:
        raise refuse("target_modules names none of the served model's modules")
    return rank, targets


def _read_weights(name: str, directory: Path, config: ModelConfig,
                  rank: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights_file = directory / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise LoraAdapterError(f"LoRA adapter {name!r}: {str(weights_file)!r} is missing", "lora")
    try:
        tensors = load_file(str(weights_file))
    except (OSError, SafetensorError) as exc:
        raise LoraAdapterError(f"LoRA adapter {name!r}: cannot read {str(weights_file)!r}: {exc}", "lora") from exc
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR.match(key)
        if match is None or match.group(3) not in TARGETS:
            raise LoraAdapterError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA weight of a module the "
                                   "served model has", "lora")
        layer = int(match.group(1))
        if layer >= config.num_hidden_layers:
            raise LoraAdapterError(f"LoRA adapter {name!r}: tensor {key!r} is for layer {layer}, but the served "
                                   f"model has {config.num_hidden_layers} layers", "lora")
        parts.setdefault((layer, match.group(3)), {})[match.group(4)] = tensor
    weights = {}
    for (layer, target), pair in sorted(parts.items()):
        out, inp = target_shape(config, target)
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None:
            raise LoraAdapterError(f"LoRA adapter {name!r}: layer {layer} {target} has lora_{'B' if b is None else 'A'} "
                                   "missing", "lora")
        if tuple(a.shape) != (rank, inp) or tuple(b.shape) != (out, rank):
            raise LoraAdapterError(
                f"LoRA adapter {name!r}: layer {layer} {target} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}; the served model needs ({rank}, {inp}) and ({out}, {rank}): it was trained "
                "for another base model", "lora")
        weights[(layer, target)] = (a.float().contiguous(), b.float().contiguous())
    return weights
