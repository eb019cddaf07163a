"""The losses' one call path: *validate* (agree across ranks), *choose* (the path), then run.

Every whole-batch loss runs

    call = validate(SPEC, tensors, scalars, ...)   # local checks, one exchange, one table
    path = call.choose(key_elements=...)           # "small", "gather" or "ring": every rank alike
    ...                                            # run: `small.evaluate` or a kernel family,
    return call.whole(share)                       # then the whole-batch sum

**Validate** (every rank, before any loss data moves):

1. Local checks of shapes, dtypes, scalars, options, `tile_size`, `sizes`; a
   problem is not raised here (the other ranks would wait) but marked.
2. The exchange, when the per-rank row counts are unknown (`sizes=None`) or the
   cross-rank checks are on (`check=`, `wholebatch.set_checks`, default on): one
   named float64 row per rank (`comm.agree.agree_rows`), its fields
   `specs.exchange_fields(spec)`: the problem mark, rows, dim, dtype, device,
   `grad_reduction`, the small-batch row limit, the spec's per-rank numbers,
   every option (the strategy first), the `sizes=` fingerprint, every scalar. It
   carries nothing else. A mark anywhere raises on every rank (the text in one
   more all-gather), then every rank runs the same checks on the same table, so
   a bad input is the same error everywhere, values shown by name. Tensor
   scalars on an accelerator ride in the row on the device (no host sync of
   their own); on CUDA with NCCL reading the table is the call's one host sync;
   with `sizes=` and checks off nothing is exchanged.
3. On a mesh (`mesh=`, `batch_dims=`), the batch dims' group is the group, and
   replicas' rows are fingerprinted around the exchange (`comm.meshgroup`).

**Choose** reads agreed numbers only (`sizing.choose`): the small path while
the whole batch is small (`small.evaluate`: every rank the whole loss from its
one reference formula), else the strategy asked for ("auto": ring past
`sizing.AUTO_RING_BYTES` of gathered keys).

**The scalars' agreement** (W > 1, not the small path): after the exchange found
them equal, the forward uses each rank's values as they are; without the
exchange, one all-reduce (max) of the scalars and the reduction code on the
device, so every rank computes with the same values even if ranks broke the
promise. Backward: each scalar's gradient reaches every rank holding the value
(split among ties), so every rank's copy gets dL/ds (after DDP's mean; with
``grad_reduction="sum"`` dL/ds / W each, summing to dL/ds).

The tile size need not agree: every kernel's result is independent of how each
rank tiles its own share, and the rings cut their messages from agreed numbers.

Legend: W ranks, B this rank's rows, N global rows, D embedding dim.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, TypeVar, cast

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from wholebatch.comm.agree import Field, Rows, agree_rows, per_rank as by_rank
from wholebatch.comm.collectives import all_reduce, apply
from wholebatch.comm.groups import checks_enabled, get_rank, get_world_size
from wholebatch.comm.meshgroup import replicas_agree, resolve_group
from wholebatch.conventions import GRAD_REDUCTIONS, grad_reduction_error
from wholebatch.errors import WholebatchError, WholebatchTypeError
from wholebatch.losses.sizing import choose, sizes_fingerprint, small_rows, tile_size_for
from wholebatch.losses.specs import STRATEGIES, LossSpec, Option, exchange_fields
from wholebatch.losses.tiles import compute_dtype

__all__ = ["SHARED", "Call", "Problem", "documented", "shared", "validate"]

SHARED = (
    "group",
    "mesh",
    "batch_dims",
    "grad_reduction",
    "tile_size",
    "sizes",
    "check",
    "strategy",
)
"""The keywords every loss takes alike (documented by `documented`, passed on by `shared`)."""


def shared(namespace: Mapping[str, Any]) -> dict[str, Any]:
    """The shared keywords' values out of a loss call's `locals()`, for `validate`."""
    return {name: namespace[name] for name in SHARED}


_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_INTS: tuple[torch.dtype, ...] = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)
_REPLICATED_FIX = (
    "it is a replicated parameter: every rank must hold the same value "
    "(keep it in the DDP module, or broadcast it)"
)


@dataclasses.dataclass(frozen=True)
class Problem:
    """A rank-local finding about a loss's arguments: what is wrong, and which exception says it."""

    text: str
    """The message, without the op's name."""
    type_error: bool = False
    """Raised as `WholebatchTypeError` (a wrong type, dtype or device) rather than `WholebatchError`."""

    def raise_for(self, op: str) -> NoReturn:
        raise (WholebatchTypeError if self.type_error else WholebatchError)(f"{op}: {self.text}")


_COMMON_ARGS = """\
group, mesh, batch_dims: the process group (default: the world), or a `DeviceMesh` and
    the dims of it that split the batch (docs/mesh.md: replicas' rows are checked alike).
grad_reduction: "mean" if parameter gradients are averaged over ranks (DDP),
    "sum" if they are summed.
tile_size: rows and columns of one logits tile (memory T² per buffer); None:
    `wholebatch.losses.tile_size_for` the device (512 on CPU). Ranks may differ.
sizes: every rank's row count B, if the caller knows them: with the cross-rank
    checks off (`check=False` or `wholebatch.set_checks(False)`) the call then makes
    no metadata exchange and no host sync.
check: run the cross-rank checks even when `sizes` is given (default: the process
    setting, on).
strategy: {strategies} (default {default!r}), the same on every rank; any other is
    refused by name."""

_F = TypeVar("_F", bound=Callable[..., Any])


def documented(spec: LossSpec) -> Callable[[_F], _F]:
    """Fill a loss docstring's ``{common}`` line with the keywords every loss shares."""

    def fill(fn: _F) -> _F:
        text = _COMMON_ARGS.format(strategies=list(spec.offered()), default=spec.default_strategy)
        lines = "\n".join(" " * 8 + line for line in text.splitlines())
        fn.__doc__ = (fn.__doc__ or "").replace(" " * 8 + "{common}", lines)
        return fn

    return fill


# ---------------------------------------------------------------------------
# Local checks: each returns a Problem or None
# ---------------------------------------------------------------------------


def _check_floats(tensors: Mapping[str, object]) -> Problem | None:
    """2-D float tensors (3-D for a name ending in ``KD``, ``QD``, ``TD``) sharing rows and dim."""
    first: Tensor | None = None
    first_name = ""
    for name, x in tensors.items():
        if x is None:
            continue
        if not isinstance(x, Tensor):
            return Problem(f"{name} must be a torch.Tensor, got {type(x).__name__}", True)
        want = 3 if name[-2:] in ("KD", "QD", "TD") else 2
        if x.dim() != want:
            what = f"(rows, {name[-2].lower()}, dim)" if want == 3 else "(rows, dim)"
            return Problem(f"{name} must be {want}-D {what}, got shape {tuple(x.shape)}")
        if x.dtype not in _DTYPES:
            return Problem(f"{name} must be float32/float64/float16/bfloat16, got {x.dtype}", True)
        if first is None:
            first, first_name = x, name
        elif x.shape[0] != first.shape[0] or x.shape[-1] != first.shape[-1]:
            return Problem(
                f"{name} has shape {tuple(x.shape)} but {first_name} has {tuple(first.shape)}; "
                "row i of each is the same sample, so rows and dim must match on every rank"
            )
        elif x.dtype != first.dtype or x.device != first.device:
            return Problem(
                f"{name} is {x.dtype} on {x.device} but {first_name} is {first.dtype} on "
                f"{first.device}; pass them with one dtype and device",
                True,
            )
    return None


def _check_labels(labels: Mapping[str, object], b: int, device: torch.device) -> Problem | None:
    """Per-row integer inputs (ids, labels): 1-D, B entries, an integer dtype, the rows' device."""
    for name, x in labels.items():
        if x is None:
            continue
        if not isinstance(x, Tensor) or x.dtype not in _INTS:
            got = x.dtype if isinstance(x, Tensor) else type(x).__name__
            return Problem(f"{name} must be an integer tensor (int64), got {got}", True)
        if x.shape != (b,):
            return Problem(
                f"{name} must hold one entry per row, shape ({b},), got {tuple(x.shape)}"
            )
        if x.device != device:
            return Problem(f"{name} is on {x.device} but the rows are on {device}", True)
    return None


def _check_scalar(name: str, value: object) -> Problem | None:
    if isinstance(value, Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            return Problem(
                f"{name} must be a float scalar (a 1-element tensor or a number), "
                f"got a {value.dtype} tensor of shape {tuple(value.shape)}",
                True,
            )
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return Problem(
            f"{name} must be a float scalar tensor or a number, got {type(value).__name__}", True
        )
    return None


def _check_sizes(sizes: object, w: int, r: int, b: int) -> Problem | None:
    if sizes is None:
        return None
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        return Problem(
            f"sizes must be a sequence of {w} ints (rows per rank), got {type(sizes).__name__}",
            True,
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


def _first_problem(checks: Sequence[Callable[[], Problem | None]]) -> Problem | None:
    for check in checks:
        found = check()
        if found is not None:
            return found
    return None


# ---------------------------------------------------------------------------
# The validated call
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Call:
    """A loss call once validated and agreed: what choosing and running it need."""

    spec: LossSpec
    group: ProcessGroup | None
    """The group the loss runs over (on a mesh, the batch dims')."""
    sizes: tuple[int, ...]
    """Every rank's row count B, in rank order."""
    per_rank: Mapping[str, tuple[int, ...]]
    """Every rank's value of each of the spec's per-rank numbers."""
    scalars: dict[str, Tensor]
    """The scalars passed, by name: 0-d tensors of the compute dtype; this rank's own until
    `choose` agrees them for a tiled path (the small path agrees its own: `small.evaluate`)."""
    grad_factor: Tensor | float
    """What the whole-batch sum multiplies the gradient by: 1 for "mean", 1/W for "sum"."""
    reduction: str
    """`grad_reduction`: "mean" or "sum" (this rank's; agreed when `checked`)."""
    checked: bool
    """The exchange ran (the scalars and the reduction were found equal on every rank)."""
    strategy: str
    """The strategy asked for (agreed)."""
    limit: int
    """The small-batch row limit (agreed: the smallest over ranks)."""
    tile_size: int | None
    """This rank's `tile_size` (None: chosen for the device)."""
    device: torch.device
    dtype: torch.dtype
    """The embeddings' device and dtype."""
    row_elements: int
    """Elements of one sample over every embedding (what the small path gathers)."""
    path: str = ""
    """"small", "gather" or "ring", once chosen (`choose`)."""

    @property
    def world(self) -> int:
        return len(self.sizes)

    @property
    def rank(self) -> int:
        return get_rank(self.group)

    @property
    def n(self) -> int:
        """N, the whole batch's rows."""
        return sum(self.sizes)

    @property
    def offset(self) -> int:
        """This rank's first row among the N."""
        return sum(self.sizes[: self.rank])

    @property
    def b(self) -> int:
        """B, this rank's rows."""
        return self.sizes[self.rank]

    @property
    def acc(self) -> torch.dtype:
        """The kernels' compute dtype (float32 for 16-bit inputs)."""
        return compute_dtype(self.dtype)

    def choose(self, *, key_elements: int, row_elements: int | None = None) -> Call:
        """This call with its `path` chosen (`sizing.choose`) from agreed numbers only:
        `key_elements` per row of the keys a gather would hold, `row_elements` per row the
        small path gathers (default: every embedding's). The tiled paths' scalars are agreed
        here (the module docstring); the small path agrees its own (`small.evaluate`)."""
        if self.world == 1:  # one process: the tiles (no small path: nothing to move)
            return dataclasses.replace(self, path="ring" if self.strategy == "ring" else "gather")
        rows = self.row_elements if row_elements is None else row_elements
        elem = torch.empty((), dtype=self.dtype).element_size()
        path = choose(self.spec, self.strategy, self.n, rows, key_elements, elem, self.limit)
        if path == "small":
            return dataclasses.replace(self, path=path)
        like = torch.empty((), dtype=self.dtype, device=self.device)
        agree = _replicated if self.checked else _agree
        values, factor = agree(like, self.scalars, self.reduction, self.world, self.group)
        return dataclasses.replace(self, path=path, scalars=values, grad_factor=factor)

    def tile(self, rows: int, cols: int) -> int:
        """The tile side for a `rows` x `cols` sweep: `tile_size`, or the device's choice."""
        if self.tile_size is not None:
            return self.tile_size
        return tile_size_for(self.device.type, rows, cols)

    def whole(self, share: Tensor) -> Tensor:
        """L = the sum over ranks of each rank's share, the same on every rank.

        Backward: all-reduce (sum) of every rank's upstream gradient, so with each rank
        back-propagating L every share gets W: after DDP's mean, exactly dL. With
        ``grad_reduction="sum"`` the gradient is divided by W instead, so a sum over ranks
        gives exactly dL.
        """
        if self.world == 1:
            return share
        total = all_reduce(share, "sum", group=self.group, check=False)
        if isinstance(self.grad_factor, Tensor):
            out: Tensor = apply(_ScaleGrad, total, self.grad_factor)
            return out
        return total


def validate(
    spec: LossSpec,
    tensors: Mapping[str, object],
    scalars: Mapping[str, object],
    *,
    options: Sequence[float] = (),
    per_rank: Sequence[int] = (),
    labels: Mapping[str, object] | None = None,
    error: str | None = None,
    group: ProcessGroup | None,
    mesh: DeviceMesh | None,
    batch_dims: Sequence[str] | None,
    grad_reduction: object,
    tile_size: object,
    sizes: object,
    check: bool | None,
    strategy: object,
) -> Call:
    """Validate on every rank and agree across ranks (the module docstring): the `Call`.

    Args:
        spec: the loss's descriptor.
        tensors: name -> this rank's float tensor (rows first, dim last; None skipped).
        scalars: name -> a float or a 1-element float tensor, the same on every rank (an
            optional scalar of the spec may be None: not passed).
        options: the codes of the spec's own options, in order (after the strategy).
        per_rank: this rank's values of the spec's per-rank numbers.
        labels: name -> a per-row integer tensor or None (ids, labels).
        error: the loss's own finding about its other arguments (raised like the checks
            here: the same on every rank).
        group, mesh, batch_dims: the process group, or a mesh and its batch dims.
        grad_reduction, tile_size, sizes, check, strategy: the loss's keywords.
    """
    op = spec.function
    group, split = resolve_group(group, mesh, batch_dims, op)
    w, r = get_world_size(group), get_rank(group)
    first = next(x for x in tensors.values() if x is not None)
    b = first.shape[0] if isinstance(first, Tensor) and first.dim() else 0
    device = first.device if isinstance(first, Tensor) else torch.device("cpu")
    given = {name: v for name, v in scalars.items() if v is not None}
    problem = _first_problem(
        [
            lambda: _check_floats(tensors),
            lambda: Problem(error) if error is not None else None,
            lambda: _check_labels(labels or {}, b, device),
            *[functools.partial(_check_scalar, n, v) for n, v in given.items()],
            lambda: Problem(bad) if (bad := grad_reduction_error(grad_reduction)) else None,
            lambda: Problem(bad) if (bad := spec.strategy_problem(strategy)) else None,
            lambda: _check_tile(tile_size),
            lambda: _check_sizes(sizes, w, r, b),
        ]
    )
    checked = w > 1 and (sizes is None or checks_enabled(check))
    if not checked and problem is not None:  # nothing is exchanged: raised here, as the
        problem.raise_for(op)  # collectives do with their checks off
    assert isinstance(first, Tensor)
    own = {name: _scalar_tensor(v, first) for name, v in given.items()} if not problem else {}
    agreed, limit = [b], small_rows()
    counts: dict[str, tuple[int, ...]] = {
        f: (v,) for f, v in zip(spec.per_rank, per_rank, strict=True)
    }
    if checked:
        row = _row(
            spec, first, scalars, grad_reduction, sizes, strategy, options, per_rank, problem
        )
        with replicas_agree(op, split, tensors):  # on a mesh with replicas: their rows checked
            table = agree_rows(row, group=group)
            table.error(op, problem.text if problem else None, type_codes=(2,))
        agreed = _check_table(spec, table, list(tensors))
        counts = {f: table.ints(f) for f in spec.per_rank}
        limit = min(table.ints("small rows"))
    elif w > 1:
        agreed = [int(v) for v in cast(Sequence[int], sizes)]  # checked: a sequence of ints
    if sum(agreed) == 0:
        where = f" (rows per rank {by_rank(agreed)}); at least one rank must pass rows"
        raise WholebatchError(
            f"{op}: the whole batch has 0 rows" + (where if w > 1 else "; pass at least one row")
        )
    reduction = str(grad_reduction)
    floats = [x for x in tensors.values() if isinstance(x, Tensor)]
    return Call(
        spec=spec,
        group=group,
        sizes=tuple(agreed),
        per_rank=counts,
        scalars=own,
        grad_factor=1.0 / w if reduction == "sum" else 1.0,
        reduction=reduction,
        checked=checked,
        strategy=str(strategy),
        limit=limit,
        tile_size=tile_size if isinstance(tile_size, int) else None,
        device=device,
        dtype=first.dtype,
        row_elements=sum(math.prod(x.shape[1:]) for x in floats),
    )


def _scalar_tensor(value: object, like: Tensor) -> Tensor:
    """`value` as a 0-d tensor of the compute dtype on `like`'s device (gradient flows; no host copy)."""
    acc = compute_dtype(like.dtype)
    if isinstance(value, Tensor):
        return value.reshape(()).to(device=like.device, dtype=acc)
    return torch.full((), float(cast(float, value)), dtype=acc, device=like.device)  # checked


# ---------------------------------------------------------------------------
# The exchange's row and its table
# ---------------------------------------------------------------------------


def _row(
    spec: LossSpec,
    first: Tensor,
    scalars: Mapping[str, object],
    grad_reduction: object,
    sizes: object,
    strategy: object,
    options: Sequence[float],
    per_rank: Sequence[int],
    problem: Problem | None,
) -> dict[str, Field]:
    """This rank's exchange row, its fields exactly `specs.exchange_fields(spec)`, in order."""
    ok = problem is None
    codes = [STRATEGIES.index(strategy) if strategy in STRATEGIES else -1, *options]
    values: dict[str, Field] = {
        "error": 0 if problem is None else 2 if problem.type_error else 1,
        "rows": first.shape[0] if ok else 0,
        "dim": first.shape[-1] if ok else 0,
        "dtype": _DTYPES.index(first.dtype) if ok else -1,
        "device": float(first.device.type != "cpu") if ok else -1,
        "grad_reduction": GRAD_REDUCTIONS.index(str(grad_reduction)) if ok else -1,
        "small rows": small_rows(),
        **{name: float(v) if ok else 0.0 for name, v in zip(spec.per_rank, per_rank, strict=True)},
        **{
            f"option {o.name}": float(c) if ok else 0.0
            for o, c in zip(spec.all_options(), codes, strict=True)
        },
        "sizes given": 1.0 if ok and sizes is not None else -1.0,
        "sizes fingerprint": (
            sizes_fingerprint(list(cast(Sequence[int], sizes))) if ok and sizes is not None else 0.0
        ),
    }
    for name in (*spec.scalars, *spec.optional_scalars):
        value = scalars.get(name)
        if not ok or value is None:
            values[f"scalar {name}"] = math.nan if value is None else 0.0
        else:  # a tensor stays on its device until the gather: no host sync
            values[f"scalar {name}"] = (
                value if isinstance(value, Tensor) else float(cast(float, value))
            )
    fields = exchange_fields(spec)
    if tuple(values) != fields:
        raise AssertionError(f"{spec.function}: the row's fields {tuple(values)} are not {fields}")
    return values


# Fields that must agree: (field, what, fix, how a value is shown, type error?).
_HEAD_CHECKS: tuple[tuple[str, str, str, Callable[[float], object], bool], ...] = (
    ("dim", "embedding dim", "", int, False),
    ("dtype", "dtype", "cast every rank's embeddings to one dtype",
     lambda v: str(_DTYPES[int(v)]).replace("torch.", ""), True),
    ("device", "device type", "put every rank's embeddings on the same kind of device",
     lambda v: "cpu" if v == 0 else "accelerator", True),
    ("grad_reduction", "grad_reduction", "pass the same grad_reduction on every rank",
     lambda v: GRAD_REDUCTIONS[int(v)], False),
)  # fmt: skip


def _scalar_shown(v: float) -> object:
    return "not passed" if math.isnan(v) else v


def _check_table(spec: LossSpec, rows: Rows, names: list[str]) -> list[int]:
    """Raise the same error on every rank if anything that must agree does not; the sizes."""
    op = spec.function
    checks = [
        (field, what, fix or f"every rank's {'/'.join(names)} must have the same dim", shown, typ)
        for field, what, fix, shown, typ in _HEAD_CHECKS
    ]
    checks += [(f"option {o.name}", o.name, o.fix, _shower(o), False) for o in spec.all_options()]
    checks += [
        (f"scalar {n}", n, _REPLICATED_FIX, _scalar_shown, False)
        for n in (*spec.scalars, *spec.optional_scalars)
    ]
    if not rows.same_all(c[0] for c in checks):  # name the first that differs
        for field, what, fix, shown, type_error in checks:
            if not rows.same(field):
                vals = by_rank([shown(v) for v in rows[field]])
                Problem(f"{what} differs across ranks {vals}; {fix}", type_error).raise_for(op)
    counts = list(rows.ints("rows"))
    want = sizes_fingerprint(counts)
    given, prints = rows["sizes given"], rows["sizes fingerprint"]
    wrong = [q for q in range(rows.world_size) if given[q] >= 0 and prints[q] != want]
    if wrong:
        raise WholebatchError(
            f"{op}: the sizes= passed on ranks {wrong} differ from the rows the ranks pass "
            f"{by_rank(counts)}; pass every rank's row count, the same list on every rank"
        )
    return counts


def _shower(option: Option) -> Callable[[float], object]:
    return option.shown


# ---------------------------------------------------------------------------
# The scalars' agreement and the whole-batch sum's gradient convention
# ---------------------------------------------------------------------------


class _Replicated(torch.autograd.Function):
    """Identity in the forward (every rank holds the same values: checked); backward: all-reduce
    (mean) of the gradient, so every rank's copy gets the same sum over ranks / W, what the
    agreement's max gives W tied ranks."""

    @staticmethod
    def forward(ctx: Any, vec: Tensor, group: Any) -> Tensor:  # type: ignore[override]  # torch declares forward(ctx, *args)
        ctx.group = group
        return vec.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return all_reduce(grad.contiguous(), "mean", group=ctx.group, check=False), None


def _factor(like: Tensor, grad_reduction: str, w: int) -> Tensor:
    value = 1.0 / w if grad_reduction == "sum" else 1.0
    return torch.full((), value, dtype=compute_dtype(like.dtype), device=like.device)


def _replicated(
    like: Tensor, own: dict[str, Tensor], grad_reduction: str, w: int, group: Any
) -> tuple[dict[str, Tensor], Tensor]:
    """The scalars once the exchange found them equal: no forward collective; backward, the
    mean of their gradients (one all-reduce)."""
    factor = _factor(like, grad_reduction, w)
    if not own:
        return {}, factor
    vec = apply(_Replicated, torch.stack(list(own.values())), group)
    return dict(zip(own, vec.unbind(), strict=True)), factor


def _agree(
    like: Tensor, own: dict[str, Tensor], grad_reduction: str, w: int, group: Any
) -> tuple[dict[str, Tensor], Tensor]:
    """The scalars and the reduction agreed by one all-reduce (max), differentiable, on the device."""
    acc = compute_dtype(like.dtype)
    code = torch.full(
        (), float(GRAD_REDUCTIONS.index(grad_reduction)), dtype=acc, device=like.device
    )
    agreed = all_reduce(torch.stack([*own.values(), code]), "max", group=group, check=False)
    one = torch.ones((), dtype=acc, device=like.device)
    factor = torch.where(agreed[-1].detach() > 0.5, one / w, one)
    return dict(zip(own, agreed[:-1].unbind(), strict=True)), factor


class _ScaleGrad(torch.autograd.Function):
    """Identity in the forward; the backward multiplies the gradient by `factor` (a tensor)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, factor: Tensor) -> Tensor:  # type: ignore[override]  # torch declares forward(ctx, *args)
        ctx.save_for_backward(factor)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        (factor,) = ctx.saved_tensors
        return grad * factor.to(grad.dtype), None
