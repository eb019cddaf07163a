"""Bad input: the same clear error on every rank, before any data moves, within seconds."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

import wholebatch as wb
from tests.support.harness import RankError, run_ranks, run_ranks_outcomes


def _shape_mismatch() -> None:
    r = dist.get_rank()
    wb.all_gather(torch.zeros(8, 16 * (1 + r)))


def _dtype_mismatch() -> None:
    r = dist.get_rank()
    wb.all_gather(torch.zeros(4, 2, dtype=torch.float32 if r == 0 else torch.float64))


def _device_mismatch() -> None:
    # `meta` is the one non-CPU device every machine has; the check fires before any data moves.
    r = dist.get_rank()
    wb.all_gather(torch.zeros(4, 2, device="cpu" if r == 0 else "meta"))


def _different_ops() -> None:
    x = torch.zeros(2, 2)
    if dist.get_rank() == 0:
        wb.all_gather(x)
    else:
        wb.all_reduce(x)


def _dim_out_of_range_on_one_rank() -> None:
    r = dist.get_rank()
    x = torch.zeros(2, 3) if r == 0 else torch.zeros(2)
    wb.all_gather(x, dim=1)


def _bad_sizes_on_one_rank() -> None:
    r = dist.get_rank()
    sizes = [2, 2, 2] if r != 1 else [2, 5, 2]
    wb.all_gather(torch.zeros(2, 3), sizes=sizes)


def _reduce_scatter_shape_mismatch() -> None:
    wb.reduce_scatter(torch.zeros(6 + 3 * dist.get_rank(), 2))


def _reduce_scatter_indivisible() -> None:
    wb.reduce_scatter(torch.zeros(7, 2))


def _all_to_all_recv_mismatch() -> None:
    r = dist.get_rank()
    recv = [1, 1, 1] if r != 2 else [1, 1, 2]
    wb.all_to_all(torch.zeros(3, 2), [1, 1, 1], recv)


def _all_reduce_op_mismatch() -> None:
    wb.all_reduce(torch.zeros(2), "sum" if dist.get_rank() == 0 else "max")


def _broadcast_src_out_of_range() -> None:
    wb.broadcast(torch.zeros(2), src=5 if dist.get_rank() == 2 else 0)


def _ring_shift_mismatch() -> None:
    wb.ring_shift(torch.zeros(2, 3), shift=1 + dist.get_rank())


def _wire_dtype_mismatch() -> None:
    wb.all_gather(torch.zeros(2, 3), wire_dtype=torch.bfloat16 if dist.get_rank() else None)


CASES: list[tuple[Callable[[], None], type[Exception], str]] = [
    (
        _shape_mismatch,
        wb.WholebatchError,
        "all_gather: shapes other than dim=0 differ across ranks {0: (16,), 1: (32,), 2: (48,)}",
    ),
    (
        _dtype_mismatch,
        wb.WholebatchTypeError,
        "all_gather: dtypes differ across ranks {0: float32, 1: float64, 2: float64}",
    ),
    (
        _device_mismatch,
        wb.WholebatchTypeError,
        "all_gather: device types differ across ranks {0: cpu, 1: meta, 2: meta}",
    ),
    (
        _different_ops,
        wb.WholebatchError,
        "ranks called different collectives {0: all_gather, 1: all_reduce, 2: all_reduce}",
    ),
    (
        _dim_out_of_range_on_one_rank,
        wb.WholebatchError,
        "all_gather: dim=1 is out of range for a 1-d tensor of shape (2,) (on ranks [1, 2])",
    ),
    (
        _bad_sizes_on_one_rank,
        wb.WholebatchError,
        "all_gather: sizes[1]=5 but this rank's input has 2",
    ),
    (
        _reduce_scatter_shape_mismatch,
        wb.WholebatchError,
        "reduce_scatter: shapes differ across ranks",
    ),
    (
        _reduce_scatter_indivisible,
        wb.WholebatchError,
        "x.shape[0]=7 does not split evenly over 3 ranks",
    ),
    (
        _all_to_all_recv_mismatch,
        wb.WholebatchError,
        "all_to_all: rank 2 expects recv_sizes=[1, 1, 2]",
    ),
    (_all_reduce_op_mismatch, wb.WholebatchError, "all_reduce: op differs across ranks"),
    (
        _broadcast_src_out_of_range,
        wb.WholebatchError,
        "broadcast: src=5 is not a rank of this 3-rank group",
    ),
    (_ring_shift_mismatch, wb.WholebatchError, "ring_shift: shift (mod W) differs across ranks"),
    (
        _wire_dtype_mismatch,
        wb.WholebatchError,
        "all_gather: wire_dtype differs across ranks {0: None, 1: bfloat16",
    ),
]


@pytest.mark.parametrize("fn,exc,text", CASES, ids=[c[0].__name__.strip("_") for c in CASES])
def test_same_error_on_every_rank(fn: Callable[[], None], exc: type[Exception], text: str) -> None:
    start = time.monotonic()
    outcomes = run_ranks_outcomes(3, fn, timeout=30)
    assert time.monotonic() - start < 10, "the error must come from the check, not a timeout"
    assert all(isinstance(o, RankError) for o in outcomes), outcomes
    messages = {o.message for o in outcomes}
    assert len(messages) == 1, f"ranks disagree: {messages}"
    (message,) = messages
    assert text in message
    assert {o.type_name for o in outcomes} == {exc.__name__}


def _after_an_error_the_group_still_works() -> list[float]:
    with contextlib.suppress(wb.WholebatchError):
        _shape_mismatch()
    return wb.all_gather(torch.tensor([float(dist.get_rank())])).tolist()


def test_group_is_usable_after_a_caught_error() -> None:
    assert run_ranks(3, _after_an_error_the_group_still_works) == [[0.0, 1.0, 2.0]] * 3


def test_errors_are_value_and_type_errors() -> None:
    assert issubclass(wb.WholebatchError, ValueError)
    assert issubclass(wb.WholebatchTypeError, TypeError)
    assert issubclass(wb.WholebatchTypeError, wb.WholebatchError)


def test_checks_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert wb.checks_enabled() is True
    monkeypatch.setenv("WHOLEBATCH_CHECKS", "0")
    assert wb.checks_enabled() is False
    assert wb.checks_enabled(True) is True
    wb.set_checks(True)
    try:
        assert wb.checks_enabled() is True
    finally:
        wb.set_checks(None)
    assert wb.checks_enabled() is False
