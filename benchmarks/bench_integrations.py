"""The integrations against the peers they replace: exactness, peak memory and time, side by side.

    .venv/bin/python -m benchmarks.bench_integrations            # N = 8,192: the RESULTS.md table
    .venv/bin/python -m benchmarks.bench_integrations --quick    # N = 2,048, ~1 minute
    .venv/bin/python -m benchmarks.bench_integrations --only clip --only trainer

Contrastive losses (one process, CPU float32, D = 256, forward + backward with
respect to both embeddings and the scalars), each peer loaded from its real
installed file (tests/support/peers.py):

    clip    open_clip 3.3.0 ClipLoss        vs wholebatch.integrations.open_clip.ClipLoss
    siglip  open_clip 3.3.0 SigLipLoss      vs wholebatch.integrations.open_clip.SigLipLoss
    ntxent  lightly 1.6.0 NTXentLoss        vs wholebatch.integrations.lightly.NTXentLoss
    bank    the same with a (4,096 x D) memory bank (MoCo)

Peak memory: each (case, implementation) in a FRESH subprocess, the growth of
the kernel's peak-RSS counter (VmHWM, reset through /proc/self/clear_refs) over
the RSS before the call, after a 256-row warm-up, glibc's mmap threshold fixed
so RSS follows live memory (as benchmarks/bench_losses.py). Time: peer and
wholebatch INTERLEAVED in one process (order alternating), median of the
per-round ratios. Exactness: the largest difference of the loss and of every
gradient, relative to the peer's largest entry, same inputs (float32 here;
the tests check float64 to 1e-10).

    trainer  transformers 5.23 Trainer vs WholeBatchTrainer: one process, a
             small GPT-2 from a config (2 layers of 64, float32), K = 4
             micro-batches of 4 ragged sequences (8-64 tokens); the time of a
             train() of 2 optimizer steps, interleaved, median per-round ratio.

Legend: N rows, D embedding dim, K micro-batches.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks._common import peak_growth, run_child

__all__ = ["main"]

MiB = 2**20
D = 256
BANK_ROWS = 4096
LOSS_CASES = ("clip", "siglip", "ntxent", "bank")


# ---------------------------------------------------------------------------
# Peak memory: the kernel's peak-RSS counter
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# The loss cases: (peer, ours) modules and how to call them
# ---------------------------------------------------------------------------


def _modules(case: str) -> tuple[nn.Module, nn.Module]:
    from tests.support.peers import load_lightly_ntxent, load_open_clip_loss
    from wholebatch.integrations import lightly, open_clip

    if case in ("clip", "siglip"):
        peer_mod = load_open_clip_loss()
        if peer_mod is None:
            raise SystemExit("open_clip is not installed (make .venv/.peers)")
        name = "ClipLoss" if case == "clip" else "SigLipLoss"
        return getattr(peer_mod, name)(), getattr(open_clip, name)()
    lightly_mod = load_lightly_ntxent()
    if lightly_mod is None:
        raise SystemExit("lightly is not installed (make .venv/.peers)")
    kwargs: dict[str, Any] = {"temperature": 0.1}
    if case == "bank":
        kwargs["memory_bank_size"] = (BANK_ROWS, D)
    torch.manual_seed(0)  # the same random bank for both
    peer = lightly_mod.NTXentLoss(**kwargs)
    torch.manual_seed(0)
    return peer, lightly.NTXentLoss(**kwargs)


def _inputs(case: str, n: int) -> list[Tensor]:
    gen = torch.Generator().manual_seed(0)
    a = F.normalize(torch.randn(n, D, generator=gen), dim=1).requires_grad_()
    b = F.normalize(torch.randn(n, D, generator=gen), dim=1).requires_grad_()
    if case == "clip":
        return [a, b, torch.tensor(10.0, requires_grad=True)]
    if case == "siglip":
        return [
            a,
            b,
            torch.tensor(10.0, requires_grad=True),
            torch.tensor(-10.0, requires_grad=True),
        ]
    return [a, b]


def _run(loss_fn: nn.Module, inputs: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
    """Forward + backward; (loss, gradients), the inputs' grads cleared again."""
    loss = loss_fn(*inputs)
    loss.backward()
    grads = [x.grad for x in inputs]  # type: ignore[misc]
    for x in inputs:
        x.grad = None
    return loss.detach(), grads  # type: ignore[return-value]


def _warm(loss_fn: nn.Module, case: str) -> None:
    # BLAS workspaces and thread pools exist before measuring. The bank cases warm
    # up without grad, which leaves the bank untouched (both implementations).
    with torch.no_grad():
        loss_fn(*[x.detach() for x in _inputs(case, 256)])


def _child_memory(case: str, impl: str, n: int) -> dict[str, Any]:
    peer, ours = _modules(case)
    loss_fn = peer if impl == "peer" else ours
    _warm(loss_fn, case)
    inputs = _inputs(case, n)
    return {"peak": peak_growth(lambda: _run(loss_fn, inputs))}


def _child_times(case: str, n: int, rounds: int) -> dict[str, Any]:
    peer, ours = _modules(case)
    for m in (peer, ours):
        _warm(m, case)
    inputs = _inputs(case, n)
    # Exactness first, on fresh modules' state (the bank is read before any update).
    (lp, gp), (lo, go) = _run(peer, inputs), _run(ours, inputs)
    scale = max(float(g.abs().max()) for g in gp)
    grad_err = max(float((a - b).abs().max()) for a, b in zip(gp, go, strict=True)) / scale
    # lightly returns the mean over this process's rows, as wholebatch: one process, same value.
    value_err = abs(float(lp) - float(lo)) / abs(float(lp))
    times: dict[str, list[float]] = {"peer": [], "ours": []}
    for r in range(rounds):
        for impl in ("peer", "ours") if r % 2 == 0 else ("ours", "peer"):
            t0 = time.perf_counter()
            _run(peer if impl == "peer" else ours, inputs)
            times[impl].append(time.perf_counter() - t0)
    ratios = [o / p for o, p in zip(times["ours"], times["peer"], strict=True)]
    return {
        "peer_s": statistics.median(times["peer"]),
        "ours_s": statistics.median(times["ours"]),
        "ratio": statistics.median(ratios),
        "value_err": value_err,
        "grad_err": grad_err,
    }


# ---------------------------------------------------------------------------
# The Trainer case
# ---------------------------------------------------------------------------


def _child_trainer(rounds: int) -> dict[str, Any]:
    import transformers

    from wholebatch.integrations.huggingface import WholeBatchTrainer

    transformers.logging.set_verbosity_error()
    gen = torch.Generator().manual_seed(0)
    k, b, steps, vocab = 4, 4, 2, 256
    rows = []
    for _ in range(k * b * steps):
        n = int(torch.randint(8, 64, (1,), generator=gen))
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        rows.append({"input_ids": ids, "labels": ids})

    def collate(batch: list[dict[str, list[int]]]) -> dict[str, Tensor]:
        width = max(len(r["input_ids"]) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, r in enumerate(batch):
            m = len(r["input_ids"])
            ids[i, :m], labels[i, :m], mask[i, :m] = torch.tensor(r["input_ids"]), ids[i, :m], 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=64, n_layer=2, n_head=4)
    times: dict[str, list[float]] = {"peer": [], "ours": []}
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=b, gradient_accumulation_steps=k,
            max_steps=steps, use_cpu=True, report_to=[], save_strategy="no",
            logging_strategy="no", disable_tqdm=True, seed=0,
        )  # fmt: skip
        for r in range(rounds + 1):  # round 0 warms up
            for impl in ("peer", "ours") if r % 2 == 0 else ("ours", "peer"):
                torch.manual_seed(0)
                model = transformers.GPT2LMHeadModel(cfg)
                cls = transformers.Trainer if impl == "peer" else WholeBatchTrainer
                trainer = cls(model=model, args=args, train_dataset=rows, data_collator=collate)
                t0 = time.perf_counter()
                trainer.train()
                if r:
                    times[impl].append(time.perf_counter() - t0)
    ratios = [o / p for o, p in zip(times["ours"], times["peer"], strict=True)]
    return {
        "peer_s": statistics.median(times["peer"]) / steps,
        "ours_s": statistics.median(times["ours"]) / steps,
        "ratio": statistics.median(ratios),
    }


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------


def _spawn(args: list[str], threads: int) -> dict[str, Any]:
    result: dict[str, Any] = run_child(
        "bench_integrations", ["--child", *args, "--threads", str(threads)],
        env={"OMP_NUM_THREADS": str(threads)},
    )  # fmt: skip
    return result


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="N = 2,048 and fewer rounds")
    p.add_argument("--n", type=int, default=None, help="rows (default 8,192; 2,048 with --quick)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5; 3 quick)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--only", action="append", choices=[*LOSS_CASES, "trainer"])
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.child:
        kind, *rest = a.child
        if kind == "memory":
            res = _child_memory(rest[0], rest[1], int(rest[2]))
        elif kind == "times":
            res = _child_times(rest[0], int(rest[1]), int(rest[2]))
        else:
            res = _child_trainer(int(rest[0]))
        print(json.dumps(res))
        return
    n = a.n or (2048 if a.quick else 8192)
    rounds = a.rounds or (3 if a.quick else 5)
    cases = a.only or [*LOSS_CASES, "trainer"]
    print(f"torch {torch.__version__}, {a.threads} threads, load average before: {_loadavg()}")
    losses = [c for c in cases if c in LOSS_CASES]
    if losses:
        print(f"\n### contrastive losses: N = {n:,}, D = {D}, one process, float32\n")
        print(
            "| case | peer peak MiB | wholebatch peak MiB | memory | peer s | wholebatch s "
            "| time (wholebatch/peer) | value diff | max grad diff |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for case in losses:
            peer = _spawn(["memory", case, "peer", str(n)], a.threads)["peak"]
            ours = _spawn(["memory", case, "ours", str(n)], a.threads)["peak"]
            t = _spawn(["times", case, str(n), str(rounds)], a.threads)
            print(
                f"| {case} | {peer / MiB:.0f} | {ours / MiB:.0f} | {peer / max(ours, 1):.1f}x less "
                f"| {t['peer_s']:.2f} | {t['ours_s']:.2f} | {t['ratio']:.2f} "
                f"| {t['value_err']:.1e} | {t['grad_err']:.1e} |",
                flush=True,
            )
    if "trainer" in cases:
        t = _spawn(["trainer", str(rounds)], a.threads)
        print("\n### Trainer step: GPT-2 (2 x 64), K = 4 x 4 ragged sequences, one process\n")
        print("| trainer | s per optimizer step | time (wholebatch/peer) |")
        print("|---|---|---|")
        print(f"| transformers.Trainer | {t['peer_s']:.3f} | 1.00 |")
        print(f"| WholeBatchTrainer | {t['ours_s']:.3f} | {t['ratio']:.2f} |")
    print(f"\nload average after: {_loadavg()}")


if __name__ == "__main__":
    main()
