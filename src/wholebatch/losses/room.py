"""The room for rows in the losses' exchange, per process group: fitted to its last calls.

Every loss's exchange (`wholebatch.losses.common.prepare`, checks on) is one
all-gather of each rank's row plus a zero-padded room for its rows of every
embedding; the small path (`wholebatch.losses.replicated`) then needs no
second collective. The room's size must be the same on every rank before the
call, so it comes from what every rank already holds alike: the rows the last
`sizing.ROOM_HISTORY` calls on the group carried, read from their agreed tables
(every rank's row count, the agreed dim, dtype and options) after their checks
passed. `sizing.fitted_room` turns them into the room, the first call on a group
gets `sizing.carry_bytes(W)`. Ranks that make the same calls on a group, as
collectives require, hold the same history; a group that is destroyed takes
its history with it (weak keys).
"""

from __future__ import annotations

import collections
import weakref

import torch.distributed as dist
from torch.distributed import ProcessGroup

from wholebatch.losses.sizing import ROOM_HISTORY, carry_bytes, fitted_room

__all__ = ["forget", "record", "room"]

_history: weakref.WeakKeyDictionary[ProcessGroup, collections.deque[int]] = (
    weakref.WeakKeyDictionary()
)


def _key(group: ProcessGroup | None) -> ProcessGroup | None:
    return dist.group.WORLD if group is None else group


def room(group: ProcessGroup | None, world: int) -> int:
    """The room (bytes per rank) of the next exchange on `group`; the same on every rank."""
    key = _key(group)
    seen = _history.get(key) if key is not None else None
    return fitted_room(list(seen), world) if seen else carry_bytes(world)


def record(group: ProcessGroup | None, needed: int) -> None:
    """After an exchange on `group` whose checks passed: its largest rank's rows were
    `needed` bytes (agreed numbers only, so every rank records the same)."""
    key = _key(group)
    if key is None:
        return
    seen = _history.get(key)
    if seen is None:
        seen = _history[key] = collections.deque(maxlen=ROOM_HISTORY)
    seen.append(needed)


def forget() -> None:
    """Every group's history gone: the next call on each gets `sizing.carry_bytes(W)` (tests)."""
    _history.clear()
