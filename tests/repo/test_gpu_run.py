"""scripts/gpu_run.sh on a machine without a GPU stops before it installs or runs anything, saying why; and
benchmarks/gpu_perf_rows.py turns gpu_bench's JSON into the rows docs/perf/ holds, stamped."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks.gpu_perf_rows import markdown

ROOT = Path(__file__).resolve().parents[2]


def _gpu_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_run.sh"), *args], cwd=ROOT, text=True,
                          capture_output=True, env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"),
                                                    "HETERO_GPU_STATE": str(tmp_path / "state")},
                          timeout=120)  # a hang guard: the script must stop at its first check


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None or Path("/dev/nvidia0").exists(),
                    reason="this machine has an NVIDIA GPU")
@pytest.mark.parametrize("step", ["first", "second", "tests"])
def test_without_a_gpu_every_step_stops_at_once_naming_why(tmp_path: Path, step: str) -> None:
    done = _gpu_run(tmp_path, step)
    assert done.returncode == 2
    assert "no NVIDIA GPU is visible" in done.stderr and "run it on the GPU machine" in done.stderr
    assert not (tmp_path / "state").exists()  # nothing installed, nothing unpacked
    assert not any((tmp_path / "out").iterdir())  # and no step started


def test_an_unknown_step_is_refused_with_the_usage(tmp_path: Path) -> None:
    done = _gpu_run(tmp_path, "frist")
    assert done.returncode == 2 and "usage: bash scripts/gpu_run.sh [first|second" in done.stderr


BENCH = {"device": "NVIDIA H200", "torch": "2.11.0+cu130", "flashinfer": "0.7.2.post1", "context": 1000,
         "kv_cache_dtype": "bfloat16", "quantization": "none", "elementwise": "flashinfer",
         "copy_bandwidth_gbs": 4258.0, "weight_bytes": 2.3e9,
         "decode": [{"batch": 1, "graphs": False, "step_ms": 7.67, "tokens_per_s": 130.4, "bytes_per_step": 2.5e9,
                     "roofline_fraction": 0.08},
                    {"batch": 1, "graphs": True, "step_ms": 2.08, "tokens_per_s": 480.8, "bytes_per_step": 2.5e9,
                     "roofline_fraction": 0.28},
                    {"batch": 64, "graphs": False, "step_ms": 8.35, "tokens_per_s": 7664.7, "bytes_per_step": 4.57e9,
                     "roofline_fraction": 0.13},
                    {"batch": 64, "graphs": True, "step_ms": 3.41, "tokens_per_s": 18768.3, "bytes_per_step": 4.57e9,
                     "roofline_fraction": 0.315}],
         "graph_step_breakdown": [{"batch": 1, "step_ms": 2.35, "run_host_ms": 0.43, "plan_ms": 0.18,
                                   "replay_ms": 1.9, "read_back_ms": 0.06, "gpu_waits_ms": 0.45}],
         "mixed_step_ms": 9.1, "ttft_ms": 12.8, "attention_us": {"flashinfer": 61.2, "torch": 168.1},
         "targets": {"graphs >= 1.3x eager at batch 1": True, "decode batch 64 with graphs >= 65% of the roofline": False}}


def test_perf_rows_carry_the_figures_and_their_stamp() -> None:
    text = markdown(BENCH, "H200", "2026-12-01", "abc1234")
    assert "| 1 | 7.67 | 2.08 | 481 | 2.50 | 28% | H200 | 2026-12-01 | `abc1234` |" in text
    assert "| 64 | 8.35 | 3.41 | 18,768 | 4.57 | 32% | H200 | 2026-12-01 | `abc1234` |" in text
    assert "| 1 | 2.35 | 1.90 | 0.43 | 0.18 | 0.06 | 0.45 | H200 | 2026-12-01 | `abc1234` |" in text
    assert "- [MISSED] decode batch 64 with graphs >= 65% of the roofline" in text
    assert "Time to first token: 12.8 ms" in text
