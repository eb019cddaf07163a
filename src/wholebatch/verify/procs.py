"""The processes verify runs in: a fresh interpreter, a clean fork per TARGET module and per run.

    with Session(timeout_s=120) as s:
        value = s.call("examples/verify_clip.py", fn, args, nproc=2, distributed=True)

Why not torchrun's launcher: every run of every target must start from clean
processes (a library singleton such as Accelerate's `AcceleratorState`, set by
one target's step, must not change the next target's verdict), and verify runs
the same step several times to localise a failure. Starting W interpreters per
run costs seconds each (importing transformers alone takes ~3 s); forking costs
milliseconds. So:

    parent (the CLI, or a user's pytest process: never runs target code)
      root        a fresh `python` (subprocess): imports torch and verify, watches
                  torch.distributed's collectives, and never runs target code
        module    fork of the root per TARGET module: imports that module, and
                  only imports it (so it holds what a fresh `import` holds)
          run     fork of the module process per run: W ranks (gloo, joined
                  through a FileStore; RANK, WORLD_SIZE, ... set as torchrun
                  sets them) or one process for the reference; exits after it

Every run therefore sees exactly the state of a fresh interpreter that imported
the target's module: nothing a step did survives it. Forking a process that
imported torch is safe here because none of these processes has started a
thread or touched an accelerator before forking (torch runs with one thread).
Linux (fork) only.

Messages are `torch.save` bytes read back with `torch.load(weights_only=True)`
and an allowlist of verify's own result classes: tensors by value, and no
message can build anything else or carry code (a run names the function to
call). A run that does not answer in time is killed; the parent kills the whole
tree if the root stalls.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = ["ChildFailure", "Session"]


class ChildFailure:
    """A run's process that raised, died or hung: what to report instead of its value."""

    def __init__(self, rank: int, kind: str, message: str, trace: str = "") -> None:
        self.rank = rank
        self.kind = kind  # "raised", "died", "hung"
        self.message = message
        self.traceback = trace

    def __repr__(self) -> str:
        return f"ChildFailure(rank={self.rank}, kind={self.kind!r}, message={self.message!r})"


def _allowed() -> list[Any]:
    """The only classes a message may build (besides tensors, containers and primitives)."""
    from wholebatch.verify.report import AuxFit, Fit, NormFit
    from wholebatch.verify.worker import (
        Condition,
        Description,
        RankResult,
        RefRequest,
        RefResult,
    )

    return [
        AuxFit,
        ChildFailure,
        Condition,
        Description,
        Fit,
        NormFit,
        RankResult,
        RefRequest,
        RefResult,
    ]


def _send(conn: Connection, obj: Any) -> None:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    conn.send_bytes(buf.getvalue())


def _recv(conn: Connection) -> Any:
    import torch

    data = conn.recv_bytes()
    with torch.serialization.safe_globals(_allowed()):
        return torch.load(io.BytesIO(data), weights_only=True)


def _runs() -> dict[str, Callable[..., Any]]:
    """What a run may call, by name (a message names the function, it never carries code)."""
    from wholebatch.verify import worker

    return {
        "describe": worker.describe,
        "split_rank": worker.split_rank,
        "reference": worker.reference,
    }


# ---------------------------------------------------------------------------
# Runs (forked from the module process)
# ---------------------------------------------------------------------------


def _run_child(
    conn: Connection,
    fn_name: str,
    args: tuple[Any, ...],
    rank: int,
    nproc: int,
    store_path: str | None,
    timeout_s: float,
) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        if store_path is not None:
            import torch.distributed as dist

            os.environ.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc),
                GROUP_RANK="0",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=os.environ.get("_WHOLEBATCH_VERIFY_PORT", "29500"),
            )
            from torch._C._distributed_c10d import FileStore  # typed where dist's export is not

            store = FileStore(store_path, nproc)
            dist.init_process_group(
                "gloo",
                store=store,
                rank=rank,
                world_size=nproc,
                timeout=timedelta(seconds=timeout_s),
            )
        fn = _runs()[fn_name]
        value = fn(*args, rank, nproc) if store_path is not None else fn(*args)
        payload: Any = ("ok", value)
    except BaseException as exc:  # report anything, SystemExit included
        payload = ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc())
    try:
        _send(conn, payload)
    except Exception as exc:  # the value does not serialise
        _send(conn, ("error", f"verify could not send the result back: {exc}", ""))
    if store_path is not None:
        import torch.distributed as dist

        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fork_run(
    fn_name: str,
    args: tuple[Any, ...],
    nproc: int,
    distributed: bool,
    timeout_s: float,
    deadline_s: float,
) -> list[Any]:
    """Fork `nproc` processes running `fn`; each rank's value or a ChildFailure."""
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="wholebatch-verify-") as tmp:
        store = os.path.join(tmp, "store") if distributed else None
        os.environ["_WHOLEBATCH_VERIFY_PORT"] = str(_free_port())
        procs, conns = [], []
        for rank in range(nproc):
            recv_end, send_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_run_child,
                args=(send_end, fn_name, args, rank, nproc, store, timeout_s),
            )
            proc.start()
            send_end.close()
            procs.append(proc)
            conns.append(recv_end)
        results: list[Any] = [None] * nproc
        pending = dict(enumerate(conns))
        end = time.monotonic() + deadline_s
        while pending:
            ready = wait(list(pending.values()), timeout=max(0.0, end - time.monotonic()))
            if not ready:
                break
            for rank, conn in list(pending.items()):
                if conn not in ready:
                    continue
                try:
                    status, *rest = _recv(conn)
                    results[rank] = (
                        rest[0]
                        if status == "ok"
                        else ChildFailure(rank, "raised", rest[0], rest[1])
                    )
                except EOFError:
                    procs[rank].join(timeout=5)
                    results[rank] = ChildFailure(
                        rank, "died", f"exited with code {procs[rank].exitcode} without a result"
                    )
                except Exception as exc:  # a result verify refuses to read back
                    results[rank] = ChildFailure(
                        rank, "raised", f"verify could not read its result: {exc}"
                    )
                del pending[rank]
        for rank in pending:
            results[rank] = ChildFailure(
                rank, "hung", f"did not finish within {deadline_s:.0f} s (killed)"
            )
        for proc in procs:
            proc.join(timeout=2 if not pending else 0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in conns:
            conn.close()
    return results


# ---------------------------------------------------------------------------
# The module process and the root
# ---------------------------------------------------------------------------


def _module_main(conn: Connection, where: str, cwd: str, sys_path: list[str]) -> None:
    from wholebatch.verify.spec import TargetError, load_module

    os.chdir(cwd)
    sys.path[:] = sys_path
    try:
        load_module(where)
        _send(conn, ("ok",))
    except TargetError as exc:
        _send(conn, ("target-error", str(exc)))
        return
    except BaseException as exc:
        last = traceback.format_exc().rstrip().splitlines()[-1]
        _send(conn, ("target-error", f"verify: importing {where!r} raised {last}"))
        del exc
        return
    while True:
        try:
            msg = _recv(conn)
        except EOFError:
            return
        if msg is None:
            return
        fn_name, args, nproc, distributed, timeout_s, deadline_s = msg
        if fn_name not in _runs():
            _send(conn, [ChildFailure(0, "raised", f"verify: no run named {fn_name!r}")])
            continue
        _send(conn, _fork_run(fn_name, args, nproc, distributed, timeout_s, deadline_s))


def root_main(fd: int) -> None:
    """The root process: `python -c '...root_main(FD)'` with a socket on FD (see the module docstring)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    # Preloaded once for every fork: DistributedDataParallel's first construction imports
    # torch._dynamo (~800 modules, seconds), which would otherwise repeat in every rank.
    import torch._dynamo
    import torch.nn.parallel
    import torch.utils.checkpoint

    from wholebatch.verify import recording, worker  # noqa: F401

    recording.watch_collectives()
    conn = Connection(fd)
    ctx = mp.get_context("fork")
    modules: dict[str, tuple[Any, Connection]] = {}
    try:
        while True:
            try:
                msg = _recv(conn)
            except EOFError:
                break
            if msg is None:
                break
            where, cwd, sys_path, call = msg
            if where not in modules:
                parent_end, child_end = ctx.Pipe()
                proc = ctx.Process(target=_module_main, args=(child_end, where, cwd, sys_path))
                proc.start()
                child_end.close()
                modules[where] = (proc, parent_end)
                status = _recv(parent_end)
                if status[0] != "ok":
                    proc.join()
                    del modules[where]
                    _send(conn, status)
                    continue
            proc, module_conn = modules[where]
            _send(module_conn, call)
            _send(conn, ("ok", _recv(module_conn)))
    finally:
        for proc, module_conn in modules.values():
            with contextlib.suppress(Exception):
                _send(module_conn, None)
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()


class Session:
    """A root process for one verify call; `call` runs a function in clean forks of a TARGET's module."""

    def __init__(self, *, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._cwd = os.getcwd()
        self._sys_path = [os.path.abspath(p) if p else self._cwd for p in sys.path]
        parent_sock, child_sock = socket.socketpair()
        code = (
            "import sys; from wholebatch.verify.procs import root_main; root_main(int(sys.argv[1]))"
        )
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        # The root's stdout goes to our stderr: what a step prints never mixes with --json.
        self._proc = subprocess.Popen(
            [sys.executable, "-c", code, str(child_sock.fileno())],
            pass_fds=(child_sock.fileno(),),
            stdout=2,
            env=env,
            start_new_session=True,
        )
        child_sock.close()
        self._conn = Connection(parent_sock.detach())

    def call(
        self,
        where: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        *,
        nproc: int = 1,
        distributed: bool = False,
        deadline_s: float | None = None,
    ) -> list[Any]:
        """Run `fn(*args)` (or `fn(*args, rank, nproc)` when distributed) in fresh forks of `where`'s module.

        Returns each process's value or a `ChildFailure`. Raises `TargetError` when the
        module cannot be imported, and `RuntimeError` when the root stops answering.
        """
        from wholebatch.verify.spec import TargetError

        deadline = deadline_s if deadline_s is not None else 4 * self.timeout_s + 60
        name = fn.__name__
        if _runs().get(name) is not fn:
            raise ValueError(f"verify: {name} is not one of the runs {sorted(_runs())}")
        call = (name, args, nproc, distributed, self.timeout_s, deadline)
        _send(self._conn, (where, self._cwd, self._sys_path, call))
        # The module's import and the run's own deadline come first; this one catches a stalled tree.
        if not self._conn.poll(deadline + 300):
            self.close()
            raise RuntimeError(f"verify: no answer from the run processes of {where!r} in time")
        try:
            status, *rest = _recv(self._conn)
        except EOFError:
            self.close()
            raise RuntimeError("verify: the root process died") from None
        if status == "target-error":
            raise TargetError(rest[0])
        values: list[Any] = rest[0]
        return values

    def close(self) -> None:
        """Stop the root and everything it started."""
        with contextlib.suppress(Exception):
            _send(self._conn, None)
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, signal.SIGKILL)  # anything left in the tree
        self._conn.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def session(timeout_s: float) -> Iterator[Session]:
    """`Session` as a context manager."""
    s = Session(timeout_s=timeout_s)
    try:
        yield s
    finally:
        s.close()
