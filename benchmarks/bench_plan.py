"""`wholebatch plan` against measurement: loss memory vs peak RSS, bytes vs counted and socket bytes, speed.

    .venv/bin/python -m benchmarks.bench_plan                  # everything; ~30 min on 2 cores
    .venv/bin/python -m benchmarks.bench_plan --only memory    # the memory sweep below
    .venv/bin/python -m benchmarks.bench_plan --quick          # N = 4,096 (W = 1, 2) only; ~2 min

1. Memory: each loss's forward + backward (the real public losses; InfoNCE also
   with k = 3 hard negatives) in FRESH processes (tests/support/plan_memprobe.py:
   peak-RSS growth, glibc's mmap threshold fixed so RSS follows live memory),
   against `wholebatch.planner.memory.loss_memory`; D = 256. Calibration points
   (where the coefficients were read): W = 1 at N = 8,192 (tiles 512 and
   2,048), W = 2 and 4 at N = 16,384, InfoNCE's directions at W = 2, N = 8,192.
   Checks: every other row (N = 4,096 and 32,768, W = 1 at 16,384 in bfloat16,
   k = 1), and W = 3 in tests/distributed/test_plan_dist.py.
2. Bytes: every rank of W = 2, 3, 4 gloo ranks counts what the library hands to c10d
   (tests/support/plan_counting.py) and what it writes to its sockets (/proc/self/io wchar),
   against `wholebatch.planner.traffic.loss_traffic`, uneven sizes with an empty rank.
3. Speed: `plan()` wall time (median of 5, after one warm call) for W = 8 .. 65,536,
   even and uneven splits; the CLI's wall time apart.
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

from benchmarks._common import FIXED_MALLOC

__all__ = ["main"]

LOSSES = ("clip", "siglip", "nt_xent", "info_nce")
ENV = {**os.environ, **FIXED_MALLOC}
# (W, N, dtype, tile, extra specs); "cal" marks the calibration points.
SWEEP: list[tuple[int, int, str, int, str]] = [
    (1, 4096, "fp32", 512, ""), (1, 4096, "bf16", 512, ""),
    (1, 8192, "fp32", 512, "cal"), (1, 8192, "bf16", 512, "cal"), (1, 8192, "fp32", 2048, "cal"),
    (1, 16384, "bf16", 512, ""), (1, 32768, "fp32", 512, ""),
    (2, 4096, "fp32", 512, ""), (2, 4096, "bf16", 512, ""),
    (2, 16384, "fp32", 512, "cal"), (2, 16384, "bf16", 512, "cal"),
    (4, 16384, "fp32", 512, "cal"), (4, 16384, "bf16", 512, "cal"), (4, 32768, "bf16", 512, ""),
]  # fmt: skip
DIRECTIONS = [
    (2, "info_nce:8192:256:512:fp32:1:q2d+d2q+q2q+d2d", "cal"),
    (2, "info_nce:8192:256:512:bf16:1:q2d+d2q+q2q+d2d", "cal"),
    (2, "info_nce:8192:256:512:fp32:0:q2d+d2q", ""),
    (2, "info_nce:8192:256:512:fp32:1", ""),
]


def _memprobe(world: int, specs: list[str]) -> dict[str, list[int]]:
    out = subprocess.run(
        [sys.executable, "-m", "tests.support.plan_memprobe", str(world), *specs],
        capture_output=True, text=True, env=ENV,
    )  # fmt: skip
    if out.returncode:
        raise SystemExit(out.stderr)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {r["spec"]: r["peaks"] for r in rows}


def _planned(spec: str, world: int) -> int:
    from tests.support.plan_cases import DTYPES
    from tests.support.plan_memprobe import case_of
    from wholebatch.planner.memory import LOSS_STRATEGY, loss_memory

    c = case_of(spec, world)
    elem = DTYPES[c.dtype].itemsize
    return loss_memory(
        c.loss, strategy=LOSS_STRATEGY[c.loss], n=sum(c.sizes), b=c.sizes[0], dim=c.dim,
        elem=elem, acc=max(4, elem), tile=c.tile or 512, w=world, negatives=c.k,
        directions=c.directions, tokens=c.tokens, device="cpu",
    )  # fmt: skip


def memory_table(quick: bool = False) -> list[dict[str, Any]]:
    groups: list[tuple[int, list[str], str]] = []
    for w, n, dt, tile, role in SWEEP:
        if quick and n != 4096:
            continue
        specs = [f"{loss}:{n}:256:{tile}:{dt}" for loss in LOSSES] + [
            f"info_nce:{n}:256:{tile}:{dt}:3"
        ]
        groups.append((w, specs, role))
    if not quick:
        for w, spec, role in DIRECTIONS:
            groups.append((w, [spec], role))
    rows = []
    for world, specs, role in groups:
        got = _memprobe(world, specs)
        for spec in specs:
            peak, planned = max(got[spec]), _planned(spec, world)
            rows.append(dict(spec=spec, world=world, measured=peak, planned=planned, role=role))
            print(
                f"| {spec} | {world} | {peak / 2**20:.1f} | {planned / 2**20:.1f} | "
                f"{100 * (planned / peak - 1):+.1f}% | {'calibration' if role else 'check'} |",
                flush=True,
            )
    return rows


def bytes_table() -> list[dict[str, Any]]:
    from tests.distributed.test_plan_dist import _count_all
    from tests.support.harness import run_ranks, shutdown_worlds
    from tests.support.plan_cases import Case, planned

    rows = []
    cases = [
        Case(loss="clip", sizes=(600, 0, 424), dim=256),
        Case(loss="siglip", sizes=(256, 100, 0, 300), dim=256),
        Case(loss="nt_xent", sizes=(512, 512), dim=256),
        Case(loss="info_nce", sizes=(700, 300, 24), dim=256, k=3),
    ]
    try:
        for case in cases:
            got = run_ranks(case.world, _count_all, [case], timeout=300)
            for rank, per in enumerate(got):
                counted = per[0]
                want = planned(case, rank)
                p_sent = sum(sum(want[ph][0].values()) for ph in ("forward", "backward"))
                c_sent = sum(sum(counted[ph][0].values()) for ph in ("forward", "backward"))
                equal = all(want[ph] == counted[ph] for ph in ("forward", "backward"))
                rows.append(dict(case=case.label(), rank=rank, planned=p_sent, counted=c_sent,
                                 equal=equal, wchar=counted["wchar"]))  # fmt: skip
                print(
                    f"| {case.label()} | {rank} | {p_sent:,} | {c_sent:,} | {'yes' if equal else 'NO'} | "
                    f"{counted['wchar']:,} | {counted['wchar'] - p_sent:,} |",
                    flush=True,
                )
    finally:
        shutdown_worlds()
    return rows


# Inf-CL (arXiv:2410.17243) Table 1: loss (peak) memory per GPU, GB, CLIP ViT-L/14
# (D = 768), fp16 features: (GPUs, their method, batch in k, published GB).
INF_CL_TABLE_1 = [
    (8, "naive", 32, 16.67), (8, "naive", 64, 66.11), (8, "local", 32, 2.27), (8, "local", 64, 8.63),
    (8, "local", 128, 33.64), (8, "ring + tiled", 32, 0.18), (8, "ring + tiled", 64, 0.36),
    (8, "ring + tiled", 128, 0.72), (8, "ring + tiled", 256, 1.45), (8, "ring + tiled", 1024, 6.53),
    (32, "naive", 32, 16.66), (32, "naive", 64, 66.11), (32, "local", 32, 0.71),
    (32, "local", 64, 2.45), (32, "local", 128, 8.98), (32, "local", 256, 34.35),
    (32, "ring + tiled", 32, 0.05), (32, "ring + tiled", 64, 0.09), (32, "ring + tiled", 128, 0.18),
    (32, "ring + tiled", 256, 0.35), (32, "ring + tiled", 1024, 1.44),
]  # fmt: skip


def published_table() -> None:
    """The planner against Inf-CL's Table 1 (tile 512 for the strategies; wholebatch's clip at its default tile)."""
    from wholebatch.losses.sizing import tile_size_for
    from wholebatch.planner.memory import loss_memory

    for w, method, k, published in INF_CL_TABLE_1:
        n = k * 1024
        b = n // w
        kw: dict[str, Any] = dict(n=n, b=b, dim=768, elem=2, acc=4, w=w)
        mine = loss_memory("clip", strategy=method, tile=512, **kw) / 2**30
        tile = tile_size_for("cuda", b, n)
        ours = loss_memory("clip", strategy="gather + tiled", tile=tile, **kw) / 2**30
        ours512 = loss_memory("clip", strategy="gather + tiled", tile=512, **kw) / 2**30
        print(
            f"| {w} | {method} | {k}k | {published:.2f} | {mine:.2f} | {100 * (mine / published - 1):+.0f}% | "
            f"{ours512:.2f} | {ours:.2f} (T = {tile:,}) |"
        )


# Inf-CL Table 2: the largest batch their method trains (with data offload), CLIP ViT-L/14.
INF_CL_TABLE_2 = [(8, 4096), (32, 12288)]  # (GPUs, batch in k)


def ring_table() -> None:
    """wholebatch's ring CLIP (strategy="ring") against Inf-CL's ring rows of Table 1, and its
    largest batch against Table 2: loss memory only (fp16 features, D = 768), tile 512 (as
    Inf-CL's kernels) and the tile the losses choose on an accelerator."""
    from wholebatch.losses.sizing import tile_size_for
    from wholebatch.planner import PlanConfig, plan
    from wholebatch.planner.memory import loss_memory

    print(
        "| GPUs | batch | Inf-CL ring GB | wholebatch ring GiB, T = 512 | vs Inf-CL | default tile GiB |"
    )
    print("|---|---|---|---|---|---|")
    for w, method, k, published in INF_CL_TABLE_1:
        if method != "ring + tiled":
            continue
        n = k * 1024
        b = n // w
        kw: dict[str, Any] = dict(n=n, b=b, dim=768, elem=2, acc=4, w=w, strategy="ring + tiled")
        ours = loss_memory("clip", tile=512, **kw)
        tile = tile_size_for("cuda", b, b)
        ours_t = loss_memory("clip", tile=tile, **kw)
        print(
            f"| {w} | {k}k | {published:.2f} | {ours / 2**30:.3f} | {ours / 2**30 / published:.2f}x | "
            f"{ours_t / 2**30:.2f} (T = {tile:,}) |"
        )
    print(
        "\n| GPUs | Inf-CL largest batch | wholebatch ring, largest batch (80 GiB, T = 512) | gather |"
    )
    print("|---|---|---|---|")
    for w, k in INF_CL_TABLE_2:
        common: dict[str, Any] = dict(
            loss="clip",
            dim=768,
            dtype="fp16",
            world=w,
            batch=w * 1024,
            tile=512,
            act_mib=0,
            params=4.28e8,
            memory_gib=80,
        )
        ring = plan(PlanConfig(strategy="ring", **common)).max_batch
        gather = plan(PlanConfig(strategy="gather", **common)).max_batch
        print(f"| {w} | {k:,}k | {ring:,} ({(ring or 0) / (k * 1024):.1f}x) | {gather:,} |")


def speed_table() -> list[dict[str, Any]]:
    t0 = time.perf_counter()
    from wholebatch.planner import PlanConfig, plan

    imported = time.perf_counter() - t0
    print(f"import wholebatch.planner (no torch): {imported:.2f} s")
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
    parser.add_argument(
        "--only", choices=["memory", "bytes", "speed", "published", "ring"], action="append"
    )
    args = parser.parse_args(argv)
    only = set(args.only or ["memory", "bytes", "speed", "published", "ring"])
    print(f"load: {os.getloadavg()}")
    if "memory" in only:
        print(
            "\n| loss:N:D:tile:dtype[:k[:directions]] | W | measured MiB | planned MiB | planned vs measured | role |\n|---|---|---|---|---|---|"
        )
        memory_table(args.quick)
    if "bytes" in only:
        print(
            "\n| case | rank | planned bytes sent | counted | per-primitive equal | socket bytes | socket - planned |\n|---|---|---|---|---|---|---|"
        )
        bytes_table()
    if "speed" in only:
        print("\n| W | loss | split | plan() ms (median of 5) |\n|---|---|---|---|")
        speed_table()
    if "published" in only:
        print(
            "\n| GPUs | method | batch | published GB | planner GiB | gap | wholebatch clip, T = 512 | "
            "wholebatch clip, default tile |\n|---|---|---|---|---|---|---|---|"
        )
        published_table()
    if "ring" in only:
        print()
        ring_table()
    print(f"load: {os.getloadavg()}")


if __name__ == "__main__":
    main()
