"""Process groups: who is in the world, and agreeing on rank-local facts.

With torch.distributed not initialised, everything here describes a world of
one process (rank 0 of 1), so code written for W ranks runs unchanged on one.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from wholebatch.comm._c10d import PrefixStore, TCPStore

__all__ = [
    "all_ranks_agree",
    "any_rank",
    "checks_enabled",
    "comm_device",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_distributed",
    "is_gloo",
    "set_checks",
]

_CHECKS_ENV = "WHOLEBATCH_CHECKS"
_checks_override: bool | None = None


# Per group, what never changes once it exists: (world size, rank) and the backend.
# torch.distributed resolves them through several Python calls each time; a loss call
# asks ~10 times. Weak keys: a destroyed group takes its entries with it.
_SHAPE: weakref.WeakKeyDictionary[ProcessGroup, tuple[int, int]] = weakref.WeakKeyDictionary()
_BACKEND: weakref.WeakKeyDictionary[ProcessGroup, str] = weakref.WeakKeyDictionary()
_T = TypeVar("_T")


def _once(
    cache: weakref.WeakKeyDictionary[ProcessGroup, _T],
    group: ProcessGroup | None,
    read: Callable[[], _T],
) -> _T:
    """`read()` for `group` (None: the world), the first time only."""
    key = dist.group.WORLD if group is None else group
    got = cache.get(key) if key is not None else None
    if got is None:
        got = read()
        if key is not None:
            cache[key] = got
    return got


def _shape(group: ProcessGroup | None) -> tuple[int, int]:
    """(world size, rank) of `group`; (1, 0) when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return _once(_SHAPE, group, lambda: (dist.get_world_size(group), dist.get_rank(group)))


def is_distributed(group: ProcessGroup | None = None) -> bool:
    """True when torch.distributed is initialised and `group` holds more than one rank."""
    return _shape(group)[0] > 1


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Ranks in `group` (default: the world); 1 when torch.distributed is not initialised."""
    return _shape(group)[0]


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank within `group`; 0 when torch.distributed is not initialised."""
    return _shape(group)[1]


def backend_of(group: ProcessGroup | None = None) -> str:
    """`group`'s backend in lower case ("gloo", "nccl", "cpu:gloo,cuda:nccl"); read once per group."""
    return _once(_BACKEND, group, lambda: str(dist.get_backend(group)).lower())


def is_gloo(group: ProcessGroup | None, device: torch.device) -> bool:
    """Whether c10d routes tensors on `device` through gloo in `group` ("gloo", or a
    "cpu:gloo,cuda:nccl" group for a CPU tensor)."""
    backend = backend_of(group)
    if ":" not in backend:
        return backend == "gloo"
    routes = dict(part.split(":", 1) for part in backend.split(",") if ":" in part)
    return routes.get(device.type) == "gloo"


def comm_device(group: ProcessGroup | None = None) -> torch.device:
    """The device that small control tensors (sizes, flags) must live on for `group`.

    gloo (and mixed "cpu:gloo,cuda:nccl" groups) take CPU tensors; NCCL and the
    other accelerator backends take tensors on the current accelerator.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    backend = backend_of(group)
    if "gloo" in backend or "mpi" in backend:
        return _CPU
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return _CPU


_CPU = torch.device("cpu")


def set_checks(enabled: bool | None) -> None:
    """Turn the cross-rank input checks on or off for this process (None: back to the default).

    The default comes from the environment variable ``WHOLEBATCH_CHECKS``
    (``0``/``false``/``off`` turn them off) and is on. The checks compare shapes,
    dtypes and devices across ranks before any data moves. Where an op must
    exchange sizes anyway (an all-gather without ``sizes=``) they cost nothing and
    always run; elsewhere they cost one small all-gather per call. Turning them
    off saves that latency; the risk is what plain c10d gives on bad input: a gloo
    abort, a hang, or (on NCCL) silently wrong data. Set it the same on every rank.
    """
    global _checks_override
    _checks_override = enabled


def checks_enabled(check: bool | None = None) -> bool:
    """Whether an op should run its cross-rank checks: `check` if given, else the process setting."""
    if check is not None:
        return check
    if _checks_override is not None:
        return _checks_override
    return os.environ.get(_CHECKS_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def all_ranks_agree(flag: bool, *, group: ProcessGroup | None = None) -> bool:
    """True on every rank iff `flag` is true on every rank of `group`.

    Every rank must call it (it is one one-element all-reduce). Use it before a
    rank-local condition changes control flow, so that all ranks take the same path.
    """
    if not is_distributed(group):
        return bool(flag)
    t = torch.tensor([0 if flag else 1], dtype=torch.int32, device=comm_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return int(t.item()) == 0


def any_rank(flag: bool, *, group: ProcessGroup | None = None) -> bool:
    """True on every rank iff `flag` is true on at least one rank of `group`."""
    return not all_ranks_agree(not flag, group=group)


def init_process_group(backend: str | None = None, *, timeout_s: float | None = None) -> None:
    """Initialise torch.distributed from torchrun's environment, with a short timeout; safe on restart.

    A thin layer over `torch.distributed.init_process_group` (a no-op if already
    initialised) that adds two things:

    - the timeout: `timeout_s`, else ``WHOLEBATCH_PG_TIMEOUT``, else 300 s, instead
      of gloo's 30 minutes, so a rank that never joins a collective ends the
      job in minutes (see docs/reliability.md for choosing it);
    - restart-safe rendezvous keys: under torchrun ``--max-restarts``, workers
      of every attempt share the agent's store, and in torch 2.13 a restarted
      gloo group can read the previous attempt's peer addresses and fail with
      "Connection refused"; each attempt here gets its own key prefix.

    With NCCL, each process first selects the CUDA device numbered LOCAL_RANK.

    Args:
        backend: "gloo", "nccl", ...; None: torch's default for the devices present.
        timeout_s: the process group's timeout in seconds.
    """
    if dist.is_initialized():
        return
    if backend is not None and "nccl" in backend and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    seconds = (
        timeout_s
        if timeout_s is not None
        else float(os.environ.get("WHOLEBATCH_PG_TIMEOUT", "300"))
    )
    timeout = timedelta(seconds=seconds)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        world = int(os.environ["WORLD_SIZE"])
        store = TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world_size=world,
            is_master=False,
            timeout=timeout,
        )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        prefixed = PrefixStore(f"wholebatch/attempt-{attempt}", store)
        dist.init_process_group(
            backend, store=prefixed, rank=int(os.environ["RANK"]), world_size=world, timeout=timeout
        )
    else:
        dist.init_process_group(backend, timeout=timeout)
