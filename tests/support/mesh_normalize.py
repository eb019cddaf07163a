"""`Accumulator.step(..., normalize=)` on a 2 x 2 mesh, and one process on the whole batch.

`run_modes` runs on each rank of the 4-rank gloo world (tests.support.harness): for
every mode it builds the mesh model of `tests.support.mesh_cases` (dp x tp: FSDP2
on dp, Colwise/Rowwise on tp; dp x cp: FSDP2 on dp_cp, each cp rank holding half
of every sequence's positions) and takes the case's steps with per-token losses
and a `Normalize(mode, ...)`. `reference` computes each mode's definition on the
whole batch in one process. Items are target tokens; sequence s (numbered over the
step's whole batch) is in group s % 3; sequences of length 1 have no target (an
empty micro-batch is made of them), and on cp a sequence's targets straddle both
cp ranks.

Mutations (`table_dims`): the normalisation table agreed over the wrong mesh dims:
() (each rank's own rows), every dim (tp replicas counted twice), ("dp",) (the cp
halves of each sequence dropped).

Legend: S sequences of a micro-batch, T padded length (T/cp on a cp rank), V vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from tests.support.mesh_cases import (
    WIDTH,
    MeshCase,
    Piece,
    _fsdp_model,
    _my_batch,
    _sequences,
    get_mesh,
    read_params,
)
from tests.support.models import IGNORE, TinyLM, micro_batch

__all__ = ["GROUP", "MODES", "NormResult", "reference", "run_modes"]

MODES = ("token", "sequence", "constant", "group")
GROUP = 3  # groups per step: sequence s is in group s % 3 (they straddle ranks and micro-batches)


@dataclasses.dataclass
class NormResult:
    params: dict[str, Tensor | Piece]  # after the steps (`mesh_cases.read_params`)
    losses: list[float]  # StepStats.loss of each step
    items: list[float]  # StepStats.items of each step


def _ids(case: MeshCase, s: int) -> list[list[Tensor]]:
    """Step s's global sequence ids as [shard][micro-batch] -> [S] (the order of `_sequences`)."""
    out, start = [], 0
    for shard in case.steps[s]:
        mbs = []
        for lens in shard:
            mbs.append(torch.arange(start, start + len(lens)))
            start += len(lens)
        out.append(mbs)
    return out


def _constant(case: MeshCase, s: int) -> float:
    """Dr. GRPO's C: the padded length times the step's number of sequences."""
    return float(WIDTH * sum(len(mb) for shard in case.steps[s] for mb in shard))


def _items(mb: dict[str, Tensor]) -> dict[str, Tensor]:
    return {"mask": mb["targets"] != IGNORE, "sequence": mb["seq"], "group": mb["seq"] % GROUP}


def per_token(model: nn.Module, mb: dict[str, Tensor]) -> Tensor:
    """Per-token cross-entropies [S, T] (0 on ignored targets)."""
    logits_STV = model(mb["tokens"])
    loss = F.cross_entropy(
        logits_STV.reshape(-1, logits_STV.shape[-1]).double(),
        mb["targets"].reshape(-1),
        ignore_index=IGNORE,
        reduction="none",
    )
    return loss.reshape(mb["targets"].shape)


def _my_items(case: MeshCase, mesh: Any, s: int, shift_ids: bool) -> list[dict[str, Tensor]]:
    """This rank's micro-batches at step s with each row's sequence id (cp: its columns)."""
    from wholebatch.comm.mesh import MeshSplit

    split = MeshSplit(mesh=mesh, batch_dims=tuple(d for d in ("dp", "cp") if d in dict(case.shape)))
    shard = split.coordinate()["dp"]
    out = []
    for (tokens, targets), ids in zip(_my_batch(case, mesh, s), _ids(case, s)[shard], strict=True):
        seq = ids[:, None].expand(targets.shape).clone()  # [S, T]: every position carries its id
        if shift_ids:  # a replica reading other sequences of the same shapes
            seq = seq + 100
        out.append({"tokens": tokens, "targets": targets, "seq": seq})
    return out


def run_modes(
    case: MeshCase,
    modes: tuple[str, ...],
    table_dims: tuple[str, ...] | None = None,
    inline_rows: int | None = None,
) -> dict[str, NormResult]:
    """Each mode's run on this rank (`table_dims`: the mutation; `case.replica_differs`:
    rank 1 reads other sequence ids; `inline_rows`: fewer table rows ride on `begin`'s
    all-gather, so the table takes its own)."""
    from wholebatch.train import normalize

    default = normalize.INLINE_ROWS
    normalize.INLINE_ROWS = default if inline_rows is None else inline_rows
    try:
        return _run_modes(case, modes, table_dims)
    finally:
        normalize.INLINE_ROWS = default


def _run_modes(
    case: MeshCase, modes: tuple[str, ...], table_dims: tuple[str, ...] | None
) -> dict[str, NormResult]:
    from wholebatch import Accumulator, Normalize

    class Mutated(Accumulator):
        def _table_dims(self) -> tuple[str, ...]:
            assert table_dims is not None
            return table_dims

    mesh = get_mesh(case.shape)
    out = {}
    for mode in modes:
        model = _fsdp_model(case, mesh)
        opt = torch.optim.SGD(model.parameters(), lr=case.lr)
        cls = Accumulator if table_dims is None else Mutated
        acc = cls(model, opt, mesh=mesh, batch_dims=case.batch_dims, check_inputs=case.check_inputs)
        losses, items = [], []
        for s in range(len(case.steps)):
            shift = case.replica_differs and dist.get_rank() == 1
            mbs = _my_items(case, mesh, s, shift)
            c = _constant(case, s) if mode == "constant" else None
            st = acc.step(mbs, per_token, normalize=Normalize(mode, items=_items, constant=c))  # type: ignore[arg-type]
            losses.append(st.loss)
            items.append(st.items)
        out[mode] = NormResult(read_params(model), losses, items)
    return out


def _mode_loss(mode: str, loss_ST: Tensor, mb: dict[str, Tensor], constant: float) -> Tensor:
    """The mode's definition on the whole batch (docs/accumulation.md), written out."""
    ids = _items(mb)
    m = ids["mask"]
    if mode == "token":
        return loss_ST[m].sum() / m.sum()
    if mode == "constant":
        return loss_ST[m].sum() / constant
    key = ids["sequence"] if mode == "sequence" else ids["group"]
    terms = []
    for u in sorted(set(key.reshape(-1).tolist())):
        sel = (key == u) & m
        n = int(sel.sum())
        if mode == "group":
            assert n > 0, f"group {u} has no item: the case must give every group a target"
        terms.append(loss_ST[sel].sum() / max(n, 1))
    return torch.stack(terms).sum() / len(terms)


def reference(case: MeshCase, mode: str) -> NormResult:
    """One process on every step's whole batch (full-width sequences, no mesh)."""
    torch.manual_seed(0)
    model = TinyLM().double()
    opt = torch.optim.SGD(model.parameters(), lr=case.lr)
    losses, items = [], []
    for s in range(len(case.steps)):
        seqs = [t for shard in _sequences(case, s) for mb in shard for t in mb]
        tokens, targets = micro_batch(seqs, width=WIDTH)
        ids = torch.cat([i for shard in _ids(case, s) for i in shard])
        mb = {"tokens": tokens, "targets": targets, "seq": ids[:, None].expand(targets.shape)}
        loss = _mode_loss(mode, per_token(model, mb), mb, _constant(case, s))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        items.append(float((targets != IGNORE).sum()))
    return NormResult({k: v.detach().clone() for k, v in model.named_parameters()}, losses, items)
