"""The losses on a device mesh: `mesh=`/`batch_dims=` resolved, replicas checked, then `prepare`.

Every whole-batch loss takes ``group=`` (a flat world) or ``mesh=`` with
``batch_dims=`` (docs/mesh.md). `prepare_on` is the one place a loss turns
those into the group it gathers over and runs its validation:

    prep, group = prepare_on(op, embeddings, scalars, group=group, mesh=mesh,
                             batch_dims=batch_dims, grad_reduction=..., ...)

- **The group**: on a mesh, the batch dims' ranks (`MeshSplit.batch_group`,
  built once per mesh and batch dims: `wholebatch.comm.meshgroup.resolve_group`).
  W in the gradient conventions is then B, the product of the batch dims' sizes.
- **Replicas** (the same coordinate on every batch dim: tensor parallel) each
  run the loss on their own batch group and must hold the same rows. A
  fingerprint of every embedding is agreed over the mesh around `prepare`'s
  exchange (`comm.meshgroup.replicas_agree`; no collective without a replica dim
  of size > 1, none with `sizes=` and the checks off); a difference is the same
  error on every rank, naming the ranks, the input and the fix.
- **A replica's gradient** is its batch-group peers': B·dL/dx of its rows with
  ``grad_reduction="mean"`` (the wrapper's mean over the batch dims gives dL/dx),
  dL/dx with "sum"; a replicated scalar gets dL/ds ("mean") or dL/ds / B ("sum").
  Nothing is split or summed over the replica dims: tensor parallelism's own
  backward combines the replicas' equal gradients into its shards.

Legend: B the batch dims' size (W of the batch group), D embedding dim.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from wholebatch.comm.groups import checks_enabled
from wholebatch.comm.meshgroup import replicas_agree, resolve_group
from wholebatch.losses.common import Prepared, prepare

__all__ = ["prepare_on"]


def prepare_on(
    op: str,
    embeddings: Mapping[str, object],
    scalars: Mapping[str, object],
    *,
    group: ProcessGroup | None,
    mesh: DeviceMesh | None,
    batch_dims: Sequence[str] | None,
    **kwargs: Any,
) -> tuple[Prepared, ProcessGroup | None]:
    """(`prepare`'s result, the group to gather over): see the module docstring.

    Args:
        op: the loss's name, for messages.
        embeddings: name -> this rank's tensor, as for `prepare` (fingerprinted on a mesh).
        scalars: name -> scalar, as for `prepare`.
        group: the flat world's group, or None.
        mesh: a `DeviceMesh` instead of `group`, or None.
        batch_dims: with `mesh`, the dims that split the batch.
        kwargs: `prepare`'s other keywords (`sizes` and `check` decide whether replicas
            are checked, as they decide whether the exchange runs).
    """
    group, split = resolve_group(group, mesh, batch_dims, op)
    if split is None:  # a flat world: no replicas to check
        return prepare(op, embeddings, scalars, group=group, **kwargs), group
    checked = kwargs.get("sizes") is None or checks_enabled(kwargs.get("check"))
    with replicas_agree(op, split, embeddings, enabled=checked):
        return prepare(op, embeddings, scalars, group=group, **kwargs), group
