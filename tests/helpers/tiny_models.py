"""Tiny seeded random checkpoints that only the tests build (a Qwen2, a Qwen3, a Phi-3, a Gemma 3, the mixtures of experts:
Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE; a Llama over the simple tokenizer's vocabulary, a noisy draft, a PEFT LoRA
adapter); the Llamas and the tokenizer the benchmarks build too are in hetero_infer/bench/harness.py."""

from __future__ import annotations

from pathlib import Path

import torch

from hetero_infer.bench.harness import save_tiny_model

# The tiny Qwen models' shared shape: 2 layers, 6 query heads over 2 KV heads, float32.
_TINY_QWEN = dict(vocab_size=512, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1000000.0,
                  bos_token_id=1, eos_token_id=0, tie_word_embeddings=False, use_sliding_window=False,
                  torch_dtype="float32")


def make_tiny_qwen2(directory: Path, seed: int = 0) -> Path:
    """A 2-layer Qwen2: q/k/v projections carry biases, 6 query heads over 2 KV heads."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(**_TINY_QWEN)
    model = Qwen2ForCausalLM(config).eval()
    # Random init leaves biases at zero; make them matter so a loader that drops them fails.
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    return save_tiny_model(model, directory)


def _random_qk_norms(model: torch.nn.Module) -> None:
    """Random init leaves the q/k norms at one; make them matter so a model that skips them fails."""
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.uniform_(0.5, 2.0)


def make_tiny_qwen3(directory: Path, seed: int = 0) -> Path:
    """A 2-layer Qwen3: q/k RMSNorm per head, no biases, 6 query heads over 2 KV heads of head_dim 24 (not
    hidden_size / heads = 16, so a loader that derives it fails)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**_TINY_QWEN, head_dim=24, attention_bias=False)
    model = Qwen3ForCausalLM(config).eval()
    _random_qk_norms(model)
    return save_tiny_model(model, directory)


def make_tiny_byte_llama(directory: Path, seed: int = 0) -> Path:
    """A 2-layer Llama over the simple tokenizer's vocabulary (tokenizer.kind simple: 256 bytes, then
    PAD 256, BOS 257, EOS 258; hetero_common/simple_tokenizer.py). No tokenizer files: that tokenizer is built in."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                         pad_token_id=256, bos_token_id=257, eos_token_id=258, torch_dtype="float32")
    directory.mkdir(parents=True, exist_ok=True)
    LlamaForCausalLM(config).eval().save_pretrained(str(directory), safe_serialization=True)
    return directory


def make_noisy_copy(source: Path, directory: Path, noise: float, seed: int = 0) -> Path:
    """`source`'s checkpoint with Gaussian noise added to every tensor (`noise` times that tensor's standard
    deviation), its tokenizer and config copied: a draft model that agrees with `source` on some tokens and
    not on others (speculative decoding's tests)."""
    import shutil

    from safetensors.torch import load_file, save_file

    directory.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.suffix != ".safetensors" and item.is_file():
            shutil.copy(item, directory / item.name)
    generator = torch.Generator().manual_seed(seed)
    for shard in source.glob("*.safetensors"):
        tensors = load_file(str(shard))
        noisy = {name: (t + noise * t.float().std() * torch.randn(t.shape, generator=generator)).to(t.dtype)
                 if t.numel() > 1 else t for name, t in tensors.items()}
        save_file(noisy, str(directory / shard.name), metadata={"format": "pt"})
    return directory


def make_lora_adapter(base: Path, directory: Path, rank: int, targets: list[str], seed: int = 0,
                      alpha: float = 16.0, rslora: bool = False) -> Path:
    """A PEFT LoRA adapter for the model in `base` with random A and B (B non-zero, unlike a fresh PEFT
    adapter's), saved as PEFT saves one (adapter_config.json, adapter_model.safetensors)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0,
                        init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # init_lora_weights=False draws both; scale B so the adapter changes greedy tokens
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(4.0)
    peft_model.save_pretrained(str(directory))
    return directory


def make_tiny_phi3(directory: Path, seed: int = 0) -> Path:
    """A 2-layer Phi-3 with fused qkv_proj / gate_up_proj and LongRoPE: random short and long factors over a
    pretrained context of 256 extended to 512 (so LongRoPE's attention factor is not one)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(seed)
    head_dim = 16
    factors = lambda: [round(float(f), 4) for f in torch.empty(head_dim // 2).uniform_(1.0, 4.0)]  # noqa: E731
    config = Phi3Config(vocab_size=512, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                        original_max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=0,
                        pad_token_id=0, tie_word_embeddings=False, sliding_window=None, torch_dtype="float32",
                        rope_scaling={"rope_type": "longrope", "short_factor": factors(), "long_factor": factors()})
    return save_tiny_model(Phi3ForCausalLM(config).eval(), directory)


GEMMA3_WINDOW = 8  # the tiny Gemma 3's sliding window: shorter than most seeded prompts


def make_tiny_gemma3(directory: Path, seed: int = 0, head_dim: int = 16, hidden_size: int = 96) -> Path:
    """A 4-layer Gemma 3 (text): three sliding-window layers of GEMMA3_WINDOW positions and one global layer
    (its RoPE linearly scaled), scores scaled by query_pre_attn_scalar 24 (not head_dim), soft-capped logits,
    and random norms (its (1 + w) norms start at w = 0, where a loader that forgot the 1 would still be close)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=512, hidden_size=hidden_size, intermediate_size=160, num_hidden_layers=4, num_attention_heads=6,
        num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1,
        eos_token_id=0, pad_token_id=0, tie_word_embeddings=True, sliding_window=GEMMA3_WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}},
        query_pre_attn_scalar=24, final_logit_softcapping=30.0, torch_dtype="float32")
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5)
    return save_tiny_model(model, directory)


# The tiny mixtures of experts' shared attention shape (6 query heads over 2 KV heads of 16) and expert shape.
_TINY_MOE = dict(vocab_size=512, hidden_size=96, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                 max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=0, pad_token_id=0,
                 tie_word_embeddings=False, torch_dtype="float32")


def _decisive_routers(model: torch.nn.Module, scale: float = 20.0) -> None:
    """Random init leaves the routers' logits near zero, every expert about equally likely: scale them so each
    token's top-k is clear-cut and a loader that swaps experts or a router that mis-ranks them fails."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith((".gate.weight", "shared_expert_gate.weight")):
                param.mul_(scale)


def make_tiny_mixtral(directory: Path, seed: int = 0) -> Path:
    """A 2-layer Mixtral: 4 experts of 64, top-2 renormalized (its checkpoint names: block_sparse_moe, w1/w2/w3)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(**_TINY_MOE, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                           rope_theta=1000000.0, sliding_window=None)
    model = MixtralForCausalLM(config).eval()
    _decisive_routers(model)
    return save_tiny_model(model, directory)


def make_tiny_qwen3_moe(directory: Path, seed: int = 0) -> Path:
    """A 3-layer Qwen3-MoE: q/k norms per head of 24, 8 experts of 48 with top-3 renormalized (norm_topk_prob),
    and layer 1 dense (mlp_only_layers) with an intermediate size of 160."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**{**_TINY_MOE, "num_hidden_layers": 3}, head_dim=24, intermediate_size=160,
                            moe_intermediate_size=48, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True,
                            decoder_sparse_step=1, mlp_only_layers=[1], rope_theta=1000000.0,
                            use_sliding_window=False)
    model = Qwen3MoeForCausalLM(config).eval()
    _decisive_routers(model)
    _random_qk_norms(model)
    return save_tiny_model(model, directory)


def make_tiny_qwen2_moe(directory: Path, seed: int = 0) -> Path:
    """A 2-layer Qwen2-MoE: q/k/v biases, 4 experts of 48 with top-2 not renormalized, and a shared expert of 80
    behind its sigmoid gate."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen2MoeConfig(**_TINY_MOE, intermediate_size=160, moe_intermediate_size=48, num_experts=4,
                            num_experts_per_tok=2, norm_topk_prob=False, shared_expert_intermediate_size=80,
                            decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1000000.0, use_sliding_window=False)
    model = Qwen2MoeForCausalLM(config).eval()
    _decisive_routers(model, scale=10.0)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    return save_tiny_model(model, directory)


def make_tiny_olmoe(directory: Path, seed: int = 0) -> Path:
    """A 2-layer OLMoE: q and k each RMS-normed over all their heads, 8 experts of 64 with top-2 not
    renormalized."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    torch.manual_seed(seed)
    config = OlmoeConfig(**_TINY_MOE, intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                         norm_topk_prob=False, rope_theta=10000.0, clip_qkv=None)
    model = OlmoeForCausalLM(config).eval()
    _decisive_routers(model)
    _random_qk_norms(model)
    return save_tiny_model(model, directory)


def make_head64_qwen3_moe(directory: Path) -> Path:
    """A 3-layer Qwen3-MoE of head size 64: 8 experts of 128, top-2 renormalized, layer 1 dense; routers
    scaled so that tokens spread over the experts decisively."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(3)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=1024, rms_norm_eps=1e-6,
        bos_token_id=1, eos_token_id=0, tie_word_embeddings=False, use_sliding_window=False,
        torch_dtype="float32")).eval()
    with torch.no_grad():
        for layer in (model.model.layers[0], model.model.layers[2]):
            layer.mlp.gate.weight.mul_(20.0)
    return save_tiny_model(model, directory)
