"""The mesh Accumulator against a hand-written exact loop, dp2 x tp2 on 4 gloo ranks, side by side.

    python -m benchmarks.bench_mesh            # 30 timed steps per method
    python -m benchmarks.bench_mesh --quick    # 8 timed steps per method

Both methods train their own copy of the same token-embedding MLP language model
(float32; tensor parallel Colwise/Rowwise on tp, FSDP2 `fully_shard` on dp) on the
same ragged batches: K = 4 micro-batches per step, sequences of random length
padded to T, padding ignored. Each step runs both methods in turn after a barrier
(in alternating order); a step's time is the slowest rank's. The table shows each method's median, the
ratio of medians, and "paired": the median over steps of (Accumulator / hand) on
the same step, which cancels most drift on a shared machine.

- hand-written: the exact loop a careful user writes on this mesh: FSDP2's sync
  only on the last micro-batch, one all-reduce of (loss, tokens) over the dp group,
  gradients x dp / N, step, zero_grad. (No clipping: torch's clip_grad_norm_ fails on
  this model, whose embedding is a DTensor on the dp mesh and the TP layers on dp x tp,
  "All operands in aten.stack.default must have the same mesh".)
- Accumulator: `Accumulator(model, opt, mesh=mesh, batch_dims=("dp",))`, which also
  agrees K before the first forward, checks the tp replicas' counts and losses and
  computes the whole gradient norm (two small all-gathers over the mesh per step,
  where the hand loop has one all-reduce).

Gradient reductions per step are FSDP2's reduce-scatters, counted by pass-through
wrappers on `torch.distributed` (tests.support.mesh_cases.count_reduce_scatters; the
real collective runs).
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

K = 4
VOCAB, DIM = 2000, 256
T, S = 64, 8  # tokens per sequence, sequences per micro-batch (--big: 128, 16)
IGNORE = -100
SHAPE = (("dp", 2), ("tp", 2))


def _batches(step: int, dp: int, s: int, t: int) -> list[tuple[Tensor, Tensor]]:
    """This dp shard's K micro-batches of s x t tokens at `step` (tp replicas get the same)."""
    gen = torch.Generator().manual_seed(1000 * step + dp)
    out = []
    for _ in range(K):
        tokens = torch.randint(1, VOCAB, (s, t), generator=gen)
        lengths = torch.randint(1, t + 1, (s, 1), generator=gen)
        targets = tokens.roll(-1, 1).masked_fill(torch.arange(t) >= lengths, IGNORE)
        out.append((tokens, targets))
    return out


def _loss_sum(model: nn.Module, mb: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    tokens, targets = mb
    logits = model(tokens)
    loss = F.cross_entropy(
        logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )
    return loss, (targets != IGNORE).sum()


def _model(mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from tests.support.models import TinyLM

    model = TinyLM(vocab=VOCAB, dim=DIM)
    parallelize_module(model, mesh["tp"], {"hidden": ColwiseParallel(), "out": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model


def _hand_step(
    model: nn.Module, opt: torch.optim.Optimizer, mbs: list[Any], dp_group: Any, dp: int
) -> float:
    row = torch.zeros(2, dtype=torch.float64)
    for i, mb in enumerate(mbs):
        model.set_requires_gradient_sync(i == len(mbs) - 1)  # type: ignore[operator]
        loss, n = _loss_sum(model, mb)
        loss.backward()
        row += torch.stack([loss.detach().double(), n.double()])
    model.set_requires_gradient_sync(True)  # type: ignore[operator]
    dist.all_reduce(row, group=dp_group)
    factor = dp / float(row[1])
    with torch.no_grad():
        grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
        torch._foreach_mul_(grads, factor)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(row[0] / row[1])


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def bench_rank(steps: int, warmup: int, s_mb: int, t_seq: int) -> dict[str, Any]:
    """Run on each of the 4 ranks: both methods, step by step; times and reduction counts."""
    from tests.support.mesh_cases import count_reduce_scatters, get_mesh
    from wholebatch.comm.mesh import MeshSplit
    from wholebatch.train.accumulate import Accumulator

    torch.set_num_threads(1)
    mesh = get_mesh(SHAPE)
    dp = MeshSplit(mesh=mesh, batch_dims=("dp",)).coordinate()["dp"]
    m_acc, m_hand = _model(mesh), _model(mesh)
    opt_acc = torch.optim.SGD(m_acc.parameters(), lr=0.1)
    opt_hand = torch.optim.SGD(m_hand.parameters(), lr=0.1)
    acc = Accumulator(m_acc, opt_acc, mesh=mesh, batch_dims=("dp",))
    dp_group = mesh["dp"].get_group()
    times: dict[str, list[float]] = {"accumulator": [], "hand": []}
    reductions: dict[str, list[int]] = {"accumulator": [], "hand": []}
    losses: dict[str, list[float]] = {"accumulator": [], "hand": []}
    # the methods run one after the other: each one's reduce-scatters are its own
    with count_reduce_scatters() as counter:
        for s in range(warmup + steps):
            mbs = _batches(s, dp, s_mb, t_seq)
            order = ("accumulator", "hand") if s % 2 == 0 else ("hand", "accumulator")
            for name in order:  # alternated: neither method always runs first
                before = counter.calls
                dist.barrier()
                t0 = time.perf_counter()
                if name == "accumulator":
                    loss = acc.step(mbs, _loss_sum).loss
                else:
                    loss = _hand_step(m_hand, opt_hand, mbs, dp_group, mesh["dp"].size())
                elapsed = _slowest(time.perf_counter() - t0)
                if s >= warmup:
                    times[name].append(elapsed)
                    reductions[name].append(counter.calls - before)
                    losses[name].append(loss)
    return {"times": times, "reductions": reductions, "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 timed steps instead of 30")
    parser.add_argument("--big", action="store_true", help="16 x 128 tokens per micro-batch")
    args = parser.parse_args()
    steps = 8 if args.quick else 30
    s_mb, t_seq = (16, 128) if args.big else (S, T)
    from benchmarks.bench_mesh import bench_rank as by_name  # pickled by module name, not __main__
    from tests.support.harness import run_ranks, shutdown_worlds

    try:
        out = run_ranks(4, by_name, steps, 3, s_mb, t_seq, timeout=1500)[0]
    finally:
        shutdown_worlds()
    t_acc, t_hand = out["times"]["accumulator"], out["times"]["hand"]
    paired = statistics.median(a / h for a, h in zip(t_acc, t_hand, strict=True))
    drift = max(
        abs(a - h) for a, h in zip(out["losses"]["accumulator"], out["losses"]["hand"], strict=True)
    )
    print(f"dp2 x tp2 on 4 gloo ranks, K={K}, {s_mb}x{t_seq} tokens per micro-batch, {steps} steps")
    print(f"{'method':<14}{'median ms':>11}{'ratio':>8}{'paired':>8}{'reductions/step':>17}")
    for name, ts in (("hand-written", t_hand), ("Accumulator", t_acc)):
        key = "hand" if name == "hand-written" else "accumulator"
        red = sorted(set(out["reductions"][key]))
        ratio = statistics.median(ts) / statistics.median(t_hand)
        p = 1.0 if key == "hand" else paired
        print(f"{name:<14}{1e3 * statistics.median(ts):>11.1f}{ratio:>8.3f}{p:>8.3f}{red!s:>17}")
    print(f"largest loss difference between the two, over all steps: {drift:.2e}")


if __name__ == "__main__":
    main()
