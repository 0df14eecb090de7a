"""GGUF files (llama.cpp's format) as a `ModelConfig` and tensors under the engine's names: the metadata mapped
onto the config, llama.cpp's tensor names onto Hugging Face's, its Q/K row permutation undone where the family has
one, and each tensor dequantized or, where the caller asks, kept in its blocks (gpu_worker/gguf_blocks.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from gpu_worker.gguf_blocks import GGUFBlocks
from gpu_worker.model_config import ModelConfig, MoeConfig
from gpu_worker.models.families import registry
from gpu_worker.models.families.family import CheckpointError, Family
from hetero_common.model_files import token_ids

_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    # a mixture of experts: the router, every expert's products stacked [experts, out, in] (split per expert
    # here), and Qwen2-MoE's shared expert with its gate
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _hf_name(gguf_name: str, layer_names: dict[str, str]) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (`layer_names`: the common per-layer
    names and the family's); None for unknown tensors."""
    stem, _, kind = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{kind}"
    if stem in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[stem]}.{kind}"
    return None  # e.g. rope_freqs, which llama.cpp precomputes and the engine derives itself


def _f32(value: Any) -> float:
    """A float32 metadata value as its shortest decimal (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _unpermute_rotary(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's HF->GGUF Q/K row permutation for the llama architecture.

    HF orders each head's rows as [first rotary half | second half] (rotate_half); llama.cpp
    interleaves them as pairs (x0, x_{d/2}), (x1, x_{d/2+1}), ... for its GPT-J style rope.
    The stored layout is therefore (head, d/2, 2); swapping the last two axes restores HF's
    (head, 2, d/2).
    """
    rows = weight.shape[0]
    return weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def load_gguf(path: Path, dtype: torch.dtype,
              keep_blocks: Callable[[int, int, int], bool] | None) -> tuple[ModelConfig, dict[str, Any]]:
    """A GGUF file's config and its tensors under the engine's names (checkpoint.load_checkpoint checks them)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise CheckpointError(f"{str(path)!r} is not a readable GGUF file: {exc}.") from exc
    meta = _GGUFMetadata(reader, path)
    experts = bool(meta.field(f"{meta.architecture}.expert_count"))
    family = registry.for_gguf_architecture(meta.architecture, repr(str(path)), experts)
    gguf_tensors = {t.name: t for t in reader.tensors}
    config = _gguf_config(meta, gguf_tensors, family)
    return config, _gguf_state(gguf_tensors, config, family, dtype, keep_blocks)


class _GGUFMetadata:
    """A GGUF file's metadata fields; `required` ones are the architecture's (`llama.block_count`)."""

    def __init__(self, reader: Any, path: Path) -> None:  # reader: gguf.GGUFReader
        self.reader = reader
        self.path = path
        self.architecture = str(self.field("general.architecture", ""))

    def field(self, key: str, default: Any = None) -> Any:
        entry = self.reader.get_field(key)
        return default if entry is None else entry.contents()

    def required(self, key: str) -> Any:
        value = self.field(f"{self.architecture}.{key}")
        if value is None:
            raise CheckpointError(f"GGUF file {str(self.path)!r} lacks metadata key {self.architecture}.{key!s}.")
        return value


def _gguf_config(meta: _GGUFMetadata, gguf_tensors: dict[str, Any], family: Family) -> ModelConfig:
    """The HF-style config from the metadata, and from the tensors where it says nothing."""
    arch = meta.architecture
    hidden, heads = int(meta.required("embedding_length")), int(meta.required("attention.head_count"))
    kv_heads = int(meta.field(f"{arch}.attention.head_count_kv") or heads)
    vocab_size = _gguf_vocab_size(meta, gguf_tensors)
    rope_scaling = _gguf_rope_scaling(meta)
    eos = token_ids(meta.field("tokenizer.ggml.eos_token_id")) + token_ids(meta.field("tokenizer.ggml.eot_token_id"))
    bos = meta.field("tokenizer.ggml.bos_token_id")
    common: dict[str, Any] = dict(
        architecture=family.architecture,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(meta.required("feed_forward_length")),
        num_hidden_layers=int(meta.required("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(meta.field(f"{arch}.attention.key_length") or hidden // heads),
        rms_norm_eps=_f32(meta.required("attention.layer_norm_rms_epsilon")),
        rope_theta=_f32(meta.field(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(meta.field(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in gguf_tensors,
        attention_bias="blk.0.attn_q.bias" in gguf_tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        moe=_gguf_moe(meta, gguf_tensors, family),
    )
    def tensor(name: str) -> list[float] | None:
        found = gguf_tensors.get(name)
        return None if found is None else np.asarray(found.data, dtype=np.float64).reshape(-1).tolist()

    return ModelConfig(**{**common, **family.gguf_config_fields(meta.field, arch, tensor)})


def _gguf_moe(meta: _GGUFMetadata, gguf_tensors: dict[str, Any], family: Family) -> MoeConfig | None:
    """A mixture of experts' shape from `{arch}.expert_*`; its sparse layers are those with a router tensor."""
    arch = meta.architecture
    experts = int(meta.field(f"{arch}.expert_count") or 0)
    if not experts:
        return None
    layers = int(meta.required("block_count"))
    return MoeConfig(
        num_experts=experts, top_k=int(meta.required("expert_used_count")),
        expert_intermediate_size=int(meta.field(f"{arch}.expert_feed_forward_length")
                                     or meta.required("feed_forward_length")),
        normalize_top_k=bool(meta.field(f"{arch}.expert_weights_norm", family.gguf_normalize_top_k)),
        sparse_layers=tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in gguf_tensors),
        shared_expert_intermediate_size=int(meta.field(f"{arch}.expert_shared_feed_forward_length") or 0))


def _gguf_vocab_size(meta: _GGUFMetadata, gguf_tensors: dict[str, Any]) -> int:
    tokens = meta.reader.get_field("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens.data)  # one entry per token string
    if "token_embd.weight" in gguf_tensors:
        return int(gguf_tensors["token_embd.weight"].shape[-1])  # GGUF order: (hidden, vocab)
    return int(meta.required("vocab_size"))


def _gguf_rope_scaling(meta: _GGUFMetadata) -> dict[str, Any] | None:
    # Note: Llama 3.1-style scaling is baked into a `rope_freqs` tensor by llama.cpp, and its HF
    # parameters are not recoverable from the metadata; such files load with rope_scaling=None.
    arch = meta.architecture
    scaling_type = meta.field(f"{arch}.rope.scaling.type")
    if scaling_type in (None, "none"):
        return None
    rope_scaling: dict[str, Any] = {"rope_type": str(scaling_type),
                                    "factor": _f32(meta.field(f"{arch}.rope.scaling.factor", 1.0))}
    original = meta.field(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        rope_scaling["original_max_position_embeddings"] = int(original)
    return rope_scaling


# The linear weights a GGUF file may keep in its blocks: the layers' products, the LM head and the embedding
# (the model looks tokens up in its blocks; a tied head computes from the same ones).
BLOCK_WEIGHTS = ("proj.weight", "lm_head.weight", "embed_tokens.weight")


def _gguf_state(gguf_tensors: dict[str, Any], config: ModelConfig, family: Family, dtype: torch.dtype,
                keep_blocks: Callable[[int, int, int], bool] | None = None) -> dict[str, Any]:
    """The tensors under the engine's names, dequantized to `dtype` (or, where `keep_blocks` says so, a linear
    weight kept in its blocks); llama's Q/K rows back in HF's rotary order."""
    from gguf.quants import dequantize

    state: dict[str, Any] = {}
    layer_names = {**_GGUF_LAYER_NAMES, **family.gguf_layer_names}
    for name, tensor in gguf_tensors.items():
        hf_name = _hf_name(name, layer_names)
        if hf_name is None:
            continue
        # GGUF lists dimensions fastest-first (ne0 = columns): reverse for torch's row-major order.
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if len(shape) == 3:  # one [out, in] matrix per expert
            for expert, part in _experts(hf_name, tensor, shape, dtype, keep_blocks):
                state[hf_name.replace(".experts.", f".experts.{expert}.")] = part
            continue
        if hf_name.endswith("shared_expert_gate.weight"):
            shape = (1, shape[-1])  # llama.cpp keeps the shared expert's one-output gate as a vector
        if (keep_blocks is not None and len(shape) == 2 and hf_name.endswith(BLOCK_WEIGHTS)
                and keep_blocks(int(tensor.tensor_type), shape[0], shape[1])):
            blocks = torch.from_numpy(np.array(tensor.data)).reshape(shape[0], -1)  # a copy: the file is read-only
            if family.gguf_rotary_permuted and ".attn_q." in name:
                blocks = _unpermute_rotary(blocks, config.num_attention_heads)
            elif family.gguf_rotary_permuted and ".attn_k." in name:
                blocks = _unpermute_rotary(blocks, config.num_key_value_heads)
            kept = GGUFBlocks(int(tensor.tensor_type), (shape[0], shape[1]), blocks.contiguous().numpy())
            state.update(family.gguf_to_engine(hf_name, kept, config))
            continue
        # np.asarray drops the memmap subclass (still no copy): numpy's memmap bookkeeping on
        # every block slice otherwise doubles the dequantization time.
        array = dequantize(np.asarray(tensor.data), tensor.tensor_type)
        if not array.flags.writeable:  # F32 tensors come back as the read-only memmap itself
            array = np.array(array)
        weight = torch.from_numpy(array).reshape(shape)
        if family.gguf_rotary_permuted and name.startswith("blk."):
            if ".attn_q." in name:
                weight = _unpermute_rotary(weight, config.num_attention_heads)
            elif ".attn_k." in name:
                weight = _unpermute_rotary(weight, config.num_key_value_heads)
        state.update(family.gguf_to_engine(hf_name, weight.to(dtype).contiguous(), config))
    return state


def _experts(name: str, tensor: Any, shape: tuple[int, ...], dtype: torch.dtype,
             keep_blocks: Callable[[int, int, int], bool] | None) -> list[tuple[int, Any]]:
    """A stacked [experts, out, in] tensor (`ffn_*_exps`) as (expert, its [out, in] weight): each kept in its
    blocks where `keep_blocks` says so (an expert's rows are whole blocks), else dequantized to `dtype`."""
    from gguf.quants import dequantize

    experts, out, cols = shape
    if keep_blocks is not None and keep_blocks(int(tensor.tensor_type), out, cols):
        blocks = np.array(tensor.data).reshape(experts, out, -1)  # a copy: the file is read-only
        return [(e, GGUFBlocks(int(tensor.tensor_type), (out, cols), np.ascontiguousarray(blocks[e])))
                for e in range(experts)]
    weight = torch.from_numpy(np.array(dequantize(np.asarray(tensor.data), tensor.tensor_type))).reshape(shape)
    return [(e, weight[e].to(dtype).contiguous()) for e in range(experts)]
