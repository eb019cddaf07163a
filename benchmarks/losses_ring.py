"""Ring vs gather for CLIP and InfoNCE on W CPU ranks: per-rank peak memory and time, side by side.

    .venv/bin/python -m benchmarks.losses_ring                      # W = 4, N = 32,768, D = 256
    .venv/bin/python -m benchmarks.losses_ring --n 8192 --rounds 1  # quicker

Fresh gloo ranks (glibc's mmap threshold fixed, so RSS follows live memory);
each round runs one forward + backward of each strategy, alternating, and
reads every rank's peak-RSS growth (tests/support/plan_memprobe.py) and wall time;
the table shows medians over rounds of the busiest rank and the ratios
ring / gather, with the planner's loss memory beside the measured peak. CPU
timings on a shared machine are noisy: only the side-by-side ratios mean much.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks._common import FIXED_MALLOC, spawn_ranks
from tests.support.plan_memprobe import peak_growth


def _inputs(loss: str, b: int, d: int, k: int, rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)

    def emb(*shape: int) -> torch.Tensor:
        return F.normalize(torch.randn(*shape, generator=g), dim=-1).requires_grad_()

    out = [emb(b, d), emb(b, d)]
    if loss == "info_nce" and k:
        out.append(emb(b, k, d))
    return out


def _call(loss: str, strategy: str, xs: list[torch.Tensor], tile: int) -> torch.Tensor:
    from wholebatch.losses import clip_loss, info_nce_loss

    s = torch.tensor(10.0, requires_grad=True)
    if loss == "clip":
        return clip_loss(xs[0], xs[1], s, strategy=strategy, tile_size=tile)  # type: ignore[arg-type]
    negs = xs[2] if len(xs) > 2 else None
    return info_nce_loss(xs[0], xs[1], s, negatives_BKD=negs, strategy=strategy, tile_size=tile)  # type: ignore[arg-type]


def _rank(rank: int, w: int, cfg: dict[str, Any]) -> Any:
    b = cfg["n"] // w
    rows = []
    for loss in cfg["losses"]:
        xs = _inputs(loss, b, cfg["d"], cfg["k"], rank)
        small = _inputs(loss, 64, cfg["d"], cfg["k"], rank)
        for strategy in ("gather", "ring"):
            _call(loss, strategy, small, cfg["tile"]).backward()  # first-call allocations
        for _ in range(cfg["rounds"]):
            for strategy in ("gather", "ring"):
                for x in xs:
                    x.grad = None
                dist.barrier()
                t0 = time.perf_counter()
                peak = peak_growth(lambda: _call(loss, strategy, xs, cfg["tile"]).backward())  # noqa: B023
                dist.barrier()
                rows.append((loss, strategy, peak, time.perf_counter() - t0))
    return rows


def _planned(loss: str, strategy: str, n: int, w: int, d: int, k: int, tile: int) -> int:
    from wholebatch.planner.memory import STRATEGY_NAMES, loss_memory

    return loss_memory(
        loss, strategy=STRATEGY_NAMES[strategy], n=n, b=n // w, dim=d, elem=4, acc=4, tile=tile,
        w=w, negatives=k if loss == "info_nce" else 0, device="cpu",
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--n", type=int, default=32768)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--k", type=int, default=0, help="InfoNCE hard negatives per query")
    p.add_argument("--tile", type=int, default=512)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--losses", default="clip", help="comma-separated: clip,info_nce")
    a = p.parse_args(argv)
    # the spawned ranks start fresh: glibc reads these there, so RSS follows live memory
    os.environ.update(FIXED_MALLOC)
    cfg = dict(n=a.n, d=a.d, k=a.k, tile=a.tile, rounds=a.rounds, losses=a.losses.split(","))
    got = spawn_ranks(_rank, a.world, cfg, timeout=3600)
    print(
        f"W = {a.world}, N = {a.n:,}, D = {a.d}, tile {a.tile}, k = {a.k}, {a.rounds} round(s), float32"
    )
    print(
        "| loss | strategy | peak per rank (MiB, busiest) | planned (MiB) | time (s, median) | peak vs gather | time vs gather |"
    )
    print("|---|---|---|---|---|---|---|")
    for loss in cfg["losses"]:
        med = {}
        for strategy in ("gather", "ring"):
            peaks, times = [], []
            for i in range(a.rounds):
                per = [
                    [r for r in got[rank] if r[0] == loss and r[1] == strategy][i] for rank in got
                ]
                peaks.append(max(r[2] for r in per))
                times.append(max(r[3] for r in per))
            med[strategy] = (statistics.median(peaks), statistics.median(times))
        for strategy in ("gather", "ring"):
            pk, tm = med[strategy]
            planned = _planned(loss, strategy, a.n, a.world, a.d, a.k, a.tile)
            print(
                f"| {loss} | {strategy} | {pk / 2**20:.1f} | {planned / 2**20:.1f} | {tm:.2f} | "
                f"{pk / med['gather'][0]:.2f}x | {tm / med['gather'][1]:.2f}x |"
            )


if __name__ == "__main__":
    main()
