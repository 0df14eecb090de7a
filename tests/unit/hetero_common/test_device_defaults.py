"""Unset `max_num_blocks` and `max_batch_size` take the device's values (hetero_common/device_defaults.py); set
ones, from a file, a preset or a flag, apply exactly; the scheduler's step batch is the worker's."""

from __future__ import annotations

from hetero.v1 import common_pb2
from hetero_common.config import PRESETS, Config
from hetero_common.device_defaults import fitted_to_worker, kv_blocks_cap, planned_batch_size, step_batch_size
from scheduler_svc.core.scheduler import Scheduler


def test_a_cpu_keeps_the_seed_values() -> None:
    config = Config().validate()
    assert kv_blocks_cap(config, "cpu") == 1024 and planned_batch_size(config, "cpu") == 32
    assert step_batch_size(config, "cpu", 10**6) == (32, "unset: the seed's on a CPU")


def test_cuda_fills_its_memory_and_batches_what_the_budgets_allow() -> None:
    config = Config().validate()
    assert kv_blocks_cap(config, "cuda") >= 2**31 - 1  # memory decides
    assert planned_batch_size(config, "cuda") == 256  # max_num_seqs, within the 4096-token budget
    assert step_batch_size(config, "cuda", 100_000)[0] == 256
    assert step_batch_size(config, "cuda", 100)[0] == 100  # a small pool: one block per sequence at least
    assert planned_batch_size(Config(max_total_tokens=64).validate(), "cuda") == 64


def test_set_values_apply_exactly_on_every_device() -> None:
    for config in (Config(max_num_blocks=77, max_batch_size=5).validate(),
                   Config(**PRESETS["high_throughput"]).validate()):
        for device in ("cpu", "cuda"):
            assert kv_blocks_cap(config, device) == config.max_num_blocks
            assert step_batch_size(config, device, 10**6) == (config.max_batch_size, "configured")


def test_the_scheduler_batches_what_its_worker_reported() -> None:
    fitted = fitted_to_worker(Config(max_num_seqs=64).validate(), max_batch_size=3, num_blocks=500)
    assert (fitted.max_batch_size, fitted.max_num_blocks) == (3, 500)
    kept = fitted_to_worker(Config(max_batch_size=7, max_num_blocks=40).validate(), 3, 500)
    assert (kept.max_batch_size, kept.max_num_blocks) == (7, 40)  # set keys win over the worker's
    scheduler = Scheduler(fitted, 500, (0,), 256)
    for i in range(5):
        scheduler.add_request(f"r{i}", [5, 6, 7], common_pb2.SamplingParams(max_tokens=4, temperature=0.0))
    assert len(scheduler.schedule().scheduled) == 3
    assert Scheduler(Config().validate(), 500, (0,), 256).max_batch_size == 32  # built without a worker: the seed's
