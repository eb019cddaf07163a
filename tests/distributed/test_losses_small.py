"""The small-batch path (losses/replicated.py) on real gloo ranks: its collectives, its agreement, its limit.

Its exactness against one process on the whole batch (every loss, every option,
uneven rows, an empty rank, both gradient reductions, sizes= with the checks
off) is checked with the tiled forms' own assertions in test_losses.py and
test_info_nce.py (their "small" cases). Here:

- the collectives per call: 1 forward (the exchange carrying the rows) and 1
  backward (the upstream gradient's mean) with the checks on; the same with
  `sizes=` and `check=False`; the tiled forms' counts are larger, so the count
  can fail;
- ranks back-propagating L with different upstream gradients (a per-rank
  weight) get the tiled forms' gradients: each rank's rows receive every rank's
  upstream gradient;
- with the checks off and ranks passing different scalars or reductions, the
  small path computes what the tiled forms' agreement does (the maximum, its
  gradient split among ties), value and every gradient;
- ranks with different row limits (`sizing.set_small_rows`) take the same path
  (the smallest limit rides in the exchange): no hang, the right loss;
- a mutation (the convention's scaling dropped) is rejected by the same check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from tests.distributed.test_losses import SCALARS, check_loss
from tests.support.harness import run_ranks
from tests.support.plan_counting import Counter, count_collectives
from wholebatch.comm.groups import get_rank
from wholebatch.losses import clip_loss, info_nce_loss, nt_xent_loss, room, siglip_loss
from wholebatch.losses.sizing import carry_bytes, using_small_rows

# float64 round-off of sums of a few dozen terms; every mutation is off by >= 1.5x.
F64: dict[str, float] = dict(rtol=1e-10, atol=1e-10)
SIZES = [2, 0, 3]
D = 3


def _hard(q: Tensor, d: Tensor, s: Any, **kw: Any) -> Tensor:
    """info_nce_loss with 2 hard negatives per query (derived from the documents) and every direction."""
    negs = torch.stack([d.flip(1), d * 0.5], 1)
    dirs = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
    return info_nce_loss(q, d, s, negatives_BKD=negs, directions=dirs, **kw)


LOSSES: dict[str, tuple[Callable[..., Tensor], list[float]]] = {
    "clip": (clip_loss, SCALARS["clip"]),
    "clip+bias": (lambda i, t, s, **kw: clip_loss(i, t, s, logit_bias=-1.5, **kw), SCALARS["clip"]),
    "siglip": (siglip_loss, SCALARS["siglip"]),
    "nt_xent": (nt_xent_loss, SCALARS["nt_xent"]),
    "info_nce": (_hard, [2.5]),
}


def _tensors(b: int, seed: int, dim: int = D) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, dim, generator=gen, dtype=torch.float64) * 0.7
    y = torch.randn(b, dim, generator=gen, dtype=torch.float64) * 0.7
    return x.requires_grad_(), y.requires_grad_()


def _step(
    name: str,
    small: int | None,
    scalars: list[float],
    dim: int = D,
    weight: float = 1.0,
    **kw: Any,
) -> dict[str, Any]:
    """One forward + backward of `name` on this rank (of `weight` x the loss): value,
    gradients, c10d calls per phase."""
    r = get_rank()
    room.forget()  # the first call on the group: the exchange's room is sizing.carry_bytes(W)
    x, y = _tensors(SIZES[r], 10 + r, dim)
    sc = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in scalars]
    fn = LOSSES[name][0]
    fwd, bwd = Counter(), Counter()
    with using_small_rows(small):
        with count_collectives(fwd):
            loss = fn(x, y, *sc, tile_size=2, **kw)
        with count_collectives(bwd):
            (weight * loss).backward()
    return {
        "value": loss.detach(), "grads": [x.grad, y.grad, *[s.grad for s in sc]],
        "calls": (fwd.calls, bwd.calls),
    }  # fmt: skip


def _counts(name: str, small: int | None, known: bool, dim: int = D) -> tuple[int, int]:
    kw: dict[str, Any] = dict(sizes=SIZES, check=False) if known else {}
    return _step(name, small, LOSSES[name][1], dim, **kw)["calls"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", list(LOSSES))
def test_collectives_per_call(name: str) -> None:
    # W = 3, rows [2, 0, 3]: every rank, the empty one included, makes the same calls:
    # one (the exchange carries the rows; or, without it, the rows carry the agreement).
    for known in (False, True):
        got = run_ranks(3, _counts, name, None, known)
        assert got == [(1, 1)] * 3, (known, got)
        tiled = run_ranks(3, _counts, name, 0, known)[0]
        assert tiled[0] > 1 and tiled[1] > 1, tiled  # the count can fail


def _both_paths_dim(name: str, dim: int) -> list[dict[str, Any]]:
    return [_step(name, small, LOSSES[name][1], dim) for small in (None, 0)]


def test_rows_past_the_exchange_room_take_one_more_all_gather() -> None:
    # 3 rows x 2 x 6,000 float64 = 288,000 bytes > sizing.carry_bytes(3) (131,072):
    # the exchange's room is not enough and one all-gather moves the rows.
    assert carry_bytes(3) < 3 * 2 * 6000 * 8
    assert run_ranks(3, _counts, "clip", None, False, 6000) == [(2, 1)] * 3
    for small, tiled in run_ranks(3, _both_paths_dim, "clip", 6000):
        torch.testing.assert_close(small["value"], tiled["value"], **F64)
        for a, b in zip(small["grads"], tiled["grads"], strict=True):
            torch.testing.assert_close(a, b, **F64)


def _both_paths(name: str, per_rank: dict[str, Any]) -> list[dict[str, Any]]:
    """The small path and the tiled forms on this rank's own arguments (checks off)."""
    r = get_rank()
    scalars = per_rank["scalars"][r]
    kw = dict(sizes=SIZES, check=False, grad_reduction=per_rank["reduction"][r])
    return [_step(name, small, scalars, **kw) for small in (None, 0)]


@pytest.mark.parametrize("name", ["clip", "siglip", "nt_xent", "info_nce"])
@pytest.mark.parametrize("case", ["scalar differs", "tie of two", "reductions differ"])
def test_agreement_without_checks_is_the_tiled_forms(name: str, case: str) -> None:
    # The caller broke its promise (checks off): every rank still computes with the
    # same values, and each rank's gradients are what the tiled forms' all-reduce
    # (max) agreement gives, the maximum's gradient split among the ranks holding it.
    base = LOSSES[name][1]
    scalars = [list(base) for _ in SIZES]
    reduction = ["mean"] * 3
    if case == "scalar differs":
        scalars[2][0] += 0.5
    elif case == "tie of two":
        scalars[0][0] += 0.5
        scalars[2][0] += 0.5
    else:
        reduction[1] = "sum"
    got = run_ranks(3, _both_paths, name, {"scalars": scalars, "reduction": reduction})
    for r, (small, tiled) in enumerate(got):
        torch.testing.assert_close(small["value"], tiled["value"], **F64, msg=f"rank {r} value")
        for i, (a, b) in enumerate(zip(small["grads"], tiled["grads"], strict=True)):
            torch.testing.assert_close(
                a, b, **F64, msg=lambda m, r=r, i=i: f"rank {r} grad {i}: {m}"
            )
        assert small["calls"] == (1, 1) and tiled["calls"][1] > 1, (small["calls"], tiled["calls"])


def _weighted_both_paths(name: str) -> list[dict[str, Any]]:
    weight = [1.0, 3.0, -0.5][get_rank()]
    return [_step(name, small, LOSSES[name][1], weight=weight) for small in (None, 0)]


@pytest.mark.parametrize("name", list(LOSSES))
def test_upstream_gradients_differing_across_ranks_are_the_tiled_forms(name: str) -> None:
    # Each rank back-propagates its own multiple of L (1, 3, -0.5): the tiled forms'
    # whole-batch sum gives each rank's rows every rank's upstream gradient, and so
    # does the small path's agreed upstream (without it, each rank's rows would get W
    # times its own weight instead of the sum of the three: the mutation fails here).
    for r, (small, tiled) in enumerate(run_ranks(3, _weighted_both_paths, name)):
        for i, (a, b) in enumerate(zip(small["grads"], tiled["grads"], strict=True)):
            torch.testing.assert_close(
                a, b, **F64, msg=lambda m, r=r, i=i: f"rank {r} grad {i}: {m}"
            )


def _mixed_limits(name: str) -> dict[str, Any]:
    # rank 1 turns the small path off; the others keep the default: the smallest wins
    return _step(name, 0 if get_rank() == 1 else None, LOSSES[name][1])


@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_row_limits_differing_across_ranks_take_one_path(name: str) -> None:
    got = run_ranks(3, _mixed_limits, name, timeout=60)
    tiled = run_ranks(3, _counts, name, 0, False)
    assert [g["calls"] for g in got] == tiled  # every rank took the tiled form
    assert len({float(g["value"]) for g in got}) == 1


def test_mutation_unscaled_small_path_is_caught() -> None:
    # The small path with the convention's scaling dropped (each rank the gradient of
    # L through its own rows only: W times too small under DDP's mean) is rejected.
    check_loss("clip", "clip", SIZES)  # the real small path passes the same check
    with pytest.raises(AssertionError, match="grad"):
        check_loss("clip_small_unscaled", "clip", SIZES)


def _rows_copied(dim: int) -> int:
    """How many times this rank's rows were copied into the exchange's room."""
    import wholebatch.comm.agree as agree

    calls = []
    original = agree._with_carry

    def counted(mine_F: Tensor, carry: Any, carry_bytes: int) -> Tensor:
        calls.extend([1] if carry else [])
        return original(mine_F, carry, carry_bytes)

    agree._with_carry = counted  # type: ignore[assignment]
    try:
        _step("clip", None, LOSSES["clip"][1], dim)
    finally:
        agree._with_carry = original  # type: ignore[assignment]
    return len(calls)


def test_rows_are_copied_for_the_room_only_when_they_fit() -> None:
    # A batch past the room never has its rows copied (a large batch's B x D copy per call).
    assert run_ranks(3, _rows_copied, D) == [1, 1, 1]
    # (rank 1 holds no rows: its empty rows always fit)
    assert run_ranks(3, _rows_copied, 6000) == [0, 1, 0]


def _room_sequence(dims: list[int]) -> list[tuple[int, int, int]]:
    """(forward c10d calls, bytes received in the forward, the room after) per clip call of
    this rank, one call per dim in `dims`, from a fresh history; each call checked against
    the tiled forms."""
    room.forget()
    out = []
    for dim in dims:
        r = get_rank()
        x, y = _tensors(SIZES[r], 10 + r, dim)
        s = torch.tensor(LOSSES["clip"][1][0], dtype=torch.float64, requires_grad=True)
        fwd = Counter()
        with count_collectives(fwd):
            loss = clip_loss(x, y, s)
        loss.backward()
        with using_small_rows(0):
            xt, yt = _tensors(SIZES[r], 10 + r, dim)
            st = torch.tensor(LOSSES["clip"][1][0], dtype=torch.float64, requires_grad=True)
            tiled = clip_loss(xt, yt, st)
            tiled.backward()
        torch.testing.assert_close(loss.detach(), tiled.detach(), **F64)
        for a, b in ((x.grad, xt.grad), (y.grad, yt.grad), (s.grad, st.grad)):
            torch.testing.assert_close(a, b, **F64)
        out.append((fwd.calls, fwd.totals()[1], room.room(None, 3)))
    return out


def test_the_exchange_room_is_fitted_to_the_last_calls() -> None:
    # W = 3, rows [2, 0, 3] of two float64 towers. The first call's room is carry_bytes(3);
    # then the room fits the largest rank's rows (3 x 2 x D x 8 bytes, to a power of two,
    # at least 1 KiB). A call past the cap (D = 6,000) takes one more all-gather and keeps
    # the small calls' room. Every rank the same calls and rooms; values exact.
    got = run_ranks(3, _room_sequence, [3, 3, 6000, 3, 3])
    assert [[(c, r) for c, _, r in g] for g in got] == [[(c, r) for c, _, r in got[0]]] * 3
    calls = [c for c, _, _ in got[0]]
    rooms = [r for _, _, r in got[0]]
    assert calls == [1, 1, 2, 1, 1], calls
    small = 1024  # 3 x 2 x 3 x 8 = 144 bytes: the floor
    assert rooms == [small, small, small, small, small], rooms  # the small calls keep it
    received = [b for _, b, _ in got[0]]
    row = 11 * 8  # clip's exchange row
    assert received[0] == 2 * (row + carry_bytes(3))
    assert received[1] == 2 * (row + small)


def _after_large(dims: list[int]) -> list[tuple[int, int, int]]:
    room.forget()
    with using_small_rows(10**6):  # the small path even at D = 6,000
        return _room_sequence_kept(dims)


def _room_sequence_kept(dims: list[int]) -> list[tuple[int, int, int]]:
    out = []
    for dim in dims:
        r = get_rank()
        x, y = _tensors(SIZES[r], 10 + r, dim)
        fwd = Counter()
        with count_collectives(fwd):
            clip_loss(x, y, torch.tensor(2.0, dtype=torch.float64)).backward()
        out.append((fwd.calls, fwd.totals()[1], room.room(None, 3)))
    return out


def test_a_large_call_alone_leaves_no_room() -> None:
    # Only large calls in the history: no room (nothing zero-filled or sent for nothing).
    got = run_ranks(3, _after_large, [6000, 6000, 3, 3])
    assert [[(c, r) for c, _, r in g] for g in got] == [[(c, r) for c, _, r in got[0]]] * 3
    # forward + backward: the first small call's rows are not carried (one more all-gather)
    assert [c for c, _, _ in got[0]] == [3, 3, 3, 2]
    assert [r for _, _, r in got[0]] == [0, 0, 1024, 1024]
    assert got[0][1][1] < got[0][0][1]  # the second large call sends no room
