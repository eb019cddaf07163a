"""Every loss of the registry under `GradCache` and `CachedStep` (K = 2 micro-batches per rank, W = 2).

The model embeds each of the loss's float inputs with its own linear map (DDP
over both ranks); integer inputs (labels, ids) and token masks pass through. Rank
r's micro-batches hold rows [2, 1] and [1, 1] (uneven, ragged token sets across
ranks), float64, each rank its own tile size, on every path the spec offers (the
small path, gather, ring; `CachedStep` on the small path and one tiled path). The reference embeds the whole batch (rank 0's micro-batches,
then rank 1's) in ONE process and differentiates the loss's independent reference
(`tests/support/loss_refs.py`): after GradCache's backward every parameter's
gradient must equal it, and after `CachedStep.step` (SGD, lr 1) every parameter
must equal one SGD step from it. A spec added to the registry is checked here with
no line added. The mutation (each rank's loss over its own rows only, the
micro-batches still cached) is rejected by the same assertion.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from tests.support.harness import run_ranks
from tests.support.loss_refs import REFERENCES
from wholebatch.comm.groups import get_rank
from wholebatch.losses import examples
from wholebatch.losses.sizing import using_small_rows
from wholebatch.losses.specs import SPECS
from wholebatch.train.cache import CachedStep
from wholebatch.train.gradcache import GradCache

F64: dict[str, float] = dict(rtol=1e-10, atol=1e-10)
MICRO = [[2, 1], [1, 1]]  # rank r's micro-batches' rows
TILES = [3, 2]  # rank r's tile size


class Towers(nn.Module):
    """One linear map per float input of the loss; a micro-batch (name -> rows) in, those out."""

    def __init__(self, floats: list[str]) -> None:
        super().__init__()
        self.floats = floats
        torch.manual_seed(7)
        maps = {n: nn.Linear(examples.DIM, examples.DIM, bias=False).double() for n in floats}
        self.maps = nn.ModuleDict(maps)

    def forward(self, mb: dict[str, Tensor]) -> list[Tensor]:
        return [self.maps[n](mb[n]) for n in self.floats]


def _floats(name: str) -> list[str]:
    spec = SPECS[name]
    return [n for n in (*spec.inputs, *spec.extras) if n.endswith("D")]


def _model(name: str) -> Towers:
    return Towers(_floats(name))


def _micro_batches(name: str, rank: int) -> list[dict[str, Tensor]]:
    """Rank `rank`'s micro-batches: the rows of examples.inputs(...), split in MICRO[rank]."""
    spec = SPECS[name]
    sizes = [sum(m) for m in MICRO]
    mine = examples.inputs(spec, sizes, rank, extras=spec.extras)
    out, at = [], 0
    for rows in MICRO[rank]:
        out.append({k: x[at : at + rows] for k, x in mine.items()})
        at += rows
    return out


def _loss(
    name: str, floats: list[str], others: dict[str, Tensor], mutation: bool, path: str
) -> Any:
    spec = SPECS[name]
    strategy = spec.default_strategy if path == "small" else path

    def loss_fn(*embeddings: Tensor) -> Tensor:
        tensors = {**dict(zip(floats, embeddings, strict=True)), **others}
        # each rank its own tile size (the rings cut their messages alike all the same)
        kw: dict[str, Any] = {"tile_size": TILES[get_rank()], "strategy": strategy}
        if mutation:  # MUTATION: this rank's rows only (a group of one per rank)
            kw["group"] = _own_group()
        return examples.call(spec, tensors, examples.scalars(spec), **kw)

    return loss_fn


_GROUPS: dict[int, Any] = {}


def _own_group() -> Any:
    import torch.distributed as dist

    if not _GROUPS:  # every rank creates every rank's group of one, in order
        for q in range(dist.get_world_size()):
            _GROUPS[q] = dist.new_group([q])
    return _GROUPS[get_rank()]


def _rank(name: str, engine: str, mutation: bool, path: str) -> dict[str, Tensor]:
    r = get_rank()
    model = _model(name)
    ddp = DistributedDataParallel(model)
    mbs = _micro_batches(name, r)
    floats = _floats(name)
    others = {k: torch.cat([mb[k] for mb in mbs]) for k in mbs[0] if k not in floats}
    loss_fn = _loss(name, floats, others, mutation, path)
    with using_small_rows(None if path == "small" else 0):
        if engine == "GradCache":
            GradCache(ddp)(mbs, loss_fn).backward()
            out = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        else:
            opt = torch.optim.SGD(model.parameters(), lr=1.0)
            CachedStep(ddp, opt, lambda m, mb: m(mb), loss_fn).step(mbs)
            out = {k: p.detach().clone() for k, p in model.named_parameters()}
    del ddp
    gc.collect()
    return out


def _reference(name: str, engine: str) -> dict[str, Tensor]:
    spec = SPECS[name]
    model = _model(name)
    floats = _floats(name)
    per_rank = []
    for r in range(len(MICRO)):
        mbs = _micro_batches(name, r)
        embs = [model(mb) for mb in mbs]
        rank_rows = {n: torch.cat([e[i] for e in embs]) for i, n in enumerate(floats)}
        rank_rows.update({k: torch.cat([mb[k] for mb in mbs]) for k in mbs[0] if k not in floats})
        per_rank.append(rank_rows)
    values = {k: torch.tensor(v, dtype=torch.float64) for k, v in examples.scalars(spec).items()}
    REFERENCES[name](examples.whole(spec, per_rank), values).backward()
    if engine == "GradCache":
        return {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    return {k: (p - p.grad).detach() for k, p in model.named_parameters()}


def _check(name: str, engine: str, path: str = "small", mutation: bool = False) -> None:
    want = _reference(name, engine)
    got_all = run_ranks(len(MICRO), _rank, name, engine, mutation, path, timeout=120)
    for r, got in enumerate(got_all):
        assert got.keys() == want.keys()
        for k, value in got.items():
            torch.testing.assert_close(
                value, want[k], **F64, msg=lambda m, k=k, r=r: f"rank {r} {k}: {m}"
            )


CASES = [
    *[(n, "GradCache", p) for n, s in SPECS.items() for p in ("small", *s.strategies)],
    *[(n, "CachedStep", p) for n, s in SPECS.items() for p in ("small", s.strategies[-1])],
]


@pytest.mark.parametrize(("name", "engine", "path"), CASES)
def test_every_loss_under_gradient_caching(name: str, engine: str, path: str) -> None:
    _check(name, engine, path)


@pytest.mark.parametrize("path", ["small", "ring"])
def test_mutation_each_rank_its_own_rows_is_caught(path: str) -> None:
    with pytest.raises(AssertionError, match="rank"):
        _check("supcon", "GradCache", path, mutation=True)
