"""`omp_wait_policy` reaches the workers `serve` starts (and only them), and the default leaves
OpenMP's own policy alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetero_infer.supervisor import worker_environment
from hetero_infer.bench.harness import run_stack


def test_the_default_leaves_the_environment_alone() -> None:
    env = {"PATH": "/bin", "OMP_WAIT_POLICY": "ACTIVE"}
    assert worker_environment(env, "") == env
    assert worker_environment({"PATH": "/bin"}, "passive") == {"PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE"}


@pytest.mark.slow
def test_serve_starts_workers_with_the_configured_policy(tiny_llama_dir: Path) -> None:
    with run_stack(tiny_llama_dir, "--omp-wait-policy", "passive", "--log-level", "warning") as stack:
        assert stack.service_process("worker").environ().get("OMP_WAIT_POLICY") == "PASSIVE"
        assert "OMP_WAIT_POLICY" not in stack.service_process("scheduler").environ()
