"""Agree a named row of numbers across ranks: every rank learns every rank's values, by name.

The one way wholebatch agrees rank-local facts before it branches (DESIGN.md,
"Agree before you branch"): each rank contributes a row of named fields, one
small all-gather carries them, and every rank reads the same table back by
field name, never by column index:

    rows = agree_rows({"loss": loss_t, "items": items_t, "bad": ~torch.isfinite(loss_t)})
    rows["items"]              # (3.0, 5.0, 0.0): each rank's value, in rank order
    rows.total("items")        # 8.0, summed in rank order: bitwise equal on every rank
    rows.ranks_where("bad")    # [1]: the ranks whose flag is set
    rows.error(op, local_error)  # the same WholebatchError on every rank, or nothing

A field is a number (Python or a 0-dim tensor, which stays on its device until
the gather: no host sync per field) or a fixed-length vector (a shape, per-rank
sizes). Every rank must pass the same field names with the same lengths, in
the same order: the row's layout is the code's, not the data's.

Without torch.distributed (or on a group of one) nothing is communicated: the
table holds this rank's row.

Legend: W ranks of `group`, F elements in one row.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from wholebatch.comm import _c10d
from wholebatch.comm.groups import comm_device, get_world_size, is_distributed
from wholebatch.errors import WholebatchError, WholebatchTypeError

__all__ = [
    "Field",
    "PendingRows",
    "Rows",
    "agree_rows",
    "errors_text",
    "exchange_text",
    "gather_errors",
    "per_rank",
    "ranks_text",
    "start_rows",
]

_MSG_BYTES = 480

Field = Tensor | float | int | bool | Sequence[float] | Sequence[int]
"""One named entry of a row: a number, a 0-dim tensor, or a fixed-length vector (1-D tensor or list)."""


class Rows:
    """Every rank's row, read by field name; identical on every rank of the group.

    Built by `agree_rows`. Scalar fields read as per-rank tuples (`rows["items"]`),
    vector fields as per-rank tuples of tuples (`rows.vectors("shape")`).
    """

    def __init__(
        self,
        table_WF: Tensor,
        layout: Mapping[str, tuple[int, int]],
        group: ProcessGroup | None,
    ) -> None:
        self.table_WF = table_WF  # [W, F] on the CPU
        self._layout = dict(layout)  # name -> (start, length)
        self._values: list[list[float]] = table_WF.tolist()
        self.group = group
        self.world_size = table_WF.shape[0]

    @property
    def names(self) -> tuple[str, ...]:
        """The row's field names, in order."""
        return tuple(self._layout)

    def _slot(self, name: str) -> tuple[int, int]:
        try:
            return self._layout[name]
        except KeyError:
            raise KeyError(f"agree_rows: no field {name!r}; fields are {self.names}") from None

    def __getitem__(self, name: str) -> tuple[float, ...]:
        """Each rank's value of the scalar field `name`, in rank order."""
        start, length = self._slot(name)
        if length != 1:
            raise KeyError(f"agree_rows: field {name!r} is a vector; read it with vectors()")
        return tuple(row[start] for row in self._values)

    def vectors(self, name: str) -> tuple[tuple[float, ...], ...]:
        """Each rank's vector field `name`, in rank order."""
        start, length = self._slot(name)
        return tuple(tuple(row[start : start + length]) for row in self._values)

    def ints(self, name: str) -> tuple[int, ...]:
        """Each rank's value of the scalar field `name` as an int."""
        return tuple(int(v) for v in self[name])

    def per_rank(self, name: str) -> dict[int, float]:
        """`{rank: value}` of the scalar field `name` (how errors show it)."""
        return dict(enumerate(self[name]))

    def total(self, name: str) -> float:
        """The sum over ranks of the scalar field `name`, added in rank order (the same on every rank)."""
        values = self[name]
        if not self.table_WF.dtype.is_floating_point:
            return sum(values)
        try:  # exactly rounded, so the result does not depend on the order of ranks
            return math.fsum(values)
        except (ValueError, OverflowError):  # inf + -inf (nan) or an overflowing sum (±inf)
            return float(sum(values))

    def ranks_where(self, name: str) -> list[int]:
        """The ranks whose scalar field `name` is nonzero (a flag set)."""
        return [r for r, v in enumerate(self[name]) if v != 0]

    def same(self, name: str) -> bool:
        """True when every rank holds the same value of `name` (NaN equals NaN)."""
        vals = self.vectors(name)
        first = vals[0]
        return all(_same(v, first) for v in vals[1:])

    def same_all(self, names: Iterable[str]) -> bool:
        """`same` of every field in `names` at once (one pass over the table)."""
        values = self._values
        if all(row == values[0] for row in values[1:]):  # every rank's whole row alike
            return True
        cols = [c for name in names for c in range(*_span(self._slot(name)))]
        first = [self._values[0][c] for c in cols]
        others = ([row[c] for c in cols] for row in self._values[1:])
        return all(got == first or _same(got, first) for got in others)

    def error(
        self,
        op: str,
        local_error: str | None,
        *,
        flag: str = "error",
        type_codes: Sequence[int] = (),
    ) -> None:
        """Raise the same error on every rank if any rank set the field `flag`.

        Every rank must call it (the flags agree, so all do or none): one text
        all-gather carries each flagged rank's `local_error` into the message. The
        error is a `WholebatchTypeError` when every flagged rank's flag is one of
        `type_codes` (a wrong type, dtype or device), else a `WholebatchError`.
        """
        flagged = self.ranks_where(flag)
        if not flagged:
            return
        codes = self.ints(flag)
        kind = (
            WholebatchTypeError if all(codes[r] in type_codes for r in flagged) else WholebatchError
        )
        if not is_distributed(self.group):
            raise kind(f"{op}: {local_error}")
        marks = [r in flagged for r in range(self.world_size)]
        bad = gather_errors(local_error, marks, self.group)
        raise kind(f"{op}: {errors_text(bad)}")

    def differ_text(self, name: str) -> str:
        """`{0: a, 1: b}` for the scalar field `name`, ints shown as ints."""
        return per_rank([_shown(v) for v in self[name]])


def _span(slot: tuple[int, int]) -> tuple[int, int]:
    return slot[0], slot[0] + slot[1]


def _same(a: Sequence[float], b: Sequence[float]) -> bool:
    return all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=True))


def _shown(v: float) -> object:
    return int(v) if isinstance(v, float) and v.is_integer() else v


class PendingRows:
    """An agreement started by `start_rows`: `wait()` gives the `Rows` (call it once)."""

    def __init__(
        self,
        table: Tensor,
        layout: Mapping[str, tuple[int, int]],
        group: ProcessGroup | None,
        work: Any,
    ) -> None:
        self._table, self._layout, self._group, self._work = table, layout, group, work

    def wait(self) -> Rows:
        """Block until every rank's row arrived; the same `Rows` on every rank."""
        if self._work is not None:
            self._work.wait()
        return Rows(self._table.cpu(), self._layout, self._group)


def start_rows(
    row: Mapping[str, Field],
    *,
    group: ProcessGroup | None = None,
    dtype: torch.dtype = torch.float64,
) -> PendingRows:
    """`agree_rows` without waiting: the all-gather runs while the caller computes.

    Every rank of `group` must call it, with the same field names and lengths, and
    then `wait()` on the result before its next collective on `group`.
    """
    distributed = is_distributed(group)
    device = comm_device(group) if distributed else _CPU
    layout: dict[str, tuple[int, int]] = {}
    numbers: list[float] = []  # every field's numbers; a tensor field's are written after
    tensors: list[tuple[int, Tensor]] = []
    for name, value in row.items():
        value = _host_number(value)
        if isinstance(value, (bool, int, float)):
            layout[name] = (len(numbers), 1)
            numbers.append(value)
            continue
        if isinstance(value, Tensor):
            n = value.numel()
            tensors.append((len(numbers), value))
        else:
            n = len(value)
            tensors.append((len(numbers), torch.tensor(list(value), dtype=dtype)))
        layout[name] = (len(numbers), n)
        numbers.extend([0.0] * n)
    mine_F = torch.tensor(numbers, dtype=dtype)
    if device.type != "cpu":
        mine_F = mine_F.to(device)  # one copy to the device
    for start, value in tensors:  # stays on its device: no host sync
        mine_F[start : start + value.numel()].copy_(value.detach().reshape(-1))
    if not distributed:
        return PendingRows(mine_F.unsqueeze(0), layout, group, None)
    table = torch.empty(get_world_size(group) * mine_F.numel(), dtype=dtype, device=device)
    work = _c10d.all_gather_single(table, mine_F, group=group, async_op=True)
    return PendingRows(table.view(-1, mine_F.numel()), layout, group, work)


_CPU = torch.device("cpu")
_PLAIN = (Tensor, torch.nn.Parameter)  # not a subclass (a DTensor's item() may communicate)


def _host_number(value: Field) -> Field:
    """A one-element plain tensor on the host as its number (no sync, no copy op); else `value`."""
    if isinstance(value, Tensor) and type(value) in _PLAIN and value.device.type == "cpu":
        return value.item() if value.numel() == 1 else value
    return value


def agree_rows(
    row: Mapping[str, Field],
    *,
    group: ProcessGroup | None = None,
    dtype: torch.dtype = torch.float64,
) -> Rows:
    """All-gather one named row per rank; every rank gets the same `Rows` table.

    Every rank of `group` must call it with the same field names and lengths.
    Not differentiable (the row is detached): it agrees facts, it carries no gradient.

    Args:
        row: field name -> value (a number, 0-dim tensor, or fixed-length vector).
        group: the process group; None: the default group (or one process).
        dtype: the wire dtype: float64 (default; holds integers exactly up to 2**53,
            and NaN) or int64 for integer-only rows.
    """
    return start_rows(row, group=group, dtype=dtype).wait()


def exchange_text(
    msg: str, group: ProcessGroup | None = None, *, max_bytes: int = _MSG_BYTES
) -> list[str]:
    """Every rank's `msg` (UTF-8, cut to `max_bytes`), in rank order; every rank must call it.

    Text travels as a fixed-size uint8 tensor: no pickle (unlike `all_gather_object`).
    """
    world_size = get_world_size(group)
    if world_size == 1:
        return [msg.encode("utf-8")[:max_bytes].decode("utf-8", "ignore")]
    device = comm_device(group)
    data = msg.encode("utf-8")[:max_bytes]
    buf = torch.zeros(max_bytes, dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = torch.empty(world_size * max_bytes, dtype=torch.uint8, device=device)
    _c10d.all_gather_single(out, buf.to(device), group=group)
    raw = bytes(out.cpu().tolist())
    return [
        raw[r * max_bytes : (r + 1) * max_bytes].rstrip(b"\0").decode("utf-8", "ignore")
        for r in range(world_size)
    ]


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


def ranks_text(values: Sequence[float], ranks: Sequence[int]) -> str:
    """`{0: 13, 2: 12.5}`: the values of `ranks` only, whole numbers shown without a point."""
    return "{" + ", ".join(f"{r}: {_shown(values[r])}" for r in ranks) + "}"


def per_rank(values: Sequence[object]) -> str:
    """`{0: a, 1: b}` — how errors show a per-rank value."""
    return "{" + ", ".join(f"{r}: {v}" for r, v in enumerate(values)) + "}"
