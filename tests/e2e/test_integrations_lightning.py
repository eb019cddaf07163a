"""`wholebatch.integrations.lightning` against the real Lightning 2.6.6 `Trainer`, on 2 gloo ranks.

One spawned world (2 ranks, lightning imported once per rank) runs every case of
this file in one call, each a real `Trainer.fit` under `DDPStrategy`:

- a token LM (float64) with `accumulate_grad_batches=3` over 7 batches per rank
  (windows of 3, 3 and the epoch's short last 1), every micro-batch holding a
  different number of target tokens on each rank: with `WholeBatchAccumulation`
  every optimizer step's gradient, and the logged loss, are compared with ONE
  process on the window's whole batch (rows of every rank), step by step;
- the same fit with plain Lightning and a token mean in `training_step` (what
  the docs show): the mutation, which the same assertion must reject;
- `wholebatch.GradCache` inside a LightningModule (CLIP loss over both ranks,
  K = 2 micro-batches per rank, uneven rows), against one process's whole batch;
- the token fit under FSDP2 (Lightning's `ModelParallelStrategy`, `fully_shard`
  in `configure_model`): the parameters after its three steps, fixed and plain;
- the errors, the same on both ranks.

Reference: plain torch in this process (no Lightning), SGD steps on the window's
whole batch, the loss written from its formula.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.support.harness import run_ranks
from tests.support.lightning_env import existing_group_environment
from tests.support.peers import SKIP_REASON, peer_root

pytestmark = pytest.mark.skipif(
    peer_root("lightning") is None, reason=SKIP_REASON.format("lightning")
)

W, K, BATCHES, V, D = 2, 3, 7, 7, 4
LR = 0.5
# float64; each gradient sums a few hundred terms of size <= ~5: round-off ~1e-14.
# 1e-10 leaves room and rejects plain Lightning (off by several percent).
F64: dict[str, float] = dict(rtol=1e-10, atol=1e-12)
IGNORE = -100


# -- data and model shared by the ranks and the reference -------------------------


def token_batch(rank: int, j: int) -> dict[str, Tensor]:
    """Rank `rank`'s batch `j`: 1-3 rows of 2-5 tokens, ~40% of targets ignored (ragged counts)."""
    gen = torch.Generator().manual_seed(1000 * rank + j)
    rows, length = 1 + (j + rank) % 3, 2 + (j + 2 * rank) % 4
    x = torch.randint(0, V, (rows, length), generator=gen)
    y = torch.randint(0, V, (rows, length), generator=gen)
    drop = torch.rand(rows, length, generator=gen) < 0.4
    drop.view(-1)[0] = False  # at least one target: the plain token mean is finite
    y[drop] = IGNORE
    return {"x": x, "y": y}


class TokenNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D)
        self.head = nn.Linear(D, V)
        self.double()

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.emb(x)))  # [rows, T, V]


def token_loss_sum(net: nn.Module, b: dict[str, Tensor]) -> Tensor:
    logits = net(b["x"])
    return F.cross_entropy(
        logits.flatten(0, 1), b["y"].flatten(), ignore_index=IGNORE, reduction="sum"
    )


def windows() -> list[list[int]]:
    """Batch indices of each optimizer step: [0,1,2], [3,4,5], [6] (the short last window)."""
    return [list(range(s, min(s + K, BATCHES))) for s in range(0, BATCHES, K)]


def reference_token_steps() -> tuple[list[dict[str, Tensor]], list[float]]:
    """One process: each window's whole batch (every rank's micro-batches), SGD(LR) after each."""
    net = TokenNet()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    grads, losses = [], []
    for win in windows():
        parts = [token_batch(r, j) for r in range(W) for j in win]
        n = sum(int((b["y"] != IGNORE).sum()) for b in parts)
        loss = sum(token_loss_sum(net, b) for b in parts) / n
        opt.zero_grad()
        loss.backward()  # type: ignore[union-attr]
        grads.append({k: p.grad.clone() for k, p in net.named_parameters()})  # type: ignore[union-attr]
        losses.append(float(loss.detach()))
        opt.step()
    return grads, losses


# -- what each rank runs -------------------------------------------------------------


def _lightning() -> Any:
    import lightning.pytorch as pl

    HarnessEnvironment = existing_group_environment()

    class Probe(
        pl.Callback
    ):  # placed after the callback under test: sees the gradient Lightning steps on
        def __init__(self) -> None:
            self.grads: list[dict[str, Tensor]] = []

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            self.grads.append({k: p.grad.clone() for k, p in pl_module.net.named_parameters()})

    from lightning.pytorch.loggers import Logger

    class MemoryLogger(Logger):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[tuple[int | None, dict[str, float]]] = []

        @property
        def name(self) -> str:
            return "memory"

        @property
        def version(self) -> int:
            return 0

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.rows.append((step, dict(metrics)))

    def trainer(callbacks: list[Any], k: int, logger: Any = False) -> Any:
        from lightning.pytorch.strategies import DDPStrategy

        return pl.Trainer(
            accelerator="cpu", devices=W, num_nodes=1, max_epochs=1,
            strategy=DDPStrategy(cluster_environment=HarnessEnvironment(), process_group_backend="gloo"),
            accumulate_grad_batches=k, callbacks=callbacks, logger=logger,
            log_every_n_steps=1, use_distributed_sampler=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        )  # fmt: skip

    return pl, Probe, MemoryLogger, trainer


def _token_module(pl: Any, mode: str) -> Any:
    class TokenLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = TokenNet()

        def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Any:
            if mode == "sum":  # what the callback asks for
                return {
                    "loss": token_loss_sum(self.net, batch),
                    "items": (batch["y"] != IGNORE).sum(),
                }
            if mode == "mean":  # what Lightning's docs show: a token mean
                logits = self.net(batch["x"])
                return F.cross_entropy(
                    logits.flatten(0, 1), batch["y"].flatten(), ignore_index=IGNORE
                )
            return {"loss": token_loss_sum(self.net, batch)}  # "no_items": an error

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=LR)

    return TokenLM()


def _loader(rank: int) -> Any:
    from torch.utils.data import DataLoader

    return DataLoader([token_batch(rank, j) for j in range(BATCHES)], batch_size=None)


def lightning_world() -> dict[str, Any]:
    """Every case of this file on one rank (one world call: lightning imports once per rank)."""
    from wholebatch.errors import WholebatchError
    from wholebatch.integrations.lightning import WholeBatchAccumulation

    pl, Probe, MemoryLogger, trainer = _lightning()
    rank = torch.distributed.get_rank()
    out: dict[str, Any] = {}

    # 1. the fix: exact steps, logged loss, stats
    cb, probe, log = WholeBatchAccumulation(), Probe(), MemoryLogger()
    module = _token_module(pl, "sum")
    trainer([cb, probe], K, logger=log).fit(module, _loader(rank))
    out["fixed_grads"] = probe.grads
    out["fixed_logged"] = [m["train_loss"] for _, m in log.rows if "train_loss" in m]
    out["fixed_stats"] = [(s.loss, s.items, s.micro_batches) for s in cb.history]
    out["training_step_restored"] = "training_step" not in vars(module)

    # 2. the mutation: plain Lightning, a token mean per micro-batch
    probe = Probe()
    trainer([probe], K).fit(_token_module(pl, "mean"), _loader(rank))
    out["plain_grads"] = probe.grads

    # 3. errors, the same on every rank
    try:
        trainer([WholeBatchAccumulation()], K).fit(_token_module(pl, "no_items"), _loader(rank))
        out["no_items_error"] = None
    except WholebatchError as exc:
        out["no_items_error"] = str(exc)

    # 4. GradCache inside a LightningModule
    out.update(gradcache_case(pl, trainer, rank))

    # 5. FSDP2: Lightning's ModelParallelStrategy, `fully_shard` in configure_model
    for fixed in (True, False):
        out[f"fsdp_{'fixed' if fixed else 'plain'}"] = fsdp_case(pl, trainer, rank, fixed)
    return out


def fsdp_case(pl: Any, trainer: Any, rank: int, fixed: bool) -> dict[str, Tensor]:
    """The token fit under FSDP2 (sharded parameters and gradients); the full parameters after it."""
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from wholebatch.integrations.lightning import WholeBatchAccumulation

    base = type(_token_module(pl, "sum" if fixed else "mean"))

    class Sharded(base):  # type: ignore[misc, valid-type]
        def configure_model(self) -> None:
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    module = Sharded()
    env = type(trainer([], 1).strategy.cluster_environment)()  # the harness's group
    pl.Trainer(
        accelerator="cpu", devices=W, num_nodes=1, max_epochs=1, plugins=[env],
        strategy=ModelParallelStrategy(data_parallel_size=W, tensor_parallel_size=1),
        accumulate_grad_batches=K, logger=False, use_distributed_sampler=False,
        callbacks=[WholeBatchAccumulation(log_name=None)] if fixed else [],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    ).fit(module, _loader(rank))  # fmt: skip
    return {
        k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for k, p in module.net.named_parameters()
    }


# -- GradCache inside a LightningModule ------------------------------------------------

ROWS = {0: [3, 2], 1: [1, 4]}  # rows of each rank's K = 2 micro-batches (uneven)
D_IN = 5


def clip_rows(rank: int, j: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(50 + 10 * rank + j)
    n = ROWS[rank][j]
    return (
        torch.randn(n, D_IN, generator=gen, dtype=torch.float64),
        torch.randn(n, D_IN, generator=gen, dtype=torch.float64),
    )


class Towers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.img = nn.Linear(D_IN, 3)
        self.txt = nn.Linear(D_IN, 3)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(5.0)))
        self.double()

    def forward(self, pair: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        return F.normalize(self.img(pair[0]), dim=-1), F.normalize(self.txt(pair[1]), dim=-1)


def reference_clip_grads() -> dict[str, Tensor]:
    """One process: the CLIP loss over every rank's rows (rank order), N x N logits."""
    net = Towers()
    pairs = [clip_rows(r, j) for r in range(W) for j in range(len(ROWS[r]))]
    img, txt = net((torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])))
    logits = net.logit_scale.exp() * img @ txt.T
    labels = torch.arange(len(logits))
    loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
    loss.backward()
    return {k: p.grad.clone() for k, p in net.named_parameters()}  # type: ignore[union-attr]


def gradcache_case(pl: Any, trainer: Any, rank: int) -> dict[str, Any]:
    from torch.utils.data import DataLoader

    import wholebatch

    grads: list[dict[str, Tensor]] = []

    class ClipModule(pl.LightningModule):
        """The recipe of docs/integrations/lightning.md: GradCache in training_step."""

        def __init__(self) -> None:
            super().__init__()
            self.towers = Towers()

        def forward(self, pair: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
            return self.towers(pair)  # what GradCache embeds with (through DDP's forward)

        def training_step(self, micro_batches: list[Any], batch_idx: int) -> Tensor:
            cache = wholebatch.GradCache(self.trainer.strategy.model)
            scale = self.towers.logit_scale.exp()
            return cache(micro_batches, lambda i, t: wholebatch.clip_loss(i, t, scale))

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            grads.append({k: p.grad.clone() for k, p in self.towers.named_parameters()})

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=LR)

    step = [[clip_rows(rank, j) for j in range(len(ROWS[rank]))]]  # one batch = K micro-batches
    loader = DataLoader(step, batch_size=None, collate_fn=lambda b: b)
    trainer([], 1).fit(ClipModule(), loader)
    return {"gradcache_grads": grads}


# -- the test -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_ranks(W, lightning_world, timeout=240)


def test_accumulation_is_the_whole_batch_step_by_step(world: list[dict[str, Any]]) -> None:
    ref_grads, ref_losses = reference_token_steps()
    for rank, out in enumerate(world):
        got = out["fixed_grads"]
        assert len(got) == len(ref_grads) == 3  # windows 3, 3 and the short last 1
        for step, (g, r) in enumerate(zip(got, ref_grads, strict=True)):
            for name in r:
                torch.testing.assert_close(
                    g[name], r[name], **F64, msg=f"rank {rank} step {step} {name}"
                )
        assert [m for _, _, m in out["fixed_stats"]] == [3, 3, 1]
        for (loss, _, _), want in zip(out["fixed_stats"], ref_losses, strict=True):
            assert loss == pytest.approx(want, rel=1e-12)
        assert out["training_step_restored"]
    assert world[0]["fixed_logged"] == pytest.approx(ref_losses, rel=1e-12)  # the logged loss


def test_mutation_plain_lightning_is_rejected(world: list[dict[str, Any]]) -> None:
    ref_grads, _ = reference_token_steps()
    worst = 0.0
    for out in world:
        for g, r in zip(out["plain_grads"], ref_grads, strict=True):
            for name in r:
                err = float((g[name] - r[name]).abs().max() / r[name].abs().max())
                worst = max(worst, err)
    assert worst > 1e-3, "plain Lightning matched the whole batch: the test could not fail"


def _reference_params() -> dict[str, Tensor]:
    """The parameters after the reference's three SGD steps."""
    net = TokenNet()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for g in reference_token_steps()[0]:
        for k, p in net.named_parameters():
            p.grad = g[k]
        opt.step()
    return {k: p.detach() for k, p in net.named_parameters()}


def _update_error(got: dict[str, Tensor], want: dict[str, Tensor]) -> float:
    init = {k: p.detach() for k, p in TokenNet().named_parameters()}
    return max(
        float(((got[k] - init[k]) - (want[k] - init[k])).norm() / (want[k] - init[k]).norm())
        for k in want
    )


def test_fsdp2_accumulation_is_the_whole_batch(world: list[dict[str, Any]]) -> None:
    # ModelParallelStrategy + fully_shard: the callback rescales each rank's gradient shard.
    want = _reference_params()
    for rank, out in enumerate(world):
        err = _update_error(out["fsdp_fixed"], want)
        assert err <= 1e-10, f"rank {rank}: FSDP2 update off by {err:.3g}"
    assert _update_error(world[0]["fsdp_plain"], want) > 1e-3  # the mutation: plain Lightning


def test_errors_name_the_fix_on_every_rank(world: list[dict[str, Any]]) -> None:
    msgs = {out["no_items_error"] for out in world}
    assert len(msgs) == 1 and (msg := msgs.pop()) is not None
    assert '"items"' in msg and "SUM" in msg


def test_gradcache_inside_a_lightning_module(world: list[dict[str, Any]]) -> None:
    ref = reference_clip_grads()
    for rank, out in enumerate(world):
        (g,) = out["gradcache_grads"]
        for name in ref:
            torch.testing.assert_close(g[name], ref[name], **F64, msg=f"rank {rank} {name}")
