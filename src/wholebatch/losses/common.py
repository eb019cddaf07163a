"""What every whole-batch loss shares: validation agreed across ranks, agreed scalars, the whole-batch sum.

`prepare` runs on every rank before any loss moves data:

1. Local checks (shapes, dtypes, scalars, options, `tile_size`, `sizes`).
2. The exchange, when the per-rank row counts are unknown (`sizes=None`) or
   the cross-rank checks are on (`check=`, `wholebatch.set_checks`, default on):
   one all-gather of a small float64 row per rank carrying its rows, dim,
   dtype, device, options, `grad_reduction`, the `sizes` it was given and its
   scalar values. Tensor scalars ride in that row as tensors (concatenated on
   the device, never read on their own): no `.item()`. Every rank runs the
   same checks on the same table, so a bad input raises the same error on
   every rank. On CUDA with NCCL reading the table is the one host sync of
   the call; with `sizes=` given and checks off there is no exchange at all.
3. The agreement (W > 1, always): one all-reduce (max) of the scalars and the
   reduction code, on the device. When ranks agree (the checks above say so,
   or the caller promises it) this returns every value unchanged; when checks
   are off and they do not, every rank still computes with the same values,
   never a silently different loss per rank. Its backward sends each scalar's
   gradient to every rank holding the value (split evenly among ties: all
   ranks when they agree), so every rank's copy of `logit_scale` receives the
   same gradient dL/ds (after DDP's mean: dL/ds; with ``grad_reduction="sum"``
   each rank gets dL/ds / W and the sum is dL/ds).

The tile size need not agree: every kernel's result is independent of how
each rank tiles its own share (NT-Xent deals its work from N and W alone).

Legend: W ranks, B this rank's rows, N global rows, D embedding dim.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from wholebatch.comm.checks import errors_text, gather_errors, per_rank
from wholebatch.comm.collectives import all_gather, all_reduce
from wholebatch.comm.groups import checks_enabled, comm_device, get_rank, get_world_size
from wholebatch.conventions import GRAD_REDUCTIONS, grad_reduction_error
from wholebatch.errors import WholebatchError, WholebatchTypeError
from wholebatch.losses.sizing import EXCHANGE_HEADER, exchange_row_elements, sizes_fingerprint
from wholebatch.losses.tiles import compute_dtype, tile_size_for

__all__ = ["Prepared", "prepare", "resolve_tile", "whole"]

_REDUCTIONS: tuple[str, ...] = GRAD_REDUCTIONS
_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_MSG_BYTES = 480
# Header of an exchanged row: error flag, rows, dim, dtype, device, reduction
# (its length and the row's are in `sizing`, which the planner reads too).
_ERR, _ROWS, _DIM, _DTYPE, _DEVICE, _RED = range(EXCHANGE_HEADER)
_HEADER = EXCHANGE_HEADER


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prepared:
    """What a loss needs once its inputs are validated and agreed."""

    sizes: list[int]
    """Every rank's row count B, in rank order."""
    scalars: list[Tensor]
    """The scalar arguments, in order: 0-d tensors of the compute dtype, agreed across ranks."""
    grad_factor: Tensor | float
    """What `whole` multiplies the gradient by: 1 for "mean", 1/W for "sum"."""


# ---------------------------------------------------------------------------
# Local checks: each returns a message ("T..." type error, "V..." value error) or None
# ---------------------------------------------------------------------------


def _check_embeddings(tensors: Mapping[str, object]) -> tuple[int, int, str | None]:
    """(B, D, why unusable or None) for 2-D float tensors (3-D allowed as (B, k, D)) sharing B and D."""
    first: Tensor | None = None
    first_name = ""
    for name, x in tensors.items():
        if x is None:
            continue
        if not isinstance(x, Tensor):
            return 0, 0, f"T{name} must be a torch.Tensor, got {type(x).__name__}"
        want = 3 if name.endswith("_BKD") else 2
        if x.dim() != want:
            what = "(rows, k, dim)" if want == 3 else "(rows, dim)"
            return 0, 0, f"V{name} must be {want}-D {what}, got shape {tuple(x.shape)}"
        if x.dtype not in _DTYPES:
            return 0, 0, f"T{name} must be float32/float64/float16/bfloat16, got {x.dtype}"
        if first is None:
            first, first_name = x, name
            continue
        if x.shape[0] != first.shape[0] or x.shape[-1] != first.shape[-1]:
            return (
                0,
                0,
                (
                    f"V{name} has shape {tuple(x.shape)} but {first_name} has {tuple(first.shape)}; "
                    "row i of each is the same sample, so rows and dim must match on every rank"
                ),
            )
        if x.dtype != first.dtype or x.device != first.device:
            return (
                0,
                0,
                (
                    f"T{name} is {x.dtype} on {x.device} but {first_name} is {first.dtype} on "
                    f"{first.device}; pass them with one dtype and device"
                ),
            )
    assert first is not None
    return first.shape[0], first.shape[-1], None


def _check_scalar(name: str, value: object) -> str | None:
    if isinstance(value, Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            return (
                f"T{name} must be a float scalar (a 1-element tensor or a number), "
                f"got a {value.dtype} tensor of shape {tuple(value.shape)}"
            )
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"T{name} must be a float scalar tensor or a number, got {type(value).__name__}"
    return None


def _check_sizes(sizes: object, w: int, r: int, b: int) -> str | None:
    if sizes is None:
        return None
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        return f"Tsizes must be a sequence of {w} ints (rows per rank), got {type(sizes).__name__}"
    vals = list(sizes)
    if len(vals) != w or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in vals):
        return f"Vsizes={vals!r} must hold {w} non-negative ints, one per rank"
    if vals[r] != b:
        return f"Vsizes[{r}]={vals[r]} but this rank passes {b} rows"
    return None


def resolve_tile(tile_size: int | None, device: torch.device, rows: int, cols: int) -> int:
    """The tile side to use: `tile_size`, or `tile_size_for` the device and the sweep."""
    if tile_size is None:
        return tile_size_for(device.type, rows, cols)
    return tile_size


def _raise(op: str, msg: str) -> NoReturn:
    kind, text = msg[0], msg[1:]
    raise (WholebatchTypeError if kind == "T" else WholebatchError)(f"{op}: {text}")


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
            the checks here: the same on every rank).
        group: the process group.
    """
    options = options or {}
    w, r = get_world_size(group), get_rank(group)
    b, _, err = _check_embeddings(embeddings)
    if error is not None:
        err = "V" + error
    for name, value in scalars.items():
        err = err or _check_scalar(name, value)
    if err is None and (bad := grad_reduction_error(grad_reduction)) is not None:
        err = "V" + bad
    if (
        err is None
        and tile_size is not None
        and (isinstance(tile_size, bool) or not isinstance(tile_size, int) or tile_size < 1)
    ):
        err = f"Vtile_size={tile_size!r} must be a positive int or None (chosen for the device)"
    err = err or _check_sizes(sizes, w, r, b)
    first = next(x for x in embeddings.values() if x is not None)
    if w == 1:
        if err is not None:
            _raise(op, err)
        if b == 0:
            raise WholebatchError(f"{op}: the whole batch has 0 rows; pass at least one row")
        assert isinstance(first, Tensor)
        vals = [_scalar_tensor(v, first) for v in scalars.values()]  # type: ignore[arg-type]
        return Prepared(sizes=[b], scalars=vals, grad_factor=1.0)
    if sizes is None or checks_enabled(check):
        table = _exchange(op, embeddings, scalars, grad_reduction, sizes, options, err, group)
        agreed = _check_table(op, table, list(embeddings), list(scalars), options, w)
    elif err is not None:
        # Nothing is exchanged (sizes given, checks off): a local error is raised here,
        # as the collectives do with their checks off.
        _raise(op, err)
    else:
        agreed = [int(v) for v in sizes]  # type: ignore[attr-defined]
    if sum(agreed) == 0:
        raise WholebatchError(
            f"{op}: the whole batch has 0 rows (rows per rank {per_rank(agreed)}); "
            "at least one rank must pass rows"
        )
    assert isinstance(first, Tensor)
    vals, factor = _agree(first, list(scalars.values()), str(grad_reduction), w, group)  # type: ignore[arg-type]
    return Prepared(sizes=agreed, scalars=vals, grad_factor=factor)


def _exchange(
    op: str,
    embeddings: Mapping[str, object],
    scalars: Mapping[str, object],
    grad_reduction: object,
    sizes: object,
    options: Mapping[str, tuple[float, str]],
    err: str | None,
    group: ProcessGroup | None,
) -> list[list[float]]:
    w = get_world_size(group)
    dev = comm_device(group)
    b, d = 0, 0
    first = next((x for x in embeddings.values() if isinstance(x, Tensor)), None)
    if err is None and isinstance(first, Tensor):
        b, d = first.shape[0], first.shape[-1]
    head = [
        float(err is not None),
        float(b),
        float(d),
        float(_DTYPES.index(first.dtype)) if err is None and first is not None else -1.0,
        float(first.device.type != "cpu") if err is None and first is not None else -1.0,
        float(_REDUCTIONS.index(str(grad_reduction))) if err is None else -1.0,
    ]
    head += [float(v) if err is None else 0.0 for v, _ in options.values()]
    given = err is None and sizes is not None
    head += [1.0, sizes_fingerprint(list(sizes))] if given else [-1.0, 0.0]  # type: ignore[call-overload]
    parts = [torch.tensor(head, dtype=torch.float64, device=dev)]
    for value in scalars.values():
        if err is None and isinstance(value, Tensor):
            parts.append(value.detach().reshape(1).to(device=dev, dtype=torch.float64))
        else:
            num = float(value) if err is None else 0.0  # type: ignore[arg-type]
            parts.append(torch.full((1,), num, dtype=torch.float64, device=dev))
    mine = torch.cat(parts)
    n = mine.numel()
    assert n == exchange_row_elements(len(options), len(scalars)), "exchange row layout"
    table: list[list[float]] = (
        all_gather(mine, sizes=[n] * w, group=group, check=False).view(w, n).tolist()
    )
    if any(t[_ERR] for t in table):
        bad = gather_errors(err, [bool(t[_ERR]) for t in table], group, max_bytes=_MSG_BYTES)
        kind = "T" if all(m[0] == "T" for m in bad.values()) else "V"
        _raise(op, kind + errors_text({q: m[1:] for q, m in bad.items()}))
    return table


def _check_table(
    op: str,
    table: list[list[float]],
    names: list[str],
    scalar_names: list[str],
    options: Mapping[str, tuple[float, str]],
    w: int,
) -> list[int]:
    """Raise the same error on every rank if anything that must agree does not; return the sizes."""
    n_opt = len(options)
    columns: list[tuple[int, str, str]] = [
        (_DIM, "embedding dim", f"every rank's {'/'.join(names)} must have the same dim"),
        (_DTYPE, "dtype", "cast every rank's embeddings to one dtype"),
        (_DEVICE, "device type", "put every rank's embeddings on the same kind of device"),
        (_RED, "grad_reduction", "pass the same grad_reduction on every rank"),
    ]
    for i, (name, (_, fix)) in enumerate(options.items()):
        columns.append((_HEADER + i, name, fix))
    base = _HEADER + n_opt + 2
    for i, name in enumerate(scalar_names):
        columns.append(
            (
                base + i,
                name,
                "it is a replicated parameter: every rank must hold the same value "
                "(keep it in the DDP module, or broadcast it)",
            )
        )
    for col, what, fix in columns:
        vals = [t[col] for t in table]
        same = all(v == vals[0] or (math.isnan(v) and math.isnan(vals[0])) for v in vals)
        if not same:
            shown: list[Any] = vals
            if col == _DTYPE:
                shown = [str(_DTYPES[int(v)]).replace("torch.", "") for v in vals]
            elif col == _RED:
                shown = [_REDUCTIONS[int(v)] for v in vals]
            elif col == _DEVICE:
                shown = ["cpu" if v == 0 else "accelerator" for v in vals]
            elif col < base:
                shown = [int(v) for v in vals]
            exc = WholebatchTypeError if col in (_DTYPE, _DEVICE) else WholebatchError
            raise exc(f"{op}: {what} differs across ranks {per_rank(shown)}; {fix}")
    rows = [int(t[_ROWS]) for t in table]
    want = sizes_fingerprint(rows)
    wrong = [
        q for q, t in enumerate(table) if t[_HEADER + n_opt] >= 0 and t[_HEADER + n_opt + 1] != want
    ]
    if wrong:
        raise WholebatchError(
            f"{op}: the sizes= passed on ranks {wrong} differ from the rows the ranks pass "
            f"{per_rank(rows)}; pass every rank's row count, the same list on every rank"
        )
    return rows


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
    over ranks gives exactly dL.
    """
    if get_world_size(group) == 1:
        return local
    total = all_reduce(local, "sum", group=group, check=False)
    if isinstance(prep.grad_factor, Tensor):
        out: Tensor = _ScaleGrad.apply(total, prep.grad_factor)  # type: ignore[no-untyped-call]
        return out
    return total
