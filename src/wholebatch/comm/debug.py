"""Debug mode: every wholebatch collective first checks in, so a missing rank is named.

    WHOLEBATCH_DEBUG=1 torchrun --nproc-per-node 4 train.py      # or wholebatch.set_debug(True)

The usual distributed failure is a hang: one rank skips a collective (an early
`return`, one fewer micro-batch) and the others wait for the process group's
timeout (30 minutes on gloo, 10 on NCCL), then die without saying who or where.
In debug mode each wholebatch op first writes a small *arrival record* (op,
sequence number, shape, dtype, device, call site) to the process group's
key-value store and waits, with a bounded timeout, for every rank's record of
the same sequence number. Then, on every rank:

- a rank whose record did not arrive in time is named, with the op and call
  site the others are waiting in, and that rank's last op;
- ranks that arrived in *different* ops (a skipped call shifts the sequence)
  are named with each rank's op and call site.

It uses the store c10d already has (no pickle, no extra transport), costs a
few store round trips per op, and is off by default. Without debug mode the
fingerprint exchange in `wholebatch.comm.checks` still catches mismatched shapes,
dtypes and ops, but a rank that never arrives is only seen at the group timeout.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from types import FrameType

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from wholebatch.comm._c10d import Store
from wholebatch.comm.groups import get_rank, get_world_size, is_distributed
from wholebatch.errors import WholebatchError

__all__ = ["arrive", "call_site", "debug_enabled", "set_debug"]

_ENV = "WHOLEBATCH_DEBUG"
_TIMEOUT_ENV = "WHOLEBATCH_DEBUG_TIMEOUT"
_override: bool | None = None
_timeout_override: float | None = None
_seq: dict[str, int] = {}
_PKG_DIR = os.path.dirname(os.path.abspath(__file__))


def set_debug(enabled: bool | None, *, timeout_s: float | None = None) -> None:
    """Turn debug mode on or off for this process (None: back to ``WHOLEBATCH_DEBUG``).

    Set it the same on every rank. `timeout_s` bounds how long a collective waits
    for every rank to check in (default ``WHOLEBATCH_DEBUG_TIMEOUT`` or 60 s):
    short enough to name a missing rank long before the group's own timeout,
    long enough for the slowest rank's work between two collectives.
    """
    global _override, _timeout_override
    _override = enabled
    _timeout_override = timeout_s


def debug_enabled() -> bool:
    """Whether wholebatch collectives check in before they run."""
    if _override is not None:
        return _override
    return os.environ.get(_ENV, "0").strip().lower() in ("1", "true", "on", "yes")


def _timeout() -> float:
    if _timeout_override is not None:
        return _timeout_override
    return float(os.environ.get(_TIMEOUT_ENV, "60"))


def call_site() -> str:
    """`file:line in function` of the first caller outside the wholebatch package."""
    frame: FrameType | None = sys._getframe(1)
    while (
        frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _PKG_DIR
    ):
        frame = frame.f_back
    if frame is None:
        return "?"
    return (
        f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"
    )


def _store() -> Store:
    # c10d's own key-value store (the rendezvous store every rank already
    # reaches); private in c10d, so its absence turns debug mode into an error
    # that says so rather than a silent no-op.
    from torch.distributed import distributed_c10d

    getter = getattr(distributed_c10d, "_get_default_store", None)
    if getter is None:  # pragma: no cover - every supported torch has it
        raise WholebatchError(
            "debug mode: this torch has no c10d default store; turn WHOLEBATCH_DEBUG off"
        )
    store: Store = getter()
    return store


def _group_key(group: ProcessGroup | None) -> str:
    if group is None or group is dist.GroupMember.WORLD:
        return "world"
    return str(getattr(group, "group_name", id(group)))


def arrive(op: str, x: torch.Tensor, group: ProcessGroup | None) -> None:
    """Check in for `op` on `group`; raise the same `WholebatchError` on every rank if ranks diverge.

    A no-op unless debug mode is on and `group` holds more than one rank.
    """
    if not debug_enabled() or not is_distributed(group):
        return
    gkey = _group_key(group)
    seq = _seq.get(gkey, 0) + 1
    _seq[gkey] = seq
    rank, world = get_rank(group), get_world_size(group)
    site = call_site()
    record = f"{op}|{tuple(x.shape)}|{str(x.dtype).replace('torch.', '')}|{x.device.type}|{site}"
    store = _store()
    prefix = f"wholebatch/debug/{gkey}"
    store.set(f"{prefix}/{seq}/{rank}", record)
    store.set(f"{prefix}/last/{rank}", f"#{seq} {op} at {site}")
    if seq > 2:  # every rank has passed seq - 2: its records are no longer read
        store.delete_key(f"{prefix}/{seq - 2}/{rank}")
    keys = [f"{prefix}/{seq}/{r}" for r in range(world)]
    timeout = _timeout()
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except Exception:  # c10d raises DistStoreError/RuntimeError by version
        missing = [r for r in range(world) if not store.check([keys[r]])]
        if not missing:  # arrived just now
            return _compare(op, seq, store, keys, rank)
        lasts = []
        for r in missing:
            last_key = f"{prefix}/last/{r}"
            last = store.get(last_key).decode() if store.check([last_key]) else "none yet"
            lasts.append(f"rank {r}: {last}")
        raise WholebatchError(
            f"{op} #{seq} at {site}: rank(s) {missing} did not arrive within {timeout:.0f} s "
            f"(their last wholebatch op: {'; '.join(lasts)}). A rank skipped this collective "
            "(an early return or continue, one fewer micro-batch, a backward it did not run) or "
            "died; every rank must call the same wholebatch ops in the same order"
        ) from None
    _compare(op, seq, store, keys, rank)


def _compare(op: str, seq: int, store: Store, keys: list[str], rank: int) -> None:
    records = [v.decode() for v in store.multi_get(keys)]
    ops = [r.split("|", 1)[0] for r in records]
    if len(set(ops)) > 1:
        where = "; ".join(
            f"rank {r}: {rec.split('|')[0]} at {rec.split('|')[-1]}"
            for r, rec in enumerate(records)
        )
        raise WholebatchError(
            f"wholebatch op #{seq}: ranks are in different collectives ({where}); a rank skipped or "
            "added a collective before this point"
        )
