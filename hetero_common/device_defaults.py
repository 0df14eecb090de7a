"""The KV pool's cap and the step batch where the config leaves them unset (`max_num_blocks`,
`max_batch_size`: null), chosen for the worker's device.

The seed's values (1024 blocks, 32 sequences a step) were made for its mock engine. On a CPU
they still fit: a step of 32 keeps two cores busy, and a pool of 1024 blocks within
`kv_cache_memory_gb`. On a GPU they would bind the device: 16K tokens of KV on an 80-141 GB
card, 32 sequences where the bandwidth roofline wants hundreds. So on CUDA the pool takes what
`gpu_memory_utilization` leaves, and a step holds as many sequences as `max_num_seqs`, the
token budget and the pool allow (one block each at least). A value that is set, in a file, a
preset, the environment or a flag, applies exactly.
"""

from __future__ import annotations

from dataclasses import replace

from hetero_common.config import Config

SEED_MAX_NUM_BLOCKS = 1024  # the CPU pool's cap when max_num_blocks is unset
SEED_MAX_BATCH_SIZE = 32  # the CPU step batch when max_batch_size is unset


def kv_blocks_cap(config: Config, device_type: str) -> int:
    """The most KV blocks the worker allocates: the configured cap, else the seed's on a CPU and none on CUDA
    (its memory decides)."""
    if config.max_num_blocks is not None:
        return config.max_num_blocks
    return SEED_MAX_NUM_BLOCKS if device_type == "cpu" else 2**31 - 1


def planned_batch_size(config: Config, device_type: str) -> int:
    """The step batch before the pool is sized (what CUDA graphs and the warm-up are made for)."""
    if config.max_batch_size is not None:
        return config.max_batch_size
    if device_type == "cpu":
        return SEED_MAX_BATCH_SIZE
    return max(1, min(config.max_num_seqs, config.max_total_tokens))


def step_batch_size(config: Config, device_type: str, num_blocks: int) -> tuple[int, str]:
    """(sequences one step may compute, why): `planned_batch_size`, on CUDA also at most one per block."""
    planned = planned_batch_size(config, device_type)
    if config.max_batch_size is not None:
        return planned, "configured"
    if device_type == "cpu":
        return planned, "unset: the seed's on a CPU"
    return max(1, min(planned, num_blocks)), "unset: min(max_num_seqs, max_total_tokens, kv blocks) on CUDA"


def fitted_to_worker(config: Config, max_batch_size: int, num_blocks: int) -> Config:
    """The scheduler's config for a worker that reported this step batch and block count: unset keys take the
    worker's values (set ones stay as they are)."""
    if config.max_batch_size is None:  # a worker that reports none (0) predates the field: the seed's
        config = replace(config, max_batch_size=max_batch_size or SEED_MAX_BATCH_SIZE)
    if config.max_num_blocks is None:
        config = replace(config, max_num_blocks=num_blocks)
    return config
