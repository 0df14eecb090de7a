"""The GPU path's host-side logic, on the CPU: graph batch sizes and padding, FlashInfer's append
indices, backend selection, KV sizing from free memory, and the new config keys.

The kernels themselves run only on a GPU (tests/gpu/test_gpu.py); what is tested here is pure
Python/numpy that feeds them, checked against the torch reference where it can be.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_worker.cuda.cuda_graphs import graph_batch_sizes, pad_decode_table, padded_batch_size
from gpu_worker.cuda.cuda_setup import kv_blocks_for_memory
from hetero_common.errors import ConfigError
from hetero_infer.config_sources import load_config
from kernels.attention_backend import select_attention_backend
from kernels.cache_ops import allocate_kv_cache
from kernels.flashinfer_backend import append_indices, decode_uses_tensor_cores, flashinfer_unavailable_reason
from kernels.page_table import PageTable
from kernels.torch_attention import TorchPagedAttention


def test_graph_batch_sizes_ladder() -> None:
    assert graph_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    full = graph_batch_sizes(256)
    assert full[:6] == [1, 2, 4, 8, 16, 24] and full[-1] == 256 and all(b - a <= 8 for a, b in zip(full, full[1:]))


def test_graph_batch_sizes_capped_by_num_cuda_graphs() -> None:
    for n in (1, 2, 3, 5, 10):
        sizes = graph_batch_sizes(256, n)
        assert len(sizes) <= n and sizes[-1] == 256 and sizes == sorted(sizes)
    assert graph_batch_sizes(256, 2) == [1, 256]
    assert graph_batch_sizes(32, 100) == graph_batch_sizes(32)


def test_padded_batch_size() -> None:
    sizes = [1, 2, 4, 8, 16, 24]
    assert [padded_batch_size(b, sizes) for b in (1, 2, 3, 5, 9, 17, 24, 25)] == [1, 2, 4, 8, 16, 24, 24, None]


def _random_decode_step(block_size: int, lengths: list[int], num_blocks: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    free = list(rng.permutation(num_blocks - 1))  # the last block is the padding scratch block
    tables = [np.array([free.pop() for _ in range(-(-n // block_size))], dtype=np.int32) for n in lengths]
    return PageTable.build(tables, np.ones(len(lengths)), np.array(lengths), block_size)


@pytest.mark.parametrize("block_size", [1, 16])
def test_padding_leaves_real_rows_unchanged(block_size: int) -> None:
    """A padded decode table gives the real sequences exactly the attention of the unpadded one,
    and its dummy rows write only into the scratch block."""
    torch.manual_seed(0)
    num_blocks, hq, hkv, d = 64, 4, 2, 8
    pad_block = num_blocks - 1
    table = _random_decode_step(block_size, [5, 17, 1], num_blocks)
    padded = pad_decode_table(table, 8, pad_block)
    assert padded.batch_size == 8 and padded.num_tokens == 8
    assert padded.qo_indptr.tolist() == list(range(9))
    assert padded.kv_indices[-5:].tolist() == [pad_block] * 5 and padded.kv_last_page_len[-5:].tolist() == [1] * 5
    positions, slots = padded.token_positions()
    assert positions[3:].tolist() == [0] * 5 and slots[3:].tolist() == [pad_block * block_size] * 5
    real_positions, real_slots = table.token_positions()
    assert (positions[:3] == real_positions).all() and (slots[:3] == real_slots).all()
    cache = allocate_kv_cache(1, num_blocks, block_size, hkv, d, torch.float32, "cpu",
                              TorchPagedAttention.kv_layout)[0].normal_()
    q = torch.randn(8, hq, d)
    attention = TorchPagedAttention(hq, hkv, d)
    attention.plan(table)
    expected = attention.run(q[:3], cache)
    attention.plan(padded)
    torch.testing.assert_close(attention.run(q, cache)[:3], expected, rtol=0, atol=0)
    assert pad_decode_table(table, 3, pad_block) is table
    with pytest.raises(ValueError):
        pad_decode_table(table, 2, pad_block)


def test_append_indices_address_the_same_slots_as_the_torch_write() -> None:
    """FlashInfer's (batch index, position) per token resolves to the slots the torch path writes."""
    block_size = 16
    tables = [np.array([7, 3, 9]), np.array([4]), np.array([11, 2])]
    table = PageTable.build(tables, np.array([2, 1, 20]), np.array([33, 1, 20]), block_size)
    batch, positions = append_indices(table)
    assert batch.dtype == np.int32 and positions.dtype == np.int32
    assert batch.tolist() == [0, 0, 1] + [2] * 20
    kv_indptr, kv_indices = table.kv_indptr.numpy(), table.kv_indices.numpy()
    pages = kv_indices[kv_indptr[batch] + positions // block_size]
    _, slots = table.token_positions()
    assert (pages.astype(np.int64) * block_size + positions % block_size == slots).all()


def test_tensor_core_rule() -> None:
    # group size = qo heads / kv heads; CUDA-core decode up to 4, tensor cores above (7 has no CUDA-core kernel)
    assert [decode_uses_tensor_cores(h, 1) for h in (1, 2, 3, 4, 5, 6, 7, 8, 16)] == [False] * 4 + [True] * 5
    assert not decode_uses_tensor_cores(32, 8) and decode_uses_tensor_cores(28, 4)


def test_backend_selection_on_this_machine() -> None:
    cpu = torch.device("cpu")
    assert select_attention_backend("torch", cpu, 64, torch.float32)[0] == "torch"
    name, reason = select_attention_backend("auto", cpu, 64, torch.float32)
    assert name == "torch" and "cpu" in reason
    with pytest.raises(ValueError, match="flashinfer.*cannot be used"):
        select_attention_backend("flashinfer", cpu, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="unknown"):
        select_attention_backend("triton", cpu, 64)


def test_flashinfer_reasons() -> None:
    assert "CUDA" in flashinfer_unavailable_reason(torch.device("cpu"), 128, torch.bfloat16)
    if not torch.cuda.is_available():
        assert "no CUDA device" in flashinfer_unavailable_reason(torch.device("cuda"), 128, torch.bfloat16)
    else:
        assert "head_dim" in flashinfer_unavailable_reason(torch.device("cuda"), 96, torch.bfloat16)
        assert "float32" in flashinfer_unavailable_reason(torch.device("cuda"), 128, torch.float32)


def test_kv_blocks_for_memory() -> None:
    gib = 2**30
    # 0.9 x 10 GiB - 1 GiB activations = 8 GiB -> 8 blocks of 1 GiB, capped by max_num_blocks
    assert kv_blocks_for_memory(10 * gib, 0.9, gib, gib, 100) == 8
    assert kv_blocks_for_memory(10 * gib, 0.9, gib, gib, 3) == 3
    assert kv_blocks_for_memory(gib, 0.5, gib, 1024, 100) == 0


def test_gpu_config_keys() -> None:
    config = load_config(env={})
    assert config.gpu_memory_utilization == 0.9 and config.enable_cuda_graphs and config.num_cuda_graphs is None
    assert not config.use_cuda_graphs_for_non_decode_steps
    assert config.startup_timeout_s >= 600  # room for a CUDA worker's cold FlashInfer JIT before it is ready
    config = load_config(env={"HETERO_GPU_MEMORY_UTILIZATION": "0.5", "HETERO_NUM_CUDA_GRAPHS": "4"},
                         cli_overrides={"enable_cuda_graphs": "false"})
    assert (config.gpu_memory_utilization, config.num_cuda_graphs, config.enable_cuda_graphs) == (0.5, 4, False)
    for key, value in (("gpu_memory_utilization", "1.5"), ("num_cuda_graphs", "0"),
                       ("use_cuda_graphs_for_non_decode_steps", "true")):
        with pytest.raises(ConfigError, match=key):
            load_config(env={}, cli_overrides={key: value})
