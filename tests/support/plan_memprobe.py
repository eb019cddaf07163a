"""Peak-RSS growth of one loss forward + backward per rank.

    MALLOC_MMAP_THRESHOLD_=131072 python -m tests.support.plan_memprobe W LOSS:N:D:TILE:DTYPE[:K[:DIRS]] ...

Prints one JSON line per spec: {"spec": ..., "peaks": [rank 0's bytes, ...]}.
Each spec runs the real public loss (tests/support/plan_cases.py) on N // W rows per
rank (InfoNCE with K hard negatives per query). RSS follows live memory when
glibc maps every large block and unmaps it on free: in FRESH processes the
environment fixes its mmap threshold from the start (the command above, used
by benchmarks/bench_plan.py); `peaks_here` does the same with `mallopt` in a
running process (the tests' shared gloo worlds), after trimming the heap.

A rank that fails sends its traceback instead of a result, and the command
exits 1 with it; a rank that dies or a run past its deadline (a hang) kills
every rank and exits 1: the caller never waits forever.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import queue
import socket
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.support.plan_cases import Case, call, inputs

__all__ = ["case_of", "peak_growth", "peaks_here"]

DEADLINE_S = 900.0
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


_SHORT = {
    "q2d": "query_to_doc",
    "d2q": "doc_to_query",
    "q2q": "query_to_query",
    "d2d": "doc_to_doc",
}


def case_of(spec: str, world: int) -> Case:
    """`LOSS:N:D:TILE:DTYPE[:K[:DIRS]]` -> the `Case` with N // W rows on each of `world` ranks.

    DIRS: InfoNCE's directions joined by "+", short names (q2d+d2q+q2q+d2d).
    LOSS may end in "/ring" (clip, info_nce: `strategy="ring"`).
    """
    loss, n, d, t, dt, *rest = spec.split(":")
    loss, _, strategy = loss.partition("/")
    dirs = tuple(_SHORT[x] for x in rest[1].split("+")) if len(rest) > 1 else ("query_to_doc",)
    return Case(
        loss=loss, sizes=(int(n) // world,) * world, dim=int(d), tile=int(t), dtype=dt,
        k=int(rest[0]) if rest else 0, directions=dirs, strategy=strategy or "gather",
    )  # fmt: skip


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def peak_growth(fn: Any) -> int:
    """Bytes the resident set grew to at most while `fn()` ran (VmHWM reset before)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    fn()
    return _status("VmHWM") - before


def _measure(case: Case, rank: int, world: int) -> int:
    args = inputs(case, rank)
    # first-call allocations, once, on the path the measured call takes (64 rows would take
    # the small path, losses/small.py, whose kernels are not the tiled forms')
    small = dataclasses.replace(case, sizes=(64,) * world, small=0)
    call(small, inputs(small, rank)).backward()
    if world > 1:
        dist.barrier()
    return peak_growth(lambda: call(case, args).backward())


def peaks_here(specs: list[str]) -> list[int]:
    """This rank's peak growth per spec, in a running process (e.g. a tests/support/harness.py world)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(_M_MMAP_THRESHOLD, 131072)
    libc.mallopt(_M_TRIM_THRESHOLD, 131072)
    libc.malloc_trim(0)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    return [_measure(case_of(s, world), rank, world) for s in specs]


def _rank(rank: int, w: int, port: int, specs: list[str], results: Any) -> None:
    try:
        torch.set_num_threads(1)
        if w > 1:
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=w,
                timeout=timedelta(seconds=120),
            )  # fmt: skip
        out = [_measure(case_of(s, w), rank, w) for s in specs]
        results.put((rank, out, None))
        if w > 1:
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, None, traceback.format_exc()))


def main(argv: list[str]) -> int:
    w, specs = int(argv[0]), argv[1:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, w, port, specs, results)) for r in range(w)]
    for p in procs:
        p.start()
    got: dict[int, list[int]] = {}
    failure = ""
    deadline = time.monotonic() + DEADLINE_S
    while len(got) < w and not failure:
        try:
            rank, out, tb = results.get(timeout=1.0)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in got]
            if dead:
                failure = f"rank(s) {dead} died (exit codes {[procs[r].exitcode for r in dead]})"
            elif time.monotonic() > deadline:
                failure = f"no result from rank(s) {sorted(set(range(w)) - set(got))} in {DEADLINE_S:.0f} s"
            continue
        if tb is not None:
            failure = f"rank {rank} failed:\n{tb}"
        else:
            got[rank] = out
    for p in procs:
        p.join(timeout=5.0 if not failure else 0.1)
        if p.is_alive():
            p.kill()
    if failure:
        print(f"plan_memprobe: {failure}", file=sys.stderr)
        return 1
    for i, spec in enumerate(specs):
        print(json.dumps({"spec": spec, "world": w, "peaks": [got[r][i] for r in range(w)]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
