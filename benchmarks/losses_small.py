"""Small batches: one loss call of wholebatch against open_clip's exact configuration, on 2 CPU ranks.

    .venv/bin/python -m benchmarks.losses_small              # 8 and 64 rows per rank, 100 calls
    .venv/bin/python -m benchmarks.losses_small --profile    # + where wholebatch's forward goes

open_clip 3.3.0's own `ClipLoss` / `SigLipLoss` (tests/support/peers.py loads its
loss.py; `gather_with_grad=True, local_loss=True`, the reference: its training CLI
with `--gather-with-grad --local-loss`; and `local_loss=False`, every rank the
whole N x N logits) beside `wholebatch.clip_loss` / `siglip_loss` on the same
inputs, alternating (the order rotated each round), median over calls of forward
and of forward + backward;
wholebatch with the checks on (default) and with `sizes=` + `check=False` (no
exchange). `--profile` adds, per implementation, the collectives that reach
gloo per call (torch.profiler's `gloo:*` events, forward and backward) and
rank 0's busiest operators of wholebatch's CLIP and SigLIP calls.
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

from benchmarks._common import spawn_ranks


def _impls(b: int, w: int) -> dict[str, Any]:
    from tests.support.peers import load_open_clip_loss
    from wholebatch.losses import clip_loss, siglip_loss

    oc = load_open_clip_loss()
    r = dist.get_rank()
    known: dict[str, Any] = dict(sizes=[b] * w, check=False)
    out: dict[str, Any] = {
        "clip wholebatch": lambda i, t, s: clip_loss(i, t, s),
        "clip wholebatch sizes+check=False": lambda i, t, s: clip_loss(i, t, s, **known),
        "siglip wholebatch": lambda i, t, s: siglip_loss(i, t, s, -10.0),
        "siglip wholebatch sizes+check=False": lambda i, t, s: siglip_loss(i, t, s, -10.0, **known),
    }
    if oc is not None:
        cl = oc.ClipLoss(gather_with_grad=True, local_loss=True, rank=r, world_size=w)
        cl_all = oc.ClipLoss(gather_with_grad=True, rank=r, world_size=w)
        sl = oc.SigLipLoss(rank=r, world_size=w)
        out["clip open_clip"] = lambda i, t, s: cl(i, t, s)
        out["clip open_clip local_loss=False"] = lambda i, t, s: cl_all(i, t, s)
        out["siglip open_clip"] = lambda i, t, s: sl(i, t, s, torch.tensor(-10.0))
    return out


def _time(fn: Any, i: torch.Tensor, t: torch.Tensor, backward: bool) -> float:
    s = torch.tensor(10.0, requires_grad=True)
    dist.barrier()
    t0 = time.perf_counter()
    loss = fn(i, t, s)
    if backward:
        loss.backward()
    return time.perf_counter() - t0


def _rank(rank: int, w: int, cfg: dict[str, Any]) -> Any:
    rows: dict[tuple[int, str, str], Any] = {}
    for b in cfg["rows"]:
        g = torch.Generator().manual_seed(rank)
        i = F.normalize(torch.randn(b, cfg["d"], generator=g), dim=-1).requires_grad_()
        t = F.normalize(torch.randn(b, cfg["d"], generator=g), dim=-1).requires_grad_()
        impls = _impls(b, w)
        for phase, backward in (("forward", False), ("forward + backward", True)):
            times: dict[str, list[float]] = {name: [] for name in impls}
            names = list(impls)
            for c in range(cfg["calls"]):
                # rotated each round: no implementation always follows the same one
                # (the first call after open_clip's SigLIP forward absorbed its ranks' skew)
                for name in names[c % len(names) :] + names[: c % len(names)]:
                    times[name].append(_time(impls[name], i, t, backward))
            for name, ts in times.items():
                rows[(b, phase, name)] = statistics.median(ts[2:])
        if cfg["profile"]:
            for name, fn in impls.items():
                rows[(b, "gloo calls per call", name)] = _collectives(fn, i, t)
            for name in ("clip wholebatch", "siglip wholebatch"):
                _profile(impls[name], i, t, f"{name}, {b} rows per rank" if rank == 0 else None)
    return rows


def _collectives(fn: Any, i: torch.Tensor, t: torch.Tensor) -> str:
    """ "forward + backward" gloo collectives per call (profiler events named gloo:*), 5 calls."""
    from torch.profiler import ProfilerActivity, profile

    def gloo(prof: Any) -> float:
        return sum(e.count for e in prof.key_averages() if e.key.startswith("gloo:")) / calls

    calls = 5
    s = torch.tensor(10.0, requires_grad=True)
    losses = []
    with profile(activities=[ProfilerActivity.CPU]) as fwd:
        for _ in range(calls):
            losses.append(fn(i, t, s))
    with profile(activities=[ProfilerActivity.CPU]) as bwd:
        for loss in losses:
            loss.backward()
    return f"{gloo(fwd):g} + {gloo(bwd):g}"


def _profile(fn: Any, i: torch.Tensor, t: torch.Tensor, title: str | None) -> None:
    """20 forward + backward calls of `fn` under torch.profiler; the table printed when `title`."""
    from torch.profiler import ProfilerActivity, profile

    s = torch.tensor(10.0, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            fn(i, t, s).backward()
    if title is not None:
        print(f"## {title}: 20 forward + backward calls, rank 0", flush=True)
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=18), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", default="8,64")
    p.add_argument("--d", type=int, default=512)
    # 100: a median of 38 calls swung run to run by up to 3x on 2 shared cores (open_clip's
    # own SigLIP forward at 64 rows: 0.67-2.60 ms over 14 runs; 0.69-0.91 at 100 calls)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--profile", action="store_true")
    a = p.parse_args(argv)
    w = 2
    cfg = dict(rows=[int(x) for x in a.rows.split(",")], d=a.d, calls=a.calls, profile=a.profile)
    got = spawn_ranks(_rank, w, cfg, timeout=1200)
    load = os.getloadavg()
    print(f"W = 2 CPU ranks, D = {a.d}, median of {a.calls - 2} calls (ms; the slower rank)")
    print(f"load average after the run: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print("| rows per rank | phase | implementation | ms | vs open_clip |")
    print("|---|---|---|---|---|")
    for key in got[0]:
        b, phase, name = key
        if phase == "gloo calls per call":
            continue
        ms = max(got[r][key] for r in got) * 1e3
        loss = name.split()[0]
        ref = (b, phase, f"{loss} open_clip")
        base = max(got[r][ref] for r in got) * 1e3 if ref in got[0] else float("nan")
        print(f"| {b} | {phase} | {name} | {ms:.2f} | {ms / base:.2f}x |")
    counts = [k for k in got[0] if k[1] == "gloo calls per call"]
    if counts:
        print("\n| rows per rank | implementation | gloo collectives per forward + backward |")
        print("|---|---|---|")
        for b, phase, name in counts:
            print(f"| {b} | {name} | {got[0][(b, phase, name)]} |")


if __name__ == "__main__":
    main()
