"""Each worker process of a host on its own GPU (gpu_worker/cuda/device_map.py), checked on the CPU: the mapping
itself, the places `serve` gives its workers, and a worker binding its device, with torch.cuda's device count
and `set_device` replaced by stand-ins. It runs for real only on a multi-GPU machine."""

from __future__ import annotations

import pytest
import torch

from gpu_worker import service
from gpu_worker.cuda.device_map import worker_device
from hetero_common.config import Config
from hetero_common.errors import ConfigError
from hetero_infer import supervisor


def test_cpu_and_auto_without_cuda_stay_on_the_cpu() -> None:
    assert worker_device("cpu", [], 3, 4, cuda_count=8) == torch.device("cpu")
    assert worker_device("auto", [], 3, 4, cuda_count=0) == torch.device("cpu")


def test_each_local_rank_takes_its_own_gpu() -> None:
    assert [worker_device("auto", [], r, 4, cuda_count=4) for r in range(4)] == \
        [torch.device(f"cuda:{r}") for r in range(4)]
    assert worker_device("cuda", [], 0, 1, cuda_count=1) == torch.device("cuda:0")
    listed = ["cuda:6", "cuda:7"]
    assert [worker_device("cuda", listed, r, 2, cuda_count=8) for r in range(2)] == \
        [torch.device("cuda:6"), torch.device("cuda:7")]


def test_a_mapping_that_cannot_hold_is_refused_naming_what_to_set() -> None:
    with pytest.raises(ConfigError, match="sees 2 CUDA device"):
        worker_device("auto", [], 2, 4, cuda_count=2)
    with pytest.raises(ConfigError, match="'devices'.*lists 2 devices.*local rank 2"):
        worker_device("cuda", ["cuda:0", "cuda:1"], 2, 4, cuda_count=4)
    with pytest.raises(ConfigError, match="'device' = 'cuda:1' puts all 2 worker processes"):
        worker_device("cuda:1", [], 1, 2, cuda_count=4)
    assert worker_device("cuda:1", [], 0, 1, cuda_count=4) == torch.device("cuda:1")  # one process: pinned
    with pytest.raises(ConfigError, match="devices"):
        Config(devices=["cuda:0", "cuda:0"]).validate()
    with pytest.raises(ConfigError, match="devices"):
        Config(devices=["gpu1"]).validate()


class RecordedProcess:
    started: list[list[str]] = []

    def __init__(self, cmd: list[str], env: object = None) -> None:
        RecordedProcess.started.append(cmd)
        self.pid = 0


def _local_ranks(config: Config, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    RecordedProcess.started = []
    monkeypatch.setattr(supervisor.subprocess, "Popen", RecordedProcess)
    sup = supervisor.Supervisor(config.validate())
    try:
        for i, address in enumerate(config.replica_addresses()):
            sup._start_group(supervisor.WorkerGroup(i, address))
    finally:
        sup.stop()  # the recorded processes hold nothing; this removes the config file and rendezvous folder
    return [int(cmd[cmd.index("--local-rank") + 1]) for cmd in RecordedProcess.started]


def test_serve_gives_every_worker_process_its_own_place_and_so_its_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    config = Config(data_parallel_size=2, tensor_parallel_size=2, devices=["cuda:3", "cuda:2", "cuda:1", "cuda:0"])
    ranks = _local_ranks(config, monkeypatch)
    assert ranks == [0, 1, 2, 3]  # replica 0's ranks, then replica 1's
    devices = [worker_device("cuda", config.devices, r, 4, cuda_count=4) for r in ranks]
    assert len(set(devices)) == 4 and devices[0] == torch.device("cuda:3")
    assert _local_ranks(Config(data_parallel_size=3), monkeypatch) == [0, 1, 2]


def test_serve_refuses_fewer_devices_than_worker_processes() -> None:
    with pytest.raises(ConfigError, match="lists 1 devices for 2 worker processes"):
        supervisor.Supervisor(Config(tensor_parallel_size=2, devices=["cuda:0"]).validate())


def test_a_worker_binds_its_device_before_anything_allocates(monkeypatch: pytest.MonkeyPatch) -> None:
    bound: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    config = service.on_own_device(Config(device="cuda", data_parallel_size=2).validate(), tp_rank=0, local_rank=1)
    assert config.device == "cuda:1" and bound == [torch.device("cuda:1")]
    alone = service.on_own_device(Config(device="auto", tensor_parallel_size=2).validate(), tp_rank=1, local_rank=None)
    assert alone.device == "cuda:1"  # started by hand: its tensor-parallel rank's place
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert service.on_own_device(Config().validate(), 0, 0).device == "cpu" and len(bound) == 2
