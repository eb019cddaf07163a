"""Verify corpus, round 4: FSDP2 and dp x tp loops on gloo, and open_clip_train's loop.

FSDP2 (`fully_shard` over a one-dim mesh "dp=2") and dp2 x tp2 (Colwise/Rowwise
on tp, FSDP2 on dp) on tests/support/models.py's TinyLM in float64, a ragged
token batch (1..8 tokens per row, one row without a target), hand-written
loops as their users write them:

- FSDP2: the step's count agreed over dp (right); each rank dividing by its own
  count (FSDP's mean then averages the ranks' means); the global count without
  undoing FSDP's mean over dp (1/dp).
- dp x tp: the count over dp, x dp (right); the count over dp but the mean
  compensated by dp x tp (tp times too large); the count all-reduced over the
  world (1/tp).

open_clip_train 3.3.0's `train_one_epoch` (its own flags, `--accum-freq K`) on
two towers (tests/support/verify_round3_peers.py): `--gather-with-grad`
(logit_scale's gradient still taken once per micro-batch), and
`--local-loss --gather-with-grad`.

Legend: N rows, B row shards (dp), K micro-batches per shard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tests.support.models import TinyLM, lm_loss_sum, make_sequences, micro_batch
from wholebatch.verify import VerifySpec, current_mesh

LENGTHS = (3, 8, 1, 5, 2, 7, 4, 6, 8, 2, 5, 3)  # N = 12, a multiple of B·K = 4 and of W·K = 6
WIDTH = 8
Mb = tuple[Tensor, Tensor]


def lm_batch() -> Mb:
    return micro_batch(make_sequences(LENGTHS, seed=7), width=WIDTH)


def token_mean(model: nn.Module, batch: Mb) -> Tensor:
    total, n = lm_loss_sum(model, batch)
    return total / n


def fsdp(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=mesh["dp"])
    return model


def tp_fsdp(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    parallelize_module(model, mesh["tp"], {"hidden": ColwiseParallel(), "out": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model


def _loop(count: str, factor: Callable[[Any], float]) -> Callable[..., None]:
    """Backward every micro-batch's token sum, then scale the gradients by factor / count.

    count: "dp" (agreed over the batch ranks), "rank" (this rank's own), "world".
    """

    def step(model: nn.Module, opt: torch.optim.Optimizer, mbs: list[Mb]) -> None:
        mesh = current_mesh()
        items = torch.zeros((), dtype=torch.float64)
        for i, mb in enumerate(mbs):
            model.set_requires_gradient_sync(i == len(mbs) - 1)  # type: ignore[operator]
            total, n = lm_loss_sum(model, mb)
            total.backward()
            items += n
        if count == "dp":
            dist.all_reduce(items, group=mesh["dp"].get_group())
        elif count == "world":
            dist.all_reduce(items)
        scale = factor(mesh) / float(items)
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        opt.step()

    return step


def _dp(mesh: Any) -> float:
    return float(mesh["dp"].size())


def _spec(step: Callable[..., None], mesh: str, parallelize: Any) -> VerifySpec:
    return VerifySpec(
        build_model=lambda: TinyLM().double(), batch=lm_batch(), step=step,
        reference_loss=token_mean, count_items=lambda b: int((b[1] != -100).sum()),
        mesh=mesh, batch_dims=("dp",), parallelize=parallelize,
    )  # fmt: skip


def fsdp_global() -> VerifySpec:
    """Right: FSDP2, the count agreed over dp, FSDP's mean undone (x dp)."""
    return _spec(_loop("dp", _dp), "dp=2", fsdp)


def fsdp_rank_count() -> VerifySpec:
    """MISTAKE: FSDP2, each rank dividing by its own count (x dp): a mean of the ranks' means."""
    return _spec(_loop("rank", _dp), "dp=2", fsdp)


def fsdp_uncompensated() -> VerifySpec:
    """MISTAKE: FSDP2, the global count, FSDP's mean over dp left in (1/dp)."""
    return _spec(_loop("dp", lambda mesh: 1.0), "dp=2", fsdp)


def dptp_exact() -> VerifySpec:
    """Right: dp2 x tp2, the count over dp, x dp."""
    return _spec(_loop("dp", _dp), "dp=2,tp=2", tp_fsdp)


def dptp_overcompensated() -> VerifySpec:
    """MISTAKE: dp2 x tp2, the count over dp, FSDP's mean compensated by dp x tp (x tp too much)."""
    return _spec(
        _loop("dp", lambda mesh: float(mesh["dp"].size() * mesh["tp"].size())), "dp=2,tp=2", tp_fsdp
    )


def dptp_count_world() -> VerifySpec:
    """MISTAKE: dp2 x tp2, the count all-reduced over the world (the tp replicas' tokens too: 1/tp)."""
    return _spec(_loop("world", _dp), "dp=2,tp=2", tp_fsdp)


# ---------------------------------------------------------------------------
# open_clip_train's train_one_epoch
# ---------------------------------------------------------------------------


def _one_epoch(flags: tuple[str, ...]) -> Callable[..., None]:
    def step(model: nn.Module, optimizer: torch.optim.Optimizer, mbs: list[Any]) -> None:
        from tests.support import verify_round3_peers as oc

        clip_loss = oc._open_clip_loss()  # before the stub takes open_clip's name
        train = oc._open_clip_train()
        from open_clip_train.params import parse_args

        args = parse_args(
            ["--accum-freq", str(len(mbs)), "--precision", "fp32", "--device", "cpu", *flags]
        )
        args.distributed, args.world_size = True, dist.get_world_size()
        args.rank = args.local_rank = dist.get_rank()
        args.distill, args.wandb, args.skip_scheduler = False, False, True
        args.batch_size = len(mbs[0][0])
        loss = clip_loss.ClipLoss(
            local_loss=args.local_loss, gather_with_grad=args.gather_with_grad, cache_labels=True,
            rank=args.rank, world_size=args.world_size, use_horovod=args.horovod,
        )  # fmt: skip
        loader = oc._Loader(mbs)
        loader.num_batches, loader.num_samples = len(mbs), sum(len(mb[0]) for mb in mbs)
        train.train_one_epoch(
            model, {"train": oc._Data(loader)}, loss, 0, optimizer, None, None, None, args
        )

    return step


def _oc_spec(flags: tuple[str, ...]) -> VerifySpec:
    from tests.support import verify_round3_peers as oc

    return VerifySpec(
        build_model=oc.ClipTowers,
        batch=oc.pairs(),
        step=_one_epoch(flags),
        reference_loss=oc.clip_reference,
    )


def oc_gather_with_grad() -> VerifySpec:
    """MISTAKE (accum_freq = K, --gather-with-grad): the towers exact, logit_scale K times."""
    return _oc_spec(("--gather-with-grad",))


def oc_local_loss_with_grad() -> VerifySpec:
    """MISTAKE (accum_freq = K, --local-loss --gather-with-grad): logit_scale K times."""
    return _oc_spec(("--local-loss", "--gather-with-grad"))
