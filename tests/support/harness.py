"""Run a function on W real gloo ranks on loopback, reusing worker processes.

    from tests.support.harness import run_ranks
    outs = run_ranks(3, my_module_level_fn, arg1, arg2)   # [rank 0's result, rank 1's, rank 2's]

A *world* is W worker processes with an initialised gloo process group; it is
started once per W and reused by every test (starting torch and gloo costs
about a second a process, which on 2 cores would dominate the suite). Each call
sends `fn` (a module-level function, so it pickles by reference) and its
arguments to every rank; the worker calls `fn(*args)` and sends back the value
or the traceback. Values travel with plain `pickle` (tensors by value, no
shared-memory file descriptors).

A hard deadline per call: a rank that has not answered by then is asked for its
Python stack (faulthandler on SIGUSR1), the world is killed and restarted, and
the call fails with `RankTimeout` naming the hung ranks and where they were.
The process group's own timeout is short too, so a collective that a peer
never joins raises inside the worker instead of waiting 30 minutes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

__all__ = [
    "RankError",
    "RankFailure",
    "RankTimeout",
    "run_ranks",
    "run_ranks_outcomes",
    "shutdown_worlds",
]

DEFAULT_TIMEOUT_S = 60.0
# A collective that a peer never joins raises in the worker after this long;
# shorter than the harness deadline so the worker's own error usually arrives first.
PG_TIMEOUT_S = 20.0


@dataclasses.dataclass(frozen=True)
class RankError:
    """An exception raised on one rank: its type name, message and formatted traceback."""

    type_name: str
    message: str
    traceback: str


class RankFailure(AssertionError):
    """One or more ranks raised; the message holds every failing rank's traceback."""


class RankTimeout(AssertionError):
    """One or more ranks did not answer within the deadline; the message holds their stacks."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world_size: int, port: int, conn: Connection, stack_path: str) -> None:
    import faulthandler

    # `kill -USR1` makes this rank write every thread's Python stack to stack_path.
    stack_file = open(stack_path, "w")  # noqa: SIM115 - lives as long as the process
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=PG_TIMEOUT_S),
    )
    conn.send_bytes(pickle.dumps("ready"))
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except EOFError:
            break
        if msg is None:
            break
        module_name, qualname, args, kwargs = msg
        try:
            obj: Any = importlib.import_module(module_name)
            for part in qualname.split("."):
                obj = getattr(obj, part)
            value = obj(*args, **kwargs)
            payload = pickle.dumps(("ok", value))
        except BaseException as exc:
            err = RankError(type(exc).__name__, str(exc), traceback.format_exc())
            payload = pickle.dumps(("error", err))
        conn.send_bytes(payload)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


class _World:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._tmp = tempfile.mkdtemp(prefix=f"wb-world{world_size}-")
        self.stack_paths = [os.path.join(self._tmp, f"rank{r}.stack") for r in range(world_size)]
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker,
                args=(rank, world_size, port, child, self.stack_paths[rank]),
                daemon=True,
                name=f"wb-rank{rank}-of-{world_size}",
            )
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        deadline = time.monotonic() + 120
        for rank, conn in enumerate(self.conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                self.kill()
                raise RuntimeError(f"harness: rank {rank} of {world_size} did not start in 120 s")
            pickle.loads(conn.recv_bytes())

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(pickle.dumps(None))
        for p in self.procs:
            p.join(timeout=5)
        self.kill()

    def stacks(self, ranks: list[int]) -> dict[int, str]:
        for r in ranks:
            if self.procs[r].is_alive():
                os.kill(self.procs[r].pid, signal.SIGUSR1)
        time.sleep(0.5)
        out = {}
        for r in ranks:
            with open(self.stack_paths[r]) as f:
                out[r] = f.read() or "(no stack written: the process is not running Python code)"
        return out


_worlds: dict[int, _World] = {}


def _get_world(world_size: int) -> _World:
    world = _worlds.get(world_size)
    if world is None or not world.alive():
        if world is not None:
            world.kill()
        world = _World(world_size)
        _worlds[world_size] = world
    return world


def shutdown_worlds() -> None:
    """Stop every worker process (called at the end of the test session)."""
    for world in _worlds.values():
        world.close()
    _worlds.clear()


def run_ranks_outcomes(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on every rank; each rank's value, or its `RankError`.

    Raises `RankTimeout` if any rank does not answer within `timeout` seconds.
    """
    module = fn.__module__
    if module == "__main__":  # pragma: no cover - only when a test file is run as a script
        module = os.path.splitext(os.path.basename(sys.argv[0]))[0]
    payload = pickle.dumps((module, fn.__qualname__, args, kwargs))
    world = _get_world(world_size)
    for conn in world.conns:
        conn.send_bytes(payload)
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(results) < world_size:
        waiting = [r for r in range(world_size) if r not in results]
        progressed = False
        for r in waiting:
            conn = world.conns[r]
            if conn.poll(0.01):
                try:
                    _status, value = pickle.loads(conn.recv_bytes())
                except EOFError:
                    code = world.procs[r].exitcode
                    _status, value = "error", RankError("ProcessExit", f"exit code {code}", "")
                results[r] = value
                progressed = True
        if not progressed and time.monotonic() > deadline:
            hung = [r for r in range(world_size) if r not in results]
            stacks = world.stacks(hung)
            world.kill()
            _worlds.pop(world_size, None)
            done = {r: _describe(v) for r, v in sorted(results.items())}
            text = "\n".join(f"--- rank {r} stack ---\n{s}" for r, s in stacks.items())
            raise RankTimeout(
                f"{fn.__qualname__} on {world_size} ranks: ranks {hung} did not answer "
                f"within {timeout:.0f} s (finished: {done})\n{text}"
            )
    outcomes = [results[r] for r in range(world_size)]
    if any(isinstance(o, RankError) and _may_poison(o) for o in outcomes):
        # A rank failed inside or around a collective (a timeout, a transport
        # error, a rank that raised while its peers waited): gloo's pairs may
        # hold stale data now, so the next test gets a fresh world.
        world.kill()
        _worlds.pop(world_size, None)
    elif any(isinstance(o, RankError) for o in outcomes) and not all(
        isinstance(o, RankError) for o in outcomes
    ):
        world.kill()
        _worlds.pop(world_size, None)
    return outcomes


def _may_poison(err: RankError) -> bool:
    text = f"{err.type_name} {err.message}".lower()
    return any(
        word in text for word in ("timed out", "timeout", "gloo", "connection", "processexit")
    )


def _describe(value: Any) -> str:
    if isinstance(value, RankError):
        return f"{value.type_name}: {value.message}"
    return "ok"


def run_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on every rank and return each rank's value, in rank order.

    Raises `RankFailure` with every failing rank's traceback if any rank raised.
    """
    outcomes = run_ranks_outcomes(world_size, fn, *args, timeout=timeout, **kwargs)
    errors = {r: o for r, o in enumerate(outcomes) if isinstance(o, RankError)}
    if errors:
        text = "\n".join(f"--- rank {r} ---\n{e.traceback}" for r, e in errors.items())
        raise RankFailure(f"{fn.__qualname__} failed on ranks {sorted(errors)}:\n{text}")
    return outcomes
