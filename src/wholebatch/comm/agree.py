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
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from wholebatch.comm.groups import comm_device, get_world_size, is_distributed
from wholebatch.errors import WholebatchError

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
        self.carried_WC: Tensor | None = None
        """Every rank's carried bytes (`start_rows(carry=...)`), (W, carry_bytes) uint8, or None."""

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

    def error(self, op: str, local_error: str | None, *, flag: str = "error") -> None:
        """Raise the same `WholebatchError` on every rank if any rank set the field `flag`.

        Every rank must call it (the flags agree, so all do or none): one text
        all-gather carries each flagged rank's `local_error` into the message.
        """
        flagged = self.ranks_where(flag)
        if not flagged:
            return
        if not is_distributed(self.group):
            raise WholebatchError(f"{op}: {local_error}")
        marks = [r in flagged for r in range(self.world_size)]
        bad = gather_errors(local_error, marks, self.group)
        raise WholebatchError(f"{op}: {errors_text(bad)}")

    def differ_text(self, name: str) -> str:
        """`{0: a, 1: b}` for the scalar field `name`, ints shown as ints."""
        return per_rank([_shown(v) for v in self[name]])


def _same(a: Sequence[float], b: Sequence[float]) -> bool:
    return all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=True))


def _shown(v: float) -> object:
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _part(value: Field, dtype: torch.dtype, device: torch.device) -> Tensor:
    if isinstance(value, Tensor):
        return value.detach().reshape(-1).to(device=device, dtype=dtype)
    if isinstance(value, (bool, int, float)):
        return torch.tensor([value], dtype=dtype, device=device)
    return torch.tensor(list(value), dtype=dtype, device=device).reshape(-1)


class PendingRows:
    """An agreement started by `start_rows`: `wait()` gives the `Rows` (call it once)."""

    def __init__(
        self,
        table: Tensor,
        layout: Mapping[str, tuple[int, int]],
        group: ProcessGroup | None,
        work: Any,
        carried: int = 0,
    ) -> None:
        self._table, self._layout, self._group, self._work = table, layout, group, work
        self._carried = carried

    def wait(self) -> Rows:
        """Block until every rank's row arrived; the same `Rows` on every rank."""
        if self._work is not None:
            self._work.wait()
        if not self._carried:
            return Rows(self._table.cpu(), self._layout, self._group)
        w = self._table.shape[0]
        row_bytes = self._table.shape[1] - self._carried
        table_WF = self._table[:, :row_bytes].contiguous().view(torch.float64).view(w, -1)
        rows = Rows(table_WF.cpu(), self._layout, self._group)
        rows.carried_WC = self._table[:, row_bytes:]
        return rows


def start_rows(
    row: Mapping[str, Field],
    *,
    group: ProcessGroup | None = None,
    dtype: torch.dtype = torch.float64,
    carry: Tensor | None = None,
    carry_bytes: int = 0,
) -> PendingRows:
    """`agree_rows` without waiting: the all-gather runs while the caller computes.

    Every rank of `group` must call it, with the same field names and lengths, and
    then `wait()` on the result before its next collective on `group`.

    With `carry_bytes` > 0 (the same on every rank; float64 rows only) the same
    all-gather also carries up to that many bytes of each rank's `carry` (a 1-D
    uint8 tensor on the row's device, zero-padded; None: nothing), read back as
    `Rows.carried_WC`: data that would otherwise need a second collective.
    """
    from wholebatch.comm._c10d import all_gather_single

    distributed = is_distributed(group)
    device = comm_device(group) if distributed else torch.device("cpu")
    layout: dict[str, tuple[int, int]] = {}
    parts: list[Tensor] = []
    numbers: list[float] = []  # a run of plain numbers becomes one tensor (one copy to the device)
    start = 0
    for name, value in row.items():
        if isinstance(value, (bool, int, float)):
            layout[name] = (start, 1)
            start += 1
            numbers.append(value)
            continue
        if numbers:
            parts.append(torch.tensor(numbers, dtype=dtype, device=device))
            numbers = []
        part = _part(value, dtype, device)
        layout[name] = (start, part.numel())
        start += part.numel()
        parts.append(part)
    if numbers:
        parts.append(torch.tensor(numbers, dtype=dtype, device=device))
    mine_F = torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)
    if carry_bytes:
        row_bytes = mine_F.numel() * mine_F.element_size()
        both = torch.zeros(row_bytes + carry_bytes, dtype=torch.uint8, device=device)
        both[:row_bytes] = mine_F.view(torch.uint8)
        if carry is not None:
            both[row_bytes : row_bytes + carry.numel()] = carry
        mine_F = both
    if not distributed:
        return PendingRows(mine_F.unsqueeze(0), layout, group, None, carry_bytes)
    w = get_world_size(group)
    table = torch.empty(w * mine_F.numel(), dtype=mine_F.dtype, device=device)
    work = all_gather_single(table, mine_F, group=group, async_op=True)
    return PendingRows(table.view(w, -1), layout, group, work, carry_bytes)


def agree_rows(
    row: Mapping[str, Field],
    *,
    group: ProcessGroup | None = None,
    dtype: torch.dtype = torch.float64,
    carry: Tensor | None = None,
    carry_bytes: int = 0,
) -> Rows:
    """All-gather one named row per rank; every rank gets the same `Rows` table.

    Every rank of `group` must call it with the same field names and lengths.
    Not differentiable (the row is detached): it agrees facts, it carries no gradient.

    Args:
        row: field name -> value (a number, 0-dim tensor, or fixed-length vector).
        group: the process group; None: the default group (or one process).
        dtype: the wire dtype: float64 (default; holds integers exactly up to 2**53,
            and NaN) or int64 for integer-only rows.
        carry: bytes to carry in the same all-gather (`start_rows`).
        carry_bytes: the room for them on every rank (0: none).
    """
    return start_rows(row, group=group, dtype=dtype, carry=carry, carry_bytes=carry_bytes).wait()


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
