"""Run a function on N local processes through torchrun's own launcher, and get each rank's value.

    from wholebatch.comm.launch import launch, LaunchSpec
    values = launch(my_module_level_fn, ("arg",), spec=LaunchSpec(nproc=4))  # [rank 0's, rank 1's, ...]

wholebatch adds no spawner of its own: `launch` hands the function to
`torch.distributed.launcher.api.elastic_launch`, the library behind `torchrun`
(c10d rendezvous on 127.0.0.1 with a free port, `spawn` start method), and each
rank first joins a gloo (or NCCL) process group built from the environment the
agent sets (RANK, WORLD_SIZE, MASTER_ADDR, ...). `fn` must be a module-level
function (it is pickled by reference) and its arguments and return value must
pickle.

A rank that raises takes the others down (the agent terminates them) and
`launch` raises `LaunchError` naming the rank and carrying its traceback; a
collective that a peer never joins fails after `LaunchSpec.timeout_s`.

Also here: `in_torchrun()` (was this process started by torchrun?) and
`init_from_env()` (join the process group torchrun describes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from wholebatch.comm.groups import init_process_group
from wholebatch.errors import WholebatchError

__all__ = ["LaunchError", "LaunchSpec", "default_backend", "in_torchrun", "launch"]

# Loggers of the elastic agent and torch.multiprocessing: on a rank's failure they
# print the traceback again, interleaved; LaunchError carries it once instead.
_NOISY_LOGGERS = (
    "torch.distributed.elastic",
    "torch.distributed.launcher",
    "torch.multiprocessing",
)


class LaunchError(WholebatchError):
    """A launched rank failed; the message names the rank and holds its traceback."""

    def __init__(self, message: str, *, rank: int | None, traceback: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """How `launch` starts the local processes."""

    nproc: int = 2
    """Number of local processes (ranks) to start; at least 1."""

    backend: str | None = None
    """Process-group backend: "gloo", "nccl", or None for `default_backend()` (gloo on CPU)."""

    timeout_s: float = 120.0
    """The process group's timeout: a collective that a peer never joins fails after this."""

    threads: int = 1
    """torch threads (OMP_NUM_THREADS) per rank; 1 keeps N ranks from oversubscribing the cores."""

    def __post_init__(self) -> None:
        if isinstance(self.nproc, bool) or not isinstance(self.nproc, int) or self.nproc < 1:
            raise WholebatchError(f"LaunchSpec: nproc={self.nproc!r} must be an int >= 1")
        if self.backend not in (None, "gloo", "nccl"):
            raise WholebatchError(
                f"LaunchSpec: backend={self.backend!r}; expected 'gloo', 'nccl' or None (auto)"
            )
        if not self.timeout_s > 0:
            raise WholebatchError(f"LaunchSpec: timeout_s={self.timeout_s!r} must be > 0")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise WholebatchError(f"LaunchSpec: threads={self.threads!r} must be an int >= 1")


def default_backend() -> str:
    """NCCL when CUDA devices are present, else gloo."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def in_torchrun() -> bool:
    """True when this process was started by torchrun (or another launcher that sets RANK etc.)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _entry(
    fn: Callable[..., Any], args: Sequence[Any], backend: str, timeout_s: float, threads: int
) -> Any:
    """What each launched process runs: join the group, call `fn(*args)`, leave the group."""
    torch.set_num_threads(threads)
    init_process_group(backend, timeout_s=timeout_s)
    try:
        return fn(*args)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


@contextlib.contextmanager
def _quiet_agent() -> Iterator[None]:
    saved = {name: logging.getLogger(name).level for name in _NOISY_LOGGERS}
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _failure_text(failure: Any) -> tuple[str, str]:
    """(one-line message, traceback) of a torch.distributed.elastic ProcessFailure."""
    message = getattr(failure, "message", "")
    if isinstance(message, dict):
        text = str(message.get("message", ""))
        trace = str(message.get("extraInfo", {}).get("py_callstack", ""))
        return text, trace
    exitcode = getattr(failure, "exitcode", None)
    return (str(message) or f"exited with code {exitcode}"), ""


def launch(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    *,
    spec: LaunchSpec | None = None,
    name: str = "wholebatch",
) -> list[Any]:
    """Run `fn(*args)` on `spec.nproc` local processes in one process group; each rank's value.

    Args:
        fn: a module-level function (pickled by reference into each spawned process).
        args: its arguments (pickled).
        spec: process count, backend, timeout, threads per rank.
        name: prefix of the rendezvous run id (shows in torch's logs).

    Returns:
        The values `fn` returned, in rank order.

    Raises:
        LaunchError: a rank raised or died; the message names the first rank that did,
            with its exception and traceback.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    spec = spec or LaunchSpec()
    backend = spec.backend or default_backend()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=spec.nproc,
        run_id=f"{name}-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    threads = str(spec.threads)
    try:
        with _quiet_agent(), _env({"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}):
            results: dict[int, Any] = elastic_launch(config, _entry)(
                fn, tuple(args), backend, spec.timeout_s, spec.threads
            )
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        message, trace = _failure_text(failure)
        raise LaunchError(
            f"{name}: rank {rank} of {spec.nproc} failed: {message}"
            + (f"\n\n{trace.rstrip()}" if trace else ""),
            rank=rank,
            traceback=trace,
        ) from None
    return [results[r] for r in range(spec.nproc)]
