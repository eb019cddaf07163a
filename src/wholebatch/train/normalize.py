"""The whole batch's loss as the user means it: token, sequence, constant and group normalisation.

    norm = wholebatch.Normalize("sequence", items=lambda mb: {"mask": mb.mask, "sequence": mb.seq_ids})
    stats = acc.step(micro_batches, per_token_loss_fn, normalize=norm)
    # per_token_loss_fn(model, mb) -> per-item losses shaped like mb.mask

Each item i (a token, usually) has a loss l_i, a mask m_i (True: it counts), a
sequence id s(i) and a group id g(i). Ids are global to the step: the same id on
two micro-batches or two ranks is one sequence (one group). Over the whole step
(every micro-batch of every rank):

    token:     L = sum_i m_i l_i / N                     N = sum_i m_i
    sequence:  L = (1/S) sum_s (sum_{i in s} m_i l_i) / n_s      S sequences, n_s = sum_{i in s} m_i
    constant:  L = sum_i m_i l_i / C                     C given (e.g. max length x sequences)
    group:     L = (1/G) sum_g (sum_{i in g} m_i l_i) / n_g      G groups, n_g = sum_{i in g} m_i

so L = sum_i w_i l_i with w_i = m_i/N, m_i/(S n_s(i)), m_i/C or m_i/(G n_g(i)).
"token" is DAPO's and plain SFT's; "sequence" GRPO's; "constant" Dr. GRPO's;
"group" averages prompts (a group of G completions) equally.

Which sequences and groups exist: every id >= 0 that `items_fn` gives, at any
position, masked or not (a negative id is padding). A sequence whose items are
all masked out (a truncated completion) is one of the S sequences and adds 0,
as in trl's GRPO (`mask.sum(-1).clamp(min=1)`); a group with no item is an error
(its mean is 0/0). An item in the mask must carry an id >= 0.

Why a counting pass: n_s and S are known only when every micro-batch of every
rank has been seen, and unlike N they are not one scalar, so they cannot be
applied after backward the way `Accumulator` applies N. `count_items` reads the
index tensors of the step's K micro-batches (no forward, no activations), and
each rank's (sequence, group, count) rows ride on the all-gather that agrees K
(`begin_fields`; more than `INLINE_ROWS` rows on a rank take one more all-gather,
`gather_table`), so every rank holds the same table, from which `StepWeights`
gives every item its exact weight before any backward. "token" keeps the
after-backward rescale (no pre-pass) and "constant" needs no table.

On a device mesh (`Accumulator(mesh=, batch_dims=)`) the rows are still gathered
from every rank, and `mesh_table` keeps one copy of each data shard's rows (the
ranks along the batch dims through this rank): a context-parallel sequence's
counts add up over its cp ranks, and tensor-parallel replicas, which must report
the same rows (checked, the same error on every rank), count once.

`match_normalization` names which of these (whole step, or per micro-batch) a
set of per-item weights matches: what a verify report says when a split step
normalises otherwise than its reference.

Legend: W ranks, K micro-batches per rank, I items of one micro-batch (the mask's
elements), U unique (sequence, group) rows on one rank, R = W x max U rows gathered.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from wholebatch.comm.agree import Field, Rows, agree_rows
from wholebatch.comm.mesh import MeshSplit
from wholebatch.errors import WholebatchError, WholebatchTypeError

__all__ = [
    "INLINE_ROWS",
    "MODES",
    "ItemIds",
    "ItemsFn",
    "LocalRows",
    "Mode",
    "Normalize",
    "StepWeights",
    "begin_fields",
    "check_agreed",
    "concat_tables",
    "count_items",
    "gather_table",
    "local_rows",
    "match_normalization",
    "mesh_table",
    "mismatch_text",
    "mode_weights",
    "rank_tables",
    "read_items",
    "step_table",
]

Mode = Literal["token", "sequence", "constant", "group"]
MODES: tuple[Mode, ...] = ("token", "sequence", "constant", "group")
ItemsFn = Callable[[Any], Mapping[str, Tensor]]
Scope = Literal["step", "micro_batch"]

# What each mode's formula averages, for messages ("the step normalises ...").
_MEANING: dict[Mode, str] = {
    "token": "the token mean",
    "sequence": "the mean of sequence means",
    "constant": "the token sum over the constant",
    "group": "the mean of group means",
}


@dataclasses.dataclass(frozen=True)
class Normalize:
    """How `Accumulator.step(..., normalize=)` turns per-item losses into the whole batch's loss.

    Args:
        mode: "token", "sequence", "constant" or "group" (formulas in the module docstring).
        items: `items(micro_batch) -> {"mask": bool, "sequence": long, "group": long}`,
            from the micro-batch's index tensors only (it runs before any forward);
            "sequence" for mode "sequence", "group" for mode "group" ("sequence"
            optional there: when given, every sequence must lie in one group).
            Every tensor has the mask's shape; `loss_fn` returns losses of that shape.
        constant: C of mode "constant" (> 0, the same on every rank); None otherwise.
    """

    mode: Mode
    items: ItemsFn
    constant: float | None = None

    # Tests set "micro_batch" to show that a per-micro-batch normaliser is caught.
    _scope: ClassVar[Scope] = "step"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise WholebatchError(
                f"Normalize: mode={self.mode!r}; expected one of {', '.join(map(repr, MODES))}"
            )
        if not callable(self.items):
            raise WholebatchTypeError(
                f"Normalize: items must be callable (micro_batch -> dict of index tensors), "
                f"got {type(self.items).__name__}"
            )
        if self.mode == "constant":
            c = self.constant
            if (
                isinstance(c, bool)
                or not isinstance(c, (int, float))
                or not (math.isfinite(c) and c > 0)
            ):
                raise WholebatchError(
                    f"Normalize: mode='constant' needs constant= a positive finite number (e.g. "
                    f"max_length * number of sequences), got {c!r}"
                )
        elif self.constant is not None:
            raise WholebatchError(
                f"Normalize: constant={self.constant!r} is only for mode='constant' (mode is "
                f"{self.mode!r}); leave it None"
            )

    @property
    def needs_table(self) -> bool:
        """Whether the weights need the step's (sequence, group) counts (the pre-pass collective)."""
        return self.mode in ("sequence", "group") and self._scope == "step"

    @property
    def weighted(self) -> bool:
        """Whether items get weights before backward (False: "token", rescaled after backward)."""
        return self.mode != "token" or self._scope != "step"


@dataclasses.dataclass(frozen=True)
class ItemIds:
    """One micro-batch's index tensors, flattened: [I] each."""

    mask_I: Tensor  # bool
    sequence_I: Tensor  # long; -1 where not given
    group_I: Tensor  # long; -1 where not given
    shape: tuple[int, ...]  # the mask's shape (loss_fn's losses must have it)


def read_items(norm: Normalize, micro_batch: Any, index: int) -> tuple[ItemIds | None, str | None]:
    """`norm.items(micro_batch)` checked: (the ids, None) or (None, what is wrong)."""
    where = f"items(micro_batches[{index}])"
    try:
        out = norm.items(micro_batch)
    except Exception as e:  # raised on one rank only, it would leave the peers in begin's gather
        return None, f"{where} raised {type(e).__name__}: {e}"
    if not isinstance(out, Mapping) or not isinstance(out.get("mask"), Tensor):
        return None, f"{where} must return a dict with a 'mask' tensor, got {type(out).__name__}"
    mask = out["mask"]
    if mask.dtype != torch.bool:
        return None, f"{where}['mask'] must be a bool tensor, got {mask.dtype}"
    need = {"sequence": ("sequence",), "group": ("group",)}.get(norm.mode, ())
    ids: dict[str, Tensor] = {}
    for key in ("sequence", "group"):
        t = out.get(key)
        if t is None:
            if key in need:
                return None, f"{where} has no {key!r} ids; mode {norm.mode!r} needs them"
            continue
        if not isinstance(t, Tensor) or t.dtype != torch.long or t.shape != mask.shape:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            return None, (
                f"{where}[{key!r}] must be a long tensor shaped like the mask "
                f"{tuple(mask.shape)}, got {got}"
            )
        if key in need or (key == "sequence" and norm.mode == "group"):
            bad = int((mask & (t < 0)).sum())
            if bad:
                return None, (
                    f"{where}: {bad} items in the mask have no {key} id (ids < 0 mark padding); "
                    f"give every masked item its {key}, or mask it out"
                )
        ids[key] = t.reshape(-1)
    minus = torch.full((mask.numel(),), -1, dtype=torch.long, device=mask.device)
    seq = ids.get("sequence", minus) if norm.mode in ("sequence", "group") else minus
    grp = ids.get("group", minus) if norm.mode == "group" else minus
    return ItemIds(mask.reshape(-1), seq, grp, tuple(mask.shape)), None


def _key_rows(items: Sequence[ItemIds], mode: Mode) -> tuple[Tensor, Tensor, Tensor]:
    """Unique (sequence, group) rows of `items` with their masked item counts: [U] each, CPU."""
    if not items:
        empty = torch.empty(0, dtype=torch.long)
        return empty, empty, empty
    if mode == "sequence":
        declared = [it.sequence_I >= 0 for it in items]
    else:
        declared = [it.group_I >= 0 for it in items]
    seq = torch.cat([it.sequence_I[d].cpu() for it, d in zip(items, declared, strict=True)])
    grp = torch.cat([it.group_I[d].cpu() for it, d in zip(items, declared, strict=True)])
    mask = torch.cat([it.mask_I[d].cpu() for it, d in zip(items, declared, strict=True)])
    if mode == "sequence":
        seq_U, _, count_U = _rows_by(seq, None, mask)
        return seq_U, torch.full_like(seq_U, -1), count_U
    # "group": items of a sequence are one row (its group checked on the gathered rows);
    # items without a sequence id are one row per group.
    has = seq >= 0
    seq_U, grp_U, count_U = _rows_by(seq[has], grp[has], mask[has])
    grp_V, _, count_V = _rows_by(grp[~has], None, mask[~has])
    return (
        torch.cat([seq_U, torch.full_like(grp_V, -1)]),
        torch.cat([grp_U, grp_V]),
        torch.cat([count_U, count_V]),
    )


def _rows_by(key: Tensor, aux: Tensor | None, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Unique `key`s [U], the `aux` of each (-2 where a key's items disagree), masked counts [U].

    1-D `torch.unique` (sorting pairs with `dim=0` costs ~10x more: it is on the step's path).
    """
    uniq_U, inverse = torch.unique(key, return_inverse=True)
    count_U = torch.zeros(uniq_U.numel(), dtype=torch.long).index_add_(0, inverse, mask.long())
    if aux is None:
        return uniq_U, uniq_U, count_U
    lo_U = torch.zeros_like(uniq_U).scatter_reduce_(0, inverse, aux, "amin", include_self=False)
    hi_U = torch.zeros_like(uniq_U).scatter_reduce_(0, inverse, aux, "amax", include_self=False)
    return uniq_U, torch.where(lo_U == hi_U, lo_U, -2), count_U


def count_items(norm: Normalize, micro_batches: Sequence[Any]) -> tuple[list[ItemIds], str | None]:
    """The counting pass: every micro-batch's ids (no forward runs), or the first error."""
    out: list[ItemIds] = []
    for i, mb in enumerate(micro_batches):
        ids, error = read_items(norm, mb, i)
        if error is not None:
            return [], error
        assert ids is not None
        out.append(ids)
    return out, None


LocalRows = tuple[Tensor, Tensor, Tensor]
"""One rank's unique (sequence, group) rows and their masked item counts: [U] each, long, CPU."""


def local_rows(norm: Normalize, items: Sequence[ItemIds]) -> LocalRows:
    """This rank's rows of the step's table (what the pre-pass collective carries)."""
    return _key_rows(items, norm.mode)


# Rows of the table that ride on `begin`'s all-gather (float64: ids exact below 2**53). A
# step whose ranks hold more, or larger ids, gathers its table in one more all-gather.
# The fields are in every step's row (fixed layout: ranks that disagree on the mode
# must still read the same row to say so): 3 x 64 float64, 1.5 KiB per rank.
INLINE_ROWS = 64
_EXACT_IDS = 2**53


def begin_fields(
    norm: Normalize | None, rows: LocalRows | None, error: str | None
) -> dict[str, Field]:
    """This rank's normalisation fields of `StepFinisher.begin`'s row (the same names on every rank)."""
    n = 0 if rows is None else int(rows[0].numel())
    inline = rows is not None and n <= INLINE_ROWS and _small_ids(rows)
    pad = torch.full((INLINE_ROWS,), -1.0, dtype=torch.float64)
    table = [pad.clone(), pad.clone(), pad.clone()]
    if inline and rows is not None:
        for column, values in zip(table, rows, strict=True):
            column[:n] = values.to(torch.float64)
    return {
        "norm_mode": -1 if norm is None else MODES.index(norm.mode),
        "norm_constant": math.nan
        if norm is None or norm.constant is None
        else float(norm.constant),
        "norm_rows": n if inline else max(n, INLINE_ROWS + 1),  # > INLINE_ROWS: gather after
        "norm_error": error is not None,
        "norm_sequence": table[0],
        "norm_group": table[1],
        "norm_count": table[2],  # -1: a padding row
    }


def _small_ids(rows: LocalRows) -> bool:
    seq_U, grp_U, _ = rows
    return all(t.numel() == 0 or int(t.abs().max()) < _EXACT_IDS for t in (seq_U, grp_U))


def step_table(
    mine: LocalRows, rows: Rows, group: ProcessGroup | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Every rank's (sequence, group, count) rows [R]: from `begin`'s row when they fit, else gathered."""
    return concat_tables(rank_tables(mine, rows, group))


def rank_tables(mine: LocalRows, rows: Rows, group: ProcessGroup | None) -> list[LocalRows]:
    """Each rank's (sequence, group, count) rows [U_r], in rank order, padding dropped.

    From `begin`'s row when every rank's rows fit in it, else from one more all-gather
    over `group` (`gather_table`; every rank takes the same path: `norm_rows` is agreed).
    """
    if max(rows.ints("norm_rows")) > INLINE_ROWS:
        return gather_table(mine, rows, group)
    return _per_rank(rows, ("norm_sequence", "norm_group", "norm_count"))


def _per_rank(rows: Rows, names: tuple[str, str, str]) -> list[LocalRows]:
    """The three vector fields `names` of every rank as long tensors, padding rows (count -1) dropped."""
    out: list[LocalRows] = []
    for seq, grp, count in zip(*(rows.vectors(n) for n in names), strict=True):
        seq_U, grp_U, count_U = (torch.tensor(v, dtype=torch.long) for v in (seq, grp, count))
        real = count_U >= 0
        out.append((seq_U[real], grp_U[real], count_U[real]))
    return out


def concat_tables(tables: Sequence[LocalRows]) -> tuple[Tensor, Tensor, Tensor]:
    """The ranks' rows as one table [R] (every rank counted: a flat world)."""
    empty = torch.empty(0, dtype=torch.long)
    if not tables:
        return empty, empty, empty
    seq_R, grp_R, count_R = (torch.cat([t[i] for t in tables]) for i in range(3))
    return seq_R, grp_R, count_R


def mesh_table(
    tables: Sequence[LocalRows], split: MeshSplit, dims: Sequence[str], op: str
) -> tuple[Tensor, Tensor, Tensor]:
    """The step's table on a mesh: one copy of each data shard's rows, replicas checked.

    `tables`: every rank's rows (`rank_tables`, gathered over the whole mesh). Ranks
    that replicate a data shard (the same coordinates on every batch dim: tensor
    parallel) must report the same rows, else the same `WholebatchError` on every
    rank, naming them. The table is then the rows of the ranks along `dims` through
    this rank (the split's batch dims: each data shard exactly once, so a context-parallel
    sequence's counts are summed over its cp ranks and tp replicas are not counted twice).
    """
    holders: dict[int, list[int]] = {}
    for r, shard in sorted(split.batch_indices().items()):
        holders.setdefault(shard, []).append(r)
    for ranks in holders.values():
        first = ranks[0]
        bad = [r for r in ranks[1:] if not _same_rows(tables[r], tables[first])]
        if bad:
            shown = [first, *bad]
            differ = tuple(d for d in split.replica_dims if split.sizes[d] > 1)
            raise WholebatchError(
                f"{op}: normalize: ranks {shown} replicate the same rows (the same coordinates "
                f"on batch dims {tuple(split.batch_dims)}; they differ only on {differ}) but "
                f"report different normalisation tables: {_table_text(tables, shown)}. "
                f"Feed every rank of a {'/'.join(differ)} group the "
                "same micro-batches (shard the data by the batch dims only), or name the dim "
                "in batch_dims if its ranks are meant to hold different items (context parallel)"
            )
    return concat_tables([tables[r] for r in sorted(split.ranks_along(dims))])


def _table_text(tables: Sequence[LocalRows], ranks: Sequence[int]) -> str:
    """`(sequence, group) rows {0: 6, 1: 6}, items in the mask {...}, first ids {...}`."""
    rows = {r: int(tables[r][0].numel()) for r in ranks}
    items = {r: int(tables[r][2].sum()) for r in ranks}
    first = {
        r: [(int(q), int(g)) for q, g in zip(*(t[:3].tolist() for t in tables[r][:2]), strict=True)]
        for r in ranks
    }
    return (
        f"(sequence, group) rows {rows}, items in the mask {items}, first "
        f"(sequence, group) ids {first} (-1: not given)"
    )


def _same_rows(a: LocalRows, b: LocalRows) -> bool:
    return all(x.shape == y.shape and bool(torch.equal(x, y)) for x, y in zip(a, b, strict=True))


def check_agreed(rows: Rows, op: str, error: str | None) -> None:
    """Raise the same error on every rank for a rank's bad items or ranks that disagree on the mode."""
    rows.error(op, error, flag="norm_error")
    if not rows.same("norm_mode"):
        shown = [MODES[int(m)] if m >= 0 else None for m in rows["norm_mode"]]
        raise WholebatchError(
            f"{op}: normalize differs across ranks {dict(enumerate(shown))}; every rank must "
            "pass the same Normalize mode (None: no normalize)"
        )
    if not rows.same("norm_constant"):
        raise WholebatchError(
            f"{op}: Normalize constant differs across ranks {rows.differ_text('norm_constant')}; "
            "C must be the same number on every rank (compute it from the global batch)"
        )


class StepWeights:
    """Every item's weight w_i for the step: Σ_i w_i l_i over every rank is the mode's L.

    Built on every rank from the same gathered table, so every rank agrees on S, G,
    n_s and n_g; `for_micro_batch(i)` gives micro-batch i's weights [I] in float64.
    """

    def __init__(
        self,
        norm: Normalize,
        items: Sequence[ItemIds],
        *,
        world_size: int,
        table: tuple[Tensor, Tensor, Tensor] | None,
    ) -> None:
        self.norm = norm
        self.items = list(items)
        self.world_size = world_size
        self.keys: tuple[Tensor, Tensor] | None = None  # global ids (sorted) and their counts
        self.units = 0  # S or G
        if table is not None:
            self.keys, self.units = _global_counts(norm.mode, table)

    def for_micro_batch(self, index: int) -> Tensor:
        """Micro-batch `index`'s weights [I], float64 on the mask's device (0 outside the mask)."""
        it = self.items[index]
        mask = it.mask_I.to(torch.float64)
        if self.norm._scope == "micro_batch":
            return _local_weights(self.norm, it) / (len(self.items) * self.world_size)
        if self.norm.mode == "constant":
            assert self.norm.constant is not None
            return mask / float(self.norm.constant)
        assert self.keys is not None
        ids_U, count_U = self.keys
        ids = it.sequence_I if self.norm.mode == "sequence" else it.group_I
        if ids_U.numel() == 0:
            return mask * 0.0
        pos = torch.searchsorted(ids_U.to(ids.device), ids).clamp(max=ids_U.numel() - 1)
        n = count_U.to(ids.device, torch.float64)[pos].clamp(min=1.0)
        return torch.where(it.mask_I, 1.0 / (self.units * n), torch.zeros_like(mask))


def gather_table(mine: LocalRows, rows: Rows, group: ProcessGroup | None) -> list[LocalRows]:
    """Each rank's (sequence, group, count) rows [U_r] in one all-gather (int64), padding dropped.

    For a step whose rows do not fit in `begin`'s row; each rank's rows are padded to
    the longest (`norm_rows`).
    """
    seq_U, grp_U, count_U = mine
    pad = max(rows.ints("norm_rows")) - seq_U.numel()
    minus = torch.full((pad,), -1, dtype=torch.long)
    table = agree_rows(
        {
            "sequence": torch.cat([seq_U, minus]),
            "group": torch.cat([grp_U, minus]),
            "count": torch.cat([count_U, minus]),  # -1: a padding row
        },
        group=group,
        dtype=torch.int64,
    )
    return _per_rank(table, ("sequence", "group", "count"))


def _global_counts(
    mode: Mode, table: tuple[Tensor, Tensor, Tensor]
) -> tuple[tuple[Tensor, Tensor], int]:
    """Sorted global ids and their item counts, and the number of units (S or G); checks groups."""
    seq_R, grp_R, count_R = table
    key_R = seq_R if mode == "sequence" else grp_R
    ids_U, inverse = torch.unique(key_R, return_inverse=True)
    count_U = torch.zeros(ids_U.numel(), dtype=torch.long).index_add_(0, inverse, count_R)
    if mode == "group":
        _check_groups(ids_U, count_U, seq_R, grp_R)
    return (ids_U, count_U), int(ids_U.numel())


def _check_groups(ids_U: Tensor, count_U: Tensor, seq_R: Tensor, grp_R: Tensor) -> None:
    """The same error on every rank (the table is identical) for a split sequence or an empty group."""
    has = seq_R >= 0
    seqs_U, aux_U, _ = _rows_by(
        seq_R[has], grp_R[has], torch.zeros_like(seq_R[has], dtype=torch.bool)
    )
    if bool((aux_U == -2).any()):  # -2: a rank already saw the sequence under two groups
        split = seqs_U[aux_U == -2].tolist()[:8]
        raise WholebatchError(
            f"Accumulator.step: normalize='group': sequences {split} carry more than one group id "
            "(across micro-batches or ranks); every item of a sequence must carry its group's id"
        )
    if bool((count_U == 0).any()):
        empty = ids_U[count_U == 0].tolist()[:8]
        raise WholebatchError(
            f"Accumulator.step: normalize='group': groups {empty} have no item in the mask on any "
            "rank; a group's mean is then 0/0. Drop such groups from the batch, or give them ids < 0"
        )


def _local_weights(norm: Normalize, it: ItemIds) -> Tensor:
    """The mode's weights computed on one micro-batch alone (the per-micro-batch version)."""
    mask = it.mask_I.to(torch.float64)
    if norm.mode == "token":
        return mask / max(float(mask.sum()), 1.0)
    if norm.mode == "constant":
        assert norm.constant is not None
        return mask / float(norm.constant)
    ids = it.sequence_I if norm.mode == "sequence" else it.group_I
    declared = ids >= 0
    if not bool(declared.any()):
        return mask * 0.0
    uniq, inverse = torch.unique(ids[declared], return_inverse=True)
    n = torch.zeros(uniq.numel(), dtype=torch.float64, device=mask.device)
    n.index_add_(0, inverse, mask[declared])
    w = torch.zeros_like(mask)
    w[declared] = mask[declared] / (uniq.numel() * n[inverse].clamp(min=1.0))
    return w


# -- naming a normalisation (for verify) ----------------------------------------------


def mode_weights(
    mode: Mode,
    items: Sequence[Sequence[Mapping[str, Tensor]]],
    *,
    constant: float | None = None,
    scope: Scope = "step",
) -> list[list[Tensor]]:
    """Per-item weights [rank][micro-batch] -> [I] (float64) under `mode`, for one process holding every rank's items.

    `items[r][k]` is what `items_fn` returned for rank r's micro-batch k. `scope="step"`:
    the mode's whole-batch definition; "micro_batch": each micro-batch normalised on its
    own and the K x W micro-batch losses averaged (the common accumulation bug).
    """
    norm = Normalize(mode, items=lambda mb: mb, constant=constant)
    ids = [[_must(read_items(norm, mb, k)) for k, mb in enumerate(rank)] for rank in items]
    w, k = len(ids), max((len(r) for r in ids), default=1)
    if scope == "micro_batch":
        return [[_local_weights(norm, it) / (k * w) for it in rank] for rank in ids]
    flat = [it for rank in ids for it in rank]
    if norm.mode == "token":
        n = max(sum(float(it.mask_I.sum()) for it in flat), 1.0)
        return [[it.mask_I.to(torch.float64) / n for it in rank] for rank in ids]
    table = _key_rows(flat, norm.mode) if norm.mode != "constant" else None
    weights = StepWeights(norm, flat, world_size=1, table=table)
    out, i = [], 0
    for rank in ids:
        out.append([weights.for_micro_batch(i + j) for j in range(len(rank))])
        i += len(rank)
    return out


def _must(result: tuple[ItemIds | None, str | None]) -> ItemIds:
    ids, error = result
    if error is not None:
        raise WholebatchError(f"mode_weights: {error}")
    assert ids is not None
    return ids


def match_normalization(
    items: Sequence[Sequence[Mapping[str, Tensor]]],
    weights: Sequence[Sequence[Tensor]],
    *,
    constant: float | None = None,
    rtol: float = 1e-6,
) -> tuple[Mode, Scope] | None:
    """Which (mode, scope) the per-item `weights` [rank][micro-batch] -> [I] match, or None.

    Pure, one process: give it every rank's `items_fn` output and the weights the
    split step applied to each item (e.g. d(step loss)/d(item loss)). Modes whose ids
    are missing from `items` (or "constant" without `constant`) are not tried.
    """
    for mode in MODES:
        for scope in ("step", "micro_batch"):
            try:
                want = mode_weights(mode, items, constant=constant, scope=scope)  # type: ignore[arg-type]
            except WholebatchError:
                continue
            if _close(want, weights, rtol):
                return mode, scope  # type: ignore[return-value]
    return None


def _close(a: Sequence[Sequence[Tensor]], b: Sequence[Sequence[Tensor]], rtol: float) -> bool:
    flat_a = [t.reshape(-1).double().cpu() for r in a for t in r]
    flat_b = [t.reshape(-1).double().cpu() for r in b for t in r]
    if [t.numel() for t in flat_a] != [t.numel() for t in flat_b]:
        return False
    if not flat_a:
        return True
    x, y = torch.cat(flat_a), torch.cat(flat_b)
    scale = float(x.abs().max().clamp(min=1e-300))
    return float((x - y).abs().max()) <= rtol * scale


def mismatch_text(found: tuple[Mode, Scope], expected: tuple[Mode, Scope]) -> str:
    """'the step normalises per micro-batch sequence means; the reference averages whole sequences'."""

    def said(m: tuple[Mode, Scope], verb: str) -> str:
        mode, scope = m
        where = "over the whole step" if scope == "step" else "per micro-batch"
        return f"{verb} {_MEANING[mode]} {where}"

    return f"{said(found, 'the step takes')}; {said(expected, 'the reference takes')}"
