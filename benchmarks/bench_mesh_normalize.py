"""The mesh Accumulator's normalisation modes side by side, dp2 x tp2 on 4 gloo ranks.

    python -m benchmarks.bench_mesh_normalize            # 20 timed steps per method
    python -m benchmarks.bench_mesh_normalize --quick    # 6 timed steps per method

The model, mesh and data of benchmarks/bench_mesh.py (token-embedding MLP LM,
Colwise/Rowwise on tp, FSDP2 on dp, K = 4 ragged micro-batches). Three methods,
each its own copy of the model, run every step in turn (rotating order) after a
barrier; a step's time is the slowest rank's:

- "sum, count": `acc.step(mbs, loss_fn)` with loss_fn -> (sum of token losses, tokens),
  the default token mean (rescaled once after backward);
- "sequence": `normalize=Normalize("sequence", items=...)`: the counting pass over the
  micro-batches' index tensors, the table in `begin`'s all-gather over the mesh
  (each data shard's rows once, tp replicas checked), per-token weights;
- "group": the same with groups of 4 sequences (the same number of rows, and the
  check that every sequence lies in one group).

Each rank holds K x 8 = 32 sequences a step, so the table rides inline on `begin`'s
all-gather (at most 64 rows a rank).

The table shows each method's median, the ratio to "sum, count" and the paired
median over steps of (method / "sum, count").
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.bench_mesh import IGNORE, SHAPE, VOCAB, K, S, T, _batches, _loss_sum, _model

METHODS = ("sum, count", "sequence", "group")


def _per_token(model: nn.Module, mb: dict[str, Tensor]) -> Tensor:
    logits = model(mb["tokens"])
    loss = F.cross_entropy(
        logits.reshape(-1, VOCAB), mb["targets"].reshape(-1), ignore_index=IGNORE, reduction="none"
    )
    return loss.reshape(mb["targets"].shape)


def _items(mb: dict[str, Tensor]) -> dict[str, Tensor]:
    return {"mask": mb["targets"] != IGNORE, "sequence": mb["seq"], "group": mb["seq"] // 4}


def _with_ids(mbs: list[tuple[Tensor, Tensor]], step: int, dp: int) -> list[dict[str, Tensor]]:
    """Each micro-batch with its rows' global sequence ids [S, T] (unique over the step)."""
    out, base = [], (step * 2 + dp) * 10_000
    for k, (tokens, targets) in enumerate(mbs):
        ids = base + k * tokens.shape[0] + torch.arange(tokens.shape[0])
        out.append({"tokens": tokens, "targets": targets, "seq": ids[:, None].expand_as(tokens)})
    return out


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def bench_rank(steps: int, warmup: int, s_mb: int, t_seq: int) -> dict[str, list[float]]:
    """Run on each of the 4 ranks: every method, step by step; the slowest rank's times."""
    from tests.support.mesh_cases import get_mesh
    from wholebatch import Normalize
    from wholebatch.comm.mesh import MeshSplit
    from wholebatch.train.accumulate import Accumulator

    torch.set_num_threads(1)
    mesh = get_mesh(SHAPE)
    dp = MeshSplit(mesh=mesh, batch_dims=("dp",)).coordinate()["dp"]
    accs = {}
    for name in METHODS:
        model, _ = _model(mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        accs[name] = Accumulator(model, opt, mesh=mesh, batch_dims=("dp",))
    times: dict[str, list[float]] = {name: [] for name in METHODS}
    for s in range(warmup + steps):
        mbs = _batches(s, dp, s_mb, t_seq)
        rows = _with_ids(mbs, s, dp)
        order = METHODS[s % 3 :] + METHODS[: s % 3]  # rotated: no method always first
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            if name == "sum, count":
                accs[name].step(mbs, _loss_sum)
            else:
                norm = Normalize(name, items=_items)  # type: ignore[arg-type]
                accs[name].step(rows, _per_token, normalize=norm)  # type: ignore[arg-type]
            elapsed = _slowest(time.perf_counter() - t0)
            if s >= warmup:
                times[name].append(elapsed)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 timed steps instead of 20")
    args = parser.parse_args()
    steps = 6 if args.quick else 20
    from benchmarks.bench_mesh_normalize import bench_rank as by_name  # pickled by module name
    from tests.support.harness import run_ranks, shutdown_worlds

    try:
        times: dict[str, Any] = run_ranks(4, by_name, steps, 2, S, T, timeout=1500)[0]
    finally:
        shutdown_worlds()
    base = times["sum, count"]
    print(f"dp2 x tp2 on 4 gloo ranks, K={K}, {S}x{T} tokens per micro-batch, {steps} steps")
    print(f"{'method':<12}{'median ms':>11}{'ratio':>8}{'paired':>8}")
    for name in METHODS:
        ts = times[name]
        ratio = statistics.median(ts) / statistics.median(base)
        paired = statistics.median(a / b for a, b in zip(ts, base, strict=True))
        print(f"{name:<12}{1e3 * statistics.median(ts):>11.1f}{ratio:>8.3f}{paired:>8.3f}")


if __name__ == "__main__":
    main()
