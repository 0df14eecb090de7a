"""All decoder layers of a forward in one C call (kernels/native/llama_layers.c), bfloat16 on the CPU.

The per-layer Python loop (`LlamaModel._hidden_states_fused`) calls ~10 C kernels per layer; the Python
between them is ~1-2 ms of a SmolLM2 step (a fifth of a batch-1 step). Where every one of those kernels
is C (the C linear layers, and the attention kernel planned for every row of the step) and there is no
tensor parallelism, the same kernels run in the same order from C: bitwise the same hidden states.

Where the linear layers are oneDNN's (AMX CPUs) the loop stays, and `attention_block` takes each layer's
part between its q/k/v and o products (RoPE, the K/V write, attention) in one call instead of three.
"""

from __future__ import annotations

from typing import Protocol

import torch

from gpu_worker.cpu.packed_linear import DualPackedWeight
from kernels.native import lib as native_lib
from kernels.native.decode_attention import CACHE_DTYPES, KV_KINDS
from kernels.native.linear import NativePackedWeight
from kernels.native.linear_gguf import GGUFPackedWeight


class LoraArguments(Protocol):
    """A step's LoRA adapters as the whole-model C call takes them (`gpu_worker.lora.lora_slots.NativeLoraBatch`;
    named by its shape so that the CPU path does not depend on the LoRA room, which builds on it)."""

    def c_arguments(self) -> tuple[int, int, int]: ...


def _addresses(tensors: list[torch.Tensor | None]) -> torch.Tensor:
    return torch.tensor([0 if t is None else t.data_ptr() for t in tensors], dtype=torch.int64)


GGUF_KIND_BASE = 100  # llama_layers_bf16's `kind`: 0 the bfloat16 panels, 1 the AMX tiles, 100 + a ggml type


def _kernel_side(weight: object) -> object:
    return weight.native if type(weight) is DualPackedWeight else weight


def weights_kind(layers: list[dict]) -> int | None:
    """llama_layers_bf16's `kind` for the layers' linear weights, or None where they are not all packed for one
    C kernel (a mix of GGUF types, or some dequantized: the per-layer loop runs them)."""
    kinds = set()
    for layer in layers:
        for name in ("qkv", "o", "gate_up", "down"):
            weight = _kernel_side(layer[name])
            if type(weight) is NativePackedWeight:
                kinds.add(int(weight.amx))
            elif type(weight) is GGUFPackedWeight:
                kinds.add(GGUF_KIND_BASE + weight.type)
            else:
                return None
    return kinds.pop() if len(kinds) == 1 else None


class CLayers:
    """The layers' weight and cache addresses, gathered once; `run` computes a step's hidden states."""

    def __init__(self, layers: list[dict], cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                 head_dim: int, eps: float) -> None:
        kind = weights_kind(layers)
        assert kind is not None, "the layers' weights are not all packed for one C kernel"
        self.kind = kind

        def packed(name: str) -> list[torch.Tensor]:
            return [_kernel_side(layer[name]).packed for layer in layers]  # type: ignore[attr-defined]

        self._keep = (layers, cos, sin)  # every address below points into these
        self.input_norm = _addresses([layer["input_norm"] for layer in layers])
        self.qkv, self.o = _addresses(packed("qkv")), _addresses(packed("o"))
        self.gate_up, self.down = _addresses(packed("gate_up")), _addresses(packed("down"))
        self.qkv_bias = _addresses([layer["qkv_bias"] for layer in layers])
        self.post_norm = _addresses([layer["post_norm"] for layer in layers])
        self.cos, self.sin = cos, sin
        self.num_heads, self.num_kv_heads, self.head_dim, self.eps = num_heads, num_kv_heads, head_dim, eps
        self.hidden_size = int(layers[0]["input_norm"].shape[0])
        self.intermediate = layers[0]["down"].shape[1]
        self.num_layers = len(layers)
        self._fn = native_lib.load().llama_layers_bf16  # type: ignore[union-attr]

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, kv_cache: list[torch.Tensor] | torch.Tensor,
            k_rows: torch.Tensor, v_rows: torch.Tensor, q_rows: torch.Tensor, pages: torch.Tensor,
            kv_lens: torch.Tensor, scale: float, tiles: bool = True, lora: LoraArguments | None = None) -> torch.Tensor:
        """hidden [T, hidden] (the embeddings, updated in place) -> the last layer's output, not yet added.
        kv_cache: the HND layer caches (their addresses are read each call: a resumed cache is a new one);
        k_rows / v_rows: kernels.cache_ops.hnd_rows of the step's slots; q_rows, pages, kv_lens: the attention
        backend's C plan for every row of the step; `tiles`: prompt chunks through the attention kernel's 16-row
        tiles, else every row per row (the same bits, slower: for comparisons). `lora`: the step's LoRA adapters,
        added after each product in C (gpu_worker/lora/lora_slots.py)."""
        caches = [kv_cache[i] for i in range(self.num_layers)]
        if not all(c.is_contiguous() and c.dtype == caches[0].dtype for c in caches) or caches[0].dtype not in CACHE_DTYPES:
            raise ValueError("the C layers take contiguous bfloat16, float8_e4m3fn or int8 layer caches")
        cache_addresses = _addresses(caches)
        t, h = hidden.shape
        q, kv, inter = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.intermediate
        empty = torch.empty
        bf16 = torch.bfloat16
        x, delta, o_out = empty((t, h), dtype=bf16), empty((t, h), dtype=bf16), empty((t, h), dtype=bf16)
        qkv, attn = empty((t, q + 2 * kv), dtype=bf16), empty((t, q), dtype=bf16)
        gate_up, act = empty((t, 2 * inter), dtype=bf16), empty((t, inter), dtype=bf16)
        rc = self._fn(
            hidden.data_ptr(), t, h, self.num_heads, self.num_kv_heads, self.head_dim, inter, self.eps,
            self.num_layers, self.input_norm.data_ptr(), self.qkv.data_ptr(), self.qkv_bias.data_ptr(),
            self.o.data_ptr(), self.post_norm.data_ptr(), self.gate_up.data_ptr(), self.down.data_ptr(),
            cache_addresses.data_ptr(), int(caches[0].shape[3]), positions.data_ptr(), self.cos.data_ptr(), self.sin.data_ptr(),
            k_rows.data_ptr(), v_rows.data_ptr(), q_rows.data_ptr(), pages.data_ptr(), pages.shape[1],
            kv_lens.data_ptr(), scale, x.data_ptr(), qkv.data_ptr(), attn.data_ptr(), gate_up.data_ptr(),
            act.data_ptr(), o_out.data_ptr(), delta.data_ptr(), self.kind, int(tiles),
            KV_KINDS[caches[0].dtype], *(lora.c_arguments() if lora is not None else (None, None, 0)))
        if rc != 0:
            raise RuntimeError(f"llama_layers_bf16 failed ({rc})")
        return delta


def attention_block(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, positions: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, layer_cache: torch.Tensor, k_rows: torch.Tensor,
                    v_rows: torch.Tensor, q_rows: torch.Tensor, pages: torch.Tensor, kv_lens: torch.Tensor,
                    scale: float, tiles: bool = True) -> torch.Tensor:
    """One layer's RoPE (in place on qkv [T, q + 2 kv]), K/V write into its HND cache at k_rows / v_rows, and
    attention over the backend's C plan (q_rows, pages, kv_lens: every row, or all but the fresh prompts that
    the caller then runs through SDPA, whose rows are left unwritten): attention's output [T, q]. `tiles`: prompt
    chunks through the kernel's 16-row tiles, else every row per row (the same bits, slower: for comparisons).
    The kernels of `fused_ops.rope_`, `write_kv_hnd` and the C attention path, so bitwise their result; what
    goes is two calls and torch's index_copy_ per layer (~0.1 ms of a 32-sequence decode step)."""
    t = qkv.shape[0]
    if qkv.dtype != torch.bfloat16 or not qkv.is_contiguous() or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"attention_block takes a contiguous bfloat16 q/k/v product, not {qkv.dtype} {tuple(qkv.shape)}")
    if layer_cache.dtype not in CACHE_DTYPES or not layer_cache.is_contiguous():
        raise ValueError("attention_block takes a contiguous bfloat16, float8_e4m3fn or int8 layer cache")
    attn = torch.empty((t, num_heads * head_dim), dtype=torch.bfloat16)
    rc = native_lib.load().attention_block_bf16(  # type: ignore[union-attr]
        qkv.data_ptr(), t, num_heads, num_kv_heads, head_dim, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        layer_cache.data_ptr(), int(layer_cache.shape[3]), k_rows.data_ptr(), v_rows.data_ptr(), q_rows.shape[0],
        q_rows.data_ptr(), pages.data_ptr(), pages.shape[1], kv_lens.data_ptr(), scale, attn.data_ptr(), int(tiles),
        KV_KINDS[layer_cache.dtype])
    if rc != 0:
        raise RuntimeError(f"attention_block_bf16 failed ({rc})")
    return attn
