"""`comm.direct.gather_flat`, the raw all-gather under the exchange and `all_gather`, on gloo.

Every rank's bytes differ (`arange + 1000 * rank`), sizes are uneven with empty
ranks, and the result is compared with what c10d's own collectives give on the
same inputs; a user's own point-to-point message in flight across the call
(c10d's default tag) must neither be taken by it nor take its bytes.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.support.harness import run_ranks
from wholebatch.comm import direct


def _mine(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float64) + 1000 * rank).to(dtype)


def _rank_gather(sizes: list[int], dtype: torch.dtype, async_op: bool) -> bool:
    r, w = dist.get_rank(), dist.get_world_size()
    x = _mine(r, sizes[r], dtype)
    out = torch.full((sum(sizes),), -1, dtype=dtype)
    work = direct.gather_flat(out, x, sizes, None, async_op=async_op)
    if async_op:
        assert work is not None
        work.wait()
    # c10d's all-gather of the same bytes, padded to the largest rank: the reference
    pad = max(sizes)
    padded = torch.zeros(pad, dtype=dtype)
    padded[: sizes[r]] = x
    parts = [torch.empty(pad, dtype=dtype) for _ in range(w)]
    dist.all_gather(parts, padded)
    want = torch.cat([p[:q] for p, q in zip(parts, sizes, strict=True)])
    return torch.equal(out, want)


@pytest.mark.parametrize(
    ("sizes", "dtype", "async_op"),
    [
        ([4, 4, 4], torch.uint8, True),
        ([5, 0, 3], torch.float64, False),
        ([0, 7, 1, 2], torch.float32, True),
        ([3, 3], torch.int64, False),
    ],
)
def test_gather_flat_equals_c10d(sizes: list[int], dtype: torch.dtype, async_op: bool) -> None:
    assert run_ranks(len(sizes), _rank_gather, sizes, dtype, async_op) == [True] * len(sizes)


def _rank_user_message() -> list[float]:
    """Ranks 0 and 1 exchange a message of their own (tag 0) around a gather_flat."""
    r = dist.get_rank()
    got = torch.zeros(3, dtype=torch.float64)
    pending = dist.irecv(got, 1 - r) if r < 2 else None  # posted before, received after
    out = torch.empty(3 * 4, dtype=torch.float64)
    direct.gather_flat(out, _mine(r, 4, torch.float64), [4, 4, 4], None)
    if r < 2:
        dist.isend(torch.full((3,), 7.0 + r, dtype=torch.float64), 1 - r).wait()
        assert pending is not None
        pending.wait()
    want = torch.cat([_mine(q, 4, torch.float64) for q in range(3)])
    assert torch.equal(out, want), out
    return got.tolist()


def test_a_user_message_in_flight_is_neither_taken_nor_mixed_in() -> None:
    got = run_ranks(3, _rank_user_message)
    assert got[0] == [8.0] * 3 and got[1] == [7.0] * 3 and got[2] == [0.0] * 3


def _rank_subgroup() -> bool | None:
    """On the group of global ranks [0, 2]: group ranks map to the right peers."""
    r = dist.get_rank()
    sub = dist.new_group([0, 2])
    if r == 1:
        return None
    mine = dist.get_rank(sub)
    out = torch.empty(5, dtype=torch.float64)
    direct.gather_flat(out, _mine(r, [2, 3][mine], torch.float64), [2, 3], sub)
    return torch.equal(out, torch.cat([_mine(0, 2, torch.float64), _mine(2, 3, torch.float64)]))


def test_gather_flat_on_a_subgroup() -> None:
    assert run_ranks(3, _rank_subgroup) == [True, None, True]


def _rank_expected(carry_rows: int) -> tuple[bool, bool]:
    """`expect_rows` posted before the row exists, then `start_rows(expected=...)`: the
    same table and carried bytes as `agree_rows`; a row of another length is refused."""
    from wholebatch.comm.agree import agree_rows, expect_rows, start_rows

    r = dist.get_rank()
    row = {"rank": float(r), "rows": carry_rows + r, "scale": torch.tensor(2.5 + r)}
    carry = [torch.arange((carry_rows + r) * 3, dtype=torch.float32).reshape(-1, 3) + 100 * r]
    room = 4 * 3 * (carry_rows + 2)
    expected = expect_rows(3, carry_bytes=room)
    early = start_rows(row, carry=carry, carry_bytes=room, expected=expected).wait()
    plain = agree_rows(row, carry=carry, carry_bytes=room)
    assert early.carried_WC is not None and plain.carried_WC is not None
    same = early["scale"] == plain["scale"] and torch.equal(early.carried_WC, plain.carried_WC)
    refused = False
    wrong = expect_rows(2)
    try:
        start_rows(row, expected=wrong)
    except ValueError:
        refused = True
        assert wrong is not None
        wrong.send(torch.zeros(2, dtype=torch.float64))  # complete the posted receives
    return bool(same), refused


def test_receives_posted_before_the_row() -> None:
    assert run_ranks(3, _rank_expected, 2) == [(True, True)] * 3
