"""Batches as verify handles them: rows first, cut into micro-batches, listed, selected, collated.

A batch is a Tensor, or a tuple/list/dict of Tensors whose dim 0 is the same
row (`rows` checks it). `split_batch` cuts the W·K contiguous micro-batches of a
split, `select_rows` takes rows by index (the fit's micro-batches),
`dataset_rows` lists rows for a trainer's dataset, `fingerprint` checks that every
process built the same batch, and `collate` turns the micro-batches a
`ReplaySpec`'s trainer recorded on every rank into one whole batch.

Legend: W ranks, K micro-batches per rank, J = W·K micro-batches, N rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from wholebatch.errors import WholebatchError, WholebatchTypeError

__all__ = [
    "ROW_COLUMN",
    "Batch",
    "collate",
    "dataset_rows",
    "fingerprint",
    "rows",
    "select_rows",
    "split_batch",
]

Batch = Any

ROW_COLUMN = "row"
"""The column `collate` adds: each row's index in the whole recorded batch (a global id)."""


def rows(batch: Batch, what: str = "batch") -> int:
    """Rows (dim 0) of a batch: a Tensor, or a tuple/list/dict of Tensors with equal rows."""
    if isinstance(batch, Tensor):
        if batch.dim() == 0:
            raise WholebatchError(f"VerifySpec: {what} is a 0-d tensor; it needs rows (dim 0)")
        return int(batch.shape[0])
    parts = list(batch.values()) if isinstance(batch, Mapping) else batch
    if not isinstance(parts, (tuple, list)) or not parts:
        raise WholebatchTypeError(
            f"VerifySpec: {what} must be a Tensor or a non-empty tuple/list/dict of Tensors, "
            f"got {type(batch).__name__}"
        )
    counts = {rows(p, what) for p in parts}
    if len(counts) != 1:
        raise WholebatchError(
            f"VerifySpec: the tensors of {what} have different row counts {sorted(counts)}; "
            "row i of each must be the same sample"
        )
    return counts.pop()


def split_batch(batch: Batch, parts: int) -> list[Batch]:
    """Cut a batch's rows into `parts` contiguous chunks (sizes differ by at most one)."""
    if isinstance(batch, Tensor):
        return list(torch.tensor_split(batch, parts))
    if isinstance(batch, Mapping):
        cols = {k: split_batch(v, parts) for k, v in batch.items()}
        return [{k: v[i] for k, v in cols.items()} for i in range(parts)]
    pieces = [split_batch(b, parts) for b in batch]
    return [type(batch)(p[i] for p in pieces) for i in range(parts)]


def select_rows(batch: Batch, index: Sequence[int]) -> Batch:
    """The rows `index` of a batch, in that order, with the batch's structure."""
    idx = torch.as_tensor(list(index), dtype=torch.long)
    if isinstance(batch, Tensor):
        return batch[idx]
    if isinstance(batch, Mapping):
        return {k: select_rows(v, index) for k, v in batch.items()}
    return type(batch)(select_rows(b, index) for b in batch)


def dataset_rows(batch: Batch) -> list[Any]:
    """The batch as a list of rows: tensors, tuples of tensors, or dicts of tensors."""
    n = rows(batch)
    if isinstance(batch, Tensor):
        return list(batch.unbind(0))
    if isinstance(batch, Mapping):
        return [{k: v[i] for k, v in batch.items()} for i in range(n)]
    return [type(batch)(b[i] for b in batch) for i in range(n)]


def fingerprint(batch: Batch) -> float:
    """A number that changes when the batch does (checks every process built the same one)."""
    if isinstance(batch, Tensor):
        return float(batch.detach().double().sum()) + float((batch != 0).sum())
    values = batch.values() if isinstance(batch, Mapping) else batch
    return sum(fingerprint(b) for b in values)


def collate(
    recorded: Sequence[Mapping[str, Tensor]], left_padded: Sequence[str] = ()
) -> tuple[dict[str, Tensor], list[list[int]]]:
    """J recorded micro-batches as one batch, and the rows each one holds in it.

    Every micro-batch must hold the same columns, each a Tensor of at least one dim
    whose dim 0 is the micro-batch's rows, with the same dtype and number of dims
    everywhere. Each column is padded with zeros to the widest micro-batch's sizes
    (on the right; on the left for the columns in `left_padded`: a trainer's
    left-padded prompts keep their tokens next to what follows), and the
    micro-batches are concatenated in order. A column `ROW_COLUMN` numbers the rows.

    Raises:
        WholebatchError: the micro-batches do not fit together (named: which, and why).
    """
    if not recorded:
        raise WholebatchError(
            "verify: the trainer recorded no micro-batch (run.record was never called)"
        )
    keys = list(recorded[0])
    if ROW_COLUMN in keys:
        raise WholebatchError(
            f"verify: a recorded column is named {ROW_COLUMN!r}, the name verify gives the rows' "
            "index in the whole batch; rename it"
        )
    out: dict[str, Tensor] = {}
    pieces: list[list[int]] = []
    start = 0
    for j, mb in enumerate(recorded):
        if list(mb) != keys:
            raise WholebatchError(
                f"verify: recorded micro-batch {j} has columns {list(mb)}, micro-batch 0 {keys}; "
                "record the same columns every time"
            )
        sizes = set()
        for key, value in mb.items():
            if not isinstance(value, Tensor) or value.dim() == 0:
                raise WholebatchTypeError(
                    f"verify: recorded column {key!r} of micro-batch {j} is "
                    f"{type(value).__name__}{'' if not isinstance(value, Tensor) else ' of 0 dims'}; "
                    "record tensors with a dim per row (leave scalars such as num_items_in_batch out)"
                )
            sizes.add(int(value.shape[0]))
        if len(sizes) != 1:
            raise WholebatchError(
                f"verify: the columns of recorded micro-batch {j} hold different row counts "
                f"{sorted(sizes)}; row i of each must be the same sample"
            )
        n = sizes.pop()
        pieces.append(list(range(start, start + n)))
        start += n
    for key in keys:
        parts = [mb[key] for mb in recorded]
        kinds = {(p.dtype, p.dim()) for p in parts}
        if len(kinds) != 1:
            raise WholebatchError(
                f"verify: recorded column {key!r} changes dtype or dims across micro-batches "
                f"({sorted(str(k) for k in kinds)})"
            )
        widest = [max(int(p.shape[d]) for p in parts) for d in range(1, parts[0].dim())]
        padded = []
        for p in parts:
            pad: list[int] = []
            for d in reversed(range(1, p.dim())):  # F.pad lists the last dim first
                extra = widest[d - 1] - int(p.shape[d])
                pad += [extra, 0] if key in left_padded else [0, extra]
            padded.append(F.pad(p.detach().cpu(), pad) if any(pad) else p.detach().cpu())
        out[key] = torch.cat(padded)
    out[ROW_COLUMN] = torch.arange(start)
    return out, pieces
