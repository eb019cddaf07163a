"""Debug mode names the rank that never arrives, and the ranks that diverged, on every rank."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import wholebatch as wb
from tests.support.harness import RankError, run_ranks, run_ranks_outcomes


def _with_debug(body_name: str, skipper: int) -> object:
    # A fresh group per test: its own sequence numbers and store keys.
    group = dist.new_group()
    wb.set_debug(True, timeout_s=3)
    try:
        return globals()[body_name](group, skipper)
    finally:
        wb.set_debug(None)


def _skip_then_return(group: dist.ProcessGroup, skipper: int) -> None:
    x = torch.ones(2, 3)
    wb.all_reduce(x, group=group)
    if dist.get_rank() == skipper:
        return  # a rank-local early return: it never joins the all_gather below
    wb.all_gather(x, group=group)


def _skip_then_other_op(group: dist.ProcessGroup, skipper: int) -> None:
    x = torch.ones(2, 3)
    if dist.get_rank() != skipper:
        wb.all_gather(x, group=group)
    wb.all_reduce(x, group=group)


def _skip_backward(group: dist.ProcessGroup, skipper: int) -> None:
    x = torch.ones(2, 3, requires_grad=True)
    y = wb.all_gather(x, group=group)
    if dist.get_rank() != skipper:
        y.sum().backward()


def _clean_run(group: dist.ProcessGroup, skipper: int) -> list[float]:
    x = torch.tensor([1.0 + dist.get_rank()], requires_grad=True)
    y = wb.all_gather(x, group=group)
    (y * (1 + dist.get_rank())).sum().backward()
    assert x.grad is not None
    return x.grad.tolist()


def test_a_rank_that_never_arrives_is_named() -> None:
    start = time.monotonic()
    outs = run_ranks_outcomes(3, _with_debug, "_skip_then_return", 1, timeout=40)
    assert time.monotonic() - start < 20
    assert outs[1] is None
    for r in (0, 2):
        err = outs[r]
        assert isinstance(err, RankError) and err.type_name == "WholebatchError", err
        assert "all_gather #2 at test_debug.py:" in err.message
        assert "in _skip_then_return: rank(s) [1] did not arrive within 3 s" in err.message
        assert (
            "rank 1: #1 all_reduce at test_debug.py:" in err.message
        )  # where rank 1 was last seen


def test_ranks_in_different_ops_are_named_on_every_rank() -> None:
    outs = run_ranks_outcomes(3, _with_debug, "_skip_then_other_op", 1, timeout=40)
    assert all(isinstance(o, RankError) for o in outs), outs
    messages = {o.message for o in outs}
    assert len(messages) == 1, messages
    (msg,) = messages
    assert msg.startswith(
        "wholebatch op #1: ranks are in different collectives (rank 0: all_gather at test_debug.py:"
    )
    assert "rank 1: all_reduce at test_debug.py:" in msg


def test_a_skipped_backward_is_named() -> None:
    outs = run_ranks_outcomes(2, _with_debug, "_skip_backward", 1, timeout=40)
    assert outs[1] is None
    err = outs[0]
    assert isinstance(err, RankError)
    assert "all_gather backward #2" in err.message and "rank(s) [1] did not arrive" in err.message


def test_debug_mode_does_not_change_results() -> None:
    assert run_ranks(3, _with_debug, "_clean_run", 0) == [[6.0], [6.0], [6.0]]


def test_debug_setting(monkeypatch: object) -> None:
    assert wb.debug_enabled() is False
    wb.set_debug(True)
    try:
        assert wb.debug_enabled() is True
        # a world of one never checks in
        assert torch.equal(wb.all_gather(torch.ones(2)), torch.ones(2))
    finally:
        wb.set_debug(None)
