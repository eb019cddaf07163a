"""Every loss of the registry on a dp2 x tp2 device mesh (`mesh=`, `batch_dims=("dp",)`), every path.

4 gloo ranks, one call for every case. dp shard b is held by ranks 2b and 2b + 1
(tp replicas: the same rows, from `wholebatch.losses.examples` seeded by the
shard); shards hold rows (3, 2), or (3, 0). Every rank's loss must be the
independent reference's on the two shards' rows (`tests/support/loss_refs.py`),
each rank's input gradient 2 x the reference's for its shard's rows (B = 2, "mean",
both replicas alike) and each rank's copy of a scalar the reference's gradient.
The mutation, `group=` the whole world (the replicas' rows counted twice), fails
the same comparison. A spec added to the registry is checked here with no line added.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.support.harness import run_ranks
from tests.support.loss_refs import REFERENCES
from tests.support.mesh_cases import get_mesh
from wholebatch.losses import examples
from wholebatch.losses.sizing import using_small_rows
from wholebatch.losses.specs import SPECS

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

TOL: dict[str, float] = dict(rtol=1e-10, atol=1e-10)  # float64: round-off ~1e-14
ROWS = [(3, 2), (3, 0)]


def _cases() -> list[tuple[str, str, tuple[int, int], str]]:
    """(loss, path, shard rows, how): every path of every spec, and the world mutation."""
    out = []
    for name, spec in SPECS.items():
        for path in ("small", *spec.strategies):
            for rows in ROWS:
                out.append((name, path, rows, "mesh"))
        out.append((name, spec.default_strategy, ROWS[0], "world"))
    return out


def _run(cases: list[tuple[str, str, tuple[int, int], str]]) -> list[dict[str, Any]]:
    mesh = get_mesh((("dp", 2), ("tp", 2)))
    dp = dist.get_rank() // 2
    out = []
    for name, path, rows, how in cases:
        spec = SPECS[name]
        tensors = examples.inputs(spec, list(rows), dp)
        for x in tensors.values():
            x.requires_grad_(x.is_floating_point())
        values = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True)
                  for k, v in examples.scalars(spec).items()}  # fmt: skip
        where: dict[str, Any] = {"mesh": mesh, "batch_dims": ("dp",)} if how == "mesh" else {}
        strategy = spec.default_strategy if path == "small" else path
        with using_small_rows(None if path == "small" else 0):
            loss = examples.call(spec, tensors, values, tile_size=2, strategy=strategy, **where)
        loss.backward()
        out.append({
            "loss": loss.detach(),
            "grads": {k: x.grad for k, x in tensors.items() if x.is_floating_point()},
            "scalars": {k: v.grad for k, v in values.items()},
        })  # fmt: skip
    return out


@pytest.fixture(scope="module")
def results() -> list[list[dict[str, Any]]]:
    out: list[list[dict[str, Any]]] = run_ranks(4, _run, _cases(), timeout=240)
    return out


def _mismatches(
    case: tuple[str, str, tuple[int, int], str], got: list[dict[str, Any]]
) -> list[str]:
    name, _, rows, _ = case
    spec = SPECS[name]
    whole = examples.whole(spec, [examples.inputs(spec, list(rows), b) for b in range(2)])
    for x in whole.values():
        x.requires_grad_(x.is_floating_point())
    values = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True)
              for k, v in examples.scalars(spec).items()}  # fmt: skip
    ref = REFERENCES[name](whole, values)
    floats = [k for k, x in whole.items() if x.is_floating_point()]
    grads = dict(zip([*floats, *values], torch.autograd.grad(ref, [*(whole[k] for k in floats),
                                                                    *values.values()]), strict=True))  # fmt: skip
    starts = [0, rows[0], sum(rows)]
    bad = []
    for r, res in enumerate(got):
        b = r // 2
        if not torch.allclose(res["loss"], ref, **TOL):
            bad.append(f"rank {r} loss {float(res['loss'])} vs {float(ref.detach())}")
        for k in floats:
            want = 2 * grads[k][starts[b] : starts[b + 1]]
            g = res["grads"][k]
            want = want[:, : g.shape[1]] if want.dim() == 3 else want  # the shard's own pads
            if not torch.allclose(g, want, **TOL):
                bad.append(f"rank {r} {k} gradient")
        for k in values:
            if not torch.allclose(res["scalars"][k], grads[k], **TOL):
                bad.append(f"rank {r} {k} gradient")
    return bad


CASES = _cases()


@pytest.mark.parametrize("i", [i for i, c in enumerate(CASES) if c[3] == "mesh"],
                         ids=lambda i: "-".join(map(str, CASES[i][:3])))  # fmt: skip
def test_every_loss_on_a_mesh_matches_one_process(
    results: list[list[dict[str, Any]]], i: int
) -> None:
    assert _mismatches(CASES[i], [res[i] for res in results]) == [], CASES[i]


@pytest.mark.parametrize("i", [i for i, c in enumerate(CASES) if c[3] == "world"],
                         ids=lambda i: CASES[i][0])  # fmt: skip
def test_gathering_over_the_world_is_rejected(results: list[list[dict[str, Any]]], i: int) -> None:
    assert _mismatches(CASES[i], [res[i] for res in results]) != [], CASES[i]
