"""`wholebatch verify --mesh` targets for trainers that own the split: Lightning 2.6.6 and a plain loop.

    PYTHONPATH=src python -m wholebatch verify tests/support/verify_mesh_trainers.py:lightning_exact

Each function returns a `TrainerSpec` with `mesh="dp=2,tp=2"`, `batch_dims=("dp",)`:
TinyLM in float64 and the ragged batch of `tests/support/verify_mesh_targets.py`
(12 rows, one holding no target), K = 2 accumulation steps.

Lightning (`ModelParallelStrategy`, sized from `run.mesh`, `configure_model`
applying Colwise/Rowwise tensor parallel on its "tensor_parallel" dim and FSDP2 on
"data_parallel"; its own DistributedSampler over the data-parallel dim):

- `lightning_exact`: `WholeBatchAccumulation(group=<the dp group>)` (passes).
- `lightning_world_callback`: `WholeBatchAccumulation()` on the world: N counts each
  tp replica's tokens, and W = dp·tp divides the same tp out again (passes).
- `lightning_count_world`: the module rescales its gradients itself in
  `on_before_optimizer_step`, the count all-reduced over the world but FSDP2's mean
  over dp only: 1/tp.
- `lightning_rank_sampler`: the exact callback, but the loader's DistributedSampler
  shards by the global rank (`use_distributed_sampler=False`): the tp replicas of
  one data shard read different rows.

A plain loop (`loop_exact`): `run.shard` (this rank's data shard's rows) in a
DataLoader, `Accumulator(mesh=run.mesh, batch_dims=run.batch_dims)` (passes).

Legend: N rows, B data shards (dp), K micro-batches per shard, W processes.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler

from tests.support.lightning_env import existing_group_environment
from tests.support.models import lm_loss_sum
from tests.support.verify_mesh_targets import _batch, _model, reference_loss
from wholebatch.verify import TrainerRun, TrainerSpec

MESH = "dp=2,tp=2"
_ENV = existing_group_environment()


def _tp_fsdp(net: nn.Module, mesh: Any, tp: str, dp: str) -> None:
    """Colwise/Rowwise tensor parallel on `tp`, then FSDP2 on `dp` (Lightning's dim names)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    parallelize_module(net, mesh[tp], {"hidden": ColwiseParallel(), "out": RowwiseParallel()})
    fully_shard(net, mesh=mesh[dp])


class _Module(pl.LightningModule):  # type: ignore[misc]
    """`run.model` under Lightning: sums and counts per micro-batch, verify's optimizer.

    `rescale_world`: the mutation that rescales in `on_before_optimizer_step` with the
    window's count all-reduced over the world (the tp replicas' tokens counted twice).
    """

    def __init__(self, run: TrainerRun, rescale_world: bool = False) -> None:
        super().__init__()
        self.net = run.model
        self.run = run
        self.rescale_world = rescale_world
        self.items = torch.zeros((), dtype=torch.float64)

    def configure_model(self) -> None:
        _tp_fsdp(self.net, self.device_mesh, "tensor_parallel", "data_parallel")

    def training_step(self, b: list[Tensor], batch_idx: int) -> Any:
        loss, n = lm_loss_sum(self.net, (b[0], b[1]))
        if self.rescale_world:
            self.items = self.items + n
            return loss  # Lightning divides by K; the hook below undoes it
        return {"loss": loss, "items": n}

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if not self.rescale_world:
            return
        items = self.items.clone()
        dist.all_reduce(items)  # the mistake: the world, not the dp group
        k = self.trainer.accumulate_grad_batches
        factor = k * self.device_mesh["data_parallel"].size() / float(items)
        with torch.no_grad():
            for p in self.net.parameters():
                if p.grad is not None:
                    p.grad.mul_(factor)

    def configure_optimizers(self) -> Any:
        return self.run.optimizer  # verify's: it records the gradient it steps on


def _fit(
    run: TrainerRun, *, callback_group: str | None = "dp", world_sampler: bool = False,
    rescale_world: bool = False,
) -> None:  # fmt: skip
    """One optimizer step of Lightning's ModelParallelStrategy on verify's ranks."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from wholebatch.integrations.lightning import WholeBatchAccumulation

    assert run.mesh is not None
    callbacks = []
    if not rescale_world:
        group = run.mesh["dp"].get_group() if callback_group == "dp" else None
        callbacks.append(WholeBatchAccumulation(log_name=None, group=group))
    sampler = (
        DistributedSampler(run.dataset, num_replicas=run.world_size, rank=run.rank, shuffle=False)
        if world_sampler
        else None
    )
    strategy = ModelParallelStrategy(
        data_parallel_size=run.mesh["dp"].size(), tensor_parallel_size=run.mesh["tp"].size()
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=run.world_size, num_nodes=1, max_steps=1, max_epochs=1,
        strategy=strategy, plugins=[_ENV()], accumulate_grad_batches=run.micro_batches,
        use_distributed_sampler=not world_sampler, logger=False, callbacks=callbacks,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )  # fmt: skip
    loader = DataLoader(run.dataset, batch_size=run.per_device_rows, sampler=sampler)
    trainer.fit(_Module(run, rescale_world), loader)


def _spec(train: Any) -> TrainerSpec:
    return TrainerSpec(
        build_model=_model, batch=_batch(), train=train, reference_loss=reference_loss,
        count_items=lambda b: int((b[1] != -100).sum()), mesh=MESH, batch_dims=("dp",),
    )  # fmt: skip


def lightning_exact() -> TrainerSpec:
    return _spec(lambda run: _fit(run))


def lightning_world_callback() -> TrainerSpec:
    return _spec(lambda run: _fit(run, callback_group=None))


def lightning_count_world() -> TrainerSpec:
    return _spec(lambda run: _fit(run, rescale_world=True))


def lightning_rank_sampler() -> TrainerSpec:
    return _spec(lambda run: _fit(run, world_sampler=True))


def _loop(run: TrainerRun) -> None:
    """A plain trainer loop: this data shard's rows, K micro-batches, the mesh Accumulator."""
    from wholebatch.train.accumulate import Accumulator

    assert run.mesh is not None
    loader = DataLoader(run.shard, batch_size=run.per_device_rows)
    acc = Accumulator(run.model, run.optimizer, mesh=run.mesh, batch_dims=run.batch_dims)
    acc.step([(t, y) for t, y in loader], lm_loss_sum)


def _parallelize(model: nn.Module, mesh: Any) -> nn.Module:
    _tp_fsdp(model, mesh, "tp", "dp")
    return model


def loop_exact() -> TrainerSpec:
    import dataclasses

    return dataclasses.replace(_spec(_loop), parallelize=_parallelize)
