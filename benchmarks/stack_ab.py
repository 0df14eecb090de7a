"""Two or more configurations of the stack, in alternating rounds, on throughput.py's batch workload: for A/Bs
of a few percent on a machine whose speed drifts between runs (the development VM: one build's back-to-back
runs spread over 378-435 tok/s), where one run of each says nothing.

    python benchmarks/stack_ab.py --arm "NAME|SERVE FLAGS|ENV=VALUE ..." --arm ... [--rounds 4]
                                  [--requests 64] [--new-tokens 64] [--min-prompt 16] [--max-prompt 256]
                                  [--unary] [--model PATH]

Each `--arm` is a name, `serve` flags and environment variables for the stack's processes (e.g.
`OMP_SCHEDULE=dynamic,2`; HETERO_* variables are not passed on: give config keys as flags), `|`-separated;
the last two parts may be empty. Every round runs each arm once (the order reversed every other round, so
neither arm always runs first); the stack starts afresh for each run (`hetero-infer serve`, the config's
defaults, `dtype: auto`). Printed: each run's output tok/s; per arm, the median; per arm after the first,
its tok/s over the first arm's in each round, their median and in how many rounds it was faster.
Clients stream `Generate` (one message per token), or with `--unary` call `Complete`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

if not __package__:  # run as a file (`python benchmarks/NAME.py`): the repository root on the path, as -m has it
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import systems  # noqa: E402
from benchmarks.roofline import cpu_line  # noqa: E402
from benchmarks.workload import make_prompts, round_order  # noqa: E402
from gpu_worker.models.checkpoint import load_checkpoint  # noqa: E402
from hetero_common.log import configure_logging  # noqa: E402
from hetero_common.model_files import resolve_model_path  # noqa: E402


@dataclass(frozen=True)
class Arm:
    name: str
    flags: list[str]
    env: dict[str, str]


def parse_arm(spec: str) -> Arm:
    """"NAME|SERVE FLAGS|ENV=VALUE ..." -> Arm (argparse's type: a ValueError says what is wrong)."""
    parts = spec.split("|")
    if not parts[0].strip() or len(parts) > 3:
        raise argparse.ArgumentTypeError(f"an arm is \"NAME|SERVE FLAGS|ENV=VALUE ...\", not {spec!r}")
    flags = parts[1].split() if len(parts) > 1 else []
    env: dict[str, str] = {}
    for item in (parts[2].split() if len(parts) > 2 else []):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"arm {parts[0]!r}: {item!r} is not ENV=VALUE")
        if key.startswith("HETERO_"):
            raise argparse.ArgumentTypeError(f"arm {parts[0]!r}: {key} is not passed to the stack; give it as a flag")
        env[key] = value
    return Arm(parts[0].strip(), flags, env)


def run_arm(arm: Arm, model: str | None, prompts: list[list[int]], new_tokens: int, unary: bool) -> float:
    """One fresh stack with this arm's flags and environment: output tok/s."""
    flags = ["--dtype", "auto", *arm.flags]  # later flags win: an arm may set its own dtype
    with mock.patch.dict(os.environ, arm.env):  # the stack's processes inherit it (hetero_infer/bench/harness.py)
        result = systems.bench_stack(flags, model, prompts, new_tokens, batch=True, single=0, unary=unary)["batch"]
    return result.tok_per_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", type=parse_arm, action="append", required=True, help="NAME|SERVE FLAGS|ENV=VALUE ...")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--unary", action="store_true", help="clients call Complete instead of streaming Generate")
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    if len(args.arm) < 2:
        parser.error("give at least two --arm")
    if len({arm.name for arm in args.arm}) != len(args.arm):
        parser.error("arm names must differ")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    configure_logging("warning", "console")
    vocab = load_checkpoint(resolve_model_path(args.model))[0].vocab_size  # the same prompts as throughput.py's
    prompts = make_prompts(args.requests, args.min_prompt, args.max_prompt, vocab)
    print(cpu_line())
    print(f"workload: {args.requests} requests of {args.min_prompt}-{args.max_prompt} prompt tokens, {args.new_tokens} new "
          f"tokens each, clients {'calling Complete' if args.unary else 'streaming Generate'}; {args.rounds} rounds")
    tok_s: dict[str, list[float]] = {arm.name: [] for arm in args.arm}
    for round_index in range(args.rounds):
        for arm in round_order(args.arm, round_index):
            tok_s[arm.name].append(run_arm(arm, args.model, prompts, args.new_tokens, args.unary))
            print(f"round {round_index + 1}: {arm.name:20s} {tok_s[arm.name][-1]:7.1f} tok/s", flush=True)
    first = args.arm[0].name
    for arm in args.arm:
        line = f"{arm.name:20s} median {statistics.median(tok_s[arm.name]):7.1f} tok/s"
        if arm.name != first:
            ratios = [a / b for a, b in zip(tok_s[arm.name], tok_s[first])]
            line += (f"; / {first} per round: median {statistics.median(ratios):.3f}x "
                     f"({min(ratios):.3f}-{max(ratios):.3f}), faster in {sum(r > 1 for r in ratios)} of {len(ratios)}")
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
