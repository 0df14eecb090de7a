"""What the benchmarks (benchmarks/*.py) need to run the product from outside, shipped with it.

This module ships in the package, not among the tests, because the benchmarks run from a checkout or
against an installed package and must not import `tests` (tests/repo/test_benchmarks_layout.py): they
start a real `hetero-infer serve` stack on free loopback ports (`run_stack`, `Stack`, `free_port`,
`REPO_ROOT`) and read its pool and counters, scrape the gateway's event-loop lag, send the seeded and
oracle prompts, build tiny seeded models and tokenizers in seconds, write checkpoint variants and LoRA
adapters from tensors, and make sentence-transformers embedding models. The tests use it too; what only
the tests use is in tests/helpers/ (stack_requests.py, tiny_models.py, oracle.py). The services never
import it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import grpc
import httpx
import numpy as np
import psutil
import torch

from hetero.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from hetero_infer.supervisor import wait_healthy

if TYPE_CHECKING:
    from gpu_worker.models.checkpoint import ModelConfig

# --- a real `serve` stack ---

REPO_ROOT = Path(__file__).resolve().parents[2]


_ISSUED_PORTS: set[int] = set()


def free_port() -> int:
    """A loopback port free right now and never handed out before by this process: the kernel
    may give the same just-closed port to two bind(0) calls in a row, and two services of one
    test (a gateway's gRPC and HTTP ports) then collided (seen once in CI)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _ISSUED_PORTS:
            _ISSUED_PORTS.add(port)
            return port


@dataclass
class Stack:
    """A running `hetero-infer serve` (three processes) and a channel to its gateway."""

    process: subprocess.Popen[bytes]
    address: str
    channel: grpc.Channel
    http_port: int = 0  # the OpenAI-style HTTP API of the gateway
    host: str = "127.0.0.1"  # where every service of the stack listens

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def inference(self) -> inference_pb2_grpc.InferenceStub:
        return inference_pb2_grpc.InferenceStub(self.channel)

    def service_process(self, name: str, tp_rank: int = 0) -> psutil.Process:
        """The child of `serve` running `hetero-infer <name>` (gateway, scheduler, worker; a worker's
        tensor-parallel rank by `tp_rank`)."""
        for child in psutil.Process(self.process.pid).children():
            cmdline = child.cmdline()
            if "hetero_infer.cli" not in cmdline or cmdline[cmdline.index("hetero_infer.cli") + 1] != name:
                continue
            rank = int(cmdline[cmdline.index("--tp-rank") + 1]) if "--tp-rank" in cmdline else 0
            if rank == tp_rank:
                return child
        raise AssertionError(f"no {name} process (rank {tp_rank}) under serve")


@contextmanager
def run_stack(model: Path | None, *flags: str, timeout_s: float = 240.0, host: str = "127.0.0.1",
              wrap: Sequence[str] = ()) -> Iterator[Stack]:
    """`host`: the address every service listens on and is reached at (flags may still name
    others); `wrap`: a command line that runs `serve` (e.g. in its own mount namespace)."""
    gateway_port, http_port = free_port(), free_port()
    cmd = [*wrap, sys.executable, "-m", "hetero_infer.cli", "serve", "--serving-host", host,
           "--serving-port", str(gateway_port), "--serving-http-port", str(http_port),
           "--scheduler-address", f"{host}:{free_port()}", "--worker-address", f"{host}:{free_port()}",
           "--log-format", "json", *flags]
    if "--dtype" not in flags:  # the exact mode: `auto` may pick bfloat16 on this CPU, and tests compare tokens
        cmd += ["--dtype", "float32"]
    if model is not None:
        cmd += ["--model", str(model)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETERO_")}
    process = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env)
    address = f"{host}:{gateway_port}"
    try:
        wait_healthy(address, timeout_s, process)
        with grpc.insecure_channel(address) as channel:
            yield Stack(process, address, channel, http_port, host)
    finally:
        stop_process(process)


def stop_process(process: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGTERM (the stack drains and stops its children), then SIGKILL after the grace period."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# --- its block pool and counters, read over gRPC ---


def pool(stack: Stack) -> common_pb2.PoolStats:
    return stack.inference.GetServerInfo(inference_pb2.GetServerInfoRequest(), timeout=10).pool


def service_stats(stack: Stack) -> common_pb2.ServiceStats:
    return stack.inference.GetServerInfo(inference_pb2.GetServerInfoRequest(), timeout=10).service


def wait_for_idle(stack: Stack, timeout_s: float = 20.0) -> common_pb2.PoolStats:
    """The pool once no block is used and nothing runs or waits (or as it is at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        p = pool(stack)
        if (p.used_blocks, p.num_running, p.num_waiting) == (0, 0, 0) or time.monotonic() > deadline:
            return p
        time.sleep(0.1)


# --- the gateway's event-loop lag from outside: its histogram scraped before and after something ---

_LOOP_LAG_BUCKET = 'hetero_gateway_event_loop_lag_seconds_bucket{le="'


def loop_lag_buckets(url: str, headers: dict[str, str] | None = None) -> dict[float, float]:
    """The gateway's event-loop lag histogram: observations at or under each bound (empty before the metric)."""
    return {float(line[len(_LOOP_LAG_BUCKET):].split('"')[0]): float(line.split()[-1])
            for line in httpx.get(f"{url}/metrics", headers=headers, timeout=10).text.splitlines()
            if line.startswith(_LOOP_LAG_BUCKET)}


def lag_bound(before: dict[float, float], after: dict[float, float]) -> float | None:
    """The smallest bucket bound that holds every lag observed between the two scrapes."""
    if not after:
        return None
    total = after[float("inf")] - before.get(float("inf"), 0)
    return min(le for le in after if after[le] - before.get(le, 0) >= total)


def while_pinging(url: str, action: Callable[[], Any], settle_s: float = 0.2,
                  after_s: float = 0.1) -> tuple[Any, float, list[float]]:
    """action()'s result and seconds, and the latencies of GET /v1/models sent every 10 ms meanwhile
    (from `settle_s` before it to `after_s` after it)."""
    latencies: list[float] = []
    stop = threading.Event()

    def ping() -> None:
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                start = time.perf_counter()
                assert client.get(f"{url}/v1/models").status_code == 200
                latencies.append(time.perf_counter() - start)
                time.sleep(0.01)

    pinger = threading.Thread(target=ping)
    pinger.start()
    time.sleep(settle_s)
    try:
        start = time.perf_counter()
        result = action()
        seconds = time.perf_counter() - start
        time.sleep(after_s)
    finally:
        stop.set()
        pinger.join()
    return result, seconds, latencies


# --- prompts: seeded token ids of lengths from one token to several blocks (every step mixes prefills and
# decodes), the chat prompts the default model's oracle checks send as text (tests/model), and the 16 of
# quantized serving's accuracy oracle (benchmarks/quant_accuracy.py: those 8 and 8 more) ---

PROMPT_LENGTHS = [1, 2, 5, 9, 16, 17, 33, 50]


def make_prompts(vocab: int = 384, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


CHAT_PROMPTS = [
    "What is the capital of France?",
    "Hi",
    "Write a haiku about paged attention and continuous batching in large language model servers.",
    "1, 2, 3, 4,",
    "The quick brown fox",
    "Explain in one sentence why the sky is blue, using simple words that a child would understand easily.",
    "Translate to French: good morning",
    "def fibonacci(n):",
]

# Issue 39's oracle set: the 8 above and 8 more of other kinds (arithmetic, lists, code, a long instruction,
# a question of fact, dialogue, a definition, a story opening).
ORACLE_PROMPTS = CHAT_PROMPTS + [
    "What is 17 times 23?",
    "List three primary colors.",
    "import numpy as np\n# compute the mean of a list of numbers",
    "Summarize the plot of Romeo and Juliet in two sentences, mentioning both families and how the story ends.",
    "Who wrote the novel Pride and Prejudice?",
    "Can you help me plan a short trip to the mountains this weekend?",
    "Define photosynthesis.",
    "Once upon a time, in a small village by the sea,",
]


# --- tiny seeded random checkpoints and tokenizers, built in seconds: the weights are random but real
# (safetensors), the tokenizer a real byte-level BPE trained on a small corpus; the tests compare the engine
# with Hugging Face `transformers` on these same files ---

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


def save_tiny_model(model: torch.nn.Module, directory: Path) -> Path:
    """`model` (transformers') saved as safetensors in `directory`, with the tiny tokenizer."""
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
    return save_tiny_model(LlamaForCausalLM(config).eval(), directory)


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


# --- checkpoints written from tensors, for variants of a model offline: a Hugging Face directory from a
# state dict (an early-exit draft, a model with a LoRA adapter merged in) and a LoRA adapter in PEFT's format
# with random weights, written without `peft` or `transformers` ---


def save_checkpoint(config: ModelConfig, weights: dict[str, torch.Tensor], directory: Path,
                    dtype: torch.dtype = torch.bfloat16, **overrides) -> Path:
    """`weights` (HF names) and `config` (with `overrides`, e.g. num_hidden_layers) as a Hugging Face directory."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file({name: t.to(dtype).contiguous() for name, t in weights.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    settings = {k: v for k, v in dataclasses.asdict(config).items()
                if k not in ("architecture", "eos_token_ids", "attention_bias", "qk_norm")}
    settings.update(model_type=config.architecture, eos_token_id=list(config.eos_token_ids), **overrides)
    (directory / "config.json").write_text(json.dumps(settings))
    return directory


def module_name(layer: int, target: str) -> str:
    kind = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"model.layers.{layer}.{kind}.{target}"


def write_random_lora(config: ModelConfig, directory: Path, rank: int, targets: list[str], seed: int = 0,
                      alpha: float = 32.0, scale: float = 0.02) -> Path:
    """A LoRA adapter for `config` in PEFT's format (adapter_config.json, adapter_model.safetensors) with A and B
    drawn N(0, scale)."""
    from safetensors.torch import save_file

    from gpu_worker.lora.lora_adapter import target_shape

    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for target in targets:
            out, inp = target_shape(config, target)
            prefix = f"base_model.model.{module_name(layer, target)}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, inp, generator=g) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=g) * scale
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets, "bias": "none"}))
    return directory


# --- embedding models made from a Llama-family checkpoint: the same directory with sentence-transformers'
# module files beside the weights, so that sentence-transformers loads it as an embedding model (Transformer,
# Pooling, Normalize) and this server serves it, reading the pooling from the same files ---

_MODULE_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "1_Pooling",
                 "2_Normalize")
_POOLING_MODES = {"last": "lasttoken", "mean": "mean", "cls": "cls"}
_TEXT_ONLY = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}


def make_sentence_transformers_dir(model_dir: Path, out: Path, pooling: str) -> Path:
    """`out`: a copy of `model_dir` that sentence-transformers loads with `pooling` (last | mean | cls) and
    normalisation; returns it."""
    from sentence_transformers import SentenceTransformer, models

    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    # Plain text in, as the server takes `text` (sentence-transformers 6 would render it with the chat template).
    transformer = models.Transformer(str(model_dir), modality_config=_TEXT_ONLY, module_output_name="token_embeddings")
    size = getattr(transformer, "get_embedding_dimension", None) or transformer.get_word_embedding_dimension
    pool = models.Pooling(size(), pooling_mode=_POOLING_MODES[pooling])
    with tempfile.TemporaryDirectory() as saved:
        SentenceTransformer(modules=[transformer, pool, models.Normalize()], device="cpu").save(saved)
        for name in _MODULE_FILES:
            source = Path(saved) / name
            if source.is_dir():
                shutil.copytree(source, out / name, dirs_exist_ok=True)
            elif source.is_file():
                shutil.copy(source, out / name)
    return out


def load_sentence_transformer(model_dir: Path, dtype: str = "float32"):  # -> SentenceTransformer
    """sentence-transformers' model of `model_dir` on the CPU; a tokenizer without a padding token pads with EOS
    (batches of mixed lengths need one; the attention mask keeps it out of every vector)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu", model_kwargs={"dtype": getattr(torch, dtype)})
    if model.tokenizer.pad_token is None:
        model.tokenizer.pad_token = model.tokenizer.eos_token
    model.max_seq_length = 1 << 16
    return model


def cosine(a: np.ndarray | list[float], b: np.ndarray | list[float]) -> float:
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a64 @ b64 / (np.linalg.norm(a64) * np.linalg.norm(b64)))
