"""All-gather forward + backward: wholebatch against its peers, side by side in one run.

    python -m benchmarks.bench_comm                 # W = 2 and 4, 64 KiB .. 16 MiB per rank
    python -m benchmarks.bench_comm --quick         # W = 2, 64 KiB and 1 MiB, fewer repeats

Each configuration runs every method in turn, iteration by iteration, after a
barrier, so machine noise hits all of them alike; a method's time is the
slowest rank's, and the table shows the median. Bytes are *measured*: each
rank's bytes written to its sockets (`wchar` in /proc/self/io, which gloo's
TCP transport goes through) per forward + backward, divided by the per-rank
payload. The ring minimum for an all-gather plus its reduce-scatter is
2 (W-1) payloads.

Methods (x: this rank's payload of fp32; the backward gets a random gradient):
- c10d floor: `all_gather_single` + `reduce_scatter_single`, no autograd;
- c10d a2a floor: `all_gather_single` + all-to-all and a local sum (gloo's
  reduce-scatter sends twice the minimum; this is the cheaper raw sequence);
- wholebatch: `wholebatch.all_gather(x)` (sizes learnt, checks on);
- wholebatch fast: `wholebatch.all_gather(x, sizes=..., check=False)`;
- wholebatch bf16: `wire_dtype=torch.bfloat16`;
- wholebatch debug mode: `wholebatch.set_debug(True)` (store check-in before
  the forward and the backward collective);
- torch.distributed.nn: the deprecated `torch.distributed.nn.functional.all_gather`;
- functional: `torch.distributed._functional_collectives.all_gather_single_autograd`
  (or `all_gather_tensor_autograd` on older torch);
- GatherLayer (all-reduce): forward all-gather, backward all-reduce then slice;
- uneven: per-rank sizes 1, 1/2, 3/4, 1/4 of the payload: wholebatch against
  padding to the largest and using the c10d floor.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from benchmarks._common import free_port
from tests.support.plan_counting import wchar

KIB = 1024


class _AllReduceGather(torch.autograd.Function):
    """The common 'GatherLayer': correct gradient, but its backward all-reduces the whole output."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        w = dist.get_world_size()
        ctx.rank, ctx.b = dist.get_rank(), x.shape[0]
        out = x.new_empty((w * x.shape[0], *x.shape[1:]))
        from wholebatch.comm._c10d import all_gather_single

        all_gather_single(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad[ctx.rank * ctx.b : (ctx.rank + 1) * ctx.b]


def _methods(n: int, world: int, rank: int) -> dict[str, Callable[[], None]]:
    import wholebatch
    from wholebatch.comm._c10d import all_gather_single, reduce_scatter_single

    x = torch.randn(n)
    g = torch.randn(world * n)

    # The floors allocate their outputs per call, as any op that returns new
    # tensors must (autograd keeps the previous step's alive); on CPU each
    # fresh multi-MiB buffer costs page faults, and a floor reusing buffers
    # would measure something no training step can do.
    def floor() -> None:
        out = torch.empty(world * n)
        all_gather_single(out, x)
        gx = torch.empty(n)
        reduce_scatter_single(gx, g)

    def floor_a2a() -> None:
        out = torch.empty(world * n)
        all_gather_single(out, x)
        recv = torch.empty(world * n)
        dist.all_to_all_single(recv, g)
        recv.view(world, n).sum(0)

    def wb(**kw: Any) -> Callable[[], None]:
        def run() -> None:
            xr = x.detach().requires_grad_()
            wholebatch.all_gather(xr, **kw).backward(g)

        return run

    def wb_debug() -> None:
        wholebatch.set_debug(True)
        try:
            wb()()
        finally:
            wholebatch.set_debug(None)

    def tdnn() -> None:
        import torch.distributed.nn.functional as F

        xr = x.detach().requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.cat(F.all_gather(xr)).backward(g)

    def functional() -> None:
        import torch.distributed._functional_collectives as fc

        xr = x.detach().requires_grad_()
        fn = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd
        y = fn(xr, 0, dist.group.WORLD)
        y.backward(g)
        fc.wait_tensor(xr.grad)  # its backward is asynchronous: wait, as a training step would

    def gather_layer() -> None:
        xr = x.detach().requires_grad_()
        _AllReduceGather.apply(xr).backward(g)

    # Uneven: rank sizes follow 1, 1/2, 3/4, 1/4 of n (cycled).
    fracs = [1.0, 0.5, 0.75, 0.25]
    sizes = [max(1, int(n * fracs[r % 4])) for r in range(world)]
    xu = torch.randn(sizes[rank])
    gu = torch.randn(sum(sizes))
    big = max(sizes)

    def uneven_wb() -> None:
        xr = xu.detach().requires_grad_()
        wholebatch.all_gather(xr, sizes=sizes, check=False).backward(gu)

    def uneven_pad() -> None:
        # Pad every rank to the largest size; the cheaper raw sequence (a2a reduce-scatter).
        xpad = torch.zeros(big)
        outpad = torch.empty(world * big)
        gpad = torch.zeros(world * big)
        recvpad = torch.empty(world * big)
        xpad[: sizes[rank]] = xu
        all_gather_single(outpad, xpad)
        _ = torch.cat([outpad[r * big : r * big + s] for r, s in enumerate(sizes)])
        offs = 0
        for r, s in enumerate(sizes):
            gpad[r * big : r * big + s] = gu[offs : offs + s]
            offs += s
        dist.all_to_all_single(recvpad, gpad)
        recvpad.view(world, big).sum(0)

    return {
        "c10d floor": floor,
        "c10d a2a floor": floor_a2a,
        "wholebatch": wb(),
        "wholebatch fast": wb(sizes=[n] * world, check=False),
        "wholebatch bf16": wb(wire_dtype=torch.bfloat16),
        "wholebatch debug mode": wb_debug,
        "torch.distributed.nn": tdnn,
        "functional": functional,
        "GatherLayer (all-reduce)": gather_layer,
        "uneven: wholebatch": uneven_wb,
        "uneven: pad to max": uneven_pad,
    }


def _rank_main(
    rank: int, world: int, port: int, payloads: list[int], iters: int, queue: Any
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    torch.manual_seed(rank)
    rows = []
    for payload in payloads:
        n = payload // 4
        methods = _methods(n, world, rank)
        times: dict[str, list[float]] = {k: [] for k in methods}
        sent: dict[str, int] = dict.fromkeys(methods, 0)
        for fn in methods.values():  # warm up: first-call setup, lazy imports
            fn()
        reps = max(3, iters if payload <= 1024 * KIB else iters // 2)
        for _ in range(reps):
            for name, fn in methods.items():
                dist.barrier()
                w0 = wchar()
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
                sent[name] += wchar() - w0
        # the slowest rank's time per iteration
        for name in methods:
            t = torch.tensor(times[name], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[name] = t.tolist()
        if rank == 0:
            for name in methods:
                rows.append(
                    dict(
                        world=world,
                        payload_kib=payload // KIB,
                        method=name,
                        median_ms=statistics.median(times[name]) * 1e3,
                        bytes_per_payload=sent[name] / reps / payload,
                    )
                )
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def run(worlds: list[int], payloads: list[int], iters: int) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    rows: list[dict[str, Any]] = []
    for world in worlds:
        queue = ctx.SimpleQueue()
        port = free_port()
        procs = [
            ctx.Process(target=_rank_main, args=(r, world, port, payloads, iters, queue))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        while queue.empty():  # a rank that dies must fail the run, not leave it waiting
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise SystemExit(
                    f"bench_comm: a rank failed at W={world}: exit codes {[p.exitcode for p in procs]}"
                )
            time.sleep(0.1)
        rows.extend(queue.get())
        for p in procs:
            p.join()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per (W, payload), each method's median, ratio to the c10d floor, bytes per payload."""
    lines = [
        "| W | payload | method | median ms | x c10d floor | x a2a floor | sent / payload |",
        "|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["world"], r["payload_kib"]), []).append(r)
    for (world, kib), rs in groups.items():
        floor = next(r["median_ms"] for r in rs if r["method"] == "c10d floor")
        floor2 = next(r["median_ms"] for r in rs if r["method"] == "c10d a2a floor")
        size = f"{kib // 1024} MiB" if kib >= 1024 else f"{kib} KiB"
        for r in rs:
            lines.append(
                f"| {world} | {size} | {r['method']} | {r['median_ms']:.3f} | "
                f"{r['median_ms'] / floor:.2f} | {r['median_ms'] / floor2:.2f} | {r['bytes_per_payload']:.2f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_comm", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="W = 2, 64 KiB and 1 MiB, few repeats")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.quick:
        worlds, payloads, iters = [2], [64 * KIB, 1024 * KIB], 5
    else:
        worlds, payloads, iters = (
            args.worlds,
            [k * KIB for k in (64, 256, 1024, 4096, 16384)],
            args.iters,
        )
    start = time.perf_counter()
    rows = run(worlds, payloads, iters)
    print(table(rows))
    print(
        f"\n({time.perf_counter() - start:.0f} s; torch {torch.__version__}; gloo on loopback, {os.cpu_count()} cores)"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
