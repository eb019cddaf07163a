"""Peak-RSS growth of one loss forward + backward per rank, in FRESH gloo processes.

    MALLOC_MMAP_THRESHOLD_=131072 python -m tests.plan_memprobe W LOSS:N:D:TILE:DTYPE ...

Prints one JSON line per spec: {"spec": ..., "peaks": [rank 0's bytes, ...]}.
Fresh processes with glibc's mmap threshold fixed from the start: every large
block is mapped and unmapped, so RSS follows live memory (a reused process may
recycle freed heap and under-count). Used by tests/test_plan_dist.py and
benchmarks/bench_plan.py.
"""

from __future__ import annotations

import json
import socket
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def peak_growth(fn: Any) -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    fn()
    return _status("VmHWM") - before


def _rank(rank: int, w: int, port: int, specs: list[str], queue: Any) -> None:
    torch.set_num_threads(1)
    if w > 1:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=w
        )
    import torch.nn.functional as F

    from tests.test_plan_dist import DTYPES, LOSSES, SCALARS

    out = []
    for spec in specs:
        loss, n, d, t, dt = spec.split(":")
        rows, dim, tile = int(n) // w, int(d), int(t)
        g = torch.Generator().manual_seed(100 + rank)
        a = F.normalize(torch.randn(rows, dim, generator=g), dim=1).to(DTYPES[dt]).requires_grad_()
        b = F.normalize(torch.randn(rows, dim, generator=g), dim=1).to(DTYPES[dt]).requires_grad_()
        sc = [torch.tensor(v, requires_grad=True) for v in SCALARS[loss]]
        LOSSES[loss](a[:64].detach(), b[:64].detach(), *[s.detach() for s in sc], tile_size=tile)
        if w > 1:
            dist.barrier()
        fn = LOSSES[loss]
        out.append(peak_growth(lambda: fn(a, b, *sc, tile_size=tile).backward()))  # noqa: B023
    queue.put((rank, out))
    if w > 1:
        dist.barrier()
        dist.destroy_process_group()


def main(argv: list[str]) -> None:
    w, specs = int(argv[0]), argv[1:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank, args=(r, w, port, specs, queue)) for r in range(w)]
    for p in procs:
        p.start()
    got = dict(queue.get() for _ in range(w))
    for p in procs:
        p.join()
    for i, spec in enumerate(specs):
        print(json.dumps({"spec": spec, "world": w, "peaks": [got[r][i] for r in range(w)]}))


if __name__ == "__main__":
    main(sys.argv[1:])
