"""`wholebatch verify` targets: a CLIP step over W ranks x K micro-batches, right and wrong.

    wholebatch verify examples/verify_clip.py:correct                # PASS
    wholebatch verify examples/verify_clip.py:gather_no_grad         # FAIL: gather-no-grad
    wholebatch verify examples/verify_clip.py:per_micro_batch_loss   # FAIL: replicated-K
    wholebatch verify examples/verify_clip.py:no_rng_replay          # FAIL: no-rng-replay

Each function returns a `VerifySpec`: a two-tower model whose `logit_scale`
lives in the module (open_clip's layout), a whole batch of 24 (image, text)
pairs, the split step, and the plain whole-batch CLIP loss as the reference.
The mistakes are the ones found in widely used contrastive trainers; each step
is written the way such code is, not by subclassing wholebatch.

float64 throughout, so a right step agrees to ~1e-15 and a wrong one is off by
O(1). The batch's 24 rows split evenly for W in {1, 2, 3, 4} (the hand-written
gathers use torch.distributed.all_gather, which needs equal sizes).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from wholebatch.losses.contrastive import clip_loss
from wholebatch.train.cache import CachedStep
from wholebatch.verify import VerifySpec

ROWS, D_IN, D_OUT = 24, 5, 4
Batch = tuple[Tensor, Tensor]


class TwoTower(nn.Module):
    """Image and text towers (with dropout) and a learnable logit scale, used only by the loss."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.img = nn.Sequential(
            nn.Linear(D_IN, 8), nn.Tanh(), nn.Dropout(dropout), nn.Linear(8, D_OUT)
        )
        self.txt = nn.Sequential(
            nn.Linear(D_IN, 8), nn.Tanh(), nn.Dropout(dropout), nn.Linear(8, D_OUT)
        )
        self.logit_scale = nn.Parameter(torch.tensor(math.log(5.0)))
        self.double()

    def forward(self, x_img: Tensor, x_txt: Tensor) -> tuple[Tensor, Tensor]:
        return F.normalize(self.img(x_img), dim=1), F.normalize(self.txt(x_txt), dim=1)


def _batch() -> Batch:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(ROWS, D_IN, generator=g, dtype=torch.float64), torch.randn(
        ROWS, D_IN, generator=g, dtype=torch.float64
    )


def _inner(model: nn.Module) -> TwoTower:
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    assert isinstance(inner, TwoTower)
    return inner


def _embed(model: nn.Module, mb: Batch) -> tuple[Tensor, Tensor]:
    img, txt = model(*mb)
    return img, txt


def reference_loss(model: nn.Module, batch: Batch) -> Tensor:
    """Plain CLIP on the whole batch in one process: N x N logits, both directions."""
    img, txt = model(*batch)
    logits = model.logit_scale.exp() * img @ txt.T
    labels = torch.arange(len(img))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def _spec(step, dropout: float = 0.3) -> VerifySpec:  # type: ignore[no-untyped-def]
    return VerifySpec(
        build_model=lambda: TwoTower(dropout),
        batch=_batch(),
        step=step,
        reference_loss=reference_loss,
    )


# -- right ---------------------------------------------------------------------


def correct() -> VerifySpec:
    """CachedStep + clip_loss: exact for any W, K, uneven splits, with dropout (RNG replay)."""

    def step(
        model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list[Batch]
    ) -> None:
        scale = _inner(model).logit_scale
        loss_fn = lambda img, txt: clip_loss(img, txt, scale.exp())  # noqa: E731
        CachedStep(model, optimizer, _embed, loss_fn).step(micro_batches)

    return _spec(step)


# -- wrong ---------------------------------------------------------------------


def gather_no_grad() -> VerifySpec:
    """MISTAKE: open_clip's gather_with_grad=False: gathered features are constants but our own slice.

    (The K micro-batches are simply concatenated: no accumulation involved.)
    Every rank's loss is the whole-batch L, but gradient reaches only its own
    rows: after DDP's mean the encoders get exactly 1/W of dL/dθ.
    """

    def step(
        model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list[Batch]
    ) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        img, txt = model(
            torch.cat([m[0] for m in micro_batches]), torch.cat([m[1] for m in micro_batches])
        )
        gathered = []
        for feats in (img, txt):
            parts = [torch.zeros_like(feats) for _ in range(world)]
            dist.all_gather(parts, feats)  # no gradient
            parts[rank] = feats  # "so that gradients flow": only into this rank's rows
            gathered.append(torch.cat(parts))
        all_img, all_txt = gathered
        logits = _inner(model).logit_scale.exp() * all_img @ all_txt.T
        labels = torch.arange(len(all_img))
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return _spec(step)


def per_micro_batch_loss() -> VerifySpec:
    """MISTAKE: open_clip's accum_freq: the loss re-evaluated per micro-batch with that micro-batch live.

    Every embedding gets its right gradient, but logit_scale gets one full
    dL/ds from each of the K evaluations: K times too large. (No dropout here,
    to show this mistake alone; accum_freq also lacks RNG replay.)
    """

    def step(
        model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list[Batch]
    ) -> None:
        scale = _inner(model).logit_scale
        with torch.no_grad():
            cached = [model(*mb) for mb in micro_batches]
        k = len(micro_batches)
        for i, mb in enumerate(micro_batches):
            sync = model.no_sync() if i < k - 1 else contextlib.nullcontext()
            with sync:
                img_i, txt_i = model(*mb)
                img = torch.cat(
                    [c[0] for c in cached[:i]] + [img_i] + [c[0] for c in cached[i + 1 :]]
                )
                txt = torch.cat(
                    [c[1] for c in cached[:i]] + [txt_i] + [c[1] for c in cached[i + 1 :]]
                )
                clip_loss(img, txt, scale.exp()).backward()
        optimizer.step()
        optimizer.zero_grad()

    return _spec(step, dropout=0.0)


def no_rng_replay() -> VerifySpec:
    """MISTAKE: a hand-written gradient cache whose second pass draws new dropout masks.

    Pass 1 embeds without graph, the loss's gradient is taken once on the cached
    embeddings (so logit_scale is right), pass 2 re-embeds each micro-batch and
    back-propagates its slice: through a network with different dropout masks.
    With dropout off it is exact.
    """

    def step(
        model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list[Batch]
    ) -> None:
        scale = _inner(model).logit_scale
        with torch.no_grad():
            cached = [model(*mb) for mb in micro_batches]
        img = torch.cat([c[0] for c in cached]).requires_grad_()
        txt = torch.cat([c[1] for c in cached]).requires_grad_()
        g_img, g_txt, g_scale = torch.autograd.grad(
            clip_loss(img, txt, scale.exp()), [img, txt, scale]
        )
        k, start = len(micro_batches), 0
        for i, mb in enumerate(micro_batches):
            rows = len(mb[0])
            sync = model.no_sync() if i < k - 1 else contextlib.nullcontext()
            with sync:
                e_img, e_txt = model(*mb)  # the bug: no RNG state restored before this forward
                tensors, grads = (
                    [e_img, e_txt],
                    [g_img[start : start + rows], g_txt[start : start + rows]],
                )
                if i == k - 1:
                    tensors.append(scale)
                    grads.append(g_scale)
                torch.autograd.backward(tensors, grads)
            start += rows
        optimizer.step()
        optimizer.zero_grad()

    return _spec(step)
