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

from benchmarks._common import interleaved_times, peak_growth, run_child
from wholebatch.losses import clip_loss, info_nce_loss, nt_xent_loss, siglip_loss
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


def naive_info_nce(q_ND: Tensor, d_ND: Tensor, h_NKD: Tensor, s: Tensor) -> Tensor:
    """MultipleNegativesRankingLoss's formula: the N x N(1 + k) logits, one cross-entropy."""
    docs = torch.cat([d_ND, *h_NKD.unbind(1)])
    return F.cross_entropy(s * q_ND @ docs.T, torch.arange(q_ND.shape[0]))


def tiled_info_nce(q_ND: Tensor, d_ND: Tensor, h_NKD: Tensor, s: Tensor) -> Tensor:
    return info_nce_loss(q_ND, d_ND, s, negatives_BKD=h_NKD if h_NKD.shape[1] else None)


LOSSES: dict[str, dict[str, Callable[..., Tensor]]] = {
    "clip": {"naive": naive_clip, "tiled": clip_loss},
    "siglip": {"naive": naive_siglip, "tiled": siglip_loss},
    "nt_xent": {"naive": naive_nt_xent, "tiled": nt_xent_loss},
    "info_nce": {"naive": naive_info_nce, "tiled": tiled_info_nce},
    "info_nce_k3": {"naive": naive_info_nce, "tiled": tiled_info_nce},
}
SCALARS = {
    "clip": [10.0],
    "siglip": [10.0, -10.0],
    "nt_xent": [0.1],
    "info_nce": [20.0],
    "info_nce_k3": [20.0],
}
HARD_NEGATIVES = {"info_nce": 0, "info_nce_k3": 3}


def _loss_inputs(loss: str, n: int, d: int) -> tuple[list[Tensor], list[Tensor]]:
    """(embeddings requiring grad, scalars requiring grad) for one configuration."""
    gen = torch.Generator().manual_seed(0)
    embs = [F.normalize(torch.randn(n, d, generator=gen), dim=1) for _ in range(2)]
    if loss in HARD_NEGATIVES:
        k = HARD_NEGATIVES[loss]
        embs.append(F.normalize(torch.randn(n, k, d, generator=gen), dim=2))
    sc = [torch.tensor(v, requires_grad=True) for v in SCALARS[loss]]
    return [e.requires_grad_() for e in embs], sc


# ---------------------------------------------------------------------------
# Memory: the kernel's peak-RSS counter, reset before each measurement
# ---------------------------------------------------------------------------


def _peak_growth(fn: Callable[[], Any]) -> tuple[float, int]:
    """(seconds, peak RSS growth in bytes) of one call of `fn`."""
    t0 = time.perf_counter()
    peak = peak_growth(fn)
    return time.perf_counter() - t0, peak


# ---------------------------------------------------------------------------
# Children (one configuration each, in a fresh process)
# ---------------------------------------------------------------------------


def _child_loss(loss: str, impl: str, n: int, d: int, repeats: int) -> dict[str, Any]:
    embs, sc = _loss_inputs(loss, n, d)
    fn = LOSSES[loss][impl.split("@")[0]]
    if "@" in impl:  # "tiled@T": a given tile size
        tile, base = int(impl.split("@")[1]), fn
        fn = lambda *a: base(*a, tile_size=tile)  # noqa: E731

    def run() -> None:
        out = fn(*embs, *sc)
        out.backward()
        for t in (*embs, *sc):
            t.grad = None

    # Warm-up on 256 rows: BLAS workspaces and thread pools exist before measuring
    # (a fixed cost that would otherwise be charged to whichever runs first).
    fn(*[e[:256].detach() for e in embs], *[s.detach() for s in sc])
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
    times = interleaved_times(CACHE_MODES, run, rounds)
    acc = times["accumulate"]
    return {
        m: {
            "seconds": statistics.median(ts),
            "vs_accumulate": statistics.median(t / a for t, a in zip(ts, acc, strict=True)),
        }
        for m, ts in times.items()
    }


def _child_loss_times(
    loss: str, n: int, d: int, rounds: int, tiles: tuple[str | None, ...] = (None,)
) -> dict[str, Any]:
    """Naive and tiled (each tile size) interleaved in ONE process: medians and per-round ratios."""
    embs, sc = _loss_inputs(loss, n, d)
    impls: dict[str, Callable[[], Tensor]] = {"naive": lambda: LOSSES[loss]["naive"](*embs, *sc)}
    for spec in tiles:
        # "T": tile size T (the tile loop on its default one thread); "T/t": and
        # WHOLEBATCH_TILE_THREADS=0 (the tile loop on torch's threads, the old default)
        t = None if spec is None else int(spec.split("/")[0])
        name = "tiled" if spec is None else f"tiled T={t}"
        if spec is not None and spec.endswith("/t"):
            name += ", torch's threads"  # run with WHOLEBATCH_TILE_THREADS=0 (set below)
        if loss in HARD_NEGATIVES:
            impls[name] = lambda t=t: info_nce_loss(
                embs[0], embs[1], sc[0], negatives_BKD=embs[2] if embs[2].shape[1] else None,
                tile_size=t,
            )  # fmt: skip
        else:
            impls[name] = lambda t=t: LOSSES[loss]["tiled"](*embs, *sc, tile_size=t)
    small = [e[:256].detach() for e in embs]
    for fn in LOSSES[loss].values():
        fn(*small, *[s.detach() for s in sc])
    times: dict[str, list[float]] = {k: [] for k in impls}
    order = list(impls)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            os.environ.pop("WHOLEBATCH_TILE_THREADS", None)
            if name.endswith("torch's threads"):
                os.environ["WHOLEBATCH_TILE_THREADS"] = "0"
            t0 = time.perf_counter()
            impls[name]().backward()
            times[name].append(time.perf_counter() - t0)
            os.environ.pop("WHOLEBATCH_TILE_THREADS", None)
            for t in (*embs, *sc):
                t.grad = None
    out: dict[str, Any] = {k: statistics.median(v) for k, v in times.items()}
    out["ratio"] = {
        k: statistics.median(a / b for a, b in zip(v, times["naive"], strict=True))
        for k, v in times.items()
        if k != "naive"
    }
    # the first tiled entry, under the old keys
    out["tiled"], out["ratio_tiled"] = out[order[1]], out["ratio"][order[1]]
    return out


def _spawn(args: list[str]) -> dict[str, Any]:
    result: dict[str, Any] = run_child("bench_losses", ["--child", *args])
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
            # Times up to 8,192 (and InfoNCE at any size): naive and tiled interleaved in
            # one process (median of the per-round ratios); above, one run each in its
            # memory process.
            if n <= 8192 or loss in HARD_NEGATIVES:
                t = _spawn(["loss_times", loss, str(n), str(d), str(repeats)])
                secs = (t["naive"], t["tiled"], t["ratio_tiled"])
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


# ---------------------------------------------------------------------------
# Contention: 2 threads while a competing process computes
# ---------------------------------------------------------------------------

COMPETITOR = (
    "import torch\n"
    "torch.set_num_threads(1)\n"
    "a = torch.randn(1024, 1024)\n"
    "while True:\n"
    "    a = torch.tanh(a @ a / 32)\n"
)
CONTENTION_TILES = ("512", "1024", "2048", "512/t")


def _contention_table(n: int, d: int, rounds: int) -> None:
    print(
        f"\n### contention: clip, N = {n:,}, D = {d}, torch 2 threads, while a competing "
        "process (1 thread of matrix products) runs\n"
    )
    competitor = subprocess.Popen([sys.executable, "-c", COMPETITOR])
    try:
        time.sleep(1.0)
        t = _spawn(["loss_times", "clip", str(n), str(d), str(rounds), *map(str, CONTENTION_TILES)])
        mem = {"naive": _spawn(["loss", "clip", "naive", str(n), str(d), "1"])}
        for tile in CONTENTION_TILES[:3]:
            mem[f"tiled T={tile}"] = _spawn(["loss", "clip", f"tiled@{tile}", str(n), str(d), "1"])
        mem["tiled T=512, torch's threads"] = mem["tiled T=512"]  # threads change no memory
    finally:
        competitor.kill()
        competitor.wait()
    print("| method | peak MiB | median s | time ratio to naive (median of rounds) |")
    print("|---|---|---|---|")
    print(f"| naive N x N | {mem['naive']['peak'] / MiB:.0f} | {t['naive']:.2f} | 1.00 |")
    for k in mem:
        if k == "naive":
            continue
        print(
            f"| {k} | {mem[k]['peak'] / MiB:.0f} | {t[k]:.2f} | {t['ratio'][k]:.2f} |", flush=True
        )


# ---------------------------------------------------------------------------
# float32 precision in issue 14's regimes
# ---------------------------------------------------------------------------

# (scale s, noise σ): text = normalise(image + σ/√D·noise); σ bisected on the float64
# CLIP loss at N = 2,048 to give the losses (tests/unit/test_loss_precision.py).
REGIMES = {
    "s = 100, ordinary": (100.0, 8.0),
    "s = 100, loss 0.32": (100.0, 3.205),
    "s = 30, loss 3.4e-3": (30.0, 1.599),
    "s = 100, saturated (1e-9)": (100.0, 1.5993),
}
PRECISION_LOSSES: dict[str, tuple[Callable[..., Tensor], Callable[..., Tensor]]] = {
    "clip": (naive_clip, lambda i, t, s: clip_loss(i, t, s)),
    "siglip (b = -0.6 s)": (
        lambda i, t, s: naive_siglip(i, t, s, -0.6 * s),
        lambda i, t, s: siglip_loss(i, t, s, -0.6 * s),
    ),
    "nt_xent (τ = 1/s)": (
        lambda i, t, s: naive_nt_xent(i, t, 1 / s),
        lambda i, t, s: nt_xent_loss(i, t, 1 / s),
    ),
    "info_nce (k = 3)": (naive_info_nce, tiled_info_nce),
}


def _child_precision(n: int, d: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for regime, (s_val, sigma) in REGIMES.items():
        gen = torch.Generator().manual_seed(0)
        i = F.normalize(torch.randn(n, d, generator=gen, dtype=torch.float64), dim=1)
        noise = torch.randn(n, d, generator=gen, dtype=torch.float64)
        t = F.normalize(i + sigma / d**0.5 * noise, dim=1)
        h = F.normalize(torch.randn(n, 3, d, generator=gen, dtype=torch.float64), dim=2)
        for name, (plain, tiled) in PRECISION_LOSSES.items():
            xs = [i, t, h] if name.startswith("info_nce") else [i, t]
            xs = [x.float().double() for x in xs]
            res = []
            for fn, dtype in (
                (plain, torch.float64),
                (plain, torch.float32),
                (tiled, torch.float32),
            ):
                ins = [x.to(dtype).requires_grad_() for x in xs]
                sc = torch.tensor(s_val, dtype=dtype, requires_grad=True)
                loss = fn(*ins, sc)
                res.append(
                    [
                        loss.detach().double(),
                        *(g.double() for g in torch.autograd.grad(loss, [*ins, sc])),
                    ]
                )
            ref = res[0]

            def err(got: list[Tensor], ref: list[Tensor] = ref) -> list[float]:
                gx = torch.cat(
                    [(a - b).flatten() for a, b in zip(got[1:-1], ref[1:-1], strict=True)]
                )
                rx = torch.cat([b.flatten() for b in ref[1:-1]])
                return [
                    abs((got[0] - ref[0]).item()) / abs(ref[0].item()),
                    (gx.norm() / rx.norm()).item(),
                    abs((got[-1] - ref[-1]).item()) / abs(ref[-1].item()),
                ]

            out[f"{name}|{regime}"] = {
                "loss": ref[0].item(),
                "plain": err(res[1]),
                "tiled": err(res[2]),
            }
    return out


def _precision_table(n: int, d: int) -> None:
    print(
        f"\n### float32 precision against float64 (same float32 inputs), N = {n:,}, D = {d}: "
        "relative error of the loss, of the embeddings' gradient, of dL/ds\n"
    )
    res = _spawn(["precision", str(n), str(d)])
    print(
        "| loss | regime | loss (float64) | plain: loss / grad / dL/ds | tiled: loss / grad / dL/ds | worst tiled/plain |"
    )
    print("|---|---|---|---|---|---|")
    for key, r in res.items():
        name, regime = key.split("|")
        ratio = max(t / max(p, 2**-23) for p, t in zip(r["plain"], r["tiled"], strict=True))
        fmt = " / ".join
        print(
            f"| {name} | {regime} | {r['loss']:.3g} | {fmt(f'{e:.1e}' for e in r['plain'])} | "
            f"{fmt(f'{e:.1e}' for e in r['tiled'])} | {ratio:.2f} |",
            flush=True,
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat (~1 minute)")
    parser.add_argument(
        "--only",
        choices=[
            "clip",
            "siglip",
            "nt_xent",
            "info_nce",
            "cache",
            "contention",
            "precision",
            "ring",
            "small",
        ],
        action="append",
        help="run only these tables' rows (repeatable); default: all but ring and small "
        "(benchmarks/losses_ring.py: ring vs gather on 4 ranks; losses_small.py: small "
        "batches against open_clip on 2 ranks; each takes its own flags when run directly)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child:
        kind, *rest = args.child
        if kind == "loss":
            loss, impl, n, d, reps = rest
            print(json.dumps(_child_loss(loss, impl, int(n), int(d), int(reps))))
        elif kind == "loss_times":
            loss, n, d, reps, *tiles = rest
            tl: tuple[str | None, ...] = tuple(tiles) if tiles else (None,)
            print(json.dumps(_child_loss_times(loss, int(n), int(d), int(reps), tl)))
        elif kind == "precision":
            n, d = rest
            print(json.dumps(_child_precision(int(n), int(d))))
        elif kind == "cache":
            mode, rows, tokens, k, reps = rest
            print(json.dumps(_child_cache(mode, int(rows), int(tokens), int(k), int(reps))))
        else:
            rows, tokens, k, reps = rest
            print(json.dumps(_child_cache_times(int(rows), int(tokens), int(k), int(reps))))
        return
    only = set(
        args.only or ["clip", "siglip", "nt_xent", "info_nce", "cache", "contention", "precision"]
    )
    t0 = time.perf_counter()
    print(f"load average at start: {os.getloadavg()[0]:.1f}; torch threads {args.threads}")
    if args.quick:
        plan = [(loss, n, True) for loss in ("clip", "siglip", "nt_xent") for n in (2048, 4096)]
        plan += [("info_nce", 2048, True), ("info_nce_k3", 2048, True)]
        repeats, configs = 1, CACHE_CONFIGS_QUICK
    else:
        plan = [("clip", n, True) for n in (4096, 8192, 16384)]
        plan += [("clip", 32768, False), ("clip", 65536, False)]
        plan += [("siglip", n, True) for n in (4096, 8192, 16384)]
        plan += [("nt_xent", n, True) for n in (4096, 8192)]
        plan += [("info_nce", 16384, True), ("info_nce_k3", 16384, True)]
        repeats, configs = 3, CACHE_CONFIGS
    plan = [p for p in plan if p[0].removesuffix("_k3") in only]
    if plan:
        _loss_table(plan, 256, repeats)
    if "cache" in only:
        for name, (rows, tokens, k) in configs.items():
            _cache_table(name, rows, tokens, k, max(2, repeats))
    if "contention" in only:
        _contention_table(2048 if args.quick else 4096, 256, 3 if args.quick else 7)
    if "precision" in only:
        _precision_table(512 if args.quick else 2048, 256)
    if "ring" in only:
        from benchmarks import losses_ring

        losses_ring.main(["--n", "8192", "--rounds", "1"] if args.quick else [])
    if "small" in only:
        from benchmarks import losses_small

        losses_small.main(["--calls", "10"] if args.quick else [])
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    print(f"\ntotal wall time {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
