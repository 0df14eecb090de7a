"""An fp8 KV cache saturates at +-448: a K or V value beyond e4m3fn's range is stored as the largest finite
value of its sign, never NaN (kernels/cache_ops.py `to_fp8`; the FlashInfer backend's append uses it).

torch's own float-to-e4m3fn conversion happens to saturate on this CPU build, so comparing values alone
could not fail here: the first test looks at the mechanism instead, every conversion to float8 that the
writers make being handed values already within +-448, which holds on any device and torch release.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.cache_ops import allocate_kv_cache, gathered, stored, to_fp8, write_kv, write_kv_hnd, hnd_rows
from kernels.flashinfer_backend import _Shape

FP8 = torch.float8_e4m3fn
LIMIT = 448.0


class Float8Conversions(TorchDispatchMode):
    """Records the largest magnitude handed to each aten conversion into float8."""

    def __init__(self) -> None:
        super().__init__()
        self.largest_inputs: list[float] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if (isinstance(out, torch.Tensor) and out.dtype == FP8 and source is not None
                and source.dtype != FP8 and source.is_floating_point()):
            self.largest_inputs.append(float(source.float().abs().max()))
        return out


def _rows(*values: float, head_dim: int = 16) -> torch.Tensor:
    """[len(values) tokens, 1 head, head_dim] bf16 rows, each filled with one value."""
    return torch.tensor(values, dtype=torch.bfloat16)[:, None, None].expand(-1, 1, head_dim).contiguous()


OUT_OF_RANGE = (1000.0, -1000.0, 470.0, -3.0e4)


def _writers() -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Each fp8 writer, applied to rows [T, 1, D]: what it leaves in the cache (as fp8 values)."""
    def nhd(rows: torch.Tensor) -> torch.Tensor:
        cache = allocate_kv_cache(1, 4, 16, 1, rows.shape[-1], FP8, "cpu", layout="NHD")[0]
        slots = torch.arange(rows.shape[0])
        write_kv(cache, rows, rows, slots)
        return cache[0, 0, : rows.shape[0]]

    def hnd(rows: torch.Tensor) -> torch.Tensor:
        cache = allocate_kv_cache(1, 4, 16, 1, rows.shape[-1], FP8, "cpu", layout="HND")[0]
        slots = torch.arange(rows.shape[0])
        write_kv_hnd(cache, rows, rows, *hnd_rows(slots, 1, 16))
        return cache[0, 1, 0, : rows.shape[0]]

    flashinfer_append = _Shape(4, 1, 16, "cpu", torch.bfloat16, FP8).appended
    return {"write_kv (NHD)": nhd, "write_kv_hnd": hnd, "stored": lambda rows: stored(rows, FP8).view(FP8),
            "FlashInfer append": flashinfer_append}


@pytest.mark.parametrize("writer", list(_writers()))
def test_every_conversion_to_fp8_gets_values_within_its_range(writer: str) -> None:
    rows = _rows(*OUT_OF_RANGE, 1.5)
    with Float8Conversions() as conversions:
        _writers()[writer](rows)
    assert conversions.largest_inputs, f"{writer} made no conversion to float8"
    assert max(conversions.largest_inputs) <= LIMIT, f"{writer} converted {max(conversions.largest_inputs)} unclamped"


@pytest.mark.parametrize("writer", list(_writers()))
def test_values_beyond_448_are_stored_as_448_of_their_sign(writer: str) -> None:
    written = _writers()[writer](_rows(*OUT_OF_RANGE, 1.5, 0.0)).float()
    assert not written.isnan().any()
    expected = torch.tensor([LIMIT, -LIMIT, LIMIT, -LIMIT, 1.5, 0.0])
    assert torch.equal(written.reshape(len(expected), -1)[:, 0], expected)


def test_to_fp8_keeps_in_range_values_and_nan() -> None:
    x = torch.tensor([0.0, 1.0, -2.5, 448.0, -448.0, 0.001953125, float("nan")])
    y = to_fp8(x).float()
    assert torch.equal(y[:-1], x[:-1].to(FP8).float())  # in range: torch's rounding, unchanged
    assert y[-1].isnan()  # a NaN input stays visible rather than turning into a plausible number


def test_a_saturated_cache_reads_back_finite() -> None:
    runs = stored(_rows(*OUT_OF_RANGE).reshape(-1, 16), FP8).view(FP8)
    back = gathered(runs, torch.arange(runs.shape[0]), torch.bfloat16)
    assert torch.isfinite(back.float()).all()
