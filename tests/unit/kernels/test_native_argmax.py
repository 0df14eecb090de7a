"""The C argmax (kernels/native/argmax.py) against torch.argmax: the first maximum of each row, a NaN
counting as the maximum, -0 equal to +0, in bfloat16 and float32, on contiguous and strided rows."""

from __future__ import annotations

import pytest
import torch

from kernels.native import lib as native_lib
from kernels.native.argmax import argmax_rows

pytestmark = pytest.mark.skipif(native_lib.load() is None, reason="no C kernels here (torch's argmax serves)")


def rows_of(kind: str, rows: int, n: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, n, generator=gen) * 10
    if kind == "ties":
        return x.round()  # many equal maxima: the first must win
    if kind == "special":
        picks = torch.randint(0, rows * n, (2 * rows,), generator=gen)
        values = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0])
        x.view(-1)[picks] = values[torch.randint(0, 5, (2 * rows,), generator=gen)]
        return x
    if kind == "all -inf":
        return torch.full((rows, n), float("-inf"))
    if kind == "signed zeros":  # the maximum is 0, some of its copies negative
        x = -x.abs()
        x[:, ::3] = -0.0
        x[:, 1::7] = 0.0
        return x
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["random", "ties", "special", "all -inf", "signed zeros"])
def test_matches_torch(dtype: torch.dtype, kind: str) -> None:
    gen = torch.Generator().manual_seed(sum(map(ord, kind)))
    for rows, n in [(1, 1), (1, 257), (3, 256), (7, 1000), (33, 49152 // 16), (64, 5)]:
        x = rows_of(kind, rows, n, gen).to(dtype)
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1)), (rows, n)
        strided = torch.cat([x, x.flip(1)], dim=1)[:, :n]  # rows whose stride is not n
        assert torch.equal(argmax_rows(strided), strided.argmax(dim=-1)), (rows, n)


def test_zero_rows_and_fallbacks() -> None:
    assert argmax_rows(torch.empty(0, 10)).shape == (0,)
    half = torch.randn(4, 9).half()  # no C kernel for float16: torch's
    assert torch.equal(argmax_rows(half), half.argmax(dim=-1))
    columns = torch.randn(9, 4).t()  # elements not contiguous: torch's
    assert torch.equal(argmax_rows(columns), columns.argmax(dim=-1))
