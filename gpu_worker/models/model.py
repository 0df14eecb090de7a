"""A Llama-family decoder (Llama, Mistral, Qwen2 with q/k/v biases, Qwen3 with its q/k RMSNorm, Phi-3, and the
mixtures of experts: Mixtral, Qwen2/3-MoE, OLMoE, whose MLPs are gpu_worker/models/moe.py's) over flattened tokens.

Every scheduled token of every sequence goes through one forward pass: the linear layers
see one [num_tokens, hidden] matrix with no padding; only attention is per sequence, and
it goes through a paged backend from `kernels/`.

With tensor parallelism each rank holds a slice of the heads (q/k/v, o_proj) and of the
MLP's intermediate size (gate/up, down_proj); the partial sums after o_proj and down_proj
are all-reduced across ranks (see gpu_worker/parallel/tensor_parallel.py).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from gpu_worker.cpu import fused_ops
from gpu_worker.cpu.c_layers import CLayers, attention_block, weights_kind
from gpu_worker.cpu.packed_linear import PackedWeight, linear, linear_float32
from gpu_worker.lora.lora_slots import NativeLoraBatch, StepLora
from gpu_worker.model_config import ModelConfig
from gpu_worker.models.model_shapes import check_splits
from gpu_worker.models.moe import ExpertMlp, GroupedExperts, SparseMoe
from gpu_worker.models.rope import rope_tables
from gpu_worker.models.weight_placer import WeightPlacer
from gpu_worker.parallel.tensor_parallel import TensorParallel
from hetero_common.errors import ConfigError
from kernels import flashinfer_fused
from kernels.attention_backend import AttentionBackend
from kernels.cache_ops import hnd_rows
from kernels.native import linear_gguf


def elementwise_ops(fused: bool, device: torch.device, dtype: torch.dtype) -> ModuleType | None:
    """The fused element-wise kernels for this device and dtype (gpu_worker/cpu/fused_ops.py on a bfloat16 CPU,
    kernels/flashinfer_fused.py on CUDA in bfloat16/float16), or None: torch's separate ops. Both modules have
    `add_rms_norm` and `silu_mul` alike; their `rope_` take their own tables (LlamaModel._rope_)."""
    if not fused:
        return None
    for ops in (fused_ops, flashinfer_fused):
        if ops.available(device, dtype):
            return ops
    return None


class LlamaModel:
    """Weights as plain tensors (no nn.Module: nothing here is trained)."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
                 max_positions: int, tp: TensorParallel = TensorParallel(), prepack: bool = False,
                 native_linear: bool = False, native_linear_max_rows: int | None = None, native_linear_amx: bool = False,
                 fused: bool = False, gguf_blocks: bool = False, int8_weights: bool = False,
                 fp8_weights: bool = False, int8_w8a8: bool = False) -> None:
        """`prepack`: hold the linear layers' weights in oneDNN's blocked layout (CPU only, see
        gpu_worker/cpu/packed_linear.py); the caller checks `prepack_supported`. `native_linear`: pack them for the
        C kernel instead (bfloat16; the caller checks native_linear.unavailable_reason), or, with
        `native_linear_max_rows` (AMX CPUs), for both, the C kernel taking products of up to that many rows;
        `native_linear_amx`: the C kernel is the AMX tile one (kernels/native/linear.py's `plan` chose it).
        `fused`: run RMSNorm (with the residual add), RoPE and SiLU·mul as one kernel each where such kernels are
        available: the C kernels on a bfloat16 CPU (gpu_worker/cpu/fused_ops.py), FlashInfer's on CUDA
        (kernels/flashinfer_fused.py). `gguf_blocks` (with `native_linear`): weights the checkpoint kept in GGUF blocks
        (gpu_worker/gguf_blocks.py) are computed from them (kernels/native/linear_gguf.py) where the kernel takes
        their type; others are dequantized. `int8_weights` (with `native_linear`): every other linear weight is
        quantized to int8 per block of 32 (kernels/native/linear_gguf.int8_blocks) for the same kernel. `fp8_weights`:
        the layers' linear weights in fp8 with per-channel scales (kernels/fp8_linear.py), the LM head not;
        `int8_w8a8` (CUDA's `quantization: int8`): in int8 for torch._int_mm (kernels/int8_linear.py), likewise."""
        self.config = config
        self.device = device
        self.dtype = dtype
        self.tp = tp
        c = config
        check_splits(c, tp)
        self.num_heads = c.num_attention_heads // tp.size  # on this rank
        self.num_kv_heads = c.num_key_value_heads // tp.size
        place = WeightPlacer(weights, device, dtype, prepack, native_linear, native_linear_max_rows, native_linear_amx,
                             gguf_blocks and prepack and native_linear, int8_weights and prepack and native_linear,
                             fp8_weights, int8_w8a8)
        # The embedding: looked up straight from its GGUF blocks where they are kept (a tied LM head then computes
        # from the same ones), else from a plain table (a tied head packed as its own copy of it).
        embed = "model.embed_tokens.weight"
        self.embed_blocks = place.linear([embed]) if place.from_blocks([embed]) else None
        self.embed = None if self.embed_blocks is not None else place.tensor(embed)
        if c.tie_word_embeddings and self.embed_blocks is not None:
            self.lm_head = self.embed_blocks
        elif c.tie_word_embeddings and not place.int8_weights:
            self.lm_head = place.matrix(self.embed)
        elif place.fp8_weights or place.int8_w8a8:  # the LM head stays in the model's dtype
            self.lm_head = place.matrix(place.tensor("lm_head.weight"))
        else:
            self.lm_head = place.linear([embed if c.tie_word_embeddings else "lm_head.weight"])
        self.final_norm = place.tensor("model.norm.weight")
        self.layers = [self._layer_weights(place, i) for i in range(c.num_hidden_layers)]
        self.q_size = self.num_heads * c.head_dim
        self.kv_size = self.num_kv_heads * c.head_dim
        self._choose_elementwise(fused, max_positions)
        # Every layer in one C call where each of its kernels is C and no all-reduce sits between them
        # (with dual-packed weights: for steps of up to native_linear_max_rows rows).
        one_kernel = weights_kind(self.layers) is not None  # not a mix of GGUF types, or of blocks and tensors
        # The all-layers C kernel fuses the q/k/v product with RoPE and has no q/k RMSNorm (Qwen3) and no experts:
        # such models run layer by layer, the norm in torch between the product and the C attention block.
        self.c_layers = (CLayers(self.layers, self.cos, self.sin, self.num_heads, self.num_kv_heads, c.head_dim,
                                 c.rms_norm_eps)
                         if self.ops is fused_ops and prepack and native_linear and not tp.enabled and one_kernel
                         and not c.qk_norm and c.moe is None
                         else None)
        self.c_layers_max_rows = native_linear_max_rows
        self._expert_load: torch.Tensor | None = None  # _mlp's, since take_expert_load

    def _choose_elementwise(self, fused: bool, max_positions: int) -> None:
        """The element-wise kernels (`ops`: None for torch's separate ops) and the RoPE tables they read (the
        sliding-window layers' own, Gemma 3's local base, where they have one)."""
        c = self.config
        self.cos, self.sin = rope_tables(c, max_positions, self.device, self.dtype)
        self.local_cos_sin = (rope_tables(c, max_positions, self.device, self.dtype, local=True)
                              if c.sliding_layers and c.local_rope_theta else None)
        # Gemma's layer variant (its extra norms, GELU, windows) runs on torch's element-wise ops: the fused
        # kernels and the all-layers C call compute Llama's layer.
        llama_layer = not (c.sandwich_norms or c.sliding_layers or c.hidden_activation != "silu")
        self.ops = elementwise_ops(fused and llama_layer, self.device, self.dtype)
        self.elementwise = "torch" if self.ops is None else "c" if self.ops is fused_ops else "flashinfer"
        if self.ops is fused_ops:  # the kernel reads [max_positions, head_dim / 2] rows
            self.cos, self.sin = self.cos.contiguous(), self.sin.contiguous()
        # FlashInfer's RoPE reads one float32 [max_positions, head_dim] table, computed from float64 as the others
        self.cos_sin = (flashinfer_fused.cos_sin_cache(*rope_tables(self.config, max_positions, self.device,
                                                                    torch.float32))
                        if self.ops is flashinfer_fused else None)

    def _layer_weights(self, place: WeightPlacer, i: int) -> dict[str, PackedWeight | None]:
        """Layer `i`'s weights on this rank."""
        c, tp, p = self.config, self.tp, f"model.layers.{i}."
        # q, k, v fused into one matrix and gate, up into another: two matmuls instead of five.
        # Under tensor parallelism each is this rank's slice (rows: heads / intermediate features).
        qkv_bias = None
        if c.attention_bias:
            qkv_bias = torch.cat([place.tensor(p + f"self_attn.{n}_proj.bias", tp.rows) for n in "qkv"])
        rows, columns = (tp.rows, tp.columns) if tp.enabled else (None, None)
        qk_norm = None
        if c.qk_norm:  # one [heads + kv_heads, head_dim] weight: q's norm on each q head, k's on each k head
            q_norm, k_norm = place.tensor(p + "self_attn.q_norm.weight"), place.tensor(p + "self_attn.k_norm.weight")
            qk_norm = (torch.cat([q_norm, k_norm]) if c.qk_norm_all_heads  # OLMoE's: [q_size + kv_size]
                       else torch.cat([q_norm.expand(self.num_heads, -1), k_norm.expand(self.num_kv_heads, -1)]))
            qk_norm = qk_norm.contiguous()
        sparse = c.is_sparse(i)
        return {
            "input_norm": place.tensor(p + "input_layernorm.weight"),
            "qkv": place.linear([p + f"self_attn.{n}_proj.weight" for n in "qkv"], rows),
            "qkv_bias": qkv_bias,
            "qk_norm": qk_norm,
            "o": place.linear([p + "self_attn.o_proj.weight"], columns),
            "post_norm": place.tensor(p + "post_attention_layernorm.weight"),
            "gate_up": None if sparse else place.linear([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], rows),
            "down": None if sparse else place.linear([p + "mlp.down_proj.weight"], columns),
            "moe": self._sparse_moe(place, i) if sparse else None,
            "attention_output_norm": place.tensor(p + "attention_output_norm.weight") if c.sandwich_norms else None,
            "mlp_output_norm": place.tensor(p + "mlp_output_norm.weight") if c.sandwich_norms else None,
        }

    def _sparse_moe(self, place: WeightPlacer, i: int) -> SparseMoe:
        """Layer `i`'s mixture of experts on this rank: each expert's slice of its intermediate features, as the
        dense MLP's; the router and the shared expert's gate whole."""
        moe, p = self.config.moe, f"model.layers.{i}.mlp."
        assert moe is not None
        rows, columns = (self.tp.rows, self.tp.columns) if self.tp.enabled else (None, None)

        def expert(prefix: str) -> ExpertMlp:
            return ExpertMlp(place.linear([f"{prefix}gate_proj.weight", f"{prefix}up_proj.weight"], rows),
                             place.linear([f"{prefix}down_proj.weight"], columns))

        shared = moe.shared_expert_intermediate_size > 0
        experts = [expert(f"{p}experts.{j}.") for j in range(moe.num_experts)]
        grouped = None
        if self.device.type == "cuda":  # stacked for the grouped products: no host read-back, one CUDA graph
            if not all(type(w) is torch.Tensor for e in experts for w in (e.gate_up, e.down)):
                raise ConfigError("config key 'quantization': a mixture of experts on CUDA runs its experts "
                                  "unquantized (bfloat16 or float16) only; set quantization to none.")
            grouped, experts = GroupedExperts.stack(experts), []
        return SparseMoe(router=place.linear([p + "gate.weight"]), experts=experts,
                         top_k=moe.top_k, normalize_top_k=moe.normalize_top_k,
                         shared=expert(p + "shared_expert.") if shared else None,
                         shared_gate=place.linear([p + "shared_expert_gate.weight"]) if shared else None,
                         grouped=grouped)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings [T, hidden], a new tensor (the forward adds into it)."""
        if self.embed_blocks is not None:
            hidden = linear_gguf.rows(self.embed_blocks, input_ids)  # type: ignore[arg-type]
        else:
            hidden = F.embedding(input_ids, self.embed)
        if self.config.embedding_scale != 1.0:  # Gemma's √hidden, rounded to the dtype as transformers does
            hidden.mul_(torch.tensor(self.config.embedding_scale, dtype=hidden.dtype))
        return hidden

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * x32.to(x.dtype)

    def _qk_norm_(self, qkv: torch.Tensor, weight: torch.Tensor | None) -> None:
        """Qwen3's per-head RMSNorm, in place on the q and k heads of the q/k/v product [T, q + 2 kv] (before
        RoPE); nothing when the model has none (`weight` None)."""
        if weight is None:
            return
        if self.config.qk_norm_all_heads:  # one norm over q's heads together, one over k's
            q, k = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
            q.copy_(self._rms_norm(q, weight[: self.q_size]))
            k.copy_(self._rms_norm(k, weight[self.q_size :]))
            return
        qk = qkv[:, : self.q_size + self.kv_size].view(qkv.shape[0], self.num_heads + self.num_kv_heads,
                                                       self.config.head_dim)
        qk.copy_(self._rms_norm(qk, weight))

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, D]; cos/sin [T, 1, D/2]."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                kv_cache: torch.Tensor, attention: AttentionBackend, logits_rows: torch.Tensor) -> torch.Tensor:
        """Run all layers over T flattened tokens; return logits [len(logits_rows), vocab] in float32.

        The attention backend must already be planned for this step. Only the rows that are
        sampled (each sequence's last computed token) reach the LM head.
        """
        return self.logits(self.hidden_states(input_ids, positions, slots, kv_cache, attention)[logits_rows])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head over rows of `hidden_states`: float32 logits [rows, vocab] (soft-capped where the
        model caps them: Gemma's cap * tanh(logits / cap))."""
        logits = linear_float32(self.final_normed(hidden), self.lm_head)
        if (cap := self.config.final_logit_softcapping) is not None:
            logits = torch.tanh(logits.div_(cap)).mul_(cap)
        return logits

    def final_normed(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm over rows of `hidden_states` (what the LM head reads; embeddings pool it), in dtype."""
        if self.ops is not None:
            return self.ops.add_rms_norm(hidden.contiguous(), None, self.final_norm, self.config.rms_norm_eps)
        return self._rms_norm(hidden, self.final_norm)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      kv_cache: torch.Tensor, attention: AttentionBackend, lora: StepLora | None = None) -> torch.Tensor:
        """Run all layers over T flattened tokens; return the last layer's output [T, hidden]
        (before the final norm). Callers pick the rows that need logits (`logits`). `lora`: the step's
        LoRA adapters, added after each product (gpu_worker/lora/lora_slots.py)."""
        if abs(attention.scale - self.config.attention_scale) > 1e-9 * self.config.attention_scale:
            raise ValueError(f"the attention backend scales q·k by {attention.scale}, the model by "
                             f"{self.config.attention_scale}: create it with scale=config.attention_scale")
        if self.ops is not None:
            return self._hidden_states_fused(input_ids, positions, slots, kv_cache, attention, lora)
        c = self.config
        t = input_ids.shape[0]
        hidden = self._embed(input_ids)
        tables = {False: (self.cos[positions][:, None, :], self.sin[positions][:, None, :])}
        if self.local_cos_sin is not None:
            tables[True] = tuple(table[positions][:, None, :] for table in self.local_cos_sin)
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, c.head_dim
        act_mul = _torch_gelu_tanh_mul if c.hidden_activation == "gelu_tanh" else _torch_silu_mul
        for i, layer in enumerate(self.layers):
            x = self._rms_norm(hidden, layer["input_norm"])
            qkv = linear(x, layer["qkv"], layer["qkv_bias"])
            if lora is not None:
                lora.add(i, "qkv", x, qkv)
            self._qk_norm_(qkv, layer["qk_norm"])
            # RoPE on q and k together: one pass over their [T, Hq + Hkv, D] view instead of two.
            sliding = c.is_sliding(i)
            cos, sin = tables[sliding and self.local_cos_sin is not None]
            qk = self._rope(qkv[:, : self.q_size + self.kv_size].view(t, heads + kv_heads, dim), cos, sin)
            v = qkv[:, self.q_size + self.kv_size :].view(t, kv_heads, dim)
            layer_attention = attention.windowed(c.sliding_window) if sliding else attention
            layer_attention.write_kv(kv_cache[i], qk[:, heads:], v, slots)
            attn = layer_attention.run(qk[:, :heads], kv_cache[i]).reshape(t, self.q_size)
            # Residual adds in place: `hidden` is this forward's own buffer (embedding output).
            hidden.add_(self._output_norm(self.tp.all_reduce(self._linear(attn, layer["o"], lora, i, "o")),
                                          layer["attention_output_norm"]))
            x = self._rms_norm(hidden, layer["post_norm"])
            hidden.add_(self._output_norm(self.tp.all_reduce(self._mlp(x, layer, lora, i, act_mul)),
                                          layer["mlp_output_norm"]))
        return hidden

    def _output_norm(self, out: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """Gemma's norm on a block's output before its residual add; the output itself where there is none."""
        return out if weight is None else self._rms_norm(out, weight)

    def _mlp(self, x: torch.Tensor, layer: dict, lora: StepLora | None, i: int,
             silu_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Layer `i`'s MLP over x, before the all-reduce: dense (with the step's LoRA deltas) or a mixture of
        experts, whose load the model keeps for the worker's metrics (`take_expert_load`)."""
        moe: SparseMoe | None = layer["moe"]
        if moe is None:
            act = silu_mul(self._linear(x, layer["gate_up"], lora, i, "gate_up"))
            return self._linear(act, layer["down"], lora, i, "down")
        out, load = moe(x, silu_mul)
        self._expert_load = load if self._expert_load is None else self._expert_load + load
        return out

    def products(self) -> list[PackedWeight]:
        """Every linear weight of the model: each layer's (its experts' too) and the LM head."""
        weights = [self.lm_head]
        for layer in self.layers:
            weights += [w for name in ("qkv", "o", "gate_up", "down") if (w := layer[name]) is not None]
            weights += layer["moe"].products() if layer["moe"] is not None else []
        return weights

    def take_expert_load(self) -> torch.Tensor | None:
        """The tokens routed to each expert [num_experts], summed over the sparse layers, since the last call;
        None for a dense model or before any step."""
        load, self._expert_load = self._expert_load, None
        return load

    @staticmethod
    def _linear(x: torch.Tensor, weight: PackedWeight, lora: StepLora | None, layer: int, group: str) -> torch.Tensor:
        """x's product with a layer's weight, plus the step's LoRA deltas of that product."""
        y = linear(x, weight)
        if lora is not None:
            lora.add(layer, group, x, y)
        return y

    def _rope_(self, qkv: torch.Tensor, positions: torch.Tensor) -> None:
        """RoPE in place on the q and k heads of the q/k/v buffer, by the fused kernels' own tables."""
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.config.head_dim
        if self.ops is flashinfer_fused:
            flashinfer_fused.rope_(qkv, heads, kv_heads, dim, positions, self.cos_sin)
        else:
            fused_ops.rope_(qkv, heads + kv_heads, dim, positions, self.cos, self.sin)

    def _hidden_states_fused(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                             kv_cache: torch.Tensor, attention: AttentionBackend,
                             lora: StepLora | None = None) -> torch.Tensor:
        """`hidden_states` with the element-wise passes fused (`self.ops`: the C kernels on a bfloat16 CPU,
        FlashInfer's on CUDA): each residual add is fused into the next RMSNorm, RoPE rotates q and k in place in
        the q/k/v buffer. The C attention plans (`native_rows`, `c_layers`) are the CPU's alone."""
        c = self.config
        t = input_ids.shape[0]
        eps, heads, kv_heads, dim = c.rms_norm_eps, self.num_heads, self.num_kv_heads, c.head_dim
        hidden = self._embed(input_ids)
        positions = positions.to(torch.int64)
        if t and self.ops is fused_ops and int(positions.max()) >= self.cos.shape[0]:  # read unchecked; on CUDA
            # the runner checks on the host (a read-back here would sync the step and break graph capture)
            raise IndexError(f"position {int(positions.max())} is beyond the model's {self.cos.shape[0]} positions")
        delta: torch.Tensor | None = None  # the last block's output, not yet added to `hidden`
        # The attention backend's C plan, when it covers every row of the step: the layers' RoPE, K/V write
        # and attention then run as one C call each (gpu_worker/cpu/c_layers.py), or, with C linear layers too,
        # every layer in one call.
        # Prompt chunks may attend apart (`apart_prompts`, AMX CPUs): after each block.
        plan = getattr(attention, "native_rows", lambda: None)() if t and self.ops is fused_ops else None
        if plan is not None:
            if plan.max_page >= kv_cache[0].shape[0]:
                raise IndexError(f"page {plan.max_page} is outside the cache's {kv_cache[0].shape[0]} blocks")
            positions = positions.contiguous()
            k_rows, v_rows = hnd_rows(slots.to(torch.int64), kv_heads, kv_cache[0].shape[3])
            apart_prompts = attention.apart_prompts()
            if (self.c_layers and not apart_prompts and (lora is None or isinstance(lora, NativeLoraBatch))
                    and (self.c_layers_max_rows is None or t <= self.c_layers_max_rows)):  # from C
                hidden.add_(self.c_layers.run(hidden, positions, kv_cache, k_rows, v_rows, plan.rows,
                                              plan.pages, plan.kv_lens, attention.scale, attention.prompt_tiles, lora))
                return hidden
        for i, layer in enumerate(self.layers):
            x = self.ops.add_rms_norm(hidden, delta, layer["input_norm"], eps)
            qkv = linear(x, layer["qkv"], layer["qkv_bias"])
            if lora is not None:
                lora.add(i, "qkv", x, qkv)
            self._qk_norm_(qkv, layer["qk_norm"])  # before RoPE, which the C block and `_rope_` apply in place
            if plan is not None:
                attn = attention_block(qkv, heads, kv_heads, dim, positions, self.cos, self.sin, kv_cache[i], k_rows,
                                       v_rows, plan.rows, plan.pages, plan.kv_lens, attention.scale,
                                       attention.prompt_tiles)
                if apart_prompts:
                    attention.attend_apart_prompts(qkv, kv_cache[i], attn)
            else:
                self._rope_(qkv, positions)
                qk = qkv[:, : self.q_size + self.kv_size].view(t, heads + kv_heads, dim)
                v = qkv[:, self.q_size + self.kv_size :].view(t, kv_heads, dim)
                attention.write_kv(kv_cache[i], qk[:, heads:], v, slots)
                attn = attention.run(qk[:, :heads], kv_cache[i]).reshape(t, self.q_size)
            o = self.tp.all_reduce(self._linear(attn, layer["o"], lora, i, "o"))
            x = self.ops.add_rms_norm(hidden, o, layer["post_norm"], eps)
            delta = self.tp.all_reduce(self._mlp(x, layer, lora, i, self.ops.silu_mul))
        if delta is not None:
            hidden.add_(delta)
        return hidden


def _torch_gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GELU-tanh(gate) * up (Gemma's), as _torch_silu_mul."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)


def _torch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up [rows, 2n] = [gate | up], written over gate (no new buffer): a [rows, n] view."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)
