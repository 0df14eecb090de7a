"""The scheduler's cost as instructions, not seconds: benchmarks/scheduler_bench.py's trace run under
valgrind's callgrind, collecting only inside `Scheduler.schedule` and `Scheduler.process_result`.

    python benchmarks/scheduler_instructions.py [--checkout DIR ...] [--requests 1024]
                                                [--pool ample|tight] [--arrivals all|trickle]

Wall-clock µs per sequence-step moves by ±10% between back-to-back runs on a shared VM, more than most
changes to the scheduler; an instruction count is the same on every run of the same code and inputs,
whatever else the machine does. Each `--checkout` (default: this one) runs the bench's own trace and fake
worker from its own tree (its directory first on the path, as its processes would have it), so two
checkouts compare a change; printed: each one's instructions and its ratio to the first.

A 3-line C library built here with gcc toggles callgrind's collection (`CALLGRIND_TOGGLE_COLLECT`, from
valgrind's headers) around the two methods; the trace generation, request submission and fake worker are
not counted. Needs valgrind and its headers (Debian's `valgrind`), and a C compiler.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

TOGGLE_C = "#include <valgrind/callgrind.h>\nvoid toggle(void) { CALLGRIND_TOGGLE_COLLECT; }\n"

# Run inside each checkout: its Scheduler (either layout) wrapped so that callgrind counts its two methods only.
DRIVER = """
import ctypes, os, runpy, sys
toggle = ctypes.CDLL(os.environ["SCHEDULER_INSTRUCTIONS_LIB"]).toggle
try:  # the flat layout first: an editable install of another checkout may lend it scheduler_svc/core/
    from scheduler_svc.scheduler import Scheduler
except ImportError:
    from scheduler_svc.core.scheduler import Scheduler
for name in ("schedule", "process_result"):
    def counted(self, *args, _method=getattr(Scheduler, name)):
        toggle()
        try:
            return _method(self, *args)
        finally:
            toggle()
    setattr(Scheduler, name, counted)
sys.argv = ["scheduler_bench.py", *sys.argv[1:]]
runpy.run_path("benchmarks/scheduler_bench.py", run_name="__main__")
"""


def build_toggle(folder: Path) -> Path:
    source, library = folder / "toggle.c", folder / "libtoggle.so"
    source.write_text(TOGGLE_C)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return library


def count(checkout: Path, library: Path, bench_args: list[str]) -> int:
    """Instructions inside the two methods for one run of the bench from `checkout`."""
    env = {**os.environ, "SCHEDULER_INSTRUCTIONS_LIB": str(library), "PYTHONPATH": str(checkout)}
    run = subprocess.run(["valgrind", "--tool=callgrind", "--collect-atstart=no", "--callgrind-out-file=/dev/null",
                          sys.executable, "-c", DRIVER, *bench_args], cwd=checkout, env=env, capture_output=True,
                         text=True)
    found = re.search(r"Collected : (\d+)", run.stderr)
    if run.returncode != 0 or found is None:
        raise SystemExit(f"{checkout}: the bench under callgrind failed:\n{run.stderr[-2000:]}")
    return int(found.group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkout", type=Path, action="append", help="a checkout to count (repeat to compare)")
    p.add_argument("--requests", type=int, default=1024)
    p.add_argument("--pool", choices=("ample", "tight"), default="ample")
    p.add_argument("--arrivals", choices=("all", "trickle"), default="all")
    args = p.parse_args()
    checkouts = [c.resolve() for c in args.checkout or [Path(__file__).resolve().parent.parent]]
    bench_args = ["--requests", str(args.requests), "--pool", args.pool, "--arrivals", args.arrivals, "--repeat", "1"]
    with tempfile.TemporaryDirectory() as folder:
        library = build_toggle(Path(folder))
        counts = [count(c, library, bench_args) for c in checkouts]
    print(f"instructions in schedule() + process_result(), {args.requests} requests, pool {args.pool}, "
          f"arrivals {args.arrivals}")
    for checkout, n in zip(checkouts, counts):
        print(f"  {checkout}: {n:,}  ({n / counts[0]:.4f}x the first)")


if __name__ == "__main__":
    main()
