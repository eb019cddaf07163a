"""The small-batch path (losses/small.py) on real gloo ranks: its collectives, its agreement, its limit.

Its exactness against one process on the whole batch (every loss, every option,
uneven rows, an empty rank, both gradient reductions, sizes= with the checks
off) is checked with the tiled forms' own assertions in test_losses.py and
test_info_nce.py (their "small" cases). Here:

- the collectives per call: 2 forward (the exchange, then the rows) and 1
  backward (the upstream gradient's mean) with the checks on; 1 + 1 with
  `sizes=` and `check=False`; the tiled forms' counts are larger, so the count
  can fail;
- a call's collectives and bytes depend on its own arguments only, never on the
  calls before it;
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
from wholebatch.losses import clip_loss, info_nce_loss, nt_xent_loss, siglip_loss
from wholebatch.losses.sizing import using_small_rows
from wholebatch.losses.specs import SPECS, exchange_fields

EXCHANGE = exchange_fields(SPECS["clip"])
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
        "calls": (fwd.calls, bwd.calls), "bytes": (fwd.totals(), bwd.totals()),
    }  # fmt: skip


def _counts(name: str, small: int | None, known: bool, dim: int = D) -> tuple[int, int]:
    kw: dict[str, Any] = dict(sizes=SIZES, check=False) if known else {}
    return _step(name, small, LOSSES[name][1], dim, **kw)["calls"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", list(LOSSES))
def test_collectives_per_call(name: str) -> None:
    # W = 3, rows [2, 0, 3]: every rank, the empty one included, makes the same calls:
    # the exchange and the rows (without the exchange, the rows carry the agreement).
    for known, want in ((False, (2, 1)), (True, (1, 1))):
        got = run_ranks(3, _counts, name, None, known)
        assert got == [want] * 3, (known, got)
        tiled = run_ranks(3, _counts, name, 0, known)[0]
        assert tiled[0] > want[0] and tiled[1] > 1, tiled  # the count can fail


def _sequence(dims: list[int]) -> list[tuple[Any, ...]]:
    """(calls, bytes) of one clip call per dim in `dims`, in that order, on this rank."""
    return [(got["calls"], got["bytes"]) for got in (_step("clip", None, [2.5], d) for d in dims)]


def test_a_calls_collectives_and_bytes_do_not_depend_on_earlier_calls() -> None:
    # The same small call (D = 3) alone, after small calls, and after large ones (D =
    # 6,000: 288 kB of rows per rank), each path: identical calls and bytes every time.
    # (A room for rows sized from the group's last calls failed this: its bytes moved.)
    alone = run_ranks(3, _sequence, [3])
    after = run_ranks(3, _sequence, [6000, 3, 3, 6000, 6000, 3])
    for r in range(3):
        small = [x for x, d in zip(after[r], [6000, 3, 3, 6000, 6000, 3], strict=True) if d == 3]
        large = [x for x, d in zip(after[r], [6000, 3, 3, 6000, 6000, 3], strict=True) if d > 3]
        assert small == [alone[r][0]] * 3, (r, small, alone[r])
        assert len(set(large)) == 1, (r, large)
        ((calls, (fwd, _)),) = alone[r]
        assert calls == (2, 1) and fwd[1] == 2 * 8 * len(EXCHANGE) + (5 - SIZES[r]) * 2 * 3 * 8


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
