"""GGUF files written, as llama.cpp's converter writes them, from the weights of a Hugging Face checkpoint (the
tests' oracle then runs transformers on the directory and the engine on the file; benchmarks/moe.py gives llama.cpp
the file): llama.cpp's tensor names, the Q/K rows of `llama` files permuted for its interleaved RoPE, a mixture of
experts' products stacked per layer (`ffn_*_exps`), the layers' products optionally quantized (Q8_0, Q4_0) with
the `gguf` package, and optionally another GGUF file's tokenizer (llama.cpp loads none without one)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from gpu_worker.model_config import ModelConfig
from gpu_worker.models.checkpoint import load_checkpoint
from gpu_worker.models.families import registry
from gpu_worker.models.gguf_checkpoint import _GGUF_LAYER_NAMES
from gpu_worker.models.rope import rope_attention_factor

_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _permuted(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's Q/K row order: each head's halves (2, d/2) as pairs (d/2, 2)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(model_dir: Path, path: Path, quantize: str | None = None, tokenizer_from: Path | None = None) -> Path:
    """`model_dir`'s checkpoint as the GGUF file `path`; `quantize` (Q8_0, Q4_0): the layers' products in that
    type, the rest float32; `tokenizer_from`: a GGUF file whose `tokenizer.ggml.*` fields are copied."""
    import gguf

    config, state = load_checkpoint(model_dir)
    family = registry.for_architecture(config.architecture)
    c, moe = config, config.moe
    writer = gguf.GGUFWriter(str(path), family.gguf_architectures[0])
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_theta)
    _add_layer_variant(writer, c)
    if tokenizer_from is not None:
        _copy_tokenizer(writer, tokenizer_from)
    else:
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(0)
    if moe is not None:
        writer.add_expert_count(moe.num_experts)
        writer.add_expert_used_count(moe.top_k)
        writer.add_expert_feed_forward_length(moe.expert_intermediate_size)
        if moe.shared_expert_intermediate_size:
            writer.add_expert_shared_feed_forward_length(moe.shared_expert_intermediate_size)
        if moe.normalize_top_k != family.gguf_normalize_top_k:
            writer.add_expert_weights_norm(moe.normalize_top_k)
    names = {family.engine_module(v): k for k, v in {**_GGUF_LAYER_NAMES, **family.gguf_layer_names}.items()}
    qtype = None if quantize is None else getattr(gguf.GGMLQuantizationType, quantize)

    def add(name: str, tensor: torch.Tensor) -> None:
        array = tensor.float().numpy()
        if qtype is not None and name.startswith("blk.") and array.ndim >= 2 and array.shape[-1] % 32 == 0 \
                and "ffn_gate_inp" not in name:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(array))

    experts: dict[str, list[torch.Tensor]] = {}
    fused_parts = {part: (fused, i) for fused, parts in family.gguf_fused.items() for i, part in enumerate(parts)}
    fused: dict[str, list[torch.Tensor | None]] = {}  # a fused tensor's parts, in row order
    for name, tensor in state.items():
        stem, kind = name.rsplit(".", 1)
        if stem in _GLOBAL:
            add(f"{_GLOBAL[stem]}.{kind}", tensor)
            continue
        _, _, layer, rest = stem.split(".", 3)
        if ".experts." in rest:  # mlp.experts.{j}.gate_proj: stacked below, in expert order
            product = rest.rsplit(".", 1)[1]
            experts.setdefault(f"blk.{layer}.{names['mlp.experts.' + product]}.{kind}", []).append(tensor)
            continue
        if family.gguf_rotary_permuted and rest in ("self_attn.q_proj", "self_attn.k_proj"):
            tensor = _permuted(tensor, c.num_attention_heads if rest == "self_attn.q_proj" else c.num_key_value_heads)
        if rest in fused_parts:  # Phi-3's: concatenated once every part is there
            target, index = fused_parts[rest]
            parts = fused.setdefault(f"blk.{layer}.{target}.{kind}", [None] * len(family.gguf_fused[target]))
            parts[index] = tensor
            if all(p is not None for p in parts):
                add(f"blk.{layer}.{target}.{kind}", torch.cat(parts))  # type: ignore[arg-type]
            continue
        if rest == "mlp.shared_expert_gate":
            tensor = tensor.reshape(-1)  # llama.cpp's vector
        add(f"blk.{layer}.{names[rest]}.{kind}", tensor)
    for name, parts in experts.items():
        add(name, torch.stack(parts))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_layer_variant(writer, c: ModelConfig) -> None:
    """Linear RoPE scaling, and Gemma 3's facts: its window, which layers have it (a flag per layer), their RoPE
    base, the score scale where it is not llama.cpp's rule (head_dim), the logits' soft cap."""
    import gguf

    scaling = c.rope_scaling or {}
    kind = scaling.get("rope_type")
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
    elif kind == "longrope":  # llama.cpp's Phi-3: the factors as tensors, the attention factor it derives
        writer.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
        writer.add_rope_scaling_attn_factors(rope_attention_factor(c))
        for which in ("long", "short"):
            writer.add_tensor(f"rope_factors_{which}.weight", np.asarray(scaling[f"{which}_factor"], dtype=np.float32))
    elif kind is not None:
        raise ValueError(f"rope_scaling {kind!r} is not written to GGUF files here")
    if c.sliding_layers:
        writer.add_sliding_window(c.sliding_window)
        if len(c.sliding_layers) < c.num_hidden_layers:  # some layers without: a flag per layer
            writer.add_sliding_window_pattern([c.is_sliding(i) for i in range(c.num_hidden_layers)])
        if c.local_rope_theta:
            writer.add_rope_freq_base_swa(c.local_rope_theta)
    if c.query_pre_attn_scalar and c.query_pre_attn_scalar != c.head_dim:
        writer.add_attention_scale(c.attention_scale)
    if c.final_logit_softcapping is not None:
        writer.add_final_logit_softcapping(c.final_logit_softcapping)


def _copy_tokenizer(writer, source: Path) -> None:
    """The `tokenizer.ggml.*` fields of the GGUF file `source` (its vocabulary, merges, special ids)."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer.ggml."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, field.contents())
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(name, field.contents())
        elif kind == gguf.GGUFValueType.BOOL:
            writer.add_bool(name, field.contents())
        else:
            writer.add_uint32(name, int(field.contents()))
