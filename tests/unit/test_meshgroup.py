"""The replicas' fingerprint and its comparison, in one process (unit tier).

`wholebatch.comm.meshgroup` compares each replica's fingerprint of its rows with
its first replica's, up to round-off. Here the table is built from fingerprints of
tensors on this process: what must pass (the same rows, the same rows with
round-off, NaN alike, no rows) and what must not (other values, another order,
other row counts). The agreement itself runs on 4 gloo ranks in
tests/distributed/test_mesh_losses.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from wholebatch.comm.agree import Rows
from wholebatch.comm.meshgroup import _differs, _stats

STATS = ("rows", "eps", "sum", "abs", "sq", "pos")


def table(*xs: object) -> Rows:
    """A table of one fingerprinted tensor "x", one row per rank."""
    values = [[float(v) for v in _stats(x)] for x in xs]
    layout = {f"replica x {s}": (i, 1) for i, s in enumerate(STATS)}
    return Rows(torch.tensor(values, dtype=torch.float64), layout, None)


def base(dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(64, 8, generator=torch.Generator().manual_seed(0)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_same_rows_and_round_off_pass(dtype: torch.dtype) -> None:
    x = base(dtype)
    assert _differs(table(x, x.clone()), "replica", "x", 0, 1) is None
    if dtype != torch.bfloat16:
        # Every element one epsilon off, all the same way (the worst round-off): still the same.
        nudged = (x.double() * (1 + torch.finfo(dtype).eps)).to(dtype)
        assert _differs(table(x, nudged), "replica", "x", 0, 1) is None
    # bfloat16 (tolerance capped at 1e-4): a non-deterministic kernel's round-off, one ulp
    # either way on every element of a 512 x 256 block, still passes.
    gen = torch.Generator().manual_seed(2)
    y = torch.randn(512, 256, generator=gen).to(dtype)
    sign = torch.randint(0, 2, y.shape, generator=gen).double() * 2 - 1
    noisy = (y.double() * (1 + sign * torch.finfo(dtype).eps)).to(dtype)
    assert _differs(table(y, noisy), "replica", "x", 0, 1) is None


def test_other_values_another_order_and_other_rows_are_caught() -> None:
    x = base()
    assert _differs(table(x, x + 0.01), "replica", "x", 0, 1) == "sum"
    assert _differs(table(x, x.flip(0)), "replica", "x", 0, 1) == "pos"  # same values
    assert _differs(table(x, x[:-1]), "replica", "x", 0, 1) == "rows"
    # bfloat16: its epsilon (8e-3) would hide this; the tolerance is capped at 1e-4.
    y = base(torch.bfloat16)
    other = torch.randn(64, 8, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert _differs(table(y, other), "replica", "x", 0, 1) is not None


def test_nan_alike_no_rows_and_lists_of_parts() -> None:
    x = base()
    x[3, 2] = float("nan")
    assert _differs(table(x, x.clone()), "replica", "x", 0, 1) is None
    assert _differs(table(x, base()), "replica", "x", 0, 1) is not None  # NaN on one only
    empty = torch.zeros(0, 8)
    assert _differs(table(empty, empty.clone()), "replica", "x", 0, 1) is None
    assert _differs(table(None, None), "replica", "x", 0, 1) is None  # absent alike
    # A list (micro-batches' outputs) sums its parts; swapping two parts is caught.
    a, b = base()[:5], base()[5:9]
    assert _differs(table([a, b], [a, b]), "replica", "x", 0, 1) is None
    assert _differs(table([a, b], [b, a]), "replica", "x", 0, 1) is not None
