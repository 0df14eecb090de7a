"""`weight_prepack`: linear weights held in oneDNN's blocked layout (gpu_worker/cpu/packed_linear.py) give
the products of plain `F.linear` (bfloat16: to its rounding; float32: to the last bits) and,
on the tiny models, the same greedy tokens as unpacked float32 — the oracle mode's answer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.cpu.packed_linear import linear, pack_weight, prepack_supported
from tests.helpers.oracle import engine_greedy, make_prompts
from tests.unit.gpu_worker.test_cpu_dtype import prefill_logits

pytestmark = pytest.mark.skipif(not prepack_supported(torch.device("cpu"), torch.float32),
                                reason="this torch build has no oneDNN linear-weight packing")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_packed_linear_matches_plain(dtype: torch.dtype, tol: float) -> None:
    if not prepack_supported(torch.device("cpu"), dtype):
        pytest.skip(f"oneDNN packs no {dtype} weights on this CPU (bfloat16 needs AVX512)")
    torch.manual_seed(0)
    weight = (torch.randn(96, 64) / 8).to(dtype)
    bias = torch.randn(96).to(dtype)
    packed = pack_weight(weight)
    assert packed.is_mkldnn and tuple(packed.shape) == (96, 64)
    wide = torch.randn(5, 128).to(dtype)
    cases = [torch.randn(1, 64).to(dtype), torch.randn(37, 64).to(dtype),
             wide[:, :64],  # a strided view, like the SiLU·up half of gate_up
             torch.randn(2, 3, 64).to(dtype)]
    for x in cases:
        for b in (None, bias):
            got, want = linear(x, packed, b), F.linear(x, weight, b)
            assert got.shape == want.shape and got.dtype == want.dtype
            rel = float((got.float() - want.float()).norm() / want.float().norm())
            assert rel < tol, (tuple(x.shape), b is not None, rel)
    assert torch.equal(linear(cases[1], weight), F.linear(cases[1], weight))  # a plain weight goes to F.linear


def test_cuda_and_half_weights_are_never_packed() -> None:
    assert not prepack_supported(torch.device("cuda"), torch.bfloat16)
    assert not prepack_supported(torch.device("cpu"), torch.float16)


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_packed_model_logits_match_plain_float32(model_fixture: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(model_fixture)
    prompts = make_prompts()
    plain = prefill_logits(model_dir, torch.float32, prompts, prepack=False)
    packed = prefill_logits(model_dir, torch.float32, prompts, prepack=True)
    rel = (packed - plain).norm(dim=-1) / plain.norm(dim=-1)
    assert float(rel.max()) < 1e-5, rel


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_packed_engine_greedy_tokens_equal_plain_float32(model_fixture: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(model_fixture)
    prompts = make_prompts()
    assert engine_greedy(model_dir, prompts, weight_prepack=True) == engine_greedy(model_dir, prompts, weight_prepack=False)
