"""The multi-process harness itself: results, errors and hangs come back as they should."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.support.harness import RankError, RankFailure, RankTimeout, run_ranks, run_ranks_outcomes


def _rank_and_sum(offset: int) -> tuple[int, int, float]:
    t = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), float(t.item())


def _raise_on_rank(bad: int) -> int:
    if dist.get_rank() == bad:
        raise ValueError(f"rank {bad} says no")
    return dist.get_rank()


def _skip_collective_on_rank(bad: int) -> None:
    group = dist.new_group(timeout=timedelta(seconds=3))
    if dist.get_rank() != bad:
        dist.all_reduce(torch.ones(1), group=group)  # rank `bad` never joins: the others wait


def _sleep_on_rank(bad: int) -> None:
    if dist.get_rank() == bad:
        time.sleep(30)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_rank_answers(world_size: int) -> None:
    outs = run_ranks(world_size, _rank_and_sum, 10)
    total = sum(r + 10 for r in range(world_size))
    assert outs == [(r, world_size, float(total)) for r in range(world_size)]


def test_an_error_comes_back_with_its_traceback() -> None:
    outs = run_ranks_outcomes(2, _raise_on_rank, 1)
    assert outs[0] == 0
    assert isinstance(outs[1], RankError)
    assert outs[1].type_name == "ValueError" and "rank 1 says no" in outs[1].traceback
    with pytest.raises(RankFailure, match="rank 0 says no"):
        run_ranks(2, _raise_on_rank, 0)


def test_a_skipped_collective_fails_fast_and_the_world_recovers() -> None:
    start = time.monotonic()
    outs = run_ranks_outcomes(2, _skip_collective_on_rank, 1, timeout=30)
    assert outs[1] is None
    assert isinstance(outs[0], RankError)  # gloo's own (short) timeout, not a hang
    assert time.monotonic() - start < 30
    assert run_ranks(2, _rank_and_sum, 0) == [(0, 2, 1.0), (1, 2, 1.0)]


def test_a_hung_rank_is_named_with_its_stack() -> None:
    with pytest.raises(RankTimeout) as info:
        run_ranks(2, _sleep_on_rank, 1, timeout=3)
    text = str(info.value)
    assert "ranks [1] did not answer" in text
    assert "_sleep_on_rank" in text  # the stack shows where rank 1 was
    assert run_ranks(2, _rank_and_sum, 0) == [(0, 2, 1.0), (1, 2, 1.0)]
