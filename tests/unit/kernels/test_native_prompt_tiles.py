"""Prompt chunks in the C attention kernel's 16-row tiles (kernels/native/prompt_row_tiles.c, on AVX512-BF16
CPUs): against dense float32 attention, for every head grouping and both head sizes, over cached prefixes and
with NaN in every unwritten slot; a row's result independent of the rest of the step and of how its prompt was
split into chunks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.native import decode_attention as native_decode
from kernels.page_table import PageTable
from kernels.torch_attention import TorchPagedAttention
from tests.unit.kernels.test_kernels import dense_attention
from tests.unit.kernels.test_native_decode import decode_case, needs_kernel

TILE_MIN_ROWS = 8  # decode_attention.c's PROMPT_TILE_MIN_ROWS


def chunk_case(seqs: list[tuple[int, int]], hq: int, hkv: int, d: int, block_size: int, seed: int = 0):
    """test_native_decode's cache (NaN in every slot no sequence wrote) holding each sequence's (kv_len, q_len)
    K/V rows, its last q_len tokens this step's chunk; q rows strided like the model's. Returns the cache, the
    pages per sequence, q, and each sequence's K and V."""
    cache, table, _, keys, values = decode_case([n for n, _ in seqs], hq, hkv, d, block_size, seed, fill=float("nan"))
    indptr, indices = table.kv_indptr.numpy(), table.kv_indices.numpy()
    tables = [indices[indptr[i]:indptr[i + 1]].astype(np.int32) for i in range(len(seqs))]
    q = torch.randn(sum(m for _, m in seqs), hq + 2 * hkv, d).to(torch.bfloat16)[:, :hq]
    return cache, tables, q, keys, values


def attend(cache, tables, seqs: list[tuple[int, int]], q: torch.Tensor, tiles: bool = True) -> torch.Tensor:
    """Every row of the step through the C kernel (one plan: decodes, short chunks and tiled chunks together;
    `tiles` false: every row on the per-row path)."""
    hq, d, hkv = q.shape[1], q.shape[2], cache.shape[2]
    backend = TorchPagedAttention(hq, hkv, d, decode_kernel="c", prompt_tiles=tiles)
    table = PageTable.build(tables, np.array([m for _, m in seqs]), np.array([n for n, _ in seqs]), cache.shape[3])
    backend.plan(table)
    assert backend.native_rows() is not None  # the C kernel takes every row
    return backend.run(q, cache)


def skip_without_tiles(head_dim: int, block_size: int) -> None:
    if not native_decode.takes_prompts(head_dim, block_size):
        pytest.skip("no AVX512-BF16 here: prompt rows are not the C kernel's")


# (kv_len, q_len): fresh prompts of 40, 17 (a full tile and one row) and exactly the minimum; 37 rows over a
# 20-token cached prefix; a 7-row chunk (the per-row path); a decode; 300 rows over several pages.
SEQS = [(40, 40), (57, 37), (17, 17), (TILE_MIN_ROWS, TILE_MIN_ROWS), (12, 7), (30, 1), (300, 300)]


@needs_kernel
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 2), (8, 2), (10, 2), (12, 2)])  # G = 1, 2, 3, 4, 5, 6
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prompt_chunks_in_tiles_match_dense_float32(block_size: int, heads: tuple[int, int], head_dim: int) -> None:
    skip_without_tiles(head_dim, block_size)
    cache, tables, q, keys, values = chunk_case(SEQS, *heads, head_dim, block_size)
    out = attend(cache, tables, SEQS, q)
    assert not out.isnan().any()  # the NaN slots past each sequence's length never reach a row
    start = 0
    for (n, m), k, v in zip(SEQS, keys, values):
        ref = dense_attention(q[start:start + m].float(), k.float(), v.float(), n - m)
        # float32 scores and sums, the softmax numerators rounded to bfloat16 once (as SDPA's flash kernel does)
        torch.testing.assert_close(out[start:start + m].float(), ref, rtol=1e-2, atol=1e-2)
        start += m


@needs_kernel
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 2), (8, 2), (10, 2), (12, 2)])  # G = 1, 2, 3, 4, 5, 6
@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_tiled_row_is_the_per_row_paths_bits(block_size: int, heads: tuple[int, int], head_dim: int) -> None:
    """attention_order.h: the chunks of 8+ rows take the tiles, and each of their rows is bit for bit what the
    per-row path computes for it, in the same step with the tiles off and one by one as decodes (every
    grouping, both head sizes, odd and even lengths, NaN in every unwritten slot)."""
    skip_without_tiles(head_dim, block_size)
    cache, tables, q, _, _ = chunk_case(SEQS, *heads, head_dim, block_size, seed=11)
    tiled = attend(cache, tables, SEQS, q)
    rows_only = attend(cache, tables, SEQS, q, tiles=False)
    assert torch.equal(tiled, rows_only)
    start = 0
    for (n, m), table in zip(SEQS, tables):
        one_by_one = torch.cat([attend(cache, [table], [(n - m + i + 1, 1)], q[start + i:start + i + 1])
                                for i in range(0, m, 7)])
        assert torch.equal(tiled[start:start + m:7], one_by_one), (n, m)
        start += m


@needs_kernel
def test_a_tiled_row_depends_on_nothing_but_its_own_sequence() -> None:
    """Bitwise: a chunk alone, the same chunk between decodes and other chunks, and its rows in other chunkings
    of the same prompt (other tile boundaries, a cached prefix in front): each lane of a tile is its own row."""
    skip_without_tiles(64, 16)
    seqs = [(30, 1), (100, 100), (70, 25), (9, 1)]
    cache, tables, q, _, _ = chunk_case(seqs, 9, 3, 64, 16, seed=5)
    together = attend(cache, tables, seqs, q)
    rows = slice(1, 101)  # the 100-token prompt's rows in the step
    alone = attend(cache, [tables[1]], [(100, 100)], q[rows])
    assert torch.equal(alone, together[rows])
    for split in (19, 40, 77, 92):  # the prompt's last rows as a chunk over a cached prefix of `split` tokens
        later = attend(cache, [tables[1]], [(100, 100 - split)], q[rows][split:])
        assert torch.equal(later, together[rows][split:])
