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
from collections.abc import Mapping, Sequence

import torch
from torch.distributed import ProcessGroup

from wholebatch.comm.groups import comm_device, get_world_size
from wholebatch.errors import WholebatchError, WholebatchTypeError

__all__ = [
    "MAX_DIMS",
    "Fingerprints",
    "check_arg",
    "check_shapes_except",
    "errors_text",
    "exchange",
    "exchange_text",
    "gather_errors",
    "per_rank",
    "wire_dtype_code",
]

_MAGIC = 0x57424348  # "WBCH": a row without it came from something that is not a wholebatch op
MAX_DIMS = 16
_HEADER = 12
_MSG_BYTES = 480

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


# Header slots of a fingerprint row.
_MAGIC_I, _OP_I, _ARG_I, _DTYPE_I, _DEVICE_I, _NDIM_I, _DIM_I, _ERR_I, _WIRE_I, _NVEC_I = range(10)


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


def _encode(
    op: str,
    x: torch.Tensor,
    dim: int,
    arg: int,
    wire_code: int,
    world_size: int,
    vec_a: Sequence[int] | None,
    vec_b: Sequence[int] | None,
    error: bool,
) -> list[int]:
    width = _HEADER + MAX_DIMS + 2 * world_size
    row = [0] * width
    row[_MAGIC_I] = _MAGIC
    row[_OP_I] = _OP_CODES[op]
    row[_ARG_I] = arg
    row[_DTYPE_I] = _dtype_code(x.dtype)
    row[_DEVICE_I] = _device_code(x.device)
    row[_NDIM_I] = x.dim()
    row[_DIM_I] = dim
    row[_ERR_I] = int(error)
    row[_WIRE_I] = wire_code
    row[_NVEC_I] = (1 if vec_a is not None else 0) + (2 if vec_b is not None else 0)
    for i, s in enumerate(x.shape[:MAX_DIMS]):
        row[_HEADER + i] = s
    base = _HEADER + MAX_DIMS
    for i, v in enumerate(list(vec_a or [])[:world_size]):
        row[base + i] = int(v)
    for i, v in enumerate(list(vec_b or [])[:world_size]):
        row[base + world_size + i] = int(v)
    return row


def _all_gather_rows(row: list[int], group: ProcessGroup | None) -> list[list[int]]:
    from wholebatch.comm._c10d import all_gather_single

    world_size = get_world_size(group)
    device = comm_device(group)
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    table = torch.empty(world_size * len(row), dtype=torch.int64, device=device)
    all_gather_single(table, mine, group=group)
    flat = table.tolist()
    return [flat[r * len(row) : (r + 1) * len(row)] for r in range(world_size)]


def exchange_text(
    msg: str, group: ProcessGroup | None = None, *, max_bytes: int = _MSG_BYTES
) -> list[str]:
    """Every rank's `msg` (UTF-8, cut to `max_bytes`), in rank order; every rank must call it.

    Text travels as a fixed-size uint8 tensor: no pickle (unlike `all_gather_object`).
    """
    from wholebatch.comm._c10d import all_gather_single

    world_size = get_world_size(group)
    if world_size == 1:
        return [msg.encode("utf-8")[:max_bytes].decode("utf-8", "ignore")]
    device = comm_device(group)
    data = msg.encode("utf-8")[:max_bytes]
    buf = torch.zeros(max_bytes, dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = torch.empty(world_size * max_bytes, dtype=torch.uint8, device=device)
    all_gather_single(out, buf.to(device), group=group)
    raw = bytes(out.cpu().tolist())
    return [
        raw[r * max_bytes : (r + 1) * max_bytes].rstrip(b"\0").decode("utf-8", "ignore")
        for r in range(world_size)
    ]


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
    row = _encode(
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
    rows = _all_gather_rows(row, group)
    if any(r[_ERR_I] for r in rows):
        bad = gather_errors(local_error, [bool(r[_ERR_I]) for r in rows], group)
        raise WholebatchError(f"{op}: {errors_text(bad)}")
    _check_common(op, rows)
    shapes = [tuple(r[_HEADER : _HEADER + r[_NDIM_I]]) for r in rows]
    base = _HEADER + MAX_DIMS
    vec_as = [r[base : base + world_size] if r[_NVEC_I] & 1 else None for r in rows]
    vec_bs = [
        r[base + world_size : base + 2 * world_size] if r[_NVEC_I] & 2 else None for r in rows
    ]
    return Fingerprints(op=op, shapes=shapes, dim=dim, vec_a=vec_as, vec_b=vec_bs)


def gather_errors(
    local_error: str | None,
    flagged: Sequence[bool],
    group: ProcessGroup | None = None,
    *,
    max_bytes: int = _MSG_BYTES,
) -> dict[int, str]:
    """The error text of every rank whose `flagged` entry is set (every rank must call it).

    `flagged` is the same on every rank (it came from an exchange); one text
    all-gather carries the messages, so every rank can raise the same error.
    """
    msgs = exchange_text(local_error or "", group, max_bytes=max_bytes)
    return {r: m for r, m in enumerate(msgs) if flagged[r]}


def errors_text(bad: Mapping[int, str]) -> str:
    """One message for rank -> error: the text and its ranks if they agree, else each rank's."""
    if len(set(bad.values())) == 1:
        return f"{next(iter(bad.values()))} (on ranks {sorted(bad)})"
    return "; ".join(f"rank {r}: {m}" for r, m in bad.items())


def per_rank(values: Sequence[object]) -> str:
    """`{0: a, 1: b}` — how errors show a per-rank value."""
    return "{" + ", ".join(f"{r}: {v}" for r, v in enumerate(values)) + "}"


def _check_common(op: str, rows: list[list[int]]) -> None:
    if any(r[_MAGIC_I] != _MAGIC for r in rows):
        raise WholebatchError(
            f"{op}: a peer sent something that is not a wholebatch fingerprint; "
            "every rank must call the same wholebatch op at the same point"
        )
    ops = [r[_OP_I] for r in rows]
    if len(set(ops)) > 1:
        names = [_OP_NAMES.get(o, "?") for o in ops]
        raise WholebatchError(
            # no "{op}:" prefix: each rank is in a different op, the text must still agree
            f"wholebatch: ranks called different collectives {per_rank(names)}; "
            "every rank must call the same op in the same order"
        )
    dtypes = [r[_DTYPE_I] for r in rows]
    if len(set(dtypes)) > 1:
        raise WholebatchTypeError(
            f"{op}: dtypes differ across ranks {per_rank([_dtype_name(d) for d in dtypes])}; "
            "cast every rank's input to one dtype"
        )
    devices = [r[_DEVICE_I] for r in rows]
    if len(set(devices)) > 1:
        raise WholebatchTypeError(
            f"{op}: device types differ across ranks {per_rank([_device_name(d) for d in devices])}; "
            "move every rank's input to the same kind of device"
        )
    ndims = [r[_NDIM_I] for r in rows]
    if len(set(ndims)) > 1:
        shapes = [tuple(r[_HEADER : _HEADER + r[_NDIM_I]]) for r in rows]
        raise WholebatchError(
            f"{op}: inputs have different numbers of dimensions across ranks {per_rank(shapes)}"
        )
    arg_name = _ARG_NAMES.get(op, "argument")
    for slot, what in ((_ARG_I, arg_name), (_DIM_I, "dim"), (_WIRE_I, "wire_dtype")):
        vals = [r[slot] for r in rows]
        if len(set(vals)) > 1:
            shown = [_dtype_name(v) for v in vals] if slot == _WIRE_I else vals
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
