"""What the mixture-of-experts families share: their config.json's expert keys read into a `MoeConfig`, and the
Hugging Face tensor names of their experts' products (the engine's are `mlp.gate`, `mlp.experts.{j}.{gate,up,
down}_proj`: families/family.mlp_tensor_names)."""

from __future__ import annotations

from typing import Any

from gpu_worker.model_config import MoeConfig
from gpu_worker.models.families.family import CheckpointError


def first_key(cfg: dict[str, Any], keys: tuple[str, ...], where: str) -> Any:
    """The value of the first of `keys` the config sets (transformers >= 5 renames some expert keys on save)."""
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    raise CheckpointError(f"{where} lacks the required field {keys[0]!r}.")


def moe_config(cfg: dict[str, Any], where: str, *, expert_size_key: str, normalize_top_k: bool | None = None,
               shared_expert_size: int = 0) -> MoeConfig:
    """The experts' shape from a config.json; `normalize_top_k` None reads `norm_topk_prob` (default false).
    Sparse layers follow Qwen2-MoE's rule, which the others' configs leave at every layer: layer i has experts
    unless it is in `mlp_only_layers`, where (i + 1) is a multiple of `decoder_sparse_step`."""
    experts = int(first_key(cfg, ("num_experts", "num_local_experts"), where))
    top_k = int(first_key(cfg, ("num_experts_per_tok",), where))
    if experts < 1 or not 1 <= top_k <= experts:
        raise CheckpointError(f"{where} asks for {top_k} of {experts} experts per token: need 1 <= "
                              "num_experts_per_tok <= num_experts.")
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    layers = int(cfg["num_hidden_layers"])
    return MoeConfig(
        num_experts=experts, top_k=top_k, expert_intermediate_size=int(first_key(cfg, (expert_size_key,), where)),
        normalize_top_k=bool(cfg.get("norm_topk_prob", False)) if normalize_top_k is None else normalize_top_k,
        sparse_layers=tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
        shared_expert_intermediate_size=shared_expert_size)

