"""Verify corpus, round 4: Lightning 2.6.6's `Trainer`, automatic and manual optimisation.

Each target is a real `Trainer.fit` of one optimizer step with the DDP strategy
on verify's ranks (it adopts their gloo group), over the float64 key-bias
attention model and the ragged token batch of tests/support/verify_corpus_own.py,
`configure_optimizers` returning `run.optimizer`.

- automatic: `training_step` returning each micro-batch's token mean (Lightning
  divides by K, DDP by W: a mean of means); returning the token sum over the
  whole batch's count times K·W (right); wholebatch's `WholeBatchAccumulation`
  fed {"loss": sum, "items": count} (right) and fed a mean as "loss".
- manual (`automatic_optimization = False`, `manual_backward`, one `opt.step()`
  after K batches): right, a step after every batch, a mean of means.

Legend: W ranks, K micro-batches (accumulate_grad_batches).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from tests.support.verify_corpus_own import KeyBiasAttention, token_batch, token_mean, token_sum
from wholebatch.verify import TrainerRun, TrainerSpec

Batch = dict[str, Tensor]


def _module(kind: str) -> nn.Module:
    import lightning as L

    class Attention(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = KeyBiasAttention().double()
            self.optimizer: torch.optim.Optimizer | None = None
            self.total_items = 0.0
            self.k = 1
            self.automatic_optimization = not kind.startswith("manual")

        def forward(self, tokens: Tensor, mask: Tensor) -> Tensor:
            out: Tensor = self.net(tokens, mask)
            return out

        def training_step(self, batch: Batch, batch_idx: int) -> Any:
            total, count = token_sum(self, batch)
            world = self.trainer.world_size
            if kind == "mean":
                return total / count
            if kind == "global":  # Lightning divides by K and DDP by W: undo both
                return total / self.total_items * self.trainer.accumulate_grad_batches * world
            if kind == "callback":
                return {"loss": total, "items": count}
            if kind == "callback_mean":
                return {"loss": total / count, "items": count}
            opt = self.optimizers()
            if kind == "manual":
                self.manual_backward(total / self.total_items * world)
            elif kind == "manual_mean":
                self.manual_backward(total / count / self.k)
            elif kind == "manual_step_each":
                self.manual_backward(total / self.total_items * world)
                opt.step()  # type: ignore[union-attr]
                opt.zero_grad()  # type: ignore[union-attr]
                return None
            if (batch_idx + 1) % self.k == 0:
                opt.step()  # type: ignore[union-attr]
                opt.zero_grad()  # type: ignore[union-attr]
            return None

        def configure_optimizers(self) -> torch.optim.Optimizer:
            assert self.optimizer is not None
            return self.optimizer

    return Attention()


def _fit(run: TrainerRun) -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    from wholebatch.integrations.lightning import WholeBatchAccumulation

    model: Any = run.model
    model.optimizer, model.k = run.optimizer, run.micro_batches
    model.total_items = float(run.batch["mask"].sum())
    manual = not model.automatic_optimization
    callbacks = [WholeBatchAccumulation()] if model.kind_callback else []
    trainer = L.Trainer(
        accelerator="cpu", devices=run.world_size, strategy="ddp",
        max_steps=-1 if manual else 1, max_epochs=1,
        accumulate_grad_batches=1 if manual else run.micro_batches,
        limit_train_batches=run.micro_batches, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=run.output_dir, num_sanity_val_steps=0, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(model, DataLoader(run.dataset, batch_size=run.per_device_rows))


def _build(kind: str) -> Any:
    def build() -> nn.Module:
        module = _module(kind)
        module.kind_callback = kind.startswith("callback")
        return module

    return build


def _spec(kind: str) -> TrainerSpec:
    return TrainerSpec(
        build_model=_build(kind), batch=token_batch(), train=_fit, reference_loss=token_mean,
        count_items=lambda b: int(b["mask"].sum()),
    )  # fmt: skip


def lit_mean() -> TrainerSpec:
    """MISTAKE: automatic optimisation, each micro-batch's token mean."""
    return _spec("mean")


def lit_global() -> TrainerSpec:
    """Right: automatic, the token sum over the whole batch's count, x K x W."""
    return _spec("global")


def lit_callback() -> TrainerSpec:
    """Right: WholeBatchAccumulation, {"loss": token sum, "items": count}."""
    return _spec("callback")


def lit_callback_mean() -> TrainerSpec:
    """MISTAKE: WholeBatchAccumulation fed the micro-batch's mean as "loss"."""
    return _spec("callback_mean")


def lit_manual() -> TrainerSpec:
    """Right: manual optimisation, the global count, one step after K batches."""
    return _spec("manual")


def lit_manual_mean() -> TrainerSpec:
    """MISTAKE: manual optimisation, each batch's token mean / K."""
    return _spec("manual_mean")


def lit_manual_step_each() -> TrainerSpec:
    """MISTAKE: manual optimisation, opt.step() after every batch."""
    return _spec("manual_step_each")
