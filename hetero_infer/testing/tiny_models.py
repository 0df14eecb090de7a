"""Tiny seeded random checkpoints and tokenizers, built in seconds in a temporary directory.

Tests compare our engine with Hugging Face `transformers` on these same files: the weights
are random but real (safetensors written by `save_pretrained`), the tokenizer is a real
byte-level BPE trained on a small corpus.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching lets new requests join a running batch at every step.",
    "héllo wörld, naïve café — 東京 and emoji 🙂 are multi-byte characters.",
    "0123456789 + - * / = ( ) [ ] { } < > ! ? : ; ' \"",
]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_tokenizer(directory: Path, vocab_size: int = 384) -> None:
    """Train a byte-level BPE (the GPT-2/SmolLM2 family) and write tokenizer.json + config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": "<|endoftext|>",
                "chat_template": CHAT_TEMPLATE,
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": 512,
            }
        )
    )


def _save(model: torch.nn.Module, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), safe_serialization=True)
    make_tokenizer(directory)
    return directory


def make_tiny_llama(directory: Path, seed: int = 0, tie_word_embeddings: bool = False,
                    max_position_embeddings: int = 512) -> Path:
    """A 2-layer Llama with grouped-query attention (4 query heads share 2 KV heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=0,
        tie_word_embeddings=tie_word_embeddings,
        torch_dtype="float32",
    )
    return _save(LlamaForCausalLM(config).eval(), directory)


def make_tiny_qwen2(directory: Path, seed: int = 0) -> Path:
    """A 2-layer Qwen2: q/k/v projections carry biases, 6 query heads over 2 KV heads."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=512,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        bos_token_id=1,
        eos_token_id=0,
        tie_word_embeddings=False,
        use_sliding_window=False,
        torch_dtype="float32",
    )
    model = Qwen2ForCausalLM(config).eval()
    # Random init leaves biases at zero; make them matter so a loader that drops them fails.
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    return _save(model, directory)


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


def make_random_llama(directory: Path, *, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
                      vocab: int = 512, max_position_embeddings: int = 1024, scale: float = 0.08, seed: int = 0,
                      dtype: torch.dtype = torch.float32) -> Path:
    """A Llama of any shape with seeded random weights, written as config.json + safetensors directly (no
    `transformers`: the GPU machine's benchmarks and tests use it), with the tiny tokenizer. Weights are drawn
    N(0, scale) in a fixed order on the CPU, so a shape and seed give the same model anywhere."""
    from safetensors.torch import save_file

    head_dim = hidden // heads
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype)

    weights = {"model.embed_tokens.weight": rand(vocab, hidden), "lm_head.weight": rand(vocab, hidden),
               "model.norm.weight": ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        weights.update({p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
                        p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
                        p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
                        p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
                        p + "mlp.gate_proj.weight": rand(intermediate, hidden),
                        p + "mlp.up_proj.weight": rand(intermediate, hidden),
                        p + "mlp.down_proj.weight": rand(hidden, intermediate),
                        p + "input_layernorm.weight": ones(hidden),
                        p + "post_attention_layernorm.weight": ones(hidden)})
    directory.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 0,
        "torch_dtype": str(dtype).removeprefix("torch.")}))
    make_tokenizer(directory)
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
