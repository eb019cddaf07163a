"""Gradient accumulation, W = 2 gloo ranks, K = 4: the Accumulator against its peers, side by side.

    python -m benchmarks.bench_accumulate            # 30 timed steps per method
    python -m benchmarks.bench_accumulate --quick    # 8 timed steps per method
    python -m benchmarks.bench_accumulate --normalize  # Normalize modes vs "token", same data

Every method trains its own copy of the same small language-model-like network
(embedding -> MLP -> vocabulary logits, float32) on the same ragged batches
(variable-length sequences, padding targets ignored). Methods run in turn, step
by step, after a barrier, so machine noise hits them alike; a step's time is the
slowest rank's. The table shows the median, its ratio to the hand-written loop's
median, and "paired": the median over steps of (this method / hand-written) on the
same step, which cancels most drift on a shared machine.

Methods:
- hand-written: the correct loop by hand: count every micro-batch's tokens first,
  all-reduce the count, `no_sync` on micro-batches 0..K-2, loss_sum * W / N,
  clip_grad_norm_, step, zero_grad;
- Accumulator: `wholebatch.Accumulator(ddp, opt, max_grad_norm=1.0)`;
- naive: mean of per-micro-batch means / K, no `no_sync` (K all-reduces a step);
- Accumulator fp16 / bf16 / powersgd: `grad_compression=...` (PyTorch's DDP hooks;
  PowerSGD rank 4, plain all-reduce for its first 2 steps).

With `--normalize` the methods are `Accumulator.step(..., normalize=Normalize(mode))`
for mode token (the after-backward rescale, no pre-pass), sequence, group and
constant (per-token cross-entropy, mask = targets != IGNORE, one sequence id per
row, groups of 4 sequences), "vs hand" and "paired" then against "token": the
cost of the counting pass and its all-gather.

Reported per method: median step time, ratio to hand-written, gradient all-reduces
per step and bytes each rank puts into them (counted in the DDP comm hook), and for
compression the relative error of the compressed gradient against the exact one on
the same parameters and data (PowerSGD's includes its error-feedback residual).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.optimizer import register_optimizer_step_pre_hook

from benchmarks._common import free_port
from wholebatch.train.accumulate import Accumulator
from wholebatch.train.compression import GradCompression
from wholebatch.train.normalize import Normalize

W, K = 2, 4
VOCAB, DIM, HIDDEN = 1000, 128, 512
IGNORE = -100
MicroBatch = tuple[Tensor, ...]  # (tokens_ST, targets_ST), and seq_ST with --normalize


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.hidden = nn.Linear(DIM, HIDDEN)
        self.out = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens_ST: Tensor) -> Tensor:
        logits_STV: Tensor = self.out(torch.relu(self.hidden(self.emb(tokens_ST))))
        return logits_STV


def loss_sum(model: nn.Module, mb: MicroBatch) -> tuple[Tensor, Tensor]:
    tokens_ST, targets_ST = mb
    logits_STV = model(tokens_ST)
    loss = F.cross_entropy(
        logits_STV.flatten(0, 1), targets_ST.flatten(), ignore_index=IGNORE, reduction="sum"
    )
    return loss, (targets_ST != IGNORE).sum()


def per_token(model: nn.Module, mb: MicroBatch) -> Tensor:
    """Per-token cross-entropy [S, T] (0 on padding), for `normalize=`."""
    tokens_ST, targets_ST = mb[0], mb[1]
    logits_STV = model(tokens_ST)
    out: Tensor = F.cross_entropy(
        logits_STV.transpose(1, 2), targets_ST, ignore_index=IGNORE, reduction="none"
    )
    return out


def items(mb: MicroBatch) -> dict[str, Tensor]:
    """Index tensors only: the mask, one sequence id per row, groups of 4 sequences."""
    seq_ST = mb[2]
    return {"mask": mb[1] != IGNORE, "sequence": seq_ST, "group": seq_ST // 4}


def with_ids(mbs: list[MicroBatch], step: int, rank: int) -> list[MicroBatch]:
    """`mbs` with global sequence ids (one per row) for the normalisation modes."""
    out, first = [], (1000 * step + rank) * 100
    for i, (tokens_ST, targets_ST) in enumerate(mbs):
        rows = torch.arange(tokens_ST.shape[0]) + first + 10 * i
        out.append((tokens_ST, targets_ST, rows[:, None].expand_as(tokens_ST).contiguous()))
    return out


def micro_batches(step: int, rank: int) -> list[MicroBatch]:
    """K ragged micro-batches: 2-6 sequences of 8-96 tokens, padded per micro-batch."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    out = []
    for _ in range(K):
        lengths = torch.randint(
            8, 97, (int(torch.randint(2, 7, (1,), generator=gen)),), generator=gen
        )
        t = int(lengths.max())
        tokens = torch.randint(1, VOCAB, (len(lengths), t), generator=gen)
        targets = torch.roll(tokens, -1, dims=1)
        for i, n in enumerate(lengths.tolist()):
            targets[i, n - 1 :] = IGNORE
        out.append((tokens, targets))
    return out


class Counter:
    """Gradient all-reduces and bytes, counted in an uncompressed DDP comm hook."""

    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0


def _counting_allreduce(state: Counter, bucket: Any) -> torch.futures.Future[Tensor]:
    buf = bucket.buffer()
    state.calls += 1
    state.bytes += buf.numel() * buf.element_size()
    return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]


_counting_allreduce.__annotations__ = {}  # DDP accepts only runtime annotations


def hand_written_step(ddp: DDP, opt: torch.optim.Optimizer, mbs: list[MicroBatch]) -> None:
    n = torch.tensor([float(sum(int((mb[1] != IGNORE).sum()) for mb in mbs))])
    dist.all_reduce(n)  # the global token count, before any backward
    for i, mb in enumerate(mbs):
        ctx = ddp.no_sync() if i < len(mbs) - 1 else _null()
        with ctx:
            loss, _ = loss_sum(ddp, mb)
            torch.autograd.backward(loss * (W / n))  # DDP averages: * W
    torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def naive_step(ddp: DDP, opt: torch.optim.Optimizer, mbs: list[MicroBatch]) -> None:
    for mb in mbs:
        loss, n = loss_sum(ddp, mb)
        torch.autograd.backward(loss / n / len(mbs))  # mean of means, and an all-reduce every time
    torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


COMPRESSION: dict[str, Any] = {
    "Accumulator fp16": "fp16",
    "Accumulator bf16": "bf16",
    "Accumulator powersgd": GradCompression(kind="powersgd", powersgd_rank=4),
}


def _method(name: str) -> tuple[DDP, Callable[[list[MicroBatch]], None], Any]:
    """A fresh DDP copy of the model, its step function, and what counts its all-reduces."""
    model = LM()
    ddp = DDP(model, bucket_cap_mb=1000)  # one bucket: hook calls = all-reduces
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if name in COMPRESSION:
        acc = Accumulator(ddp, opt, max_grad_norm=1.0, grad_compression=COMPRESSION[name])
        return ddp, lambda mbs: _ignore(acc.step(mbs, loss_sum)), acc.comm_stats
    counter = Counter()
    ddp.register_comm_hook(counter, _counting_allreduce)
    if name.startswith("Normalize "):
        mode = name.split()[1]
        norm = Normalize(
            mode, items=items, constant=96.0 * 6 * K * W if mode == "constant" else None
        )  # type: ignore[arg-type]
        acc_n = Accumulator(ddp, opt, max_grad_norm=1.0)
        return ddp, lambda mbs: _ignore(acc_n.step(mbs, per_token, normalize=norm)), counter
    if name == "Accumulator":
        plain = Accumulator(ddp, opt, max_grad_norm=1.0)
        return ddp, lambda mbs: _ignore(plain.step(mbs, loss_sum)), counter
    if name == "hand-written":
        return ddp, lambda mbs: hand_written_step(ddp, opt, mbs), counter
    return ddp, lambda mbs: naive_step(ddp, opt, mbs), counter


def _counts(stat: Any) -> tuple[int, int]:
    if isinstance(stat, Counter):
        return stat.calls, stat.bytes
    return stat.calls, stat.wire_bytes


def _ignore(_: object) -> None:
    return None


NORMALIZE_METHODS = [
    "Normalize token",
    "Normalize sequence",
    "Normalize group",
    "Normalize constant",
]

METHODS = [
    "hand-written",
    "Accumulator",
    "naive",
    "Accumulator fp16",
    "Accumulator bf16",
    "Accumulator powersgd",
]


def _grad_after_step(
    ddp: DDP, step: Callable[[list[MicroBatch]], None], mbs: list[MicroBatch]
) -> Tensor:
    opt_params = list(ddp.module.parameters())
    captured: list[Tensor] = []
    handle = register_optimizer_step_pre_hook(
        lambda o, a, k: captured.append(torch.cat([p.grad.flatten() for p in opt_params]))  # type: ignore[union-attr]
    )
    try:
        step(mbs)
    finally:
        handle.remove()
    return captured[0]


def _compression_errors(rows: list[dict[str, Any]], methods: dict[str, Any], rank: int) -> None:
    """Each compression's gradient error against the exact gradient, same params and data."""
    mbs = micro_batches(10_000, rank)
    exact_ddp, exact_step, _ = _method("Accumulator")
    for row in rows:
        if row["name"] in COMPRESSION:
            ddp, step, _ = methods[row["name"]]
            exact_ddp.module.load_state_dict(ddp.module.state_dict())
            g_exact = _grad_after_step(exact_ddp, exact_step, mbs)
            g = _grad_after_step(ddp, step, mbs)
            row["rel_err"] = float((g - g_exact).norm() / g_exact.norm())


def _worker(rank: int, port: int, steps: int, out: Any, names: list[str]) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=W)
    methods = {name: _method(name) for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    base = names[0]
    start: dict[str, tuple[int, int]] = {}
    for s in range(steps + 2):  # 2 warm-up steps (also PowerSGD's plain all-reduce phase)
        if s == 2:
            start = {name: _counts(stat) for name, (_, _, stat) in methods.items()}
        mbs = micro_batches(s, rank)
        if base != "hand-written":
            mbs = with_ids(mbs, s, rank)
        # Rotate the order every step so no method always runs first (or after another).
        order = names[s % len(names) :] + names[: s % len(names)]
        for name in order:
            step = methods[name][1]
            dist.barrier()
            t0 = time.perf_counter()
            step(mbs)
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if s >= 2:
                times[name].append(float(dt))
    rows = []
    for name, (_, _, stat) in methods.items():
        calls, nbytes = _counts(stat)
        rows.append(
            dict(
                name=name,
                median_ms=1e3 * statistics.median(times[name]),
                # Per-step ratio to the baseline (hand-written, or "token") on the same
                # batch, then the median: pairs out the slow drifts of a shared machine.
                paired=statistics.median(
                    t / h for t, h in zip(times[name], times[base], strict=True)
                ),
                allreduces=(calls - start[name][0]) / steps,
                bytes=(nbytes - start[name][1]) / steps,
            )
        )
    # Gradient error of each compression against the exact gradient, same params and data.
    if any(row["name"] in COMPRESSION for row in rows):
        _compression_errors(rows, methods, rank)
    if rank == 0:
        out.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def prepass_ms(repeats: int = 200) -> dict[str, float]:
    """Median time of `Accumulator._begin` per mode, one process (no collective): the counting pass."""
    model = LM()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0))
    mbs = with_ids(micro_batches(0, 0), 0, 0)
    times: dict[str, list[float]] = {name: [] for name in NORMALIZE_METHODS}
    for _ in range(repeats):
        for name in NORMALIZE_METHODS:
            mode = name.split()[1]
            norm = Normalize(mode, items=items, constant=1.0 if mode == "constant" else None)  # type: ignore[arg-type]
            t0 = time.perf_counter()
            acc._begin(mbs, norm)
            times[name].append(time.perf_counter() - t0)
    return {name: 1e3 * statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 timed steps instead of 30")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 30)")
    parser.add_argument(
        "--normalize", action="store_true", help="the Normalize modes against 'token'"
    )
    args = parser.parse_args()
    steps = args.steps or (8 if args.quick else 30)
    names = NORMALIZE_METHODS if args.normalize else METHODS
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, steps, queue, names)) for r in range(W)]
    for p in procs:
        p.start()
    rows = None
    while rows is None:  # a worker that dies must not leave us waiting forever
        try:
            rows = queue.get(timeout=5)
        except Exception:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise SystemExit(
                    "bench_accumulate: a worker failed (see its traceback above)"
                ) from None
    for p in procs:
        p.join()
    base = next(r for r in rows if r["name"] == names[0])
    print(f"W={W} K={K}, {steps} timed steps, model {VOCAB}x{DIM}x{HIDDEN} fp32, AdamW, clip 1.0")
    print(
        f"{'method':<22} {'median ms':>10} {'vs ' + names[0].split()[-1][:4]:>8} {'paired':>7} {'allreduce/step':>15} {'grad bytes/step':>16} {'vs fp32':>8} {'grad rel err':>13}"
    )
    if args.normalize:
        torch.set_num_threads(1)
        pre = prepass_ms()
        print("Accumulator._begin (agree K + counting pass + weights), one process, median ms:")
        print("  " + "  ".join(f"{name.split()[1]} {ms:.3f}" for name, ms in pre.items()))
    for r in rows:
        err = "" if r.get("rel_err") is None else f"{r['rel_err']:.2e}"
        print(
            f"{r['name']:<22} {r['median_ms']:>10.1f} {r['median_ms'] / base['median_ms']:>7.3f}x {r['paired']:>6.3f}x "
            f"{r['allreduces']:>15.2f} {r['bytes']:>16,.0f} {r['bytes'] / base['bytes']:>7.3f}x {err:>13}"
        )


if __name__ == "__main__":
    main()
