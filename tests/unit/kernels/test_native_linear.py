"""The C bfloat16 linear kernel (kernels/native/linear.py) against float32 products of the same
bfloat16 inputs, its batch invariance, its padding of odd sizes, and the tiny models' logits through
it against float32; the AMX tile kernel (kernels/native/linear_amx.c) likewise where the CPU has AMX; and the
dual packing of AMX CPUs (a C kernel up to a few rows, oneDNN above). Where the CPU has no AVX512-BF16 the
kernels are not used: skipped."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.cpu.packed_linear import DualPackedWeight, linear, pack_weight, prepack_supported
from gpu_worker.cpu.worker_setup import cpu_flags
from kernels.native import lib as native_lib
from kernels.native import linear as native_linear
from kernels.native.linear import NativePackedWeight
from tests.helpers.oracle import make_prompts
from tests.unit.gpu_worker.test_cpu_dtype import REL_TOL, prefill_logits

REASON = native_linear.unavailable_reason(cpu_flags())
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"the C linear kernel is not used here: {REASON}")


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.float() @ weight.float().T
    return out if bias is None else out + bias.float()


def check_against_float32(rows: int, out_features: int, in_features: int, amx: bool, offset: int) -> None:
    """Plain and strided rows (starting `offset` elements into wider ones), with and without bias."""
    torch.manual_seed(rows * 1000 + out_features + in_features)
    weight = (torch.randn(out_features, in_features) / in_features ** 0.5).to(torch.bfloat16)
    bias = torch.randn(out_features).to(torch.bfloat16)
    packed = pack_weight(weight, native=True, amx=amx)
    assert type(packed) is NativePackedWeight and tuple(packed.shape) == (out_features, in_features)
    assert packed.amx == amx
    wide = torch.randn(rows, 2 * in_features + offset).to(torch.bfloat16)
    for x in (torch.randn(rows, in_features).to(torch.bfloat16), wide[:, offset:offset + in_features]):
        for b in (None, bias):
            got, want = linear(x, packed, b), reference(x, weight, b)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
            # float32 sums, one bfloat16 rounding: within a unit of the last place (2^-8 relative) or so.
            torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=8e-3)


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 33])
@pytest.mark.parametrize("out_features, in_features", [(1, 1), (47, 7), (48, 64), (100, 577), (960, 576)])
def test_matches_float32_products(rows: int, out_features: int, in_features: int) -> None:
    check_against_float32(rows, out_features, in_features, amx=False, offset=3)


def test_rows_do_not_depend_on_the_batch() -> None:
    torch.manual_seed(1)
    weight = torch.randn(200, 96).to(torch.bfloat16)
    packed = pack_weight(weight, native=True)
    x = torch.randn(21, 96).to(torch.bfloat16)
    together = linear(x, packed)
    for i in (0, 7, 8, 20):  # first and last rows of full tiles of 8, and the odd tile
        assert torch.equal(linear(x[i:i + 1], packed), together[i:i + 1])
    assert torch.equal(linear(x[3:17], packed), together[3:17])


@pytest.mark.parametrize("rows", [1, 7, 8, 33])
@pytest.mark.parametrize("out_features, in_features", [(47, 7), (100, 577), (960, 576)])
def test_float32_output_is_what_the_bfloat16_output_rounds(rows: int, out_features: int, in_features: int) -> None:
    """linear_bf16_f32 (the LM head's logits) stores the float32 sums that linear_bf16 rounds: rounded to bfloat16
    they are its output bit for bit, and they are within float32 summation error of the float32 product."""
    torch.manual_seed(rows + out_features)
    weight = (torch.randn(out_features, in_features) / in_features ** 0.5).to(torch.bfloat16)
    packed = pack_weight(weight, native=True)
    x = torch.randn(rows, 2 * in_features).to(torch.bfloat16)[:, 3:3 + in_features]  # strided rows
    wide = native_linear.linear(x, packed, out_dtype=torch.float32)
    assert wide.dtype == torch.float32 and wide.shape == (rows, out_features)
    assert torch.equal(wide.to(torch.bfloat16), native_linear.linear(x, packed))
    torch.testing.assert_close(wide, reference(x, weight, None), rtol=1e-4, atol=1e-4)
    assert native_linear.linear(torch.empty(0, in_features, dtype=torch.bfloat16), packed,
                                out_dtype=torch.float32).shape == (0, out_features)


def test_leading_dimensions_and_empty_input() -> None:
    weight = torch.randn(50, 16).to(torch.bfloat16)
    packed = pack_weight(weight, native=True)
    x = torch.randn(2, 3, 16).to(torch.bfloat16)
    torch.testing.assert_close(linear(x, packed).float(), reference(x, weight, None), rtol=8e-3, atol=8e-3)
    assert linear(torch.empty(0, 16, dtype=torch.bfloat16), packed).shape == (0, 50)


def test_refuses_what_it_cannot_compute() -> None:
    with pytest.raises(ValueError, match="bfloat16 weight"):
        pack_weight(torch.randn(4, 4), native=True)
    packed = pack_weight(torch.randn(4, 4).to(torch.bfloat16), native=True)
    with pytest.raises(ValueError, match="does not fit"):
        linear(torch.randn(2, 4), packed)
    with pytest.raises(ValueError, match="does not fit"):
        linear(torch.randn(2, 5).to(torch.bfloat16), packed)


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_model_logits_close_to_float32_and_to_onednn(model_fixture: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(model_fixture)
    prompts = make_prompts()
    exact = prefill_logits(model_dir, torch.float32, prompts)
    onednn = prefill_logits(model_dir, torch.bfloat16, prompts, prepack=True)
    native = prefill_logits(model_dir, torch.bfloat16, prompts, native_linear=True)
    for fast in (onednn, native):
        rel = (fast - exact).norm(dim=-1) / exact.norm(dim=-1)
        assert float(rel.max()) < REL_TOL, rel
    assert torch.equal(native.argmax(-1), exact.argmax(-1))


@pytest.mark.skipif(not prepack_supported(torch.device("cpu"), torch.bfloat16), reason="no oneDNN prepacking here")
def test_dual_packing_takes_the_c_kernel_up_to_its_rows_and_onednn_above() -> None:
    torch.manual_seed(2)
    weight = torch.randn(96, 64).to(torch.bfloat16)
    dual = pack_weight(weight, native=True, native_max_rows=4)
    assert type(dual) is DualPackedWeight and tuple(dual.shape) == (96, 64)
    x = torch.randn(9, 64).to(torch.bfloat16)
    for rows in (1, 4, 5, 9):
        want = linear(x[:rows], dual.native if rows <= 4 else dual.onednn)
        assert torch.equal(linear(x[:rows], dual), want), rows
    assert torch.equal(linear(x[:2].view(1, 2, 64), dual), linear(x[:2], dual.native).view(1, 2, 96))  # rows, not dim 0


AMX = native_lib.load() is not None and bool(native_lib.load().linear_amx_supported())
needs_amx = pytest.mark.skipif(not AMX, reason="the CPU has no AMX (or the kernel was not granted its tiles)")


@needs_amx
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 32, 33, 64, 70])
@pytest.mark.parametrize("out_features, in_features", [(32, 32), (96, 576), (960, 576), (576, 1536)])
def test_amx_tiles_match_float32_products(rows: int, out_features: int, in_features: int) -> None:
    check_against_float32(rows, out_features, in_features, amx=True, offset=32)


@needs_amx
def test_amx_rows_do_not_depend_on_the_batch_and_odd_shapes_are_refused() -> None:
    torch.manual_seed(3)
    weight = torch.randn(128, 96).to(torch.bfloat16)
    packed = pack_weight(weight, native=True, amx=True)
    x = torch.randn(45, 96).to(torch.bfloat16)
    together = linear(x, packed)
    for i in (0, 15, 16, 31, 32, 44):  # edges of the 16-row tiles and 32-row blocks
        assert torch.equal(linear(x[i:i + 1], packed), together[i:i + 1])
    assert torch.equal(linear(x[5:40], packed), together[5:40])
    with pytest.raises(ValueError, match="multiples of 32"):
        pack_weight(torch.randn(48, 96).to(torch.bfloat16), native=True, amx=True)


def test_plan_picks_the_tiles_on_amx_only_where_every_shape_fits() -> None:
    shapes = [(960, 576), (576, 576)]
    assert native_linear.plan({"avx512_bf16"}, shapes) == (False, None)  # no AMX: the panels, every product
    if AMX:
        assert native_linear.plan({"amx_bf16"}, shapes) == (True, native_linear.AMX_MAX_ROWS)
    assert native_linear.plan({"amx_bf16"}, shapes + [(49155, 576)]) == (False, native_linear.PANELS_ON_AMX_MAX_ROWS)
