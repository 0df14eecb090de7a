"""Which device each worker process on a host computes on.

`serve` starts `data_parallel_size` × `tensor_parallel_size` worker processes on its host and
gives each its place among them (`--local-rank`: replica × tensor_parallel_size + rank). On a
CUDA host that place picks the process's GPU: entry `local_rank` of config `devices`, else
`cuda:<local_rank>`. Without this every process would run on `cuda:0`: the replicas would
share one GPU's memory, and NCCL refuses tensor-parallel ranks that share a device.

A worker started by hand (`hetero-infer worker`, ranks on several hosts) takes its
`--local-rank`, or its `--tp-rank` when not given.
"""

from __future__ import annotations

import torch

from hetero_common.errors import ConfigError


def worker_device(device: str, devices: list[str], local_rank: int, processes_on_host: int,
                  cuda_count: int) -> torch.device:
    """The device of the worker process at `local_rank` among `processes_on_host` (config `device` and
    `devices`; `cuda_count`: the CUDA devices this process sees)."""
    if device == "cpu" or (device == "auto" and cuda_count == 0):
        return torch.device("cpu")
    if device not in ("auto", "cuda"):  # cuda:N, pinned by the user
        if processes_on_host > 1:
            raise ConfigError(f"config key 'device' = {device!r} puts all {processes_on_host} worker processes of this "
                              "host on one GPU; set device to cuda (each process takes its own) or list them in "
                              "'devices'")
        return torch.device(device)
    if local_rank < 0:
        raise ConfigError(f"--local-rank is {local_rank}; it must be >= 0")
    if devices:
        if local_rank >= len(devices):
            raise ConfigError(f"config key 'devices' = {devices!r} lists {len(devices)} devices; the worker process at "
                              f"local rank {local_rank} needs entry {local_rank} (data_parallel_size × "
                              "tensor_parallel_size processes run on this host)")
        name = devices[local_rank]
    else:
        name = f"cuda:{local_rank}"
    index = int(name.split(":")[1])
    if index >= cuda_count:
        raise ConfigError(f"the worker process at local rank {local_rank} needs {name}, but this process sees "
                          f"{cuda_count} CUDA device(s); list the GPUs to use in 'devices' or set CUDA_VISIBLE_DEVICES")
    return torch.device(name)


def bind_worker_device(device: torch.device) -> None:
    """Make `device` this process's current CUDA device, before anything allocates there: NCCL, FlashInfer's
    workspaces and `torch.cuda` calls without a device all use the current one."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
