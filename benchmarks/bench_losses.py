"""Peak memory and time of the whole-batch losses against the naive N x N implementation.

    .venv/bin/python -m benchmarks.bench_losses --quick     # ~1 minute
    .venv/bin/python -m benchmarks.bench_losses             # the full table, ~20 minutes on 2 cores
    .venv/bin/python -m benchmarks.bench_losses --only nt_xent --only cache   # a subset

Repeats: 3 (median) up to N = 8,192; one run above (each of those runs is long).

Every configuration runs in a FRESH subprocess (one process, CPU, float32,
forward + backward of the loss with respect to both embeddings and the scalars).
Peak memory is the growth of the process's peak RSS over its RSS just before
the call: the kernel's high-water mark (VmHWM), reset through
/proc/self/clear_refs, so nothing the process did before counts. Times come
from a separate process that runs the compared methods INTERLEAVED (naive,
tiled, tiled, naive, ...), and the tables report the median of the per-round
ratios: on a shared machine the load changes over seconds, and methods timed
minutes apart in different processes are not comparable.

Two more tables compare `CachedStep` with plain (inexact) accumulation of K
per-micro-batch losses and with the whole batch in one pass, same model: an
MLP whose embeddings are a large share of one micro-batch's memory and whose
whole-batch loss is a large share of its time, and a sequence encoder (tokens
mean-pooled), where, as in real encoders, they are not.

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

from wholebatch.losses.contrastive import clip_loss, nt_xent_loss, siglip_loss
from wholebatch.train.cache import CachedStep

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
        # x: (rows, d_in), or (rows, tokens, d_in) for a sequence encoder, mean-pooled
        out = self.net(x)
        return out.mean(1) if out.dim() == 3 else out


class _TwoTower(nn.Module):
    def __init__(self, d_in: int = 256, width: int = 1024, d_out: int = 256) -> None:
        super().__init__()
        self.img, self.txt = _Tower(d_in, width, d_out), _Tower(d_in, width, d_out)
        self.logit_scale = nn.Parameter(torch.tensor(10.0))

    def forward(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        return F.normalize(self.img(x), dim=1), F.normalize(self.txt(y), dim=1)


CACHE_MODES = ("one_micro_batch", "accumulate", "cached", "whole")


def _cache_setup(rows: int, tokens: int, k: int) -> tuple[nn.Module, Callable[[str], None]]:
    """The model and a `run(mode)` doing one optimizer step of `mode` (see CACHE_MODES).

    tokens = 0: each row is one vector (an MLP tower, the embedding is its
    output); tokens > 0: each row is a sequence of that many token vectors,
    mean-pooled after the tower (how transformer encoders are used): activation
    memory grows with tokens, the embeddings (rows x D) do not.
    """
    torch.manual_seed(0)
    model = _TwoTower()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    shape = (rows, tokens, 256) if tokens else (rows, 256)
    mbs = [
        (torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)) for _ in range(k)
    ]

    def embed(m: nn.Module, mb: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        out: tuple[Tensor, Tensor] = m(*mb)
        return out

    def loss_fn(i: Tensor, t: Tensor) -> Tensor:
        return clip_loss(i, t, model.logit_scale)

    cached = CachedStep(model, opt, embed, loss_fn)

    def run(mode: str) -> None:
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

    return model, run


def _child_cache(mode: str, rows: int, tokens: int, k: int, repeats: int) -> dict[str, Any]:
    """Peak memory of one mode, in a fresh process."""
    _, run = _cache_setup(rows, tokens, k)
    run(mode)  # warm-up: optimizer state and allocator pools exist before measuring
    times, peaks = [], []
    for _ in range(repeats):
        t, p = _peak_growth(lambda: run(mode))
        times.append(t)
        peaks.append(p)
    return {"seconds": statistics.median(times), "peak": max(peaks)}


def _child_cache_times(rows: int, tokens: int, k: int, rounds: int) -> dict[str, Any]:
    """Every mode, interleaved in ONE process (order reversed every other round).

    On a shared machine load comes and goes over seconds; modes timed in
    separate processes minutes apart see different loads. Interleaved, each
    round's ratios compare steps run seconds apart; the median ratio is robust.
    """
    _, run = _cache_setup(rows, tokens, k)
    for m in CACHE_MODES:
        run(m)  # warm-up
    times: dict[str, list[float]] = {m: [] for m in CACHE_MODES}
    for r in range(rounds):
        for m in CACHE_MODES if r % 2 == 0 else CACHE_MODES[::-1]:
            t0 = time.perf_counter()
            run(m)
            times[m].append(time.perf_counter() - t0)
    acc = times["accumulate"]
    return {
        m: {
            "seconds": statistics.median(ts),
            "vs_accumulate": statistics.median(t / a for t, a in zip(ts, acc, strict=True)),
        }
        for m, ts in times.items()
    }


def _child_loss_times(loss: str, n: int, d: int, rounds: int) -> dict[str, Any]:
    """Tiled and naive interleaved in ONE process: median time and median per-round ratio."""
    gen = torch.Generator().manual_seed(0)
    a = F.normalize(torch.randn(n, d, generator=gen), dim=1).requires_grad_()
    b = F.normalize(torch.randn(n, d, generator=gen), dim=1).requires_grad_()
    sc = [torch.tensor(v, requires_grad=True) for v in SCALARS[loss]]
    for fn in LOSSES[loss].values():
        fn(a[:256].detach(), b[:256].detach(), *[s.detach() for s in sc])
    times: dict[str, list[float]] = {"naive": [], "tiled": []}
    for r in range(rounds):
        for impl in ("naive", "tiled") if r % 2 == 0 else ("tiled", "naive"):
            t0 = time.perf_counter()
            LOSSES[loss][impl](a, b, *sc).backward()
            times[impl].append(time.perf_counter() - t0)
            a.grad = b.grad = None
            for s in sc:
                s.grad = None
    ratios = [t / nv for t, nv in zip(times["tiled"], times["naive"], strict=True)]
    return {
        "naive": statistics.median(times["naive"]),
        "tiled": statistics.median(times["tiled"]),
        "ratio": statistics.median(ratios),
    }


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
            # Times up to 8,192: naive and tiled interleaved in one process (median
            # of the per-round ratios); above, one run each in its memory process.
            if n <= 8192:
                t = _spawn(["loss_times", loss, str(n), str(d), str(repeats)])
                secs = (t["naive"], t["tiled"], t["ratio"])
            else:
                secs = (naive["seconds"], tiled["seconds"], tiled["seconds"] / naive["seconds"])
            row += [
                f"{naive['peak'] / MiB:.0f}",
                f"{tiled['peak'] / MiB:.0f}",
                f"{naive['peak'] / max(tiled['peak'], 1):.1f}x less",
                f"{secs[0]:.2f}",
                f"{secs[1]:.2f}",
                f"{secs[2]:.2f}",
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


# (rows per micro-batch, tokens per row (0: one vector per row), K): the original
# MLP configuration, where the embeddings (K·rows x 256, and their gradient) are a
# large share of one micro-batch's memory and the whole-batch loss a large share
# of its time; and a sequence encoder, where as in real encoders the activations
# grow with the tokens while the embeddings do not.
CACHE_CONFIGS = {
    "mlp": (1024, 0, 4),
    "sequence": (64, 16, 4),
}
CACHE_CONFIGS_QUICK = {"mlp": (256, 0, 4), "sequence": (32, 16, 4)}


def _cache_table(name: str, rows: int, tokens: int, k: int, repeats: int) -> None:
    what = f"{rows} rows of {tokens} tokens (mean-pooled)" if tokens else f"{rows} rows"
    print(
        f"\n### CachedStep, {name}: two towers (2 x 3 layers, width 1024, dropout, D = 256), "
        f"{k} micro-batches of {what}\n"
    )
    args = [str(rows), str(tokens), str(k)]
    mem = {m: _spawn(["cache", m, *args, str(repeats)]) for m in CACHE_MODES}
    tim = _spawn(["cache_times", *args, str(max(3, repeats))])
    base = mem["one_micro_batch"]
    print("| step | peak MiB | vs one micro-batch step | median s | time vs plain accumulation |")
    print("|---|---|---|---|---|")
    for m, label in (
        ("one_micro_batch", "one micro-batch step"),
        ("accumulate", f"plain accumulation of {k} losses (inexact)"),
        ("cached", f"CachedStep, K = {k} (exact)"),
        ("whole", f"whole batch of {rows * k} in one pass (exact)"),
    ):
        r, t = mem[m], tim[m]
        print(
            f"| {label} | {r['peak'] / MiB:.0f} | {r['peak'] / max(base['peak'], 1):.2f}x | "
            f"{t['seconds']:.2f} | {t['vs_accumulate']:.2f}x |",
            flush=True,
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat (~1 minute)")
    parser.add_argument(
        "--only",
        choices=["clip", "siglip", "nt_xent", "cache"],
        action="append",
        help="run only these tables' rows (repeatable); default: all",
    )
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        kind, *rest = args.child
        if kind == "loss":
            loss, impl, n, d, reps = rest
            print(json.dumps(_child_loss(loss, impl, int(n), int(d), int(reps))))
        elif kind == "loss_times":
            loss, n, d, reps = rest
            print(json.dumps(_child_loss_times(loss, int(n), int(d), int(reps))))
        elif kind == "cache":
            mode, rows, tokens, k, reps = rest
            print(json.dumps(_child_cache(mode, int(rows), int(tokens), int(k), int(reps))))
        else:
            rows, tokens, k, reps = rest
            print(json.dumps(_child_cache_times(int(rows), int(tokens), int(k), int(reps))))
        return
    only = set(args.only or ["clip", "siglip", "nt_xent", "cache"])
    t0 = time.perf_counter()
    if args.quick:
        plan = [(loss, n, True) for loss in ("clip", "siglip", "nt_xent") for n in (2048, 4096)]
        repeats, configs = 1, CACHE_CONFIGS_QUICK
    else:
        plan = [("clip", n, True) for n in (4096, 8192, 16384)]
        plan += [("clip", 32768, False), ("clip", 65536, False)]
        plan += [("siglip", n, True) for n in (4096, 8192, 16384)]
        plan += [("nt_xent", n, True) for n in (4096, 8192)]
        repeats, configs = 3, CACHE_CONFIGS
    plan = [p for p in plan if p[0] in only]
    if plan:
        _loss_table(plan, 256, repeats)
    if "cache" in only:
        for name, (rows, tokens, k) in configs.items():
            _cache_table(name, rows, tokens, k, max(2, repeats))
    print(f"\ntotal wall time {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
