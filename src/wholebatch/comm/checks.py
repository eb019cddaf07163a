"""Cross-rank checks: every rank learns every rank's shapes, sizes and dtype before data moves.

One small all-gather of a fixed-length int64 *fingerprint* per rank carries
what a collective must agree on: the op, its arguments, dtype, device type,
shape and (where the op has them) per-rank sizes. Every rank then runs the same
validation on the same table, so a mismatch raises the same `WholebatchError`
on every rank, before any payload moves: never a gloo abort, a hang or garbage.
Where an op must exchange sizes anyway (an all-gather with unknown sizes) this
is that exchange, so the checks cost nothing extra.

A rank-local problem (a `dim` out of range on one rank, a wrong `sizes` list)
is not raised locally, which would leave the other ranks waiting: it is marked
in the fingerprint and its text exchanged in a second round, then raised on all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from wholebatch.comm.agree import (
    Rows,
    agree_rows,
    errors_text,
    exchange_text,
    gather_errors,
    per_rank,
)
from wholebatch.comm.debug import arrive
from wholebatch.comm.groups import checks_enabled, get_world_size
from wholebatch.errors import WholebatchError, WholebatchTypeError

__all__ = [
    "MAX_DIMS",
    "Fingerprints",
    "agree_call",
    "alone",
    "check_arg",
    "check_shapes_except",
    "errors_text",
    "exchange",
    "exchange_text",
    "gather_errors",
    "norm_dim",
    "per_rank",
    "require_tensor",
    "sizes_problem",
    "wire_dtype_code",
    "wire_problem",
]

_MAGIC = 0x57424348  # "WBCH": a row without it came from something that is not a wholebatch op
MAX_DIMS = 16

_OP_CODES = {
    "all_gather": 1,
    "all_reduce": 2,
    "reduce_scatter": 3,
    "all_to_all": 4,
    "broadcast": 5,
    "ring_shift": 6,
}
_OP_NAMES = {v: k for k, v in _OP_CODES.items()}
# What the header's `arg` slot holds for each op (its value is printed as encoded).
_ARG_NAMES = {"all_reduce": "op", "broadcast": "src", "ring_shift": "shift (mod W)"}
# How an op's `arg` is shown by name where it is a code (all_reduce's op: its index + 1).
_ARG_SHOWN = {"all_reduce": ("?", "sum", "mean", "max", "min")}
_DTYPES: list[torch.dtype] = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    torch.complex64, torch.complex128,
]  # fmt: skip
_DEVICE_TYPES = ["cpu", "cuda", "meta", "xpu", "mps", "hpu"]


def _dtype_code(dtype: torch.dtype | None) -> int:
    if dtype is None:
        return 0
    return _DTYPES.index(dtype) + 1 if dtype in _DTYPES else 99


def _dtype_name(code: int) -> str:
    if code == 0:
        return "None"
    return str(_DTYPES[code - 1]).replace("torch.", "") if code <= len(_DTYPES) else "other"


def wire_dtype_code(dtype: torch.dtype | None) -> int:
    """The fingerprint code of a wire dtype (0 for None)."""
    return _dtype_code(dtype)


def _device_code(device: torch.device) -> int:
    t = device.type
    return _DEVICE_TYPES.index(t) + 1 if t in _DEVICE_TYPES else 99


def _device_name(code: int) -> str:
    return _DEVICE_TYPES[code - 1] if 1 <= code <= len(_DEVICE_TYPES) else "other"


@dataclasses.dataclass(frozen=True)
class Fingerprints:
    """Every rank's fingerprint for one call, identical on every rank after `exchange`."""

    op: str
    shapes: list[tuple[int, ...]]
    dim: int
    vec_a: list[list[int] | None]
    vec_b: list[list[int] | None]

    def sizes(self) -> list[int]:
        """Each rank's size along the op's `dim`."""
        return [s[self.dim] if s else 0 for s in self.shapes]


def _fingerprint(
    op: str,
    x: torch.Tensor,
    dim: int,
    arg: int,
    wire_code: int,
    world_size: int,
    vec_a: Sequence[int] | None,
    vec_b: Sequence[int] | None,
    error: bool,
) -> dict[str, int | list[int]]:
    """This rank's fingerprint row (named fields; every rank's has the same layout)."""

    def padded(values: Sequence[int] | None, n: int) -> list[int]:
        out = [int(v) for v in list(values or [])[:n]]
        return out + [0] * (n - len(out))

    return {
        "magic": _MAGIC,
        "op": _OP_CODES[op],
        "arg": arg,
        "dtype": _dtype_code(x.dtype),
        "device": _device_code(x.device),
        "ndim": x.dim(),
        "dim": dim,
        "error": int(error),
        "wire": wire_code,
        "has_a": int(vec_a is not None),
        "has_b": int(vec_b is not None),
        "shape": padded(x.shape, MAX_DIMS),
        "vec_a": padded(vec_a, world_size),
        "vec_b": padded(vec_b, world_size),
    }


def exchange(
    op: str,
    x: torch.Tensor,
    *,
    dim: int,
    arg: int = 0,
    wire_dtype: torch.dtype | None = None,
    vec_a: Sequence[int] | None = None,
    vec_b: Sequence[int] | None = None,
    local_error: str | None = None,
    group: ProcessGroup | None = None,
) -> Fingerprints:
    """All-gather every rank's fingerprint for `op` and run the common checks on all ranks.

    Checks here: every rank is in the same op with the same `arg`, `dim` and wire
    dtype, the same dtype, device type and number of dimensions, and no rank
    reported a `local_error`. Op-specific checks (which dims must match, sizes)
    are the caller's, on the returned table, which is identical on every rank.
    """
    world_size = get_world_size(group)
    row = _fingerprint(
        op,
        x,
        dim,
        arg,
        wire_dtype_code(wire_dtype),
        world_size,
        vec_a,
        vec_b,
        local_error is not None,
    )
    rows = agree_rows(row, group=group, dtype=torch.int64)
    rows.error(op, local_error)
    _check_common(op, rows)
    return Fingerprints(
        op=op,
        shapes=_shapes(rows),
        dim=dim,
        vec_a=_vectors(rows, "vec_a", "has_a"),
        vec_b=_vectors(rows, "vec_b", "has_b"),
    )


def _vectors(rows: Rows, name: str, given: str) -> list[list[int] | None]:
    return [
        [int(x) for x in v] if has else None
        for v, has in zip(rows.vectors(name), rows[given], strict=True)
    ]


def _shapes(rows: Rows) -> list[tuple[int, ...]]:
    return [
        tuple(int(s) for s in shape[: int(n)])
        for shape, n in zip(rows.vectors("shape"), rows["ndim"], strict=True)
    ]


def _check_common(op: str, rows: Rows) -> None:
    if any(m != _MAGIC for m in rows["magic"]):
        raise WholebatchError(
            f"{op}: a peer sent something that is not a wholebatch fingerprint; "
            "every rank must call the same wholebatch op at the same point"
        )
    ops = rows.ints("op")
    if len(set(ops)) > 1:
        names = [_OP_NAMES.get(o, "?") for o in ops]
        raise WholebatchError(
            # no "{op}:" prefix: each rank is in a different op, the text must still agree
            f"wholebatch: ranks called different collectives {per_rank(names)}; "
            "every rank must call the same op in the same order"
        )
    dtypes = rows.ints("dtype")
    if len(set(dtypes)) > 1:
        raise WholebatchTypeError(
            f"{op}: dtypes differ across ranks {per_rank([_dtype_name(d) for d in dtypes])}; "
            "cast every rank's input to one dtype"
        )
    devices = rows.ints("device")
    if len(set(devices)) > 1:
        raise WholebatchTypeError(
            f"{op}: device types differ across ranks {per_rank([_device_name(d) for d in devices])}; "
            "move every rank's input to the same kind of device"
        )
    if not rows.same("ndim"):
        shapes = _shapes(rows)
        raise WholebatchError(
            f"{op}: inputs have different numbers of dimensions across ranks {per_rank(shapes)}"
        )
    arg_name = _ARG_NAMES.get(op, "argument")
    for field, what in (("arg", arg_name), ("dim", "dim"), ("wire", "wire_dtype")):
        vals = rows.ints(field)
        if len(set(vals)) > 1:
            shown: Sequence[object] = vals
            if field == "wire":
                shown = [_dtype_name(v) for v in vals]
            elif field == "arg" and op in _ARG_SHOWN:
                codes = _ARG_SHOWN[op]
                shown = [codes[v] if 0 <= v < len(codes) else "invalid" for v in vals]
            raise WholebatchError(
                f"{op}: {what} differs across ranks {per_rank(shown)}; pass the same on every rank"
            )


def check_arg(op: str, name: str, values: Sequence[object], fix: str) -> None:
    """Raise if a per-rank argument value differs across ranks."""
    if len(set(values)) > 1:
        raise WholebatchError(f"{op}: {name} differs across ranks {per_rank(values)}; {fix}")


def check_shapes_except(op: str, fps: Fingerprints, dim: int | None) -> None:
    """Raise unless every rank's shape matches, except along `dim` (None: all dims must match)."""

    def key(shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(s for i, s in enumerate(shape) if i != dim)

    if len({key(s) for s in fps.shapes}) > 1:
        if dim is None:
            raise WholebatchError(
                f"{op}: shapes differ across ranks {per_rank(fps.shapes)}; every rank must pass the same shape"
            )
        trailing = [key(s) for s in fps.shapes]
        raise WholebatchError(
            f"{op}: shapes other than dim={dim} differ across ranks {per_rank(trailing)} "
            f"(full shapes {per_rank(fps.shapes)}); only dim={dim} may differ"
        )


# ---------------------------------------------------------------------------
# The collectives' argument checks (`wholebatch.comm.collectives`)
# ---------------------------------------------------------------------------


def require_tensor(op: str, x: object) -> Tensor:
    if not isinstance(x, Tensor):
        raise WholebatchTypeError(f"{op}: expected a torch.Tensor, got {type(x).__name__}")
    return x


def norm_dim(x: Tensor, dim: int) -> tuple[int, str | None]:
    """`dim` made non-negative, or the reason it cannot be (reported on every rank)."""
    nd = x.dim()
    if nd == 0:
        return 0, "a 0-d tensor has no dim to split along; unsqueeze it first"
    if nd > MAX_DIMS:
        return 0, f"tensors of more than {MAX_DIMS} dims are not supported (got {nd})"
    if not -nd <= dim < nd:
        return 0, f"dim={dim} is out of range for a {nd}-d tensor of shape {tuple(x.shape)}"
    return dim % nd, None


def wire_problem(x: Tensor, wire_dtype: torch.dtype | None) -> str | None:
    if wire_dtype is None:
        return None
    if not isinstance(wire_dtype, torch.dtype) or not wire_dtype.is_floating_point:
        return f"wire_dtype={wire_dtype!r} must be a floating torch.dtype such as torch.bfloat16"
    if not x.is_floating_point():
        return f"wire_dtype needs a floating input, got {x.dtype}"
    return None


def sizes_problem(
    name: str, sizes: Sequence[int] | None, world_size: int, total: int | None
) -> str | None:
    """Why `sizes` (one entry per rank) is unusable, or None; `total` is its required sum."""
    if sizes is None:
        return None
    try:
        vals = [int(s) for s in sizes]
    except (TypeError, ValueError):
        return f"{name} must be a sequence of {world_size} ints, got {sizes!r}"
    if len(vals) != world_size:
        return (
            f"{name} has {len(vals)} entries for a group of {world_size} ranks; give one per rank"
        )
    if any(v < 0 for v in vals):
        return f"{name}={vals} has a negative entry"
    if total is not None and sum(vals) != total:
        return f"{name}={vals} sums to {sum(vals)} but the input has {total} along dim"
    return None


def agree_call(
    op: str,
    x: Tensor,
    *,
    need_sizes: bool,
    check: bool | None,
    local_error: str | None,
    dim: int = 0,
    arg: int = 0,
    wire_dtype: torch.dtype | None = None,
    vec_a: Sequence[int] | None = None,
    vec_b: Sequence[int] | None = None,
    group: ProcessGroup | None,
) -> Fingerprints | None:
    """Exchange fingerprints when sizes must be learnt or checks are on; else raise local errors here.

    In debug mode (`wholebatch.set_debug`) every rank first checks in, so a rank
    that never arrives is named instead of leaving the others waiting.
    """
    arrive(op, x, group)
    if need_sizes or checks_enabled(check):
        return exchange(
            op,
            x,
            dim=dim,
            arg=arg,
            wire_dtype=wire_dtype,
            vec_a=vec_a,
            vec_b=vec_b,
            local_error=local_error,
            group=group,
        )
    if local_error is not None:
        raise WholebatchError(f"{op}: {local_error}")
    return None


def alone(op: str, world_size: int, err: str | None) -> bool:
    """True in a world of one, where every op is the identity (after raising `err`, if any)."""
    if world_size > 1:
        return False
    if err:
        raise WholebatchError(f"{op}: {err}")
    return True
