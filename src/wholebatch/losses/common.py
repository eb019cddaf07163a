"""What every whole-batch loss shares: validation agreed across ranks, agreed scalars, the whole-batch sum.

`prepare` runs on every rank before any loss moves data:

1. Local checks (shapes, dtypes, scalars, options, `tile_size`, `sizes`).
2. The exchange, when the per-rank row counts are unknown (`sizes=None`) or
   the cross-rank checks are on (`check=`, `wholebatch.set_checks`, default on):
   one named float64 row per rank (`wholebatch.comm.agree.start_rows`: one
   all-gather, read back by field name) carrying its rows, dim, dtype,
   device, options, `grad_reduction`, the `sizes` it was given and its
   scalar values, and whether its local checks failed (a value or a type
   error: the kind travels in the row, the text in one more all-gather), then
   a room for the rank's rows (`wholebatch.losses.room`; the small path uses
   them). Tensor scalars on an accelerator ride in that row as tensors (copied
   on the device, never read on their own: no host sync); a plain CPU tensor's
   value is read as a number. Every rank runs the same checks on the same
   table, so a bad input raises the same error on every rank. On CUDA with
   NCCL reading the table is the one host sync of the call; with `sizes=`
   given and checks off there is no exchange at all.
3. The agreement (W > 1). When the exchange ran, it found the scalars and the
   reduction equal on every rank (or raised): the forward uses each rank's
   values as they are, with no collective. Without the exchange (`sizes=`
   with checks off), one all-reduce (max) of the scalars and the reduction
   code, on the device: when ranks agree (the caller promises it) this
   returns every value unchanged; when they do not, every rank still
   computes with the same values, never a silently different loss per rank.
   Either way the backward sends each scalar's gradient to every rank holding
   the value (split evenly among ties: all ranks when they agree; one
   all-reduce of the gradients after the exchange, of the gradients and the
   tie counts after the max), so every rank's copy of `logit_scale` receives the
   same gradient dL/ds (after DDP's mean: dL/ds; with ``grad_reduction="sum"``
   each rank gets dL/ds / W and the sum is dL/ds).

The tile size need not agree: every kernel's result is independent of how
each rank tiles its own share (NT-Xent deals its work from N and W alone).

Legend: W ranks, B this rank's rows, N global rows, D embedding dim.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from wholebatch.comm import direct
from wholebatch.comm.agree import Field, PendingRows, Rows, expect_rows, start_rows
from wholebatch.comm.checks import errors_text, gather_errors, per_rank
from wholebatch.comm.collectives import all_reduce
from wholebatch.comm.groups import checks_enabled, get_rank, get_world_size
from wholebatch.conventions import GRAD_REDUCTIONS, grad_reduction_error
from wholebatch.errors import WholebatchError, WholebatchTypeError
from wholebatch.losses import room
from wholebatch.losses.sizing import (
    auto_strategy,
    exchange_row_elements,
    replicates,
    sizes_fingerprint,
    small_rows,
)
from wholebatch.losses.tiles import compute_dtype, tile_size_for

__all__ = [
    "Prepared",
    "Problem",
    "prepare",
    "resolve_strategy",
    "resolve_tile",
    "whole",
]

_REDUCTIONS: tuple[str, ...] = GRAD_REDUCTIONS
_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_MSG_BYTES = 480
_REPLICATED_FIX = (
    "it is a replicated parameter: every rank must hold the same value "
    "(keep it in the DDP module, or broadcast it)"
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prepared:
    """What a loss needs once its inputs are validated and agreed."""

    sizes: list[int]
    """Every rank's row count B, in rank order."""
    scalars: list[Tensor]
    """The scalar arguments, in order: 0-d tensors of the compute dtype, agreed across ranks."""
    grad_factor: Tensor | float
    """What `whole` multiplies the gradient by: 1 for "mean", 1/W for "sum"."""
    replicated: bool = False
    """The small path runs (`wholebatch.losses.replicated`): every rank computes the whole loss.
    Then `scalars` are this rank's own values, not yet agreed (see `checked`)."""
    checked: bool = True
    """The exchange ran (the scalars and the reduction were found equal on every rank)."""
    carried_WC: Tensor | None = None
    """Every rank's rows as bytes, carried by the exchange (`losses.room`'s room each, zero
    padded), or None; a rank's are there when they fit (every rank knows: agreed sizes)."""


@dataclasses.dataclass(frozen=True)
class Problem:
    """A rank-local finding about a loss's arguments: what is wrong, and which exception says it."""

    text: str
    """The message, without the op's name."""
    type_error: bool = False
    """Raised as `WholebatchTypeError` (a wrong type, dtype or device) rather than `WholebatchError`."""

    @property
    def code(self) -> int:
        """Its exchange field: 1 a value error, 2 a type error (0: none)."""
        return 2 if self.type_error else 1

    def raise_for(self, op: str) -> NoReturn:
        """Raise it, named for `op`."""
        raise (WholebatchTypeError if self.type_error else WholebatchError)(f"{op}: {self.text}")


def _type(text: str) -> Problem:
    return Problem(text, type_error=True)


# ---------------------------------------------------------------------------
# Local checks: each returns a Problem or None
# ---------------------------------------------------------------------------


def _check_embeddings(tensors: Mapping[str, object]) -> tuple[int, int, Problem | None]:
    """(B, D, why unusable or None) for 2-D float tensors (3-D allowed as (B, k, D)) sharing B and D."""
    first: Tensor | None = None
    first_name = ""
    for name, x in tensors.items():
        if x is None:
            continue
        if not isinstance(x, Tensor):
            return 0, 0, _type(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        want = 3 if name.endswith("_BKD") else 2
        if x.dim() != want:
            what = "(rows, k, dim)" if want == 3 else "(rows, dim)"
            return 0, 0, Problem(f"{name} must be {want}-D {what}, got shape {tuple(x.shape)}")
        if x.dtype not in _DTYPES:
            return 0, 0, _type(f"{name} must be float32/float64/float16/bfloat16, got {x.dtype}")
        if first is None:
            first, first_name = x, name
            continue
        if x.shape[0] != first.shape[0] or x.shape[-1] != first.shape[-1]:
            return (
                0,
                0,
                Problem(
                    f"{name} has shape {tuple(x.shape)} but {first_name} has {tuple(first.shape)}; "
                    "row i of each is the same sample, so rows and dim must match on every rank"
                ),
            )
        if x.dtype != first.dtype or x.device != first.device:
            return (
                0,
                0,
                _type(
                    f"{name} is {x.dtype} on {x.device} but {first_name} is {first.dtype} on "
                    f"{first.device}; pass them with one dtype and device"
                ),
            )
    assert first is not None
    return first.shape[0], first.shape[-1], None


def _check_scalar(name: str, value: object) -> Problem | None:
    if isinstance(value, Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            return _type(
                f"{name} must be a float scalar (a 1-element tensor or a number), "
                f"got a {value.dtype} tensor of shape {tuple(value.shape)}"
            )
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return _type(
            f"{name} must be a float scalar tensor or a number, got {type(value).__name__}"
        )
    return None


def _check_sizes(sizes: object, w: int, r: int, b: int) -> Problem | None:
    if sizes is None:
        return None
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        return _type(
            f"sizes must be a sequence of {w} ints (rows per rank), got {type(sizes).__name__}"
        )
    vals = list(sizes)
    if len(vals) != w or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in vals):
        return Problem(f"sizes={vals!r} must hold {w} non-negative ints, one per rank")
    if vals[r] != b:
        return Problem(f"sizes[{r}]={vals[r]} but this rank passes {b} rows")
    return None


def _check_tile(tile_size: object) -> Problem | None:
    if tile_size is None or (
        isinstance(tile_size, int) and not isinstance(tile_size, bool) and tile_size >= 1
    ):
        return None
    return Problem(
        f"tile_size={tile_size!r} must be a positive int or None (chosen for the device)"
    )


def _local_problem(
    embeddings: Mapping[str, object],
    scalars: Mapping[str, object],
    grad_reduction: object,
    tile_size: object,
    sizes: object,
    error: str | None,
    w: int,
    r: int,
) -> tuple[int, Problem | None]:
    """(B, the first local problem or None), in the order the checks have always run."""
    b, _, err = _check_embeddings(embeddings)
    if error is not None:
        err = Problem(error)
    for name, value in scalars.items():
        err = err or _check_scalar(name, value)
    if err is None and (bad := grad_reduction_error(grad_reduction)) is not None:
        err = Problem(bad)
    err = err or _check_tile(tile_size)
    return b, err or _check_sizes(sizes, w, r, b)


def resolve_tile(tile_size: int | None, device: torch.device, rows: int, cols: int) -> int:
    """The tile side to use: `tile_size`, or `tile_size_for` the device and the sweep."""
    if tile_size is None:
        return tile_size_for(device.type, rows, cols)
    return tile_size


def resolve_strategy(strategy: str, gathered_bytes: int) -> str:
    """ "gather" or "ring": `strategy` itself, or what "auto" picks (`sizing.auto_strategy`).

    Every rank decides alike: the strategy was agreed (an exchange column) and
    `gathered_bytes` comes from agreed numbers (N, k, D, the dtype).
    """
    return auto_strategy(gathered_bytes) if strategy == "auto" else strategy


def _scalar_tensor(value: Tensor | float, like: Tensor) -> Tensor:
    """`value` as a 0-d tensor of the compute dtype on `like`'s device (gradient flows; no host copy)."""
    acc = compute_dtype(like.dtype)
    if isinstance(value, Tensor):
        return value.reshape(()).to(device=like.device, dtype=acc)
    return torch.full((), float(value), dtype=acc, device=like.device)


# ---------------------------------------------------------------------------
# The exchange and the agreement
# ---------------------------------------------------------------------------


def prepare(
    op: str,
    embeddings: Mapping[str, object],
    scalars: Mapping[str, object],
    *,
    grad_reduction: object,
    tile_size: object,
    sizes: object = None,
    check: bool | None = None,
    options: Mapping[str, tuple[float, str]] | None = None,
    error: str | None = None,
    group: ProcessGroup | None = None,
    small: bool = False,
    carry: bool = False,
) -> Prepared:
    """Validate on every rank, agree across ranks; see the module docstring.

    Args:
        op: the loss's name, for messages.
        embeddings: name -> this rank's tensor (2-D (B, D); a name ending in
            ``_BKD`` is 3-D (B, k, D); None is skipped).
        scalars: name -> a float or a 1-element float tensor, the same on every rank.
        grad_reduction: "mean" or "sum".
        tile_size: a positive int, or None (chosen per device).
        sizes: every rank's B if the caller knows them, else None.
        check: run the cross-rank checks even when `sizes` is given (default:
            the process setting, on).
        options: name -> (a number that must agree across ranks, how to fix it).
        error: the caller's own finding about its other arguments (raised like
            the checks here, as a value error: the same on every rank).
        group: the process group.
        small: the loss offers the small path for this call (`Prepared.replicated`
            when the whole batch is small: `sizing.replicates` on the agreed N, the
            embeddings' row width and the smallest row limit over ranks).
        carry: the exchange carries this rank's rows of every embedding
            (`wholebatch.losses.room`, `Prepared.carried_WC`); the same on every rank
            (a loss passes it always, whatever its other arguments).
    """
    options = options or {}
    w, r = get_world_size(group), get_rank(group)
    checked = sizes is None or checks_enabled(check)
    rows_bytes, expected = _receives(group, w, len(options), len(scalars), carry, checked)
    b, err = _local_problem(embeddings, scalars, grad_reduction, tile_size, sizes, error, w, r)
    first = next(x for x in embeddings.values() if x is not None)
    if w == 1:
        if err is not None:
            err.raise_for(op)
        if b == 0:
            raise WholebatchError(f"{op}: the whole batch has 0 rows; pass at least one row")
        assert isinstance(first, Tensor)
        vals = [_scalar_tensor(v, first) for v in scalars.values()]  # type: ignore[arg-type]
        return Prepared(sizes=[b], scalars=vals, grad_factor=1.0)
    values: list[Tensor | float] = list(scalars.values())  # type: ignore[arg-type]
    if checked:
        elem = first.element_size() if isinstance(first, Tensor) else 0
        fits = err is None and b * _row_elements(embeddings) * elem <= rows_bytes
        # only rows that fit the room are copied (a large batch is never copied)
        data = [x for x in embeddings.values() if isinstance(x, Tensor)] if fits else None
        row = _row(embeddings, scalars, grad_reduction, sizes, options, err)
        pending = start_rows(
            row, group=group, carry=data, carry_bytes=rows_bytes, expected=expected
        )
        # while the exchange is in flight: what the call needs whatever the table says
        own = None if err is not None else [_scalar_tensor(v, first) for v in values]  # type: ignore[arg-type]
        table = _exchange_done(op, pending, len(options), len(scalars), err, group)
        agreed = _check_table(op, table, list(embeddings), list(scalars), options)
        if carry:  # agreed numbers only: every rank records the same
            room.record(group, max(agreed) * _row_elements(embeddings) * elem)
        limit = min(table.ints("small rows"))
    elif err is not None:
        # Nothing is exchanged (sizes given, checks off): a local error is raised here,
        # as the collectives do with their checks off.
        err.raise_for(op)
    else:
        agreed = [int(v) for v in sizes]  # type: ignore[attr-defined]
        limit = small_rows()
    if sum(agreed) == 0:
        raise WholebatchError(
            f"{op}: the whole batch has 0 rows (rows per rank {per_rank(agreed)}); "
            "at least one rank must pass rows"
        )
    assert isinstance(first, Tensor)
    if not checked:
        own = [_scalar_tensor(v, first) for v in values]
    assert own is not None  # an error anywhere was raised by the exchange
    if small and replicates(sum(agreed), _row_elements(embeddings), first.element_size(), limit):
        # every rank computes the whole loss: no agreement collective here (losses/replicated.py)
        return Prepared(
            sizes=agreed, scalars=own, grad_factor=1.0 / w if grad_reduction == "sum" else 1.0,
            replicated=True, checked=checked, carried_WC=table.carried_WC if checked else None,
        )  # fmt: skip
    if checked:  # the exchange found every scalar and the reduction equal on every rank
        vals, factor = _replicated(first, own, str(grad_reduction), w, group)
    else:
        vals, factor = _agree(first, values, str(grad_reduction), w, group)
    return Prepared(sizes=agreed, scalars=vals, grad_factor=factor)


def _receives(
    group: ProcessGroup | None, w: int, options: int, scalars: int, carry: bool, checked: bool
) -> tuple[int, direct.Expected | None]:
    """(the exchange's room for rows, its receives posted now, or None without it).

    The receives go out first: a peer's row then moves the moment the peer sends it,
    while this rank still checks and builds its own (`comm.direct.expect_flat`). The
    room is the group's, the same on every rank."""
    if not checked or w == 1:
        return 0, None
    rows_bytes = room.room(group, w) if carry else 0
    row = exchange_row_elements(options, scalars)
    return rows_bytes, expect_rows(row, group=group, carry_bytes=rows_bytes)


def _row_elements(embeddings: Mapping[str, object]) -> int:
    """Elements per sample over every embedding (a (B, k, D) tensor counts k·D)."""
    return sum(math.prod(x.shape[1:]) for x in embeddings.values() if isinstance(x, Tensor))


def _factor(like: Tensor, grad_reduction: str, w: int) -> Tensor:
    acc = compute_dtype(like.dtype)
    return torch.full(
        (), 1.0 / w if grad_reduction == "sum" else 1.0, dtype=acc, device=like.device
    )


def _option(name: str) -> str:
    return f"option {name}"


def _scalar(name: str) -> str:
    return f"scalar {name}"


def _row(
    embeddings: Mapping[str, object],
    scalars: Mapping[str, object],
    grad_reduction: object,
    sizes: object,
    options: Mapping[str, tuple[float, str]],
    err: Problem | None,
) -> dict[str, Field]:
    """This rank's exchange row, by field name (`exchange_row_elements` long)."""
    ok = err is None
    first = next((x for x in embeddings.values() if isinstance(x, Tensor)), None)
    usable = ok and first is not None
    assert not usable or first is not None
    row: dict[str, Field] = {
        "error": 0 if err is None else err.code,
        "rows": first.shape[0] if usable else 0,  # type: ignore[union-attr]
        "dim": first.shape[-1] if usable else 0,  # type: ignore[union-attr]
        "dtype": _DTYPES.index(first.dtype) if usable else -1,  # type: ignore[union-attr]
        "device": float(first.device.type != "cpu") if usable else -1,  # type: ignore[union-attr]
        "grad_reduction": _REDUCTIONS.index(str(grad_reduction)) if ok else -1,
        "small rows": small_rows(),
    }
    for name, (number, _) in options.items():
        row[_option(name)] = float(number) if ok else 0.0
    given = ok and sizes is not None
    row["sizes given"] = 1.0 if given else -1.0
    row["sizes fingerprint"] = sizes_fingerprint(list(sizes)) if given else 0.0  # type: ignore[call-overload]
    for name, value in scalars.items():
        if ok and isinstance(value, Tensor):
            row[_scalar(name)] = value  # stays on its device until the gather: no host sync
        else:
            row[_scalar(name)] = float(value) if ok else 0.0  # type: ignore[arg-type]
    return row


def _exchange_done(
    op: str,
    pending: PendingRows,
    options: int,
    scalars: int,
    err: Problem | None,
    group: ProcessGroup | None,
) -> Rows:
    """The exchange's table once every rank's row arrived (`start_rows`); a local problem
    anywhere is raised on every rank."""
    rows = pending.wait()
    assert rows.table_WF.shape[1] == exchange_row_elements(options, scalars), "row"
    flagged = rows.ranks_where("error")
    if flagged:
        marks = [q in flagged for q in range(rows.world_size)]
        bad = gather_errors(err.text if err else None, marks, group, max_bytes=_MSG_BYTES)
        codes = rows.ints("error")
        type_error = all(codes[q] == 2 for q in flagged)
        Problem(errors_text(bad), type_error=type_error).raise_for(op)
    return rows


# Header fields that must agree: (field, what, fix, how a value is shown, type error?).
_HEADER_CHECKS: tuple[tuple[str, str, str, Callable[[float], object], bool], ...] = (
    ("dim", "embedding dim", "", int, False),
    ("dtype", "dtype", "cast every rank's embeddings to one dtype",
     lambda v: str(_DTYPES[int(v)]).replace("torch.", ""), True),
    ("device", "device type", "put every rank's embeddings on the same kind of device",
     lambda v: "cpu" if v == 0 else "accelerator", True),
    ("grad_reduction", "grad_reduction", "pass the same grad_reduction on every rank",
     lambda v: _REDUCTIONS[int(v)], False),
)  # fmt: skip
_HEADER_FIELDS = tuple(check[0] for check in _HEADER_CHECKS)


def _check_table(
    op: str,
    rows: Rows,
    names: list[str],
    scalar_names: list[str],
    options: Mapping[str, tuple[float, str]],
) -> list[int]:
    """Raise the same error on every rank if anything that must agree does not; return the sizes."""
    fields = itertools.chain(_HEADER_FIELDS, map(_option, options), map(_scalar, scalar_names))
    if not rows.same_all(fields):  # name the first that differs
        checks = [
            (
                field,
                what,
                fix or f"every rank's {'/'.join(names)} must have the same dim",
                shown,
                typ,
            )
            for field, what, fix, shown, typ in _HEADER_CHECKS
        ]
        checks += [(_option(n), n, fix, int, False) for n, (_, fix) in options.items()]
        checks += [(_scalar(n), n, _REPLICATED_FIX, _same_value, False) for n in scalar_names]
        for field, what, fix, shown, type_error in checks:
            if not rows.same(field):
                vals = per_rank([shown(v) for v in rows[field]])
                Problem(f"{what} differs across ranks {vals}; {fix}", type_error).raise_for(op)
    counts = list(rows.ints("rows"))
    want = sizes_fingerprint(counts)
    given, prints = rows["sizes given"], rows["sizes fingerprint"]
    wrong = [q for q in range(rows.world_size) if given[q] >= 0 and prints[q] != want]
    if wrong:
        raise WholebatchError(
            f"{op}: the sizes= passed on ranks {wrong} differ from the rows the ranks pass "
            f"{per_rank(counts)}; pass every rank's row count, the same list on every rank"
        )
    return counts


def _same_value(v: float) -> object:
    return v


class _Replicated(torch.autograd.Function):
    """Identity in the forward (every rank holds the same values: checked); backward: all-reduce
    (mean) of the gradient, so every rank's copy gets the same sum over ranks / W, what the
    agreement's max gives W tied ranks."""

    @staticmethod
    def forward(ctx: Any, vec: Tensor, group: Any) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return vec.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return all_reduce(grad.contiguous(), "mean", group=ctx.group, check=False), None


def _replicated(
    like: Tensor, values: Sequence[Tensor | float], grad_reduction: str, w: int, group: Any
) -> tuple[list[Tensor], Tensor]:
    """`_agree` once the exchange has checked the values equal: no forward collective; the
    backward sends every rank the mean of the scalars' gradients (one all-reduce)."""
    factor = _factor(like, grad_reduction, w)
    if not values:
        return [], factor
    vec = torch.stack([_scalar_tensor(v, like) for v in values])
    return list(_Replicated.apply(vec, group).unbind()), factor  # type: ignore[no-untyped-call]


def _agree(
    like: Tensor, values: list[Tensor | float], grad_reduction: str, w: int, group: Any
) -> tuple[list[Tensor], Tensor]:
    """The scalars and the reduction agreed by one all-reduce (max), differentiable, on the device."""
    acc = compute_dtype(like.dtype)
    code = torch.full((), float(_REDUCTIONS.index(grad_reduction)), dtype=acc, device=like.device)
    vec = torch.stack([*[_scalar_tensor(v, like) for v in values], code])
    agreed = all_reduce(vec, "max", group=group, check=False)
    one = torch.ones((), dtype=acc, device=like.device)
    factor = torch.where(agreed[-1].detach() > 0.5, one / w, one)
    return list(agreed[:-1].unbind()), factor


# ---------------------------------------------------------------------------
# The whole-batch scalar and its gradient convention
# ---------------------------------------------------------------------------


class _ScaleGrad(torch.autograd.Function):
    """Identity in the forward; the backward multiplies the gradient by `factor` (a tensor)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, factor: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(factor)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        (factor,) = ctx.saved_tensors
        return grad * factor.to(grad.dtype), None


def whole(local: Tensor, prep: Prepared, group: ProcessGroup | None) -> Tensor:
    """L = sum over ranks of each rank's share, the same on every rank.

    Backward: all-reduce (sum) of every rank's upstream gradient, so with each
    rank back-propagating L every share gets W: after DDP's mean, exactly dL.
    With ``grad_reduction="sum"`` the gradient is divided by W instead, so a sum
    over ranks gives exactly dL. (The small path, `wholebatch.losses.replicated`, has its own.)
    """
    if get_world_size(group) == 1:
        return local
    total = all_reduce(local, "sum", group=group, check=False)
    if isinstance(prep.grad_factor, Tensor):
        out: Tensor = _ScaleGrad.apply(total, prep.grad_factor)  # type: ignore[no-untyped-call]
        return out
    return total
