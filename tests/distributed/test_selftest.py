"""`wholebatch selftest`: passes on a real local group, and its checks catch a wrong collective."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from torch import Tensor

from tests.e2e.test_cli import run_cli
from tests.support.harness import run_ranks
from wholebatch.cli.selftest import RTOL, _check_collective, _data, _rows
from wholebatch.losses.specs import SPECS


def test_selftest_passes_on_three_local_ranks_with_json() -> None:
    result = run_cli("selftest", "--nproc", "3", "--json", timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    doc = json.loads(result.stdout)
    assert doc["passed"] and doc["world_size"] == 3 and doc["backend"] == "gloo"
    names = [c["check"] for c in doc["checks"]]
    for op in (
        "all_gather",
        "all_reduce",
        "reduce_scatter",
        "all_to_all",
        "broadcast",
        "ring_shift",
    ):
        assert any(n.startswith(op) for n in names), op
    for spec in SPECS.values():  # every loss, on every path it has: a spec without one fails
        paths = {"small path", *spec.strategies}
        assert {f"{spec.function} ({p})" for p in paths} <= set(names), (spec.name, names)
    assert all(c["passed"] and c["backward_rel_err"] <= RTOL for c in doc["checks"])


def _gather_without_grad(x: Tensor) -> Tensor:
    """MUTATION: torch.distributed.all_gather with the local slice put back."""
    w, rank = dist.get_world_size(), dist.get_rank()
    rows = _rows(w)
    parts = [torch.zeros(n, x.shape[1], dtype=x.dtype) for n in rows]
    padded = torch.zeros(max(rows), x.shape[1], dtype=x.dtype)
    padded[: x.shape[0]] = x.detach()
    got = [torch.zeros_like(padded) for _ in range(w)]
    dist.all_gather(got, padded)
    parts = [g[:n] for g, n in zip(got, rows, strict=True)]
    parts[rank] = x
    return torch.cat(parts)


def _errors_of_mutant() -> tuple[float, float]:
    rank, w = dist.get_rank(), dist.get_world_size()
    xs = [_data(r, _rows(w)[r]) for r in range(w)]
    return _check_collective(
        rank, torch.device("cpu"), xs, lambda ys: [torch.cat(ys)] * w, _gather_without_grad
    )


def test_selftest_check_rejects_a_gather_without_gradient() -> None:
    errs = run_ranks(2, _errors_of_mutant)
    assert all(fwd == 0.0 for fwd, _ in errs)  # the forward is right...
    assert all(bwd > 0.1 for _, bwd in errs)  # ...the backward drops the other rank's terms
