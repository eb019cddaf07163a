"""Peak memory and time of the whole-batch losses against the naive N x N implementation.

    .venv/bin/python -m benchmarks.bench_losses --quick     # ~1 minute
    .venv/bin/python -m benchmarks.bench_losses             # the full table, ~10 minutes on 2 idle cores

Repeats: 3 (median) up to N = 8,192; one run above (each of those runs is long).

Every configuration runs in a FRESH subprocess (one process, CPU, float32,
forward + backward of the loss with respect to both embeddings and the scalars).
Peak memory is the growth of the process's peak RSS over its RSS just before
the call: the kernel's high-water mark (VmHWM), reset through
/proc/self/clear_refs, so nothing the process did before counts. Times are
medians over repeats; tiled and naive run side by side in the same invocation,
and the table reports their ratios, never a lone absolute time.

A second table compares `CachedStep` with plain (inexact) accumulation of K
per-micro-batch losses and with the whole batch in one pass, same model.

Legend: N global rows (one process: W = 1), D embedding dim, K micro-batches.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from wholebatch.cache import CachedStep
from wholebatch.losses import clip_loss, nt_xent_loss, siglip_loss

__all__ = ["main"]

MiB = 2**20


# ---------------------------------------------------------------------------
# Naive implementations: the full N x N logits, as open_clip / SimCLR code does
# ---------------------------------------------------------------------------


def naive_clip(i_ND: Tensor, t_ND: Tensor, s: Tensor) -> Tensor:
    logits_NN = s * i_ND @ t_ND.T
    labels = torch.arange(i_ND.shape[0])
    return (F.cross_entropy(logits_NN, labels) + F.cross_entropy(logits_NN.T, labels)) / 2


def naive_siglip(i_ND: Tensor, t_ND: Tensor, s: Tensor, b: Tensor) -> Tensor:
    n = i_ND.shape[0]
    y_NN = 2 * torch.eye(n, dtype=i_ND.dtype) - 1
    return -F.logsigmoid(y_NN * (s * i_ND @ t_ND.T + b)).sum() / n


def naive_nt_xent(z1_ND: Tensor, z2_ND: Tensor, tau: Tensor) -> Tensor:
    n = z1_ND.shape[0]
    z_2ND = torch.cat([z1_ND, z2_ND])
    logits = (z_2ND @ z_2ND.T / tau).masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
    return F.cross_entropy(logits, torch.cat([torch.arange(n) + n, torch.arange(n)]))


LOSSES: dict[str, dict[str, Callable[..., Tensor]]] = {
    "clip": {"naive": naive_clip, "tiled": clip_loss},
    "siglip": {"naive": naive_siglip, "tiled": siglip_loss},
    "nt_xent": {"naive": naive_nt_xent, "tiled": nt_xent_loss},
}
SCALARS = {"clip": [10.0], "siglip": [10.0, -10.0], "nt_xent": [0.1]}


# ---------------------------------------------------------------------------
# Memory: the kernel's peak-RSS counter, reset before each measurement
# ---------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> int:
    """Reset VmHWM to the current RSS; return the current RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def _peak_growth(fn: Callable[[], Any]) -> tuple[float, int]:
    """(seconds, peak RSS growth in bytes) of one call of `fn`."""
    before = _reset_peak()
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    return seconds, _status_kib("VmHWM") * 1024 - before


# ---------------------------------------------------------------------------
# Children (one configuration each, in a fresh process)
# ---------------------------------------------------------------------------


def _child_loss(loss: str, impl: str, n: int, d: int, repeats: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    a = F.normalize(torch.randn(n, d, generator=gen), dim=1).requires_grad_()
    b = F.normalize(torch.randn(n, d, generator=gen), dim=1).requires_grad_()
    sc = [torch.tensor(v, requires_grad=True) for v in SCALARS[loss]]
    fn = LOSSES[loss][impl]

    def run() -> None:
        out = fn(a, b, *sc)
        out.backward()
        a.grad = b.grad = None
        for s in sc:
            s.grad = None

    # Warm-up on 256 rows: BLAS workspaces and thread pools exist before measuring
    # (a fixed cost that would otherwise be charged to whichever runs first).
    fn(a[:256].detach(), b[:256].detach(), *[s.detach() for s in sc])
    times, peaks = [], []
    for _ in range(repeats):
        t, p = _peak_growth(run)
        times.append(t)
        peaks.append(p)
    # The first call is in a fresh process: its growth is the honest peak (later
    # calls may reuse pages the allocator kept). Report it, and the median time.
    return {"seconds": statistics.median(times), "peak": peaks[0]}


class _Tower(nn.Module):
    def __init__(self, d_in: int, width: int, d_out: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_in, width), nn.GELU(), nn.Dropout(0.1),
            nn.Linear(width, width), nn.GELU(), nn.Dropout(0.1), nn.Linear(width, d_out),
        )  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class _TwoTower(nn.Module):
    def __init__(self, d_in: int = 256, width: int = 1024, d_out: int = 256) -> None:
        super().__init__()
        self.img, self.txt = _Tower(d_in, width, d_out), _Tower(d_in, width, d_out)
        self.logit_scale = nn.Parameter(torch.tensor(10.0))

    def forward(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        return F.normalize(self.img(x), dim=1), F.normalize(self.txt(y), dim=1)


def _child_cache(mode: str, rows: int, k: int, repeats: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _TwoTower()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    mbs = [
        (torch.randn(rows, 256, generator=gen), torch.randn(rows, 256, generator=gen))
        for _ in range(k)
    ]

    def embed(m: nn.Module, mb: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        out: tuple[Tensor, Tensor] = m(*mb)
        return out

    def loss_fn(i: Tensor, t: Tensor) -> Tensor:
        return clip_loss(i, t, model.logit_scale)

    cached = CachedStep(model, opt, embed, loss_fn)

    def run() -> None:
        if mode == "cached":
            cached.step(mbs)
            return
        if mode == "accumulate":  # K small losses: inexact (fewer negatives), the baseline
            for mb in mbs:
                (loss_fn(*embed(model, mb)) / k).backward()
        elif mode == "one_micro_batch":
            loss_fn(*embed(model, mbs[0])).backward()
        else:  # "whole": the whole batch in one pass
            x = torch.cat([mb[0] for mb in mbs])
            y = torch.cat([mb[1] for mb in mbs])
            loss_fn(*embed(model, (x, y))).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    run()  # warm-up: optimizer state and allocator pools exist before measuring
    times, peaks = [], []
    for _ in range(repeats):
        t, p = _peak_growth(run)
        times.append(t)
        peaks.append(p)
    return {"seconds": statistics.median(times), "peak": max(peaks)}


def _spawn(args: list[str]) -> dict[str, Any]:
    # A fixed mmap threshold: glibc's dynamic one grows after the first large free,
    # after which freed blocks stay in RSS and the next measurement sees less growth
    # than it allocates. Fixed, every large block is mapped and unmapped: RSS follows
    # live memory, the same way for every configuration.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_losses", "--child", *args],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


# ---------------------------------------------------------------------------
# The tables
# ---------------------------------------------------------------------------


def _loss_table(plan: list[tuple[str, int, bool]], d: int, repeats: int) -> None:
    print(f"\n### losses: forward + backward, one process, CPU float32, D = {d}\n")
    print(
        "| loss | N | naive peak MiB | tiled peak MiB | memory ratio | naive s | tiled s | time ratio (tiled/naive) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for loss, n, with_naive in plan:
        reps = repeats if n <= 8192 else 1
        tiled = _spawn(["loss", loss, "tiled", str(n), str(d), str(reps)])
        naive = _spawn(["loss", loss, "naive", str(n), str(d), str(reps)]) if with_naive else None
        row = [loss, f"{n:,}"]
        if naive:
            row += [
                f"{naive['peak'] / MiB:.0f}",
                f"{tiled['peak'] / MiB:.0f}",
                f"{naive['peak'] / max(tiled['peak'], 1):.1f}x less",
                f"{naive['seconds']:.2f}",
                f"{tiled['seconds']:.2f}",
                f"{tiled['seconds'] / naive['seconds']:.2f}",
            ]
        else:
            # naive holds ~4 logits-sized float buffers (as measured where it runs)
            need = 4 * n * n * (4 if loss == "nt_xent" else 1) * 4 / 2**30
            row += [
                f"(not run: ~{need:.0f} GiB)",
                f"{tiled['peak'] / MiB:.0f}",
                "-",
                "-",
                f"{tiled['seconds']:.2f}",
                "-",
            ]
        print("| " + " | ".join(row) + " |", flush=True)


def _cache_table(rows: int, k: int, repeats: int) -> None:
    print(
        f"\n### CachedStep: two towers (2 x 3 layers, width 1024, dropout, D = 256), {k} micro-batches of {rows} rows\n"
    )
    res = {
        m: _spawn(["cache", m, str(rows), str(k), str(repeats)])
        for m in ("one_micro_batch", "accumulate", "cached", "whole")
    }
    base, acc = res["one_micro_batch"], res["accumulate"]
    print("| step | peak MiB | vs one micro-batch step | median s | time vs plain accumulation |")
    print("|---|---|---|---|---|")
    for m, label in (
        ("one_micro_batch", "one micro-batch step"),
        ("accumulate", f"plain accumulation of {k} losses (inexact)"),
        ("cached", f"CachedStep, K = {k} (exact)"),
        ("whole", f"whole batch of {rows * k} in one pass (exact)"),
    ):
        r = res[m]
        print(
            f"| {label} | {r['peak'] / MiB:.0f} | {r['peak'] / max(base['peak'], 1):.2f}x | "
            f"{r['seconds']:.2f} | {r['seconds'] / acc['seconds']:.2f}x |",
            flush=True,
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat (~1 minute)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        kind, *rest = args.child
        if kind == "loss":
            loss, impl, n, d, reps = rest
            print(json.dumps(_child_loss(loss, impl, int(n), int(d), int(reps))))
        else:
            mode, rows, k, reps = rest
            print(json.dumps(_child_cache(mode, int(rows), int(k), int(reps))))
        return
    t0 = time.perf_counter()
    if args.quick:
        plan = [(loss, n, True) for loss in ("clip", "siglip", "nt_xent") for n in (2048, 4096)]
        _loss_table(plan, 256, 1)
        _cache_table(256, 4, 2)
    else:
        plan = [("clip", n, True) for n in (4096, 8192, 16384)]
        plan += [("clip", 32768, False), ("clip", 65536, False)]
        plan += [("siglip", n, True) for n in (4096, 8192, 16384)]
        plan += [("nt_xent", n, True) for n in (4096, 8192)]
        _loss_table(plan, 256, 3)
        _cache_table(1024, 4, 3)
    print(f"\ntotal wall time {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
