"""The AMX prompt-attention kernel (kernels/native_prompt_attention.py) against float32 attention on the same
bfloat16 inputs: within the error of torch's own bfloat16 SDPA, on strided rows, grouped KV heads, head sizes
64 and 128, prompt lengths around the kernel's 16-row and 32-key blocks, and large scores."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import native_prompt_attention

pytestmark = pytest.mark.skipif(not native_prompt_attention.supported(64, 1, 1),
                                reason="no AMX here (or its tiles were not granted): SDPA serves")


def prompt(n: int, hq: int, hkv: int, d: int, gen: torch.Generator, magnitude: float = 1.0):
    """q, k, v as views of one strided q/k/v buffer, as the model's fused product leaves them."""
    width = (hq + 2 * hkv) * d
    qkv = (torch.randn(n, width + 24, generator=gen) * magnitude)[:, 8:8 + width].to(torch.bfloat16)
    return (qkv[:, : hq * d].view(n, hq, d), qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d),
            qkv[:, (hq + hkv) * d :].view(n, hkv, d))


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)[0].transpose(0, 1)


@pytest.mark.parametrize("heads", [(1, 1), (4, 2), (9, 3)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_matches_float32_within_sdpa_error(heads: tuple[int, int], head_dim: int) -> None:
    hq, hkv = heads
    gen = torch.Generator().manual_seed(hq * 1000 + head_dim)
    scale = head_dim ** -0.5
    for n in (2, 15, 16, 17, 31, 32, 33, 100, 257):
        for magnitude in (1.0, 6.0):  # 6: scores in the hundreds, softmax near one-hot
            q, k, v = prompt(n, hq, hkv, head_dim, gen, magnitude)
            out = torch.full((n, hq + 1, head_dim), 7.0, dtype=torch.bfloat16)[:, 1:]  # strided rows too
            assert native_prompt_attention.prompt_attention(q, k, v, out, scale)
            exact = causal(q.float(), k.float(), v.float(), scale)
            sdpa_error = (causal(q, k, v, scale).float() - exact).abs().max().item()
            error = (out.float() - exact).abs().max().item()
            assert out.isfinite().all()
            assert error <= 1.5 * sdpa_error + 0.01 * magnitude, (n, magnitude, error, sdpa_error)


def test_one_token_prompt_is_its_value() -> None:
    q, k, v = prompt(1, 4, 2, 64, torch.Generator().manual_seed(0))
    out = torch.empty(1, 4, 64, dtype=torch.bfloat16)
    assert native_prompt_attention.prompt_attention(q, k, v, out, 0.125)
    assert torch.equal(out, v.repeat_interleave(2, 1))


def test_refuses_what_it_cannot_take() -> None:
    assert not native_prompt_attention.supported(96, 4, 2)  # not a multiple of 64: SDPA
    assert not native_prompt_attention.supported(64, 3, 2)  # heads not a multiple of the KV heads
    q, k, v = prompt(4, 2, 1, 64, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="out must be bfloat16"):
        native_prompt_attention.prompt_attention(q, k, v, torch.empty(4, 2, 64), 0.125)
    with pytest.raises(ValueError, match="same rows"):
        native_prompt_attention.prompt_attention(q, k, v[:3], torch.empty(4, 2, 64, dtype=torch.bfloat16), 0.125)
