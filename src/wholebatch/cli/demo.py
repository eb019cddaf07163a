"""`wholebatch demo`: CLIP-style training on scikit-learn's digits, on N local processes.

    wholebatch demo                                  # or: make demo (4 processes, ~2 minutes on 2 cores)
    wholebatch demo --nproc 2 --epochs 2 --batch-size 128 --out /tmp/wb-demo

The 1,797 8x8 digits are cut in half: one tower sees an image's left half, the
other its right half, and `clip_loss` (with a learnable `logit_scale`) teaches
them which right half belongs to which left half. A whole batch of 1,024 is
split 4 ranks x 2 micro-batches x 128 and trained with `CachedStep`, which gives
every parameter the gradient of the loss on all 1,024 pairs at once.

Before training, rank 0 checks the first step's split gradient (every
parameter, `logit_scale` included) against one process computing the plain
N x N CLIP loss on the whole batch in float64 (the split step runs in float32, so
the error shown is float32 round-off), and measures activation memory
(tensors autograd saves for backward) of that one pass against the cached
step on one rank. Retrieval on 397 held-out digits (find the right half of
each left half among all 397; chance 0.25% top-1, 1.26% top-5) is measured
before training and after every epoch. The output folder gets `summary.json`
and `training.png` (loss and retrieval per epoch).

Legend: W ranks, K micro-batches per rank, B rows per micro-batch, N whole batch, D dim.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from wholebatch.errors import WholebatchError

__all__ = ["DemoConfig", "DemoModel", "run_demo"]

TEST_ROWS = 397  # held out: 1,797 - 397 = 1,400 training pairs
HALF = 32  # pixels in half an 8x8 digit
MAX_LOGIT_SCALE = 100.0  # CLIP's clamp


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """How `wholebatch demo` trains. (The CLI's flags.)"""

    nproc: int = 4
    """W: local processes (gloo ranks)."""

    batch_size: int = 1024
    """N: the whole batch per optimizer step, over all ranks and micro-batches."""

    micro_batches: int = 2
    """K: micro-batches per rank (the whole batch's rows split into W·K parts)."""

    epochs: int = 150
    """Passes over the 1,400 training pairs."""

    lr: float = 3e-3
    """Adam's learning rate."""

    hidden: int = 128
    """Width of each tower's hidden layers."""

    seed: int = 0
    """Seed for the held-out split, the model and the shuffling."""

    out: Path = Path("wholebatch-demo")
    """Folder for summary.json and training.png (created)."""

    def __post_init__(self) -> None:
        for name, low in (("nproc", 1), ("micro_batches", 1), ("epochs", 1), ("hidden", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise WholebatchError(f"{name} must be an integer >= {low}, got {value!r}")
        w_k = self.nproc * self.micro_batches
        train = 1797 - TEST_ROWS
        if not (isinstance(self.batch_size, int) and w_k <= self.batch_size <= train):
            raise WholebatchError(
                f"batch_size must be between nproc x micro_batches = {w_k} (one row per "
                f"micro-batch) and the {train} training pairs, got {self.batch_size!r}"
            )
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise WholebatchError(f"lr must be a positive number, got {self.lr!r}")


class DemoModel(nn.Module):
    """Two MLP towers (left half, right half -> D) and CLIP's learnable log logit scale."""

    def __init__(self, hidden: int = 128, dim: int = 32) -> None:
        super().__init__()

        def tower() -> nn.Sequential:
            # fmt: skip below: the layers read left to right as the network runs
            return nn.Sequential(
                nn.Linear(HALF, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                nn.Linear(hidden, dim),
            )  # fmt: skip

        self.left = tower()
        self.right = tower()
        self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0)))

    def forward(self, left_BP: Tensor, right_BP: Tensor) -> tuple[Tensor, Tensor]:
        return F.normalize(self.left(left_BP), dim=1), F.normalize(self.right(right_BP), dim=1)


def _embed(model: nn.Module, mb: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    left_BD, right_BD = model(*mb)
    return left_BD, right_BD


def _data(seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(train left, train right, test left, test right), pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    images = torch.tensor(load_digits().images, dtype=torch.float32) / 16.0  # 1797 x 8 x 8
    perm = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))
    left = images[:, :, :4].reshape(len(images), HALF)
    right = images[:, :, 4:].reshape(len(images), HALF)
    test, train = perm[:TEST_ROWS], perm[TEST_ROWS:]
    return left[train], right[train], left[test], right[test]


@torch.no_grad()
def retrieval(model: DemoModel, left_ND: Tensor, right_ND: Tensor) -> tuple[float, float]:
    """Top-1 and top-5 accuracy of finding each left half's right half among all right halves."""
    was = model.training
    model.eval()
    a_ND, b_ND = model(left_ND, right_ND)
    model.train(was)
    sim_NN = a_ND @ b_ND.T
    rank_N = (sim_NN > sim_NN.diag()[:, None]).sum(1)  # how many wrong halves score higher
    return float((rank_N < 1).float().mean()), float((rank_N < 5).float().mean())


def naive_clip(model: DemoModel, left_ND: Tensor, right_ND: Tensor) -> Tensor:
    """The plain whole-batch CLIP loss in one process: the full N x N logits, both directions."""
    a_ND, b_ND = model(left_ND, right_ND)
    logits_NN = model.logit_scale.exp().clamp(max=MAX_LOGIT_SCALE) * a_ND @ b_ND.T
    labels = torch.arange(len(a_ND))
    return (F.cross_entropy(logits_NN, labels) + F.cross_entropy(logits_NN.T, labels)) / 2


def _micro_batches(
    left: Tensor, right: Tensor, idx: Tensor, w: int, k: int, rank: int
) -> list[tuple[Tensor, Tensor]]:
    parts = torch.tensor_split(idx, w * k)[rank * k : (rank + 1) * k]
    return [(left[p], right[p]) for p in parts]


def _gradient_check(
    ddp: nn.Module, inner: DemoModel, mbs: list[tuple[Tensor, Tensor]], whole: tuple[Tensor, Tensor]
) -> dict[str, Any]:
    """The first step's split gradient (float32) vs one process on the whole batch (float64); memory of each."""
    import torch.distributed as dist

    from wholebatch.losses.contrastive import clip_loss
    from wholebatch.train.cache import CachedStep
    from wholebatch.verify.recording import GradRecorder, SavedTensorMeter

    recorder = GradRecorder(inner.parameters())
    scale = inner.logit_scale

    def loss_fn(a_BD: Tensor, b_BD: Tensor) -> Tensor:
        return clip_loss(a_BD, b_BD, scale.exp().clamp(max=MAX_LOGIT_SCALE))

    reference = copy.deepcopy(inner)  # before any step: the same parameters on every rank
    cached_meter = SavedTensorMeter(inner.parameters())
    with cached_meter.track():
        CachedStep(ddp, recorder, _embed, loss_fn).step(mbs)
    result: dict[str, Any] = {"cached_step_saved_bytes": cached_meter.peak}
    if dist.get_rank() != 0:
        return result
    whole_meter = SavedTensorMeter(reference.parameters())
    with whole_meter.track():
        loss = naive_clip(reference, *whole)
    del loss
    result["whole_batch_saved_bytes"] = whole_meter.peak
    ref64 = copy.deepcopy(reference).double()
    torch.autograd.backward(naive_clip(ref64, whole[0].double(), whole[1].double()))
    per_param = {}
    for (name, p), (_, r) in zip(inner.named_parameters(), ref64.named_parameters(), strict=True):
        g = recorder.gradient(p)
        assert g is not None and r.grad is not None
        per_param[name] = float((g - r.grad).abs().max() / r.grad.abs().max().clamp_min(1e-30))
    result["max_rel_err"] = max(per_param.values())
    result["per_param_rel_err"] = per_param
    return result


def _rank_main(config: DemoConfig) -> dict[str, Any] | None:
    """One rank: check the gradient, then train; rank 0 returns the summary."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from tqdm import tqdm

    from wholebatch.losses.contrastive import clip_loss
    from wholebatch.train.cache import CachedStep

    rank, w, k = dist.get_rank(), dist.get_world_size(), config.micro_batches
    left, right, test_left, test_right = _data(config.seed)
    torch.manual_seed(config.seed)
    inner = DemoModel(config.hidden)
    ddp = DistributedDataParallel(inner)
    n_train, n = len(left), config.batch_size
    shuffle = torch.Generator().manual_seed(config.seed + 1)  # the same order on every rank

    def order() -> list[Tensor]:
        perm = torch.randperm(n_train, generator=shuffle)
        steps = [perm[i : i + n] for i in range(0, n_train, n)]
        return [
            s for s in steps if len(s) >= w * k
        ]  # a last whole batch too small to split: dropped

    first = order()[0]
    check = _gradient_check(
        ddp, inner, _micro_batches(left, right, first, w, k, rank), (left[first], right[first])
    )
    before = retrieval(inner, test_left, test_right)
    if rank == 0:
        b = len(torch.tensor_split(first, w * k)[0])
        print(
            f"wholebatch demo: {w} processes x {k} micro-batches x ~{b} rows = whole batch of {n}\n"
            f"gradient check, first step: the split step (float32) vs one process on the whole batch "
            f"(float64), so the error is float32 round-off:\n"
            f"  max relative error over {len(check['per_param_rel_err'])} parameters: "
            f"{check['max_rel_err']:.1e} (logit_scale: {check['per_param_rel_err']['logit_scale']:.1e})\n"
            f"activation memory saved for backward: one process, whole batch, N x N logits: "
            f"{check['whole_batch_saved_bytes'] / 2**20:.2f} MiB; CachedStep, one rank: "
            f"{check['cached_step_saved_bytes'] / 2**20:.2f} MiB\n"
            f"retrieval before training (397 held-out digits): top-1 {before[0]:.3f}, "
            f"top-5 {before[1]:.3f} (chance 0.003 / 0.013)",
            flush=True,
        )
    optimizer = torch.optim.Adam(inner.parameters(), lr=config.lr)
    scale = inner.logit_scale

    def loss_fn(a_BD: Tensor, b_BD: Tensor) -> Tensor:
        return clip_loss(a_BD, b_BD, scale.exp().clamp(max=MAX_LOGIT_SCALE))

    step = CachedStep(ddp, optimizer, _embed, loss_fn)
    history: list[dict[str, float]] = []
    start = time.perf_counter()
    seen = 0
    bar = tqdm(range(config.epochs), desc="training", disable=rank != 0, file=sys.stderr, ncols=100)
    for epoch in bar:
        losses = []
        for idx in order():
            stats = step.step(_micro_batches(left, right, idx, w, k, rank))
            losses.append(stats.loss)
            seen += len(idx)
        top1, top5 = retrieval(inner, test_left, test_right)
        rate = seen / (time.perf_counter() - start)
        history.append(
            {"epoch": epoch + 1, "loss": sum(losses) / len(losses), "top1": top1, "top5": top5}
        )
        bar.set_postfix(
            loss=f"{history[-1]['loss']:.3f}", top5=f"{top5:.2f}", samples_s=f"{rate:.0f}"
        )
    bar.close()
    if rank != 0:
        return None
    return {
        "config": {
            k_: str(v) if isinstance(v, Path) else v for k_, v in dataclasses.asdict(config).items()
        },
        "gradient_check": check,
        "retrieval_before": {"top1": before[0], "top5": before[1]},
        "retrieval_after": {"top1": history[-1]["top1"], "top5": history[-1]["top5"]},
        "chance": {"top1": 1 / TEST_ROWS, "top5": 5 / TEST_ROWS},
        "logit_scale": float(inner.logit_scale.detach().exp()),
        "history": history,
        "train_seconds": time.perf_counter() - start,
        "samples_per_second": seen / (time.perf_counter() - start),
    }


def _plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist = summary["history"]
    epochs = [h["epoch"] for h in hist]
    fig, (ax_loss, ax_ret) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax_loss.plot(epochs, [h["loss"] for h in hist], color="tab:blue")
    ax_loss.set(xlabel="epoch", ylabel="whole-batch CLIP loss", title="training loss")
    before = summary["retrieval_before"]
    ax_ret.plot([0, *epochs], [before["top1"], *(h["top1"] for h in hist)], label="top-1")
    ax_ret.plot([0, *epochs], [before["top5"], *(h["top5"] for h in hist)], label="top-5")
    ax_ret.axhline(summary["chance"]["top5"], color="gray", ls=":", label="top-5 chance")
    ax_ret.set(
        xlabel="epoch", ylabel="accuracy", ylim=(0, 1), title="held-out retrieval (397 digits)"
    )
    ax_ret.legend(loc="upper left")
    cfg = summary["config"]
    fig.suptitle(
        f"wholebatch demo: whole batch {cfg['batch_size']} = {cfg['nproc']} ranks x "
        f"{cfg['micro_batches']} micro-batches, CachedStep + clip_loss"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_demo(config: DemoConfig) -> int:
    """Train on `config.nproc` local processes; write summary.json and training.png; return 0."""
    from wholebatch.comm.launch import LaunchSpec, launch

    for module in ("sklearn", "tqdm", "matplotlib"):
        try:
            __import__(module)
        except ImportError:
            print(
                f"wholebatch demo: needs {module}; install the demo extra: pip install 'wholebatch[demo]'",
                file=sys.stderr,
            )
            return 2
    config.out.mkdir(parents=True, exist_ok=True)
    wall = time.perf_counter()
    results = launch(
        _rank_main, (config,), spec=LaunchSpec(nproc=config.nproc), name="wholebatch-demo"
    )
    summary = results[0]
    assert summary is not None
    summary["wall_seconds"] = time.perf_counter() - wall
    (config.out / "summary.json").write_text(json.dumps(summary, indent=2))
    _plot(summary, config.out / "training.png")
    after, before = summary["retrieval_after"], summary["retrieval_before"]
    print(
        f"retrieval after {config.epochs} epochs: top-1 {after['top1']:.3f}, top-5 {after['top5']:.3f} "
        f"(before: {before['top1']:.3f} / {before['top5']:.3f}); logit scale {summary['logit_scale']:.1f}\n"
        f"{summary['samples_per_second']:.0f} samples/s, {summary['wall_seconds']:.0f} s in all\n"
        f"wrote {config.out / 'summary.json'} and {config.out / 'training.png'}"
    )
    return 0
