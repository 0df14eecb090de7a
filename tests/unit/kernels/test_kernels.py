"""The pure-torch paged attention against dense causal attention on the same K/V."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.cache_ops import allocate_kv_cache, convert_layout, copy_blocks, write_kv
from kernels.page_table import PageTable
from kernels.torch_attention import TorchPagedAttention


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int) -> torch.Tensor:
    """q [Lq, Hq, D] at positions q_offset.., k/v [Lk, Hkv, D] -> [Lq, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    allowed = torch.arange(k.shape[0])[None, :] <= (q_offset + torch.arange(q.shape[0]))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bfloat16 prompts take the matmul path
def test_paged_attention_matches_dense(block_size: int, heads: tuple[int, int], dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    hq, hkv, d = heads[0], heads[1], 8
    # (cached tokens, new tokens): decodes, a fresh prompt, a chunk after a cached prefix.
    shapes = [(9, 1), (0, 7), (20, 5), (3, 1), (0, 1), (16, 16)]
    num_blocks = 128
    cache = allocate_kv_cache(1, num_blocks, block_size, hkv, d, dtype, "cpu", TorchPagedAttention.kv_layout)[0]
    free = list(np.random.default_rng(0).permutation(num_blocks))
    tables, keys, values, queries = [], [], [], []
    for cached, new in shapes:
        total = cached + new
        table = np.array([free.pop() for _ in range(-(-total // block_size))], dtype=np.int32)
        tables.append(table)
        k, v = torch.randn(total, hkv, d).to(dtype), torch.randn(total, hkv, d).to(dtype)
        keys.append(k)
        values.append(v)
        queries.append(torch.randn(new, hq, d).to(dtype))
    qo = np.array([n for _, n in shapes])
    kv = np.array([c + n for c, n in shapes])
    table = PageTable.build(tables, qo, kv, block_size)
    positions, slots = table.token_positions()
    # Write every token's K/V (cached ones as an earlier step would have, then the new ones).
    for i, (cached, new) in enumerate(shapes):
        pos = torch.arange(cached + new)
        slot = torch.from_numpy(tables[i][(pos // block_size).numpy()].astype(np.int64)) * block_size + pos % block_size
        write_kv(cache, keys[i], values[i], slot, TorchPagedAttention.kv_layout)
    expected_positions = np.concatenate([np.arange(c, c + n) for c, n in shapes])
    assert (positions == expected_positions).all()
    backend = TorchPagedAttention(hq, hkv, d)
    backend.plan(table)
    out = backend.run(torch.cat(queries), cache)
    start = 0
    for i, (cached, new) in enumerate(shapes):
        # The reference in float32 on the same (rounded) inputs; bfloat16 rounds scores and probabilities.
        ref = dense_attention(queries[i].float(), keys[i].float(), values[i].float(), cached)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out[start:start + new].float(), ref, rtol=tol, atol=tol)
        start += new


def test_page_table_metadata() -> None:
    table = PageTable.build([np.array([7, 3, 9]), np.array([4])], np.array([2, 1]), np.array([33, 1]), 16)
    assert table.qo_indptr.tolist() == [0, 2, 3]
    assert table.kv_indptr.tolist() == [0, 3, 4]
    assert table.kv_indices.tolist() == [7, 3, 9, 4]
    assert table.kv_last_page_len.tolist() == [1, 1]
    positions, slots = table.token_positions()
    assert positions.tolist() == [31, 32, 0]
    assert slots.tolist() == [3 * 16 + 15, 9 * 16 + 0, 4 * 16]


def test_copy_blocks_copies_every_layer() -> None:
    cache = torch.randn(3, 8, 2, 4, 2, 4)
    before = cache.clone()
    copy_blocks(cache, torch.tensor([1, 5]), torch.tensor([6, 2]))
    assert torch.equal(cache[:, 6], before[:, 1]) and torch.equal(cache[:, 2], before[:, 5])
    assert torch.equal(cache[:, 0], before[:, 0])


def test_hnd_write_matches_nhd_write() -> None:
    """The torch backend's HND cache holds, slot for slot, what the NHD (FlashInfer) layout holds."""
    torch.manual_seed(1)
    layers, blocks, bs, hkv, d = 2, 6, 4, 3, 8
    nhd = allocate_kv_cache(layers, blocks, bs, hkv, d, torch.float32, "cpu", "NHD")
    hnd = allocate_kv_cache(layers, blocks, bs, hkv, d, torch.float32, "cpu", "HND")
    assert hnd.shape == (layers, blocks, 2, hkv, bs, d)
    slots = torch.tensor([0, 5, 6, 23, 13])
    for layer in range(layers):
        k, v = torch.randn(len(slots), hkv, d), torch.randn(len(slots), hkv, d)
        write_kv(nhd[layer], k, v, slots, "NHD")
        write_kv(hnd[layer], k, v, slots, "HND")
    assert torch.equal(convert_layout(nhd, "NHD", "HND"), hnd)
    assert hnd.count_nonzero() == 2 * layers * len(slots) * hkv * d
