"""open_clip's `ClipLoss` and `SigLipLoss`, exact over the whole batch and memory-linear.

Change two lines of an open_clip training script (docs/integrations/open_clip.md):

    # from open_clip.loss import ClipLoss, SigLipLoss
    from wholebatch.integrations.open_clip import ClipLoss, SigLipLoss

The constructors and calls are open_clip 3.3.0's:

    loss = ClipLoss(local_loss, gather_with_grad, cache_labels, rank, world_size, use_horovod)
    loss(image_features, text_features, logit_scale[, logit_bias], output_dict=False)
    loss = SigLipLoss(cache_labels, rank, world_size, dist_impl)
    loss(image_features, text_features, logit_scale, logit_bias, output_dict=False)

Behind them are `wholebatch.clip_loss` / `wholebatch.siglip_loss`: whatever the
flags, after DDP's mean every gradient (both encoders, `logit_scale`,
`logit_bias`) equals one process's on the whole batch; memory is
O(N·D + tile²) instead of open_clip's N x N (or B x N) logits; ranks may hold
different numbers of rows, 0 included. This module does not import open_clip.

What the flags mean here:

- `local_loss`, `gather_with_grad`: open_clip's trade between memory and
  exactness (its defaults give each encoder 1/W of the whole-batch gradient;
  `local_loss=True` alone is inexact too). No longer needed: accepted, and
  every combination gives the exact whole-batch gradient with linear memory.
- `cache_labels`, `dist_impl` ("bidir", "shift", "reduce", "gather"): ways
  of building labels or moving text blocks; accepted (dist_impl is validated as
  open_clip does), no effect on the result.
- `rank`, `world_size`: read from the process group; a value other than the
  defaults (0, 1) must match the group, else the same error on every rank.
- `use_horovod=True`: an error; wholebatch runs on torch.distributed.

And open_clip_train's training loop (docs/integrations/open_clip.md):

    # from open_clip_train.train import train_one_epoch
    from wholebatch.integrations.open_clip import train_one_epoch

or run open_clip_train's own CLI through wholebatch, unchanged flags:

    torchrun --nproc-per-node 2 -m wholebatch.integrations.open_clip -- --train-data ... --accum-freq 4

`train_one_epoch` has open_clip_train 3.3.0's signature and arguments; for any
`accum_freq` each optimizer step's gradient is one process's on the window's
whole batch (every rank's rows): `logit_scale` once, dropout masks replayed
(`wholebatch.GradCache`), a micro-batch's activation memory (section
"train_one_epoch" below).

The returned value is the loss of the WHOLE batch, the same on every rank.
open_clip returns that with `local_loss=False` (CLIP); with `local_loss=True`
(CLIP) and for SigLIP it returns this rank's share, whose mean over ranks is
the whole-batch loss when ranks hold equal rows.

Legend: W ranks, B this rank's rows, N global rows, D embedding dim.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from wholebatch.conventions import GradReduction
from wholebatch.errors import WholebatchError
from wholebatch.integrations._common import check_rank_args, require_peer, scalar_numel_one
from wholebatch.losses import clip_loss, siglip_loss
from wholebatch.train import GradCache

__all__ = ["ClipLoss", "SigLipLoss", "main", "train_one_epoch", "whole_batch_loss"]

_DIST_IMPLS = ("bidir", "shift", "reduce", "gather")


def _no_horovod(op: str, use_horovod: object) -> None:
    if use_horovod:
        raise WholebatchError(
            f"{op}: use_horovod=True is not supported: wholebatch runs on torch.distributed; "
            "launch with torchrun and pass use_horovod=False"
        )


class _RankArgs(nn.Module):
    """The rank arguments both losses take, checked against the group on the first call."""

    def __init__(self, op: str, rank: int, world_size: int, group: ProcessGroup | None) -> None:
        super().__init__()
        self._op = op
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self._checked = False

    def _check_once(self) -> None:
        # Every rank calls the loss together, so every rank checks on the same call.
        if not self._checked:
            check_rank_args(self._op, self.rank, self.world_size, self.group)
            self._checked = True


class ClipLoss(_RankArgs):
    """open_clip's `ClipLoss`: symmetric InfoNCE over the whole batch, for any flags.

    Gradient contract: every rank calls it on its own rows; with DDP averaging
    parameter gradients (``grad_reduction="mean"``, the default), the encoders'
    and `logit_scale`'s gradients equal one process's on the concatenated batch;
    with ``"sum"``, after a sum over ranks. A scalar `logit_bias` adds the same
    constant to every logit, which cross-entropy ignores: the loss is unchanged
    and the bias gets an exactly zero gradient (open_clip computes the same
    zero to round-off).

    Args:
        local_loss: accepted, no effect (see the module docstring).
        gather_with_grad: accepted, no effect.
        cache_labels: accepted, no effect.
        rank: this process's rank, or the default 0; checked against `group`.
        world_size: the number of ranks, or the default 1; checked against `group`.
        use_horovod: must be False.
        group: the process group the batch is split over (default: the world).
        grad_reduction: "mean" if parameter gradients are averaged over ranks (DDP), "sum" if summed.
        tile_size: rows and columns of one logits tile (memory tile² per buffer); None:
            chosen for the device (`wholebatch.losses.tile_size_for`).
    """

    def __init__(
        self,
        local_loss: bool = False,
        gather_with_grad: bool = False,
        cache_labels: bool = False,
        rank: int = 0,
        world_size: int = 1,
        use_horovod: bool = False,
        *,
        group: ProcessGroup | None = None,
        grad_reduction: GradReduction = "mean",
        tile_size: int | None = None,
    ) -> None:
        _no_horovod("ClipLoss", use_horovod)
        super().__init__("ClipLoss", rank, world_size, group)
        self.local_loss = local_loss
        self.gather_with_grad = gather_with_grad
        self.cache_labels = cache_labels
        self.use_horovod = use_horovod
        self.grad_reduction: GradReduction = grad_reduction
        self.tile_size = tile_size

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor | float,
        logit_bias: Tensor | float | None = None,
        output_dict: bool = False,
    ) -> Tensor | dict[str, Tensor]:
        """The whole batch's CLIP loss (the same on every rank), or {"contrastive_loss": it}.

        Args:
            image_features: this rank's image embeddings (B x D), normalised as open_clip's models do.
            text_features: this rank's text embeddings (B x D); row i pairs with image row i.
            logit_scale: the logit multiplier (already exponentiated), the same on every rank.
            logit_bias: an optional scalar added to every logit (no effect on the loss).
            output_dict: return {"contrastive_loss": loss} instead of the loss.
        """
        self._check_once()
        loss = clip_loss(
            image_features,
            text_features,
            logit_scale,
            group=self.group,
            grad_reduction=self.grad_reduction,
            tile_size=self.tile_size,
        )
        if logit_bias is not None:
            bias = scalar_numel_one("ClipLoss", "logit_bias", logit_bias)
            if isinstance(bias, Tensor) and bias.requires_grad:
                # In the graph with an exactly zero gradient, as DDP expects of a used parameter.
                loss = loss + 0.0 * bias.reshape(()).to(loss.dtype)
        return {"contrastive_loss": loss} if output_dict else loss


class SigLipLoss(_RankArgs):
    """open_clip's `SigLipLoss`: the sigmoid loss over the whole batch, every `dist_impl`.

    The loss is −Σᵢⱼ log σ(yᵢⱼ·(s·IᵢTⱼ + b)) / N over all N x N pairs of the
    whole batch (yᵢᵢ = 1, else −1). Remote text blocks travel around the ring
    one at a time, so memory does not grow with W.

    Gradient contract: as `ClipLoss`; `logit_scale` and `logit_bias` are
    replicated parameters and get the whole-batch gradient after DDP's mean.

    Args:
        cache_labels: accepted, no effect.
        rank: this process's rank, or the default 0; checked against `group`.
        world_size: the number of ranks, or the default 1; checked against `group`.
        dist_impl: None, "bidir", "shift", "reduce" or "gather" (validated like
            open_clip; every choice gives the same exact result).
        group: the process group the batch is split over (default: the world).
        grad_reduction: "mean" if parameter gradients are averaged over ranks (DDP), "sum" if summed.
        tile_size: rows and columns of one logits tile; None: chosen for the device.
    """

    def __init__(
        self,
        cache_labels: bool = False,
        rank: int = 0,
        world_size: int = 1,
        dist_impl: str | None = None,
        *,
        group: ProcessGroup | None = None,
        grad_reduction: GradReduction = "mean",
        tile_size: int | None = None,
    ) -> None:
        impl = dist_impl or "bidir"
        if impl not in _DIST_IMPLS:
            raise WholebatchError(
                f"SigLipLoss: dist_impl={dist_impl!r}; expected None or one of {_DIST_IMPLS} "
                "(all give the same exact loss here)"
            )
        super().__init__("SigLipLoss", rank, world_size, group)
        self.cache_labels = cache_labels
        self.dist_impl = impl
        self.grad_reduction: GradReduction = grad_reduction
        self.tile_size = tile_size

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor | float,
        logit_bias: Tensor | float,
        output_dict: bool = False,
    ) -> Tensor | dict[str, Tensor]:
        """The whole batch's SigLIP loss (the same on every rank), or {"contrastive_loss": it}.

        Args:
            image_features: this rank's image embeddings (B x D).
            text_features: this rank's text embeddings (B x D); row i pairs with image row i.
            logit_scale: the logit multiplier (already exponentiated), the same on every rank.
            logit_bias: the logit bias, the same on every rank.
            output_dict: return {"contrastive_loss": loss} instead of the loss.
        """
        self._check_once()
        loss = siglip_loss(
            image_features,
            text_features,
            logit_scale,
            logit_bias,
            group=self.group,
            grad_reduction=self.grad_reduction,
            tile_size=self.tile_size,
        )
        return {"contrastive_loss": loss} if output_dict else loss

    def extra_repr(self) -> str:
        return f"dist_impl={self.dist_impl!r}"


# -- open_clip_train's train_one_epoch -------------------------------------------------
#
# What open_clip_train 3.3.0's loop does (open_clip_train/train.py), and why each is wrong:
# - accum_freq > 1: it caches every micro-batch's features under no_grad, then re-runs
#   each micro-batch with grad and calls the loss once PER micro-batch, on the cached
#   features with that micro-batch's slice replaced. `logit_scale` is in each of the K
#   losses, so its gradient is K times the whole batch's (2.0x at accum_freq=2); the
#   re-run draws new dropout masks, so the cached features are not the re-run's.
# - its default loss flags (local_loss=False, gather_with_grad=False) give the towers
#   1/W of their gradient under DDP; gather_with_grad=True fixes the towers only.
# - it logs the rank's loss of the last micro-batch; the whole batch's is not computed.
# Here a window of accum_freq batches is one `GradCache` call with a whole-batch loss:
# pass 1 embeds each micro-batch (RNG and autocast recorded), the loss runs once on the
# whole batch over every rank, and `backward()` re-runs each micro-batch with its RNG
# replayed, DDP reducing on the last one.


def whole_batch_loss(loss: Any) -> ClipLoss | SigLipLoss:
    """`loss` as this module's exact loss: open_clip's `ClipLoss`/`SigLipLoss` rebuilt with its flags.

    One of this module's losses is returned as it is. Other losses (open_clip's
    `CoCaLoss`, `DistillClipLoss`) are not supported yet: an error names them.
    """
    if isinstance(loss, (ClipLoss, SigLipLoss)):
        return loss
    kind = type(loss).__name__
    if type(loss).__module__.startswith("open_clip") and kind == "ClipLoss":
        return ClipLoss(
            local_loss=bool(loss.local_loss),
            gather_with_grad=bool(loss.gather_with_grad),
            cache_labels=bool(loss.cache_labels),
            rank=int(loss.rank),
            world_size=int(loss.world_size),
            use_horovod=bool(loss.use_horovod),
        )
    if type(loss).__module__.startswith("open_clip") and kind == "SigLipLoss":
        return SigLipLoss(
            cache_labels=bool(loss.cache_labels),
            rank=int(loss.rank),
            world_size=int(loss.world_size),
            dist_impl=getattr(loss, "dist_impl", None),
        )
    raise WholebatchError(
        f"train_one_epoch: the loss is {type(loss).__module__}.{kind}; wholebatch's loop "
        "supports open_clip's ClipLoss and SigLipLoss (or this module's). CoCa and "
        "distillation losses are not supported yet: use open_clip_train's own loop for them"
    )


def _input_dtype(precision: str) -> torch.dtype | None:
    # open_clip.get_input_dtype's mapping (open_clip itself is not imported: its package
    # __init__ loads torchvision and the tokenizers, which the loop does not need).
    if precision in ("bf16", "pure_bf16"):
        return torch.bfloat16
    if precision in ("fp16", "pure_fp16"):
        return torch.float16
    return None


def _autocast(
    precision: str, device_type: str
) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    # open_clip_train.precision.get_autocast's mapping.
    dtype = {"amp": torch.float16, "amp_bfloat16": torch.bfloat16, "amp_bf16": torch.bfloat16}
    if precision not in dtype:
        return contextlib.nullcontext
    return lambda: torch.amp.autocast(device_type=device_type, dtype=dtype[precision])


def _unwrap(model: nn.Module) -> Any:
    inner: Any = getattr(model, "_orig_mod", model)
    return inner.module if hasattr(inner, "module") else inner


def _embed(model: nn.Module, micro_batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """One micro-batch's features through the (DDP) model's forward; the scale is read once outside."""
    images, texts = micro_batch
    out = model(images, texts)
    if isinstance(out, dict):
        return out["image_features"], out["text_features"]
    return out[0], out[1]


def _is_master(args: Any) -> bool:
    try:
        dist_mod = require_peer("open_clip_train.distributed", "open-clip-torch", "train_one_epoch")
        return bool(dist_mod.is_master(args))
    except ImportError:
        return int(getattr(args, "rank", 0)) == 0


class _Meter:
    """open_clip_train's AverageMeter (value, running mean)."""

    val: float
    avg: float
    sum: float
    count: int

    def __init__(self) -> None:
        self.reset()

    def update(self, val: float, n: int = 1) -> None:
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count

    def reset(self) -> None:
        self.val = self.avg = self.sum = 0.0
        self.count = 0


def _check_args(args: Any, dist_model: nn.Module | None) -> int:
    """open_clip_train's arguments this loop refuses, with the fix; returns accum_freq."""
    if getattr(args, "distill", False) or dist_model is not None:
        raise WholebatchError(
            "train_one_epoch: distillation (--distill-model) is not supported by wholebatch's "
            "loop yet; use open_clip_train's own train_one_epoch for it"
        )
    if getattr(args, "horovod", False):
        raise WholebatchError(
            "train_one_epoch: --horovod is not supported: wholebatch runs on torch.distributed "
            "(launch with torchrun)"
        )
    accum = int(getattr(args, "accum_freq", 1))
    if accum < 1:
        raise WholebatchError(f"train_one_epoch: args.accum_freq={accum} must be >= 1")
    return accum


def _backward_and_step(
    loss: Tensor,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    clip: float | None,
) -> None:
    """open_clip_train's backward, clipping and step (its GradScaler path included)."""
    if scaler is not None:
        torch.autograd.backward(scaler.scale(loss))
        if clip is not None:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip, norm_type=2.0)
        scaler.step(optimizer)
        scaler.update()
        return
    torch.autograd.backward(loss)
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip, norm_type=2.0)
    optimizer.step()


def train_one_epoch(
    model: nn.Module,
    data: dict[str, Any],
    loss: nn.Module,
    epoch: int,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    scheduler: Callable[[int], Any] | None,
    dist_model: nn.Module | None,
    args: Any,
    tb_writer: Any = None,
) -> None:
    """open_clip_train 3.3.0's `train_one_epoch`, each step the whole batch's exact gradient.

    Same signature, arguments and logging as open_clip_train's. Every
    `args.accum_freq` batches form one optimizer step: one `wholebatch.GradCache`
    call over them with the loss on the whole batch of every rank, so after DDP's
    mean every gradient (both towers, `logit_scale`, `logit_bias`) equals one
    process's on that whole batch, with dropout masks replayed and one
    micro-batch's activation memory. `logit_scale` and `logit_bias` are read once
    per step from the model's parameters (open_clip's `CLIP`, `CustomTextCLIP`
    and SigLIP models keep them as `logit_scale` (log) and `logit_bias`).
    Scheduler, zero_grad, `--grad-clip-norm`, the GradScaler and the
    `logit_scale` clamp are open_clip_train's. A window left short at the end of the
    epoch is dropped, as open_clip_train drops it. The logged loss is the whole
    batch's (open_clip_train logs rank 0's share of its last micro-batch).

    Args:
        model: the model as open_clip_train builds it (DDP under torchrun).
        data: open_clip_train's data dict; `data["train"]` has `set_epoch` and `dataloader`.
        loss: open_clip's `ClipLoss`/`SigLipLoss` (rebuilt exact, same flags) or this module's.
        epoch: the epoch index.
        optimizer: steps the parameters.
        scaler: a GradScaler for `--precision amp`, or None.
        scheduler: `scheduler(step)` sets the learning rate (skipped with `args.skip_scheduler`).
        dist_model: the distillation teacher; must be None (not supported yet).
        args: open_clip_train's parsed arguments.
        tb_writer: a TensorBoard writer, or None.
    """
    accum = _check_args(args, dist_model)
    device = torch.device(args.device)
    autocast = _autocast(args.precision, device.type)
    input_dtype = _input_dtype(args.precision)
    loss_mod = whole_batch_loss(loss)
    cache = GradCache(model, embed_fn=_embed)  # type: ignore[arg-type]  # _embed also takes the autocast flag
    inner: Any = _unwrap(model)

    def whole_loss(img_ND: Tensor, txt_ND: Tensor) -> Tensor:
        scale = inner.logit_scale.exp()  # once per step: its gradient is the whole batch's
        out = loss_mod(img_ND, txt_ND, scale, getattr(inner, "logit_bias", None))
        assert isinstance(out, Tensor)
        return out

    model.train()
    data["train"].set_epoch(epoch)
    dataloader = data["train"].dataloader
    num_batches_per_epoch = dataloader.num_batches // accum
    sample_digits = math.ceil(math.log(dataloader.num_samples + 1, 10))
    losses_m: dict[str, _Meter] = {}
    batch_time_m, data_time_m = _Meter(), _Meter()
    window: list[tuple[Tensor, Tensor]] = []
    end = time.time()
    for i, batch in enumerate(dataloader):
        i_accum = i // accum
        step = num_batches_per_epoch * epoch + i_accum
        if not getattr(args, "skip_scheduler", False) and scheduler is not None:
            scheduler(step)
        images, texts = batch
        images = images.to(device=device, dtype=input_dtype, non_blocking=True)
        texts = texts.to(device=device, non_blocking=True)
        data_time_m.update(time.time() - end)
        window.append((images, texts))
        if len(window) < accum:
            continue
        optimizer.zero_grad()
        with autocast():
            total_loss = cache(window, whole_loss)
        # The scale before the step, as open_clip_train logs it.
        scale_logged = float(inner.logit_scale.detach().exp())
        _backward_and_step(total_loss, model, optimizer, scaler, args.grad_clip_norm)
        rows = len(window[-1][0])
        window = []
        with torch.no_grad():  # open_clip_train's clamp to ln(100)
            inner.logit_scale.clamp_(0, math.log(100))
        batch_time_m.update(time.time() - end)
        end = time.time()
        batch_count = i_accum + 1
        if _is_master(args) and (
            i_accum % args.log_every_n_steps == 0 or batch_count == num_batches_per_epoch
        ):
            losses = {"contrastive_loss": total_loss.detach(), "loss": total_loss.detach()}
            # fmt: skip below and on _log_step: open_clip_train's 16 logging arguments, in
            # its order, packed (one a line would be 40 lines of the same names twice)
            _log_step(
                args, epoch, step, batch_count, num_batches_per_epoch, rows, accum,
                sample_digits, dataloader.num_samples, losses, losses_m, batch_time_m,
                data_time_m, scale_logged, optimizer, tb_writer,
            )  # fmt: skip
    # A window left short here is dropped, as open_clip_train's loop drops it.


def _log_step(
    args: Any, epoch: int, step: int, batch_count: int, num_batches_per_epoch: int,
    batch_size: int, accum: int, sample_digits: int, samples_per_epoch: int,
    losses: dict[str, Tensor], losses_m: dict[str, _Meter], batch_time_m: _Meter,
    data_time_m: _Meter, logit_scale_scalar: float, optimizer: torch.optim.Optimizer,
    tb_writer: Any,
) -> None:  # fmt: skip
    """open_clip_train's log line and scalars (the loss is the whole batch's)."""
    num_samples = batch_count * batch_size * accum * args.world_size
    percent_complete = 100.0 * batch_count / num_batches_per_epoch
    for key, val in losses.items():
        losses_m.setdefault(key, _Meter()).update(val.item(), batch_size)
    loss_log = " ".join(
        f"{name.capitalize()}: {m.val:#.5g} ({m.avg:#.5g})" for name, m in losses_m.items()
    )
    samples_per_second = accum * args.batch_size * args.world_size / max(batch_time_m.val, 1e-9)
    samples_per_second_per_gpu = accum * args.batch_size / max(batch_time_m.val, 1e-9)
    lr = optimizer.param_groups[0]["lr"]
    logging.info(
        f"Train Epoch: {epoch} [{num_samples:>{sample_digits}}/{samples_per_epoch} "
        f"({percent_complete:.0f}%)] Data (t): {data_time_m.avg:.3f} Batch (t): "
        f"{batch_time_m.avg:.3f}, {samples_per_second:#g}/s, {samples_per_second_per_gpu:#g}/s/gpu "
        f"LR: {lr:5f} Logit Scale: {logit_scale_scalar:.3f} " + loss_log
    )
    log_data: dict[str, Any] = {
        "data_time": data_time_m.val,
        "batch_time": batch_time_m.val,
        "samples_per_second": samples_per_second,
        "samples_per_second_per_gpu": samples_per_second_per_gpu,
        "scale": logit_scale_scalar,
        "lr": lr,
    }
    log_data.update({name: m.val for name, m in losses_m.items()})
    log_data = {"train/" + name: val for name, val in log_data.items()}
    if tb_writer is not None:
        for name, val in log_data.items():
            tb_writer.add_scalar(name, val, step)
    if getattr(args, "wandb", False):
        wandb = require_peer("wandb", "wandb", "train_one_epoch (--report-to wandb)")
        log_data["step"] = step
        wandb.log(log_data, step=step)
    batch_time_m.reset()
    data_time_m.reset()


class _CpuDeviceIdsDDP(torch.nn.parallel.DistributedDataParallel):
    """DDP that drops `device_ids=[cpu]`, which open_clip_train's CLI passes with `--device cpu`.

    open_clip_train 3.3.0's `main` wraps the model as
    ``DistributedDataParallel(model, device_ids=[device])`` whatever the device; with a
    CPU device DDP raises ("device_ids ... only work with ... GPU modules or CPU modules"),
    so its CLI cannot train on CPU ranks at all. For CPU modules DDP wants no device_ids:
    they are dropped; any other device is passed through unchanged.
    """

    def __init__(self, module: nn.Module, device_ids: Any = None, *args: Any, **kw: Any) -> None:
        if device_ids is not None and all(torch.device(d).type == "cpu" for d in device_ids):
            device_ids = None
        super().__init__(module, device_ids, *args, **kw)


def main(argv: Sequence[str] | None = None) -> None:
    """open_clip_train's CLI (`open_clip_train.main.main`) with wholebatch's `train_one_epoch`.

    `python -m wholebatch.integrations.open_clip ARGS` (or `torchrun ... -m
    wholebatch.integrations.open_clip -- ARGS`) takes open_clip_train's arguments
    unchanged; a leading `--` is dropped (torchrun needs it before `--logs`, which
    it would otherwise read as an ambiguous abbreviation of its own `--logs-specs`).
    The loop it trains with is this module's `train_one_epoch`, which rebuilds
    `create_loss`'s ClipLoss / SigLipLoss as this module's exact ones (patching
    `open_clip.loss` would not reach `create_loss`: `open_clip.factory` imported the
    classes by name). While `main` runs, `torch.nn.parallel.DistributedDataParallel`
    is `_CpuDeviceIdsDDP` (a subclass: open_clip_train passes `device_ids=[cpu]` under
    `--device cpu`, which DDP refuses); it is restored afterwards.
    """
    cli: Any = require_peer("open_clip_train.main", "open-clip-torch", "wholebatch's open_clip CLI")
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    cli.train_one_epoch = train_one_epoch  # main() looks the loop up in its own module
    parallel: Any = torch.nn.parallel
    ddp = parallel.DistributedDataParallel
    parallel.DistributedDataParallel = _CpuDeviceIdsDDP
    try:
        cli.main(args)
    finally:
        parallel.DistributedDataParallel = ddp


if __name__ == "__main__":  # pragma: no cover - the CLI entry
    # The imported module's `main`, not this `__main__` copy's: one set of classes.
    from wholebatch.integrations.open_clip import main as _main

    _main()
