"""A small DDP training run with injectable faults, for tests/e2e/test_faults.py (run under torchrun).

    torchrun --standalone --nproc-per-node 2 tests/support/fault_scripts/train.py --out DIR --mode clean

Modes: clean; crash (rank 1 calls os._exit(13) mid-step at --fault-step on the
first attempt); skip-collective / skip-backward (rank 1 skips one wholebatch
collective, or the backward through it); nan (rank 1's loss is NaN at
--fault-step); fewer-micro-batches (rank 1 has one fewer at --fault-step).
Mutations for the resume test: --forget rng|data drops that from the resume.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import wholebatch
from wholebatch import checkpoint
from wholebatch.train.accumulate import Accumulator

K, MB, ROWS = 3, 4, 240


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--mode", default="clean")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--fault-step", type=int, default=4)
    p.add_argument("--forget", choices=["rng", "data"], default=None)
    p.add_argument("--timeout", type=float, default=10)
    args = p.parse_args()
    torch.set_num_threads(1)
    wholebatch.init_process_group("gloo", timeout_s=args.timeout)
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if args.mode.startswith("skip"):
        wholebatch.set_debug(os.environ.get("WHOLEBATCH_DEBUG") == "1", timeout_s=5)

    torch.manual_seed(0)  # the same initial weights on every rank
    model = DDP(
        nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 1)).double()
    )
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    acc = Accumulator(model, opt)
    gen = torch.Generator().manual_seed(100 + rank)  # this rank's shard of a dataset
    data_x = torch.randn(ROWS, 6, generator=gen, dtype=torch.float64)
    data_y = data_x.sum(1, keepdim=True).sin()
    torch.manual_seed(1000 + rank)  # this rank's dropout stream

    state = checkpoint.load_latest(args.out, model=model, optimizer=opt, engine=acc)
    step, pos = (state.step, int(state.data_position)) if state else (0, 0)
    if state and args.forget == "rng":
        torch.manual_seed(1000 + rank)  # mutation: the dropout stream restarts
    if state and args.forget == "data":
        pos = 0  # mutation: the data stream restarts

    while step < args.steps:
        k = (
            K - 1
            if (args.mode == "fewer-micro-batches" and rank == 1 and step == args.fault_step)
            else K
        )
        mbs = []
        for _ in range(k):
            idx = torch.arange(pos, pos + MB) % ROWS
            mbs.append((data_x[idx], data_y[idx]))
            pos += MB

        def loss_fn(
            m: nn.Module, mb: tuple[torch.Tensor, torch.Tensor], _step: int = step
        ) -> tuple[torch.Tensor, int]:
            x, y = mb
            loss = ((m(x) - y) ** 2).sum()
            if args.mode == "crash" and attempt == 0 and rank == 1 and _step == args.fault_step:
                os._exit(13)
            if args.mode == "nan" and rank == 1 and _step == args.fault_step:
                loss = loss * float("nan")
            return loss, x.shape[0]

        if args.mode in ("skip-collective", "skip-backward") and step == args.fault_step:
            feats = model.module[0](data_x[:2]).detach().requires_grad_()
            if not (args.mode == "skip-collective" and rank == 1):
                gathered = wholebatch.all_gather(feats)
                if not (args.mode == "skip-backward" and rank == 1):
                    gathered.sum().backward()
        stats = acc.step(mbs, loss_fn)
        step += 1
        if rank == 0:
            print(f"step {step} loss {stats.loss:.6f} skipped {stats.skipped}", flush=True)
        checkpoint.save(args.out, step, model=model, optimizer=opt, engine=acc, data_position=pos)

    if rank == 0:
        torch.save(
            {k: v.clone() for k, v in model.module.state_dict().items()}, args.out / "final.pt"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
