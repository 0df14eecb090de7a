"""How many cores this host has, and how many `serve` keeps off the workers' compute threads.

Light on purpose (no torch): the supervisor resolves `reserved_cpus: -1` before it starts anything.
"""

from __future__ import annotations

import os


def host_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_reserved_cpus(cores: int) -> int:
    """Cores `serve` keeps off its workers' compute threads for the gateway, the scheduler and local
    clients (config `reserved_cpus: -1`): 2 on hosts of 8 cores or more, none below.

    A worker's threads meet at a barrier after every parallel region, so one preempted by the gateway
    or the scheduler stalls all of them, and OpenMP's spinning threads take the cores those services
    wait for. Measured on a 16-core Xeon (benchmarks/step_cost.py, the tiny model, 64 streams): with 16
    worker threads the stack's step was 3.1x the engine's, with 14 0.9x (README). vLLM's CPU backend
    reserves a core for its front end likewise (VLLM_CPU_NUM_OF_RESERVED_CPU). On small hosts there is
    none to spare: a worker on one of two cores computes at half speed, which costs more than the
    contention, and on 4-7 cores a reserved core would leave data-parallel replicas a whole core short
    each."""
    return 2 if cores >= 8 else 0
