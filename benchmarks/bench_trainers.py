"""The fixed trainers' steps against the unfixed ones, side by side, on 2 gloo ranks.

    .venv/bin/python -m benchmarks.bench_trainers                     # all four
    .venv/bin/python -m benchmarks.bench_trainers --only lightning --rounds 5

Each case runs in 2 fresh spawned processes (one torch thread each) joined in a
gloo group; within them the unfixed and the fixed trainer alternate, order
reversed every other round (benchmarks._common.interleaved_times), round 0 a
warm-up. Reported: median wall seconds per optimizer step of each (rank 0's
clock), the median of the per-round wall ratios (fixed / unfixed), and the
median of the per-round ratios of CPU seconds (both ranks summed: the work done,
which a loaded machine's scheduling delays do not inflate).

- lightning: `Trainer.fit` of 24 batches of 16 x 64 tokens, accumulate_grad_batches=3
  (8 steps), a token model; plain Lightning with a token mean vs `WholeBatchAccumulation`.
- open_clip: open_clip_train 3.3.0's real `train_one_epoch` (tests.support.peers) with
  open_clip's `ClipLoss(gather_with_grad=True)` vs wholebatch's, accum_freq=2,
  8 steps of 2 x 128 rows per rank (two-layer towers, 256 wide).
- trl: `SFTTrainer` vs `WholeBatchSFTTrainer`, GPT-2 (2 layers, 64 wide), K = 4 x 4 ragged
  sequences, 4 steps; `train()` timed (the trainer and its dataset built outside the clock).
- deepspeed: a ZeRO-2 engine on the CPU accelerator; DeepSpeed's documented loop
  (a token mean, backward and step per micro-batch) vs `DeepSpeedAccumulator`, K = 3
  micro-batches of 16 x 64 tokens, 4 steps (both engines built outside the clock).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks._common import free_port

CASES = ("lightning", "open_clip", "trl", "deepspeed")
IGNORE = -100
Times = dict[str, dict[str, list[float]]]  # clock ("wall", "cpu") -> mode -> seconds per round


def _clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def interleaved(modes: tuple[str, ...], run: Callable[[str], Any], rounds: int) -> Times:
    """Wall and CPU seconds of `run(mode)` per round for every mode, order reversed every other round.

    benchmarks._common.interleaved_times with this process's CPU time beside the
    wall clock: on a loaded 2-core machine a rank waits for the scheduler, which
    the wall clock counts and CPU time does not.
    """
    times: Times = {"wall": {m: [] for m in modes}, "cpu": {m: [] for m in modes}}
    for r in range(rounds):
        for m in modes if r % 2 == 0 else modes[::-1]:
            w0, c0 = _clocks()
            run(m)
            w1, c1 = _clocks()
            times["wall"][m].append(w1 - w0)
            times["cpu"][m].append(c1 - c0)
    return times


def _tokens(seed: int, rows: int, length: int, vocab: int) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (rows, length), generator=gen)
    y = torch.randint(0, vocab, (rows, length), generator=gen)
    y[torch.rand(rows, length, generator=gen) < 0.3] = IGNORE
    return {"x": x, "y": y}


class TokenMLP(nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 128) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: Tensor) -> Tensor:
        h = self.emb(x)
        return self.head(h + self.mlp(h))


def _ce_sum(logits: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")


# -- the cases (run on every rank; return {mode: seconds per step} lists) ------------------


def case_lightning(rounds: int) -> tuple[Times, int]:
    from tests.e2e.test_integrations_lightning import _lightning
    from wholebatch.integrations.lightning import WholeBatchAccumulation

    pl, _, _, trainer = _lightning()
    rank, k, batches = torch.distributed.get_rank(), 3, 24
    data = [_tokens(1000 * rank + j, 16, 64, 512) for j in range(batches)]

    class LM(pl.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self, fixed: bool) -> None:
            super().__init__()
            self.net, self.fixed = TokenMLP(), fixed

        def training_step(self, b: dict[str, Tensor], i: int) -> Any:
            s = _ce_sum(self.net(b["x"]), b["y"])
            n = (b["y"] != IGNORE).sum()
            return {"loss": s, "items": n} if self.fixed else s / n

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    from torch.utils.data import DataLoader

    def run(mode: str) -> None:
        cbs = [WholeBatchAccumulation(log_name=None)] if mode == "ours" else []
        trainer(cbs, k).fit(LM(mode == "ours"), DataLoader(data, batch_size=None))

    return interleaved(("peer", "ours"), run, rounds + 1), batches // k


def case_open_clip(rounds: int) -> tuple[Times, int]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.support.peers import load_open_clip_loss, load_open_clip_train
    from wholebatch.integrations import open_clip as ours

    peer_loop, peer_loss = load_open_clip_train(), load_open_clip_loss()
    if peer_loop is None or peer_loss is None:
        raise SystemExit("open-clip-torch is not installed (make .venv/.peers)")
    rank, w = torch.distributed.get_rank(), torch.distributed.get_world_size()
    d_in, d, rows, accum, steps = 256, 256, 128, 2, 8

    class Towers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.img = nn.Sequential(nn.Linear(d_in, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
            self.txt = nn.Sequential(nn.Linear(d_in, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
            self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0)))

        def forward(self, images: Tensor, texts: Tensor) -> dict[str, Tensor]:
            return {
                "image_features": F.normalize(self.img(images), dim=-1),
                "text_features": F.normalize(self.txt(texts), dim=-1),
                "logit_scale": self.logit_scale.exp(),
            }

    class Loader(list):  # type: ignore[type-arg]
        num_batches = accum * steps
        num_samples = accum * steps * rows

    gen = torch.Generator().manual_seed(rank)
    loader = Loader(
        (torch.randn(rows, d_in, generator=gen), torch.randn(rows, d_in, generator=gen))
        for _ in range(accum * steps)
    )
    data = {"train": types.SimpleNamespace(dataloader=loader, set_epoch=lambda e: None)}
    args = types.SimpleNamespace(
        device="cpu", precision="fp32", accum_freq=accum, distill=False, horovod=False,
        skip_scheduler=True, grad_clip_norm=None, log_every_n_steps=10**9, world_size=w,
        batch_size=rows, rank=rank, local_rank=rank, wandb=False,
    )  # fmt: skip

    def run(mode: str) -> None:
        model = DDP(Towers())
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        loss = peer_loss.ClipLoss(gather_with_grad=True, rank=rank, world_size=w)
        loop = peer_loop.train_one_epoch if mode == "peer" else ours.train_one_epoch
        loop(model, data, loss, 0, opt, None, None, None, args)

    return interleaved(("peer", "ours"), run, rounds + 1), steps


def case_trl(rounds: int) -> tuple[Times, int]:
    import transformers
    import trl
    from datasets import Dataset

    from tests.e2e.test_integrations_trl import tokenizer
    from tests.support.peers import accelerate_on_harness_group
    from wholebatch.integrations.trl import WholeBatchSFTTrainer

    transformers.logging.set_verbosity_error()
    k, b, steps, vocab = 4, 4, 4, 40
    gen = torch.Generator().manual_seed(0)
    rows = [
        {"input_ids": torch.randint(4, vocab, (int(torch.randint(8, 64, (1,), generator=gen)),),
                                    generator=gen).tolist()}
        for _ in range(2 * k * b * steps)
    ]  # fmt: skip
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=64, n_layer=2, n_head=4)

    times: Times = {"wall": {"peer": [], "ours": []}, "cpu": {"peer": [], "ours": []}}
    for r in range(rounds + 1):  # the trainer is built outside the clock: only train() is timed
        for mode in ("peer", "ours") if r % 2 == 0 else ("ours", "peer"):
            cls = trl.SFTTrainer if mode == "peer" else WholeBatchSFTTrainer
            with accelerate_on_harness_group(), tempfile.TemporaryDirectory() as out:
                args = trl.SFTConfig(
                    output_dir=out, per_device_train_batch_size=b, gradient_accumulation_steps=k,
                    max_steps=steps, use_cpu=True, bf16=False, report_to=[], save_strategy="no",
                    logging_strategy="no", disable_tqdm=True, seed=0, dataset_num_proc=None,
                )  # fmt: skip
                torch.manual_seed(0)
                trainer = cls(
                    model=transformers.GPT2LMHeadModel(cfg), args=args,
                    train_dataset=Dataset.from_list(rows), processing_class=tokenizer(),
                )  # fmt: skip
                w0, c0 = _clocks()
                trainer.train()
                w1, c1 = _clocks()
                times["wall"][mode].append(w1 - w0)
                times["cpu"][mode].append(c1 - c0)
    return times, steps


def case_deepspeed(rounds: int) -> tuple[Times, int]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    from wholebatch.integrations.deepspeed import DeepSpeedAccumulator

    rank, k, steps = torch.distributed.get_rank(), 3, 4
    data = [
        [_tokens(1000 * rank + 10 * s + j, 16, 64, 512) for j in range(k)] for s in range(steps)
    ]

    def engine() -> Any:
        net = TokenMLP()
        cfg = {
            "train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": k,
            "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        }  # fmt: skip
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        return deepspeed.initialize(model=net, optimizer=opt, config=cfg, dist_init_required=False)[
            0
        ]

    engines = {"peer": engine(), "ours": engine()}  # built once: initialisation is not the step
    acc = DeepSpeedAccumulator(engines["ours"])

    def run(mode: str) -> None:
        eng = engines[mode]
        for window in data:
            if mode == "ours":
                acc.step(
                    window,
                    lambda e, b: _ce_sum(e(b["x"]), b["y"]),
                    lambda b: (b["y"] != IGNORE).sum(),
                )
                continue
            for b in window:
                eng.backward(_ce_sum(eng(b["x"]), b["y"]) / (b["y"] != IGNORE).sum())
                eng.step()

    return interleaved(("peer", "ours"), run, rounds + 1), steps


CASE_FNS: dict[str, Callable[[int], tuple[Times, int]]] = {
    "lightning": case_lightning, "open_clip": case_open_clip, "trl": case_trl,
    "deepspeed": case_deepspeed,
}  # fmt: skip


# -- the driver ------------------------------------------------------------------------------


def _rank_main(rank: int, world: int, port: int, case: str, rounds: int, out_path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
         "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port + 1)}
    )  # fmt: skip
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        times, steps = CASE_FNS[case](rounds)
        with open(f"{out_path}.{rank}", "w") as f:
            json.dump({"times": times, "steps": steps}, f)
    finally:
        dist.barrier()  # no rank tears down while a peer's last collective is in flight
        dist.destroy_process_group()


def _median_ratio(ours: list[float], peer: list[float]) -> float:
    return statistics.median(o / p for o, p in zip(ours, peer, strict=True))


def run_case(case: str, rounds: int) -> dict[str, Any]:
    """Both ranks' clocks; round 0 (a warm-up) dropped. CPU: the two ranks' CPU seconds summed."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.spawn(_rank_main, args=(2, free_port(), case, rounds, out), nprocs=2, join=True)
        per_rank = []
        for r in range(2):
            with open(f"{out}.{r}") as f:
                per_rank.append(json.load(f))
    steps = per_rank[0]["steps"]
    wall = {m: per_rank[0]["times"]["wall"][m][1:] for m in ("peer", "ours")}
    cpu = {
        m: [a + b for a, b in zip(*(pr["times"]["cpu"][m][1:] for pr in per_rank), strict=True)]
        for m in ("peer", "ours")
    }
    return {
        "case": case,
        "peer_s_per_step": statistics.median(wall["peer"]) / steps,
        "ours_s_per_step": statistics.median(wall["ours"]) / steps,
        "ratio": _median_ratio(wall["ours"], wall["peer"]),
        "cpu_ratio": _median_ratio(cpu["ours"], cpu["peer"]),
        "rounds": len(wall["peer"]),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", action="append", choices=CASES)
    p.add_argument(
        "--rounds", type=int, default=5, help="timed rounds after one warm-up (default 5)"
    )
    a = p.parse_args(argv)
    with open("/proc/loadavg") as f:
        print(f"# load average before: {' '.join(f.read().split()[:3])}", file=sys.stderr)
    print(f"{'trainer':<10} {'unfixed s/step':>15} {'fixed s/step':>13} {'wall':>7} {'cpu':>7}")
    for case in a.only or CASES:
        t0 = time.perf_counter()
        r = run_case(case, a.rounds)
        print(
            f"{case:<10} {r['peer_s_per_step']:>15.4f} {r['ours_s_per_step']:>13.4f} "
            f"{r['ratio']:>6.3f}x {r['cpu_ratio']:>6.3f}x   ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
