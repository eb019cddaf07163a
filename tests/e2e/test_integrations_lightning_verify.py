"""`wholebatch verify` on a Lightning 2.6.6 step: a `TrainerSpec` whose `configure_optimizers` returns verify's optimizer.

One command (W = 2 x K = 3, --json) runs two targets of this module, each a real
`Trainer.fit` of one optimizer step under DDP on verify's ranks:

- `lightning_fixed`: `WholeBatchAccumulation` and a `training_step` returning
  {"loss": sum, "items": count}: verify must pass it;
- `lightning_plain`: plain Lightning with a token mean in `training_step`: verify
  must fail it as a mean of means.

`configure_optimizers` returns `run.optimizer` (verify's recording optimizer):
Lightning calls its `step(closure)`, the optimizer runs the closure (the window's
last micro-batch, then the callback's rescale in `on_before_optimizer_step`) and
records the gradient it steps on. Lightning's own DistributedSampler shards the
dataset verify hands over (no shuffling for a sequential loader).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.e2e.test_cli import ROOT, run_cli
from tests.support.lightning_env import existing_group_environment
from tests.support.peers import SKIP_REASON, peer_root
from wholebatch.verify.spec import TrainerRun, TrainerSpec

pytestmark = [
    pytest.mark.skipif(peer_root("lightning") is None, reason=SKIP_REASON.format("lightning")),
]

V, D, ROWS, SEQ = 11, 4, 12, 6
Batch = dict[str, Tensor]


class TokenNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.head = nn.Linear(D, V)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.emb(x)))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return TokenNet().double()


def token_batch() -> Batch:
    """ROWS rows of SEQ tokens; each row's targets end after a different length (-100 after)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, V, (ROWS, SEQ), generator=g)
    y = torch.randint(0, V, (ROWS, SEQ), generator=g)
    lengths = torch.randint(1, SEQ + 1, (ROWS,), generator=g)
    y[torch.arange(SEQ)[None, :] >= lengths[:, None]] = -100
    return {"x": x, "y": y}


def loss_sum(model: nn.Module, b: Batch) -> Tensor:
    return F.cross_entropy(
        model(b["x"]).flatten(0, 1), b["y"].flatten(), ignore_index=-100, reduction="sum"
    )


def reference_loss(model: nn.Module, batch: Batch) -> Tensor:
    return loss_sum(model, batch) / (batch["y"] != -100).sum()


def _fit(run: TrainerRun, fixed: bool) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader

    from wholebatch.integrations.lightning import WholeBatchAccumulation

    env_cls = _environment_class()

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = run.model

        def training_step(self, b: Batch, batch_idx: int) -> Any:
            if fixed:
                return {"loss": loss_sum(self.net, b), "items": (b["y"] != -100).sum()}
            return loss_sum(self.net, b) / (b["y"] != -100).sum()

        def configure_optimizers(self) -> Any:
            return run.optimizer  # verify's: it records the gradient it steps on

    trainer = pl.Trainer(
        accelerator="cpu", devices=run.world_size, num_nodes=1, max_steps=1, max_epochs=1,
        strategy=DDPStrategy(cluster_environment=env_cls(), process_group_backend="gloo"),
        accumulate_grad_batches=run.micro_batches, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[WholeBatchAccumulation(log_name=None)] if fixed else [],
    )  # fmt: skip
    trainer.fit(Module(), DataLoader(run.dataset, batch_size=run.per_device_rows))


def _environment_class() -> Any:
    return existing_group_environment()


def lightning_fixed() -> TrainerSpec:
    return TrainerSpec(
        build_model=build_model, batch=token_batch(), train=lambda run: _fit(run, True),
        reference_loss=reference_loss,
    )  # fmt: skip


def lightning_plain() -> TrainerSpec:
    return TrainerSpec(
        build_model=build_model, batch=token_batch(), train=lambda run: _fit(run, False),
        reference_loss=reference_loss,
    )  # fmt: skip


EX = str(Path(__file__).relative_to(ROOT))


@pytest.fixture(scope="module")
def reports() -> dict[str, dict[str, Any]]:
    targets = [f"{EX}:lightning_fixed", f"{EX}:lightning_plain"]
    result = run_cli(
        "verify", *targets, "--nproc", "2", "--micro-batches", "3", "--json", timeout=400
    )
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    return {r["target"]: r for r in json.loads(result.stdout)["results"]}


def test_verify_passes_the_fixed_lightning_step(reports: dict[str, dict[str, Any]]) -> None:
    report = reports[f"{EX}:lightning_fixed"]
    assert report["passed"], (report["diagnoses"], report["error"])


def test_verify_fails_plain_lightning_as_a_mean_of_means(
    reports: dict[str, dict[str, Any]],
) -> None:
    report = reports[f"{EX}:lightning_plain"]
    assert not report["passed"]
    assert next(d["code"] for d in report["diagnoses"]) == "mean-of-means", report["diagnoses"]
