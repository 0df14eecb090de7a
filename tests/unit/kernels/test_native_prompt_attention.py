"""The AMX prompt-attention kernel (kernels/native/prompt_attention.py) against float32 attention on the same
bfloat16 inputs: within the error of torch's own bfloat16 SDPA, for fresh prompts and chunks over a cached
prefix, K/V read from shuffled pages, on strided query rows, grouped KV heads, head sizes 64 and 128, lengths
around the kernel's 16-row and 32-key blocks, and large scores."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels.cache_ops import allocate_kv_cache, write_kv
from kernels.native import prompt_attention as native_prompt_attention

pytestmark = pytest.mark.skipif(not native_prompt_attention.supported(64, 1, 1),
                                reason="no AMX here (or its tiles were not granted): SDPA serves")


def paged(kv_len: int, hkv: int, d: int, block_size: int, gen: torch.Generator, magnitude: float = 1.0):
    """A layer cache holding one sequence's K/V [kv_len, hkv, d] in shuffled pages (the rest NaN: never read)."""
    num_pages = -(-kv_len // block_size)
    cache = allocate_kv_cache(1, num_pages + 3, block_size, hkv, d, torch.bfloat16, "cpu", "HND")[0]
    cache.fill_(float("nan"))
    pages = torch.from_numpy(np.random.default_rng(kv_len).permutation(num_pages + 3)[:num_pages].astype(np.int32))
    k = (torch.randn(kv_len, hkv, d, generator=gen) * magnitude).to(torch.bfloat16)
    v = torch.randn(kv_len, hkv, d, generator=gen).to(torch.bfloat16)
    pos = torch.arange(kv_len)
    write_kv(cache, k, v, pages[pos // block_size].long() * block_size + pos % block_size, "HND")
    return cache, pages, k, v


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, hq, d] the last n positions of k, v [kv_len, hkv, d]."""
    group, n, kv_len = q.shape[1] // k.shape[1], q.shape[0], k.shape[0]
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)))
    mask = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - n, kv_len)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)[0].transpose(0, 1)


def queries(n: int, hq: int, d: int, gen: torch.Generator, magnitude: float) -> torch.Tensor:
    """q rows strided as in the model's fused q/k/v product."""
    return (torch.randn(n, hq + 5, d, generator=gen) * magnitude)[:, 2:2 + hq].to(torch.bfloat16)


@pytest.mark.parametrize("heads", [(1, 1), (4, 2), (9, 3)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_matches_float32_within_sdpa_error(heads: tuple[int, int], head_dim: int) -> None:
    hq, hkv = heads
    gen = torch.Generator().manual_seed(hq * 1000 + head_dim)
    scale = head_dim ** -0.5
    for n, kv_len, block_size in [(2, 2, 16), (15, 15, 16), (17, 17, 5), (31, 31, 16), (33, 33, 16), (100, 100, 16),
                                  (257, 257, 32), (16, 40, 16), (17, 300, 16), (40, 41, 7), (100, 612, 64)]:
        for magnitude in (1.0, 6.0):  # 6: scores in the hundreds, softmax near one-hot
            cache, pages, k, v = paged(kv_len, hkv, head_dim, block_size, gen, magnitude)
            q = queries(n, hq, head_dim, gen, magnitude)
            out = torch.full((n, hq + 1, head_dim), 7.0, dtype=torch.bfloat16)[:, 1:]  # strided rows too
            assert native_prompt_attention.prompt_attention(q, cache, pages, kv_len, out, scale)
            exact = causal(q.float(), k.float(), v.float(), scale)
            sdpa_error = (causal(q, k, v, scale).float() - exact).abs().max().item()
            error = (out.float() - exact).abs().max().item()
            assert out.isfinite().all()
            assert error <= 1.5 * sdpa_error + 0.01 * magnitude, (n, kv_len, magnitude, error, sdpa_error)


def test_a_one_token_prompt_is_its_value() -> None:
    cache, pages, _, v = paged(1, 2, 64, 16, torch.Generator().manual_seed(0))
    q = queries(1, 4, 64, torch.Generator().manual_seed(1), 1.0)
    out = torch.empty(1, 4, 64, dtype=torch.bfloat16)
    assert native_prompt_attention.prompt_attention(q, cache, pages, 1, out, 0.125)
    assert torch.equal(out, v.repeat_interleave(2, 1))


def test_refuses_what_it_cannot_take() -> None:
    assert not native_prompt_attention.supported(96, 4, 2)  # not a multiple of 64
    assert not native_prompt_attention.supported(64, 3, 2)  # heads not a multiple of the KV heads
    cache, pages, _, _ = paged(20, 1, 64, 16, torch.Generator().manual_seed(0))
    q = queries(4, 2, 64, torch.Generator().manual_seed(1), 1.0)
    out = torch.empty(4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out must be bfloat16"):
        native_prompt_attention.prompt_attention(q, cache, pages, 20, torch.empty(4, 2, 64), 0.125)
    with pytest.raises(ValueError, match="4 query rows"):
        native_prompt_attention.prompt_attention(q, cache, pages, 3, out, 0.125)  # more queries than tokens
    with pytest.raises(ValueError, match="at least 2 entries"):
        native_prompt_attention.prompt_attention(q, cache, pages[:1], 20, out, 0.125)
    with pytest.raises(IndexError, match="outside the cache"):
        native_prompt_attention.prompt_attention(q, cache, pages + cache.shape[0], 20, out, 0.125)
