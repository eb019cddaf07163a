"""What the benchmarks share: a free port, spawned ranks, peak-RSS growth, interleaved timing."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now (for a gloo store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_ranks(target: Callable[..., Any], world: int, cfg: Any, timeout: float) -> dict[int, Any]:
    """`target(rank, world, cfg)` on `world` fresh (spawned) gloo ranks on loopback, one
    thread each: {rank: what it returned}. `timeout` seconds bound the whole run and
    each collective."""
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    args = (target, world, port, cfg, q, timeout)
    procs = [ctx.Process(target=_ranked, args=(r, *args)) for r in range(world)]
    for pr in procs:
        pr.start()
    got = dict(q.get(timeout=timeout) for _ in procs)
    for pr in procs:
        pr.join(timeout=30)
    return got


def _ranked(
    rank: int, target: Callable[..., Any], world: int, port: int, cfg: Any, q: Any, timeout: float
) -> None:
    """One rank of `spawn_ranks`."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=timeout),
    )  # fmt: skip
    q.put((rank, target(rank, world, cfg)))
    dist.destroy_process_group()


def status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_growth(fn: Callable[[], Any]) -> int:
    """Peak RSS growth in bytes over one call of `fn` (VmHWM reset to VmRSS first, Linux)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS: nothing the process did before counts
    before = status_kib("VmRSS") * 1024
    fn()
    return status_kib("VmHWM") * 1024 - before


def interleaved_times(
    modes: Sequence[str], run: Callable[[str], Any], rounds: int
) -> dict[str, list[float]]:
    """Seconds of `run(mode)` per round for every mode, in ONE process, order reversed every other round.

    On a shared machine load comes and goes over seconds; modes timed in
    separate processes minutes apart see different loads. Interleaved, each
    round's ratios compare calls made seconds apart; their median is robust.
    """
    times: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(rounds):
        for m in modes if r % 2 == 0 else modes[::-1]:
            t0 = time.perf_counter()
            run(m)
            times[m].append(time.perf_counter() - t0)
    return times


# A fixed mmap threshold: glibc's dynamic one grows after the first large free, after
# which freed blocks stay in RSS and the next measurement sees less growth than it
# allocates. Fixed, every large block is mapped and unmapped: RSS follows live memory,
# the same way for every configuration.
FIXED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def run_child(module: str, args: Sequence[str], env: dict[str, str] | None = None) -> Any:
    """`python -m benchmarks.<module> *args` in a fresh process (FIXED_MALLOC set): its last line, as JSON."""
    out = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", *args],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, **FIXED_MALLOC, **(env or {})},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])
