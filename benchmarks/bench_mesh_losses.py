"""A loss with `mesh=` against the same loss on the batch dims' group, dp2 x tp2 on 4 gloo ranks.

    python -m benchmarks.bench_mesh_losses            # 30 timed calls per method
    python -m benchmarks.bench_mesh_losses --quick    # 8

What `mesh=`, `batch_dims=` adds to a loss call: resolving the (cached) batch
group and the tp replicas' check (a fingerprint of the embeddings, O(B·D), and
one all-gather over the mesh started before the loss's own exchange and read
after it). The baseline is the workaround it replaces: `group=` the batch dims'
group, which checks nothing. Both run forward and backward of `clip_loss` and
`info_nce_loss` (one hard negative) on the same rows (float32, B rows per rank,
D = 256), after a barrier, in alternating order; a call's time is the slowest
rank's. "paired" is the median over calls of (mesh / group) on the same call.
On dp2 x cp2 (no replica dim) `mesh=` adds no collective at all.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

D = 256
SHAPE = (("dp", 2), ("tp", 2))


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def bench_rank(calls: int, warmup: int, rows: int) -> dict[str, Any]:
    """Run on each of the 4 ranks: both methods, call by call; the slowest rank's times."""
    from tests.support.mesh_cases import get_mesh
    from wholebatch.comm.meshgroup import resolve_group
    from wholebatch.losses import clip_loss, info_nce_loss

    torch.set_num_threads(1)
    mesh = get_mesh(SHAPE)
    group, _ = resolve_group(None, mesh, ("dp",), "bench")
    dp = dist.get_rank() // 2
    gen = torch.Generator().manual_seed(dp)  # tp replicas: the same rows
    x, y = (torch.randn(rows, D, generator=gen) for _ in range(2))
    h = torch.randn(rows, 1, D, generator=gen)
    losses = {
        "clip": lambda **kw: clip_loss(x, y, scale, **kw),
        "info_nce": lambda **kw: info_nce_loss(x, y, scale, negatives_BKD=h, **kw),
    }
    times: dict[str, dict[str, list[float]]] = {n: {"mesh": [], "group": []} for n in losses}
    for req in (x, y, h):
        req.requires_grad_()
    scale = torch.tensor(10.0, requires_grad=True)
    where = {"mesh": {"mesh": mesh, "batch_dims": ("dp",)}, "group": {"group": group}}
    for name, fn in losses.items():
        for s in range(warmup + calls):
            order = ("mesh", "group") if s % 2 == 0 else ("group", "mesh")
            for how in order:
                dist.barrier()
                t0 = time.perf_counter()
                fn(**where[how]).backward()
                elapsed = _slowest(time.perf_counter() - t0)
                if s >= warmup:
                    times[name][how].append(elapsed)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 timed calls instead of 30")
    parser.add_argument("--rows", type=int, default=256, help="rows per rank (default 256)")
    args = parser.parse_args()
    calls = 8 if args.quick else 30
    from benchmarks.bench_mesh_losses import bench_rank as by_name  # pickled by module name
    from tests.support.harness import run_ranks, shutdown_worlds

    try:
        out = run_ranks(4, by_name, calls, 3, args.rows, timeout=1500)[0]
    finally:
        shutdown_worlds()
    print(f"dp2 x tp2 on 4 gloo ranks, {args.rows} rows per rank, D={D}, float32, {calls} calls")
    print(f"{'loss':<10}{'group= ms':>11}{'mesh= ms':>10}{'ratio':>8}{'paired':>8}")
    for name, t in out.items():
        ratio = statistics.median(t["mesh"]) / statistics.median(t["group"])
        paired = statistics.median(a / b for a, b in zip(t["mesh"], t["group"], strict=True))
        g, m = 1e3 * statistics.median(t["group"]), 1e3 * statistics.median(t["mesh"])
        print(f"{name:<10}{g:>11.1f}{m:>10.1f}{ratio:>8.3f}{paired:>8.3f}")


if __name__ == "__main__":
    main()
