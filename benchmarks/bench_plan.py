"""`wholebatch plan` against measurement: loss memory vs peak RSS, bytes vs counted and socket bytes, speed.

    .venv/bin/python -m benchmarks.bench_plan            # N = 4,096 .. 32,768 (W = 1), W = 2 and 4; ~10 min
    .venv/bin/python -m benchmarks.bench_plan --quick    # N = 4,096 and 8,192, W = 2; ~2 min

1. Memory: each loss's forward + backward in FRESH processes (tests/plan_memprobe.py:
   peak-RSS growth, glibc's mmap threshold fixed so RSS follows live memory), against
   `wholebatch.planner.memory.loss_memory`; D = 256, tile 512; float32 at W = 1 for
   N = 4,096 .. 32,768, and float32/bfloat16 at W = 2 and 4 (N = 16,384).
2. Bytes: every rank of W = 2, 3, 4 gloo ranks counts what the library hands to c10d
   (tests/plan_counting.py) and what it writes to its sockets (/proc/self/io wchar),
   against `wholebatch.planner.traffic.loss_traffic`, uneven sizes with an empty rank.
3. Speed: `plan()` wall time (median of 5, after one warm call) for W = 8 .. 65,536,
   even and uneven splits; `import wholebatch.planner` and the CLI's wall time apart.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

__all__ = ["main"]

LOSSES = ("clip", "siglip", "nt_xent", "info_nce")
ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def _memprobe(world: int, specs: list[str]) -> dict[str, list[int]]:
    out = subprocess.run(
        [sys.executable, "-m", "tests.plan_memprobe", str(world), *specs],
        capture_output=True, text=True, env=ENV, check=True,
    )  # fmt: skip
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {r["spec"]: r["peaks"] for r in rows}


def memory_table(
    worlds_ns: list[tuple[int, int, str]], dim: int = 256, tile: int = 512
) -> list[dict[str, Any]]:
    from wholebatch.planner.memory import LOSS_STRATEGY, loss_memory

    rows = []
    for world, n, dtype in worlds_ns:
        specs = [f"{loss}:{n}:{dim}:{tile}:{dtype}" for loss in LOSSES]
        got = _memprobe(world, specs)
        elem = {"fp32": 4, "bf16": 2}[dtype]
        for spec in specs:
            loss = spec.split(":")[0]
            planned = loss_memory(
                loss, strategy=LOSS_STRATEGY[loss], n=n, b=n // world, dim=dim, elem=elem,
                acc=max(4, elem), tile=tile, w=world,
            )  # fmt: skip
            peak = max(got[spec])
            rows.append(dict(loss=loss, world=world, n=n, dtype=dtype, measured=peak, planned=planned,
                             error=planned / peak - 1))  # fmt: skip
            r = rows[-1]
            print(
                f"| {loss} | {world} | {n:,} | {dtype} | {peak / 2**20:.1f} | {planned / 2**20:.1f} | "
                f"{100 * r['error']:+.1f}% |",
                flush=True,
            )
    return rows


def bytes_table() -> list[dict[str, Any]]:
    from tests.harness import run_ranks, shutdown_worlds
    from tests.test_plan_dist import _nonzero, _planned, _rank_count

    rows = []
    cases = [("clip", [600, 0, 424]), ("siglip", [256, 100, 0, 300]), ("nt_xent", [512, 512]),
             ("info_nce", [700, 300, 24])]  # fmt: skip
    try:
        for loss, sizes in cases:
            got = run_ranks(len(sizes), _rank_count, loss, sizes, 256, "fp32")
            for rank, counted in enumerate(got):
                planned = _planned(loss, sizes, rank, 256, "fp32")
                p_sent = sum(sum(planned[ph][0].values()) for ph in ("forward", "backward"))
                c_sent = sum(
                    sum(_nonzero(counted[ph][0]).values()) for ph in ("forward", "backward")
                )
                equal = all(
                    planned[ph] == tuple(_nonzero(d) for d in counted[ph])
                    for ph in ("forward", "backward")
                )
                rows.append(dict(loss=loss, sizes=sizes, rank=rank, planned=p_sent, counted=c_sent,
                                 equal=equal, wchar=counted["wchar"]))  # fmt: skip
                print(
                    f"| {loss} | {sizes} | {rank} | {p_sent:,} | {c_sent:,} | {'yes' if equal else 'NO'} | "
                    f"{counted['wchar']:,} | {counted['wchar'] - p_sent:,} |",
                    flush=True,
                )
    finally:
        shutdown_worlds()
    return rows


def speed_table() -> list[dict[str, Any]]:
    t0 = time.perf_counter()
    from wholebatch.planner import PlanConfig, plan

    imported = time.perf_counter() - t0
    print(f"import wholebatch.planner (torch included): {imported:.2f} s")
    rows = []
    for world in (8, 1024, 65536):
        for loss in (*LOSSES, "tokens"):
            for extra in (0, 12_345):
                c = PlanConfig(
                    loss=loss,
                    batch=1_048_576 + extra,
                    dim=768,
                    world=world,
                    act_mib=40,
                    params=4.3e8,
                )
                plan(c)
                times = []
                for _ in range(5):
                    s = time.perf_counter()
                    plan(c)
                    times.append(time.perf_counter() - s)
                med = statistics.median(times)
                rows.append(dict(world=world, loss=loss, uneven=bool(extra), seconds=med))
                print(
                    f"| {world:,} | {loss} | {'uneven' if extra else 'even'} | {med * 1e3:.0f} |",
                    flush=True,
                )
    cmd = [
        sys.executable,
        "-m",
        "wholebatch",
        "plan",
        "--loss",
        "siglip",
        "--world",
        "65536",
        "--batch",
        "1060921",
    ]
    s = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    cli = time.perf_counter() - s
    s = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    torch_only = time.perf_counter() - s
    print(
        f"CLI `wholebatch plan --loss siglip --world 65536 ...`: {cli:.2f} s wall; `python -c 'import torch'`: {torch_only:.2f} s"
    )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=["memory", "bytes", "speed"], action="append")
    args = parser.parse_args(argv)
    only = set(args.only or ["memory", "bytes", "speed"])
    print(f"load: {os.getloadavg()}")
    if "memory" in only:
        print(
            "\n| loss | W | N | dtype | measured MiB | planned MiB | planned vs measured |\n|---|---|---|---|---|---|---|"
        )
        if args.quick:
            plan_ = [(1, 4096, "fp32"), (2, 8192, "fp32")]
        else:
            plan_ = [(1, n, "fp32") for n in (4096, 8192, 16384, 32768)]
            plan_ += [(w, 16384, dt) for w in (2, 4) for dt in ("fp32", "bf16")]
        memory_table(plan_)
    if "bytes" in only:
        print(
            "\n| loss | rows per rank | rank | planned bytes sent | counted | per-primitive equal | socket bytes | socket - planned |\n|---|---|---|---|---|---|---|---|"
        )
        bytes_table()
    if "speed" in only:
        print("\n| W | loss | split | plan() ms (median of 5) |\n|---|---|---|---|")
        speed_table()
    print(f"load: {os.getloadavg()}")


if __name__ == "__main__":
    main()
