"""Every whole-batch loss, from its spec, against its one-process reference on real gloo ranks.

The losses are iterated from `wholebatch.losses.specs.SPECS`: a new loss is
checked here with no line added, and a spec without an independent reference
(`tests/support/loss_refs.py`) fails. Per loss, on W = 3 ranks with rows [2, 0, 3]
(uneven, an empty rank) and ragged token sets, float64, each rank with its own
tile size (3, 2, 5) and back-propagating its own multiple of L (1, 2, 3):

- every path it has: the small path, gather, ring (where its spec offers them),
  both gradient reductions, `sizes=` with `check=False`, its extras (ids, hard
  negatives);
- every rank's value is the reference's; each rank's rows' gradient is U x the
  reference's ("mean", U = 6 the sum of the weights; U / W with "sum") and each
  rank's copy of a scalar gets U / W x its gradient (U / W² with "sum");
- a whole batch of one row (rows [1, 0]): finite, the reference's gradients;
- mutations the same assertions reject: SupCon counting only a rank's own
  positives, ids masked on one rank only, DCL with the positive in its
  denominator, MaxSim summing instead of taking the max.

float64 sums of a few dozen terms: round-off ~1e-14; 1e-10 leaves room, and
every mutation is off by far more.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor

from tests.support.harness import run_ranks
from tests.support.loss_refs import REFERENCES
from wholebatch.comm.groups import get_rank
from wholebatch.losses import examples
from wholebatch.losses.sizing import using_small_rows
from wholebatch.losses.specs import SPECS, LossSpec

F64: dict[str, float] = dict(rtol=1e-10, atol=1e-10)
SIZES = [2, 0, 3]
TILES = [3, 2, 5]
WEIGHTS = [1.0, 2.0, 3.0]


def _cases(spec: LossSpec, sizes: list[int]) -> dict[str, dict[str, Any]]:
    """Case name -> how the loss is called (path, keywords, extras)."""
    paths = {"small": None} | {p: 0 for p in spec.strategies}
    out: dict[str, dict[str, Any]] = {}
    for path, small in paths.items():
        strategy = spec.default_strategy if path == "small" else path
        for reduction in ("mean", "sum"):
            out[f"{path} {reduction}"] = dict(
                small=small, kw={"strategy": strategy, "grad_reduction": reduction}
            )
    if spec.kernel != "tokens":  # (token sets: every rank must pad alike without the checks)
        out["known sizes"] = dict(small=0, kw={"sizes": sizes, "check": False})
    for extra in spec.extras:
        for path, small in paths.items():
            strategy = spec.default_strategy if path == "small" else path
            out[f"{extra} {path}"] = dict(small=small, kw={"strategy": strategy}, extras=(extra,))
    return out


@contextlib.contextmanager
def _mutation(name: str) -> Iterator[None]:
    """A known-wrong implementation in place (this worker, this call only)."""
    import wholebatch.losses.dcl as dcl
    import wholebatch.losses.late as late
    import wholebatch.losses.supcon as supcon
    import wholebatch.losses.tiles as tiles

    saved: list[tuple[Any, str, Any]] = []

    def put(module: Any, attr: str, value: Any) -> None:
        saved.append((module, attr, getattr(module, attr)))
        setattr(module, attr, value)

    if name == "local positives":  # SupCon's label sums from this rank's rows only
        put(supcon, "all_reduce", lambda x, *a, **k: x)
    elif name == "ids on rank 0 only":
        real = tiles.mask_ids
        put(tiles, "mask_ids", lambda s, a, b: real(s, a, b) if get_rank() == 0 else None)
        import wholebatch.losses.lse as lse
        import wholebatch.losses.ring as ring

        put(lse, "mask_ids", tiles.mask_ids)
        put(ring, "mask_ids", tiles.mask_ids)
    elif name == "positive in the denominator":  # DCL turned back into NT-Xent's log-sum-exp
        put(dcl, "_decoupled", lambda a, *_: torch.logaddexp(a, torch.zeros_like(a)))
    elif name == "sum over tokens":  # MaxSim's max replaced by a sum over the doc's tokens

        def summed(q: Tensor, qm: Tensor, d: Tensor, dm: Tensor) -> Tensor:
            sim = torch.einsum("bqd,ctd->bcqt", q, d) * dm.bool()[None, :, None, :]
            return (sim.sum(-1) * qm.to(sim.dtype)[:, None, :]).sum(-1)

        put(late, "maxsim_scores", summed)
    try:
        yield
    finally:
        for module, attr, value in reversed(saved):
            setattr(module, attr, value)


def _run(name: str, sizes: list[int], cases: dict[str, dict[str, Any]], mutation: str) -> dict:
    """Every case of loss `name` on this rank: value, input and scalar gradients."""
    spec, r = SPECS[name], get_rank()
    out = {}
    for case, how in cases.items():
        tensors = examples.inputs(spec, sizes, r, extras=how.get("extras", ()))
        for x in tensors.values():
            x.requires_grad_(x.is_floating_point())
        values = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True)
                  for k, v in examples.scalars(spec).items()}  # fmt: skip
        with using_small_rows(how["small"]), _mutation(mutation):
            loss = examples.call(spec, tensors, values, tile_size=TILES[r], **how["kw"])
            (WEIGHTS[r] * loss).backward()
        grads = {k: x.grad for k, x in tensors.items() if x.is_floating_point()}
        out[case] = (loss.detach(), grads, {k: v.grad for k, v in values.items()})
    return out


def _check(name: str, sizes: list[int], mutation: str = "") -> None:
    spec = SPECS[name]
    cases = _cases(spec, sizes)
    got = run_ranks(len(sizes), _run, name, sizes, cases, mutation, timeout=120)
    w = len(sizes)
    u = sum(WEIGHTS[:w])
    for case, how in cases.items():
        per_rank = [examples.inputs(spec, sizes, q, extras=how.get("extras", ())) for q in range(w)]
        rows = examples.whole(spec, per_rank)
        for x in rows.values():
            x.requires_grad_(x.is_floating_point())
        values = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True)
                  for k, v in examples.scalars(spec).items()}  # fmt: skip
        ref = REFERENCES[name](rows, values)
        floats = [k for k, x in rows.items() if x.is_floating_point()]
        grads = torch.autograd.grad(ref, [*(rows[k] for k in floats), *values.values()])
        reduction = how["kw"].get("grad_reduction", "mean")
        row_factor = u if reduction == "mean" else u / w
        starts = [sum(sizes[:q]) for q in range(w)]
        for q, (value, rank_grads, scalar_grads) in enumerate(g[case] for g in got):
            where = f"{name} [{case}] rank {q}"
            torch.testing.assert_close(
                value, ref.detach(), **F64, msg=lambda m, where=where: f"{where}: {m}"
            )
            for k, full in zip(floats, grads[: len(floats)], strict=True):
                mine = full[starts[q] : starts[q] + sizes[q]]
                mine = mine[:, : rank_grads[k].shape[1]] if mine.dim() == 3 else mine  # own pads
                torch.testing.assert_close(rank_grads[k], row_factor * mine, **F64,
                                           msg=lambda m, k=k, where=where: f"{where} grad {k}: {m}")  # fmt: skip
            for k, full in zip(values, grads[len(floats) :], strict=True):
                assert torch.isfinite(scalar_grads[k]), (where, k)
                torch.testing.assert_close(scalar_grads[k], row_factor / w * full, **F64,
                                           msg=lambda m, k=k, where=where: f"{where} grad {k}: {m}")  # fmt: skip


@pytest.mark.parametrize("name", list(SPECS))
def test_every_loss_matches_its_reference_on_every_path(name: str) -> None:
    _check(name, SIZES)


@pytest.mark.parametrize("name", list(SPECS))
def test_a_whole_batch_of_one_row_is_finite_and_exact(name: str) -> None:
    _check(name, [1, 0])


def test_every_spec_has_an_independent_reference() -> None:
    assert set(REFERENCES) == set(SPECS), set(SPECS) ^ set(REFERENCES)


@pytest.mark.parametrize(
    ("name", "mutation"),
    [
        ("supcon", "local positives"),
        ("clip", "ids on rank 0 only"),
        ("info_nce", "ids on rank 0 only"),
        ("dcl", "positive in the denominator"),
        ("maxsim", "sum over tokens"),
    ],
)
def test_mutations_are_caught(name: str, mutation: str) -> None:
    with pytest.raises(AssertionError):
        _check(name, SIZES, mutation)
