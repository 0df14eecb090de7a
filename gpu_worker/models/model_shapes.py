"""What a model's shapes ask of one rank: the [out, in] shapes of its linear weights (the CPU's kernel plan reads
them), and whether tensor parallelism can split its heads and features."""

from __future__ import annotations

from gpu_worker.model_config import ModelConfig
from gpu_worker.parallel.tensor_parallel import TensorParallel
from hetero_common.errors import ConfigError


def linear_shapes(config: ModelConfig, tp: TensorParallel) -> list[tuple[int, int]]:
    """The [out, in] shapes of one rank's linear weights that decide the CPU's kernel plan: q/k/v, o, gate/up, down
    (a dense layer's, and a mixture of experts' expert and shared expert), the LM head last. Not a router's or a
    shared expert gate's: a few rows each (8 experts, one gate), which the panels take whatever the plan
    (WeightPlacer.matrix), and which would otherwise keep every product off the AMX tiles."""
    c, size = config, tp.size
    q, kv = c.num_attention_heads // size * c.head_dim, c.num_key_value_heads // size * c.head_dim
    moe = c.moe
    mlps = [c.intermediate_size // size] if moe is None or len(moe.sparse_layers) < c.num_hidden_layers else []
    if moe is not None:
        mlps += [n // size for n in (moe.expert_intermediate_size, moe.shared_expert_intermediate_size) if n]
    shapes = [(q + 2 * kv, c.hidden_size), (c.hidden_size, q)]
    shapes += [shape for inter in mlps for shape in ((2 * inter, c.hidden_size), (c.hidden_size, inter))]
    return shapes + [(c.vocab_size, c.hidden_size)]


def check_splits(config: ModelConfig, tp: TensorParallel) -> None:
    """ConfigError where `tp` cannot split the model: its heads and intermediate features (the experts' too)
    must divide among the ranks, and a q/k norm over all heads (OLMoE's) needs them on one rank."""
    c = config
    tp.check_divides(num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                     intermediate_size=c.intermediate_size,
                     **({} if c.moe is None else {
                         "expert intermediate_size": c.moe.expert_intermediate_size,
                         "shared_expert_intermediate_size": c.moe.shared_expert_intermediate_size}))
    if c.qk_norm_all_heads and tp.enabled:  # its RMSNorm spans every head: one rank's would see a slice
        raise ConfigError(f"config key 'tensor_parallel_size' = {tp.size}: a {c.architecture} model normalizes q "
                          "and k over all heads at once and runs on one rank only; set it to 1.")
