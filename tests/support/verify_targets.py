"""Verify targets that need a peer library: open_clip's real ClipLoss, and Accelerate's process state.

- `open_clip_local_loss` / `open_clip_local_loss_with_grad`: a two-tower model
  (LayerNorm + MLP towers, dict batch {"image", "text"}) trained with open_clip's
  own `ClipLoss(local_loss=True, ...)` (loaded from the installed open_clip's
  loss.py; the package itself needs torchvision), without and with
  `gather_with_grad`. Without it the cross-rank logits lose their gradient: not
  a fixed multiple of the right gradient, exact at W = 1.
- `accelerate_cpu` / `accelerate_default`: the same correct loop through an
  `Accelerator`, with and without `cpu=True`. On CPU without it, Accelerate
  silently skips its DDP wrap (a process state it keeps in a singleton), so the
  ranks hold different gradients; run after `accelerate_cpu` in the same
  processes, the singleton would hand it the DDP state and it would pass.

Per-sample mean-squared regression for the Accelerate loop (items = rows).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator
from torch import Tensor, nn

from wholebatch.verify.spec import VerifySpec

ROWS, D_IN, D_OUT = 18, 6, 4


def _open_clip_loss_module() -> Any:
    spec = importlib.util.find_spec("open_clip")
    assert spec is not None and spec.origin is not None, "open_clip is not installed"
    path = Path(spec.origin).parent / "loss.py"
    loaded = importlib.util.spec_from_file_location("_open_clip_loss", path)
    assert loaded is not None and loaded.loader is not None
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module


open_clip_loss = _open_clip_loss_module()


class Towers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Sequential(
            nn.LayerNorm(D_IN), nn.Linear(D_IN, 8), nn.SiLU(), nn.Linear(8, D_OUT)
        )
        self.text = nn.Sequential(
            nn.LayerNorm(D_IN), nn.Linear(D_IN, 8), nn.SiLU(), nn.Linear(8, D_OUT)
        )
        self.logit_scale = nn.Parameter(torch.tensor(math.log(8.0)))
        self.double()

    def forward(self, image: Tensor, text: Tensor) -> tuple[Tensor, Tensor]:
        return F.normalize(self.image(image), dim=-1), F.normalize(self.text(text), dim=-1)


def _pairs() -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(21)
    return {
        "image": torch.randn(ROWS, D_IN, generator=g, dtype=torch.float64),
        "text": torch.randn(ROWS, D_IN, generator=g, dtype=torch.float64),
    }


def _clip_reference(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    img, txt = model(batch["image"], batch["text"])
    logits = model.logit_scale.exp() * img @ txt.T
    labels = torch.arange(len(img))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def _open_clip_spec(gather_with_grad: bool) -> VerifySpec:
    def step(
        model: nn.Module, optimizer: torch.optim.Optimizer, mbs: list[dict[str, Tensor]]
    ) -> None:
        inner = model.module if hasattr(model, "module") else model
        loss_fn = open_clip_loss.ClipLoss(
            local_loss=True, gather_with_grad=gather_with_grad,
            rank=dist.get_rank(), world_size=dist.get_world_size(),
        )  # fmt: skip
        img, txt = model(torch.cat([m["image"] for m in mbs]), torch.cat([m["text"] for m in mbs]))
        loss_fn(img, txt, inner.logit_scale.exp()).backward()
        optimizer.step()
        optimizer.zero_grad()

    return VerifySpec(build_model=Towers, batch=_pairs(), step=step, reference_loss=_clip_reference)


def open_clip_local_loss() -> VerifySpec:
    """MISTAKE: open_clip ClipLoss(local_loss=True, gather_with_grad=False)."""
    return _open_clip_spec(gather_with_grad=False)


def open_clip_local_loss_with_grad() -> VerifySpec:
    """open_clip ClipLoss(local_loss=True, gather_with_grad=True): right (its gather has a backward)."""
    return _open_clip_spec(gather_with_grad=True)


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D_IN, 8), nn.Tanh(), nn.Linear(8, 1))
        self.double()

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x).squeeze(-1)


def _regression() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(ROWS, D_IN, generator=g, dtype=torch.float64)
    return x, torch.randn(ROWS, generator=g, dtype=torch.float64)


def _mse(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


def _accelerate_spec(cpu: bool) -> VerifySpec:
    def step(
        model: nn.Module, optimizer: torch.optim.Optimizer, mbs: list[tuple[Tensor, Tensor]]
    ) -> None:
        kwargs = {"cpu": True} if cpu else {}
        accelerator = Accelerator(gradient_accumulation_steps=len(mbs), **kwargs)
        model, optimizer = accelerator.prepare(model, optimizer)
        rows = torch.tensor(float(sum(len(mb[0]) for mb in mbs)), dtype=torch.float64)
        dist.all_reduce(rows)  # the global number of samples
        scale = accelerator.num_processes * len(mbs)  # undo DDP's mean and backward's 1/K
        for mb in mbs:
            with accelerator.accumulate(model):
                total = F.mse_loss(model(mb[0]), mb[1], reduction="sum")
                accelerator.backward(total / rows * scale)
                optimizer.step()
                optimizer.zero_grad()

    return VerifySpec(
        build_model=Regressor, batch=_regression(), step=step, reference_loss=_mse, wrap="none"
    )


def accelerate_cpu() -> VerifySpec:
    """An Accelerate loop with Accelerator(cpu=True): DDP on CPU, right normalisation."""
    return _accelerate_spec(cpu=True)


def accelerate_default() -> VerifySpec:
    """MISTAKE on CPU: Accelerator() without cpu=True skips DDP without a word."""
    return _accelerate_spec(cpu=False)
