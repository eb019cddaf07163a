"""lightly's `NTXentLoss`, exact over the whole batch, with its memory bank.

Change two lines of a lightly SimCLR / MoCo script (docs/integrations/lightly.md):

    # from lightly.loss import NTXentLoss
    from wholebatch.integrations.lightly import NTXentLoss

    loss_fn = NTXentLoss(temperature=0.5, memory_bank_size=0, gather_distributed=True)
    loss = loss_fn(out0, out1)        # (B x D) each; normalised inside, as lightly does

Without a memory bank this is `wholebatch.nt_xent_loss` on the L2-normalised
views: SimCLR's loss over all 2N views of the whole batch, memory-linear, exact
after DDP's mean for any split of rows over ranks (0 rows included). This
module does not import lightly.

`gather_distributed` is accepted and has no effect: the loss is always that of
the whole batch over `group` (default: the world), which is what lightly
computes with `gather_distributed=True` when every rank holds the same number
of rows. (With `False` lightly trains each rank on its own negatives; to do
that on purpose, pass a one-rank `group`.)

The memory bank (MoCo style), `memory_bank_size=(K, D)`, has these whole-batch
semantics, which are lightly's with `gather_distributed=True`, made exact for
uneven rows:

- ONE bank of K rows shared by every rank: rank 0's freshly drawn bank is
  broadcast on the first call, and every update is the same on every rank;
- the loss of row i (of every rank) is cross-entropy of [z0ᵢ·z1ᵢ, z0ᵢ·bank] / τ
  against class 0, the bank read BEFORE this call's update; the loss returned
  is the mean over all N rows of the whole batch (not over this rank's rows);
- when training (out0 requires grad, agreed on every rank), the N rows of
  z1 (every rank's, in rank order, detached) are written at the bank pointer
  as lightly does (rows that do not fit before the end are dropped and the
  pointer returns to 0);
- the bank carries no gradient, so only the rows' own terms differentiate:
  one process holding the whole batch and one bank computes exactly this.

Legend: W ranks, B this rank's rows, N global rows, D embedding dim, K bank rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from wholebatch.comm import (
    Field,
    agree_rows,
    all_gather,
    broadcast,
    comm_device,
    get_world_size,
    is_distributed,
)
from wholebatch.conventions import GradReduction, check_grad_reduction
from wholebatch.errors import WholebatchError, WholebatchTypeError
from wholebatch.losses import nt_xent_loss, tile_size_for
from wholebatch.losses.tiles import cpu_tile_threads

__all__ = ["NTXentLoss"]

_EPS = 1e-8  # lightly refuses |temperature| below this


def _bank_shape(size: int | Sequence[int]) -> tuple[int, ...]:
    """lightly's accepted sizes: 0 (no bank) or (K, D) with K, D >= 0."""
    shape = (size,) if isinstance(size, int) else tuple(size)
    if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in shape):
        raise WholebatchError(
            f"NTXentLoss: memory_bank_size={size!r}; every entry must be a non-negative int"
        )
    if isinstance(size, int) and size > 0:
        raise WholebatchError(
            f"NTXentLoss: memory_bank_size={size} does not give the feature dimension; "
            f"pass memory_bank_size=({size}, dim), or 0 for no memory bank"
        )
    if shape != (0,) and len(shape) != 2:
        raise WholebatchError(
            f"NTXentLoss: memory_bank_size={size!r}; expected (num_features, dim) or 0"
        )
    return shape


class NTXentLoss(nn.Module):
    """lightly's `NTXentLoss` over the whole batch: SimCLR, or MoCo with a shared memory bank.

    Gradient contract: every rank of `group` calls it with its own rows and
    back-propagates the value it gets (the same on every rank); with DDP
    averaging gradients (``grad_reduction="mean"``), the encoder's gradient
    equals one process's on the concatenated batch; with ``"sum"``, after a
    sum over ranks. Without a bank, gradients to other ranks' rows return
    through the all-gather's reduce-scatter; with a bank there are none.

    Args:
        temperature: τ; logits are divided by it. |τ| >= 1e-8.
        memory_bank_size: 0 for SimCLR, or (K, D) for a bank of K negatives of dim D.
        gather_distributed: accepted, no effect (the loss is always the whole batch's).
        group: the process group the batch is split over (default: the world).
        grad_reduction: "mean" if parameter gradients are averaged over ranks (DDP), "sum" if summed.
        tile_size: rows and columns of one logits tile (with a bank: tiles of
            tile_size² logits, tile_size² / K rows of the K columns); None: chosen
            for the device.
    """

    bank: Tensor
    bank_ptr: Tensor

    def __init__(
        self,
        temperature: float = 0.5,
        memory_bank_size: int | Sequence[int] = 0,
        gather_distributed: bool = False,
        *,
        group: ProcessGroup | None = None,
        grad_reduction: GradReduction = "mean",
        tile_size: int | None = None,
    ) -> None:
        super().__init__()
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise WholebatchTypeError(
                f"NTXentLoss: temperature must be a number, got {type(temperature).__name__}"
            )
        if abs(temperature) < _EPS:
            raise WholebatchError(
                f"NTXentLoss: temperature={temperature}; |temperature| must be >= {_EPS} "
                "(logits are divided by it)"
            )
        check_grad_reduction("NTXentLoss", grad_reduction)
        self.temperature = float(temperature)
        self.gather_distributed = gather_distributed
        self.group = group
        self.grad_reduction: GradReduction = grad_reduction
        self.tile_size = tile_size
        self.size = _bank_shape(memory_bank_size)
        # lightly's layout: float32 buffers, not saved in the state dict, a random unit bank.
        self.register_buffer("bank", torch.empty(self.size, dtype=torch.float), persistent=False)
        self.register_buffer("bank_ptr", torch.zeros(1, dtype=torch.long), persistent=False)
        if len(self.size) == 2:
            with torch.no_grad():
                self.bank = F.normalize(torch.randn(self.size).type_as(self.bank), dim=-1)
        self._bank_synced = False

    def forward(self, out0: Tensor, out1: Tensor) -> Tensor:
        """The whole batch's loss (the same on every rank).

        Args:
            out0: this rank's first-view projections (B x D), any norm: normalised here.
            out1: this rank's second-view projections (B x D); row i is the same sample.
        """
        if self.size[0] == 0:
            z0, z1 = (F.normalize(x, dim=1) if _is_2d(x) else x for x in (out0, out1))
            return nt_xent_loss(
                z0,
                z1,
                self.temperature,
                group=self.group,
                grad_reduction=self.grad_reduction,
                tile_size=self.tile_size,
            )
        return self._bank_loss(out0, out1)

    # -- the memory bank --------------------------------------------------------

    def _local_error(self, out0: Tensor, out1: Tensor) -> str | None:
        for name, x in (("out0", out0), ("out1", out1)):
            if not isinstance(x, Tensor) or not _is_2d(x) or not x.is_floating_point():
                shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
                return f"{name} must be a 2-D float tensor (rows, dim), got {shape}"
        if out0.shape != out1.shape:
            return f"out0 has shape {tuple(out0.shape)} but out1 has {tuple(out1.shape)}"
        if out0.shape[1] != self.size[1]:
            return f"the embeddings have dim {out0.shape[1]} but the memory bank has {self.size[1]}"
        return None

    def _bank_loss(self, out0: Tensor, out1: Tensor) -> Tensor:
        err = self._local_error(out0, out1)
        w = get_world_size(self.group)
        if err is not None and not is_distributed(self.group):
            raise WholebatchError(f"NTXentLoss: {err}")
        update = bool(err is None and out0.requires_grad)
        if err is None:
            bank_KD = self._shared_bank().to(out0.dtype)  # read before this call's update
            # Cross-entropy against class 0 of [positive | K negatives] of the normalised
            # views, in row tiles of as many logits as one square tile (T x T): T²/K rows.
            tile = self.tile_size or tile_size_for(out0.device.type, out0.shape[0], len(bank_KD))
            rows = max(1, min(tile, tile * tile // max(1, len(bank_KD))))
            loss_B: Tensor = _BankNTXent.apply(out0, out1, bank_KD, 1.0 / self.temperature, rows)  # type: ignore[no-untyped-call]  # torch types Function.apply as untyped
            local = loss_B.sum()
            row: dict[str, Field] = {
                "error": 0,
                "loss": local.detach(),
                "rows": out0.shape[0],
                "update": update,
            }
        else:
            self._shared_bank()  # the broadcast every rank joins on the first call
            row = {"error": 1, "loss": 0.0, "rows": 0, "update": False}
        # One all-gather of 4 numbers per rank: errors, loss sums, row counts, update flags.
        table = agree_rows(row, group=self.group)
        if bad := table.ranks_where("error"):
            raise WholebatchError(
                f"NTXentLoss: bad embeddings on ranks {bad}"
                + (f" (here: {err})" if err else "")
                + "; pass out0 and out1 of shape (rows, bank dim) on every rank"
            )
        if not table.same("update"):
            raise WholebatchError(
                "NTXentLoss: out0 requires grad on some ranks and not on others "
                f"({ {r: bool(v) for r, v in enumerate(table['update'])} }); the shared memory bank "
                "is updated only when training, so every rank must be in the same mode"
            )
        sizes = list(table.ints("rows"))
        n = sum(sizes)
        if n == 0:
            raise WholebatchError("NTXentLoss: the whole batch has 0 rows; pass at least one row")
        total = table.total("loss")
        factor = w if self.grad_reduction == "mean" else 1
        # The value is the whole batch's mean; the gradient is this rank's rows' own
        # (the bank is constant), times W so that DDP's mean leaves exactly dL.
        loss = (local.new_tensor(total) + factor * (local - local.detach())) / n
        if update:
            with torch.no_grad():
                z1 = F.normalize(out1.detach(), dim=1)
                z1_ND = all_gather(z1, sizes=sizes, group=self.group, check=False)
                self._enqueue(z1_ND)
        return loss

    @torch.no_grad()
    def _shared_bank(self) -> Tensor:
        """The bank, made the same on every rank (rank 0's) on the first call.

        Not a copy: the loss reads it in its forward, before this call's update,
        and keeps nothing of it for the backward.
        """
        if not self._bank_synced:
            if is_distributed(self.group):
                device = comm_device(self.group)
                synced = broadcast(self.bank.to(device), src=0, group=self.group)
                self.bank.copy_(synced.to(self.bank.device))
            self._bank_synced = True
        return self.bank

    @torch.no_grad()
    def _enqueue(self, z1_ND: Tensor) -> None:
        """Write the whole batch's second views at the pointer, as lightly does."""
        k, ptr, n = self.size[0], int(self.bank_ptr), z1_ND.shape[0]
        if ptr + n >= k:
            self.bank[ptr:] = z1_ND[: k - ptr].to(self.bank.dtype)
            self.bank_ptr.zero_()
        else:
            self.bank[ptr : ptr + n] = z1_ND.to(self.bank.dtype)
            self.bank_ptr[0] = ptr + n

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}, memory_bank_size={self.size}"


class _BankNTXent(torch.autograd.Function):
    """l_i = log(exp(pos_i) + Σ_k exp(c·z0_i·bank_k)) − pos_i, pos_i = c·z0_i·z1_i, z = F.normalize(out).

    The bank is a constant and each l_i depends on row i's two views alone, so
    the forward goes through `rows` rows at a time: it normalises them, forms
    the rows x K tile of logits once and, when a view needs a gradient, the
    gradient of l_i with respect to out0_i and out1_i, through the
    normalisation (one more rows x K by K x D product, as the plain formula's
    backward). It keeps those two B x D results and nothing else: no
    normalised copy of the views, no logits; backward scales them by the
    incoming per-row gradient. Peak memory O(B·D + rows·K).
    """

    @staticmethod
    def forward(  # type: ignore[override]  # Function.forward takes (ctx, *args) by design
        ctx: Any, out0: Tensor, out1: Tensor, bank_KD: Tensor, c: float, rows: int
    ) -> Tensor:
        need0, need1 = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss_B = out0.new_empty(out0.shape[0])
        d0 = torch.empty_like(out0) if need0 else None
        d1 = torch.empty_like(out1) if need1 else None
        with cpu_tile_threads(out0.device):  # the losses' tile-loop thread policy
            for i in range(0, out0.shape[0], rows):
                at = slice(i, i + rows)
                x0, x1 = out0[at], out1[at]
                r0, r1 = x0.norm(dim=1, keepdim=True), x1.norm(dim=1, keepdim=True)
                n0, n1 = r0.clamp_min(_NORM_EPS), r1.clamp_min(_NORM_EPS)  # as F.normalize
                z0, z1 = x0 / n0, x1 / n1
                pos = (z0 * z1).sum(1) * c
                neg = (z0 @ bank_KD.T).mul_(c)
                lse = torch.logaddexp(pos, torch.logsumexp(neg, 1))
                loss_B[at] = lse - pos
                if d0 is None and d1 is None:
                    continue
                # 1 - softmax weight of the positive, without cancellation when it is ~1
                miss = -torch.expm1(pos - lse)[:, None] * c
                if d0 is not None:  # dl/dz0 = c·Σ_k p_k bank_k − c·(1 − p_pos)·z1
                    dz0 = (neg.sub_(lse[:, None]).exp_() @ bank_KD).mul_(c).sub_(miss * z1)
                    d0[at] = _through_normalize(dz0, z0, r0, n0)
                if d1 is not None:  # dl/dz1 = −c·(1 − p_pos)·z0
                    d1[at] = _through_normalize(-miss * z0, z1, r1, n1)
        ctx.save_for_backward(d0, d1)
        return loss_B

    @staticmethod
    def backward(ctx: Any, grad_B: Tensor) -> tuple[Tensor | None, ...]:
        d0, d1 = ctx.saved_tensors  # saved: never scaled in place
        g = grad_B[:, None]
        return (
            None if d0 is None else d0 * g,
            None if d1 is None else d1 * g,
            None,
            None,
            None,
        )


_NORM_EPS = 1e-12  # F.normalize's default


def _through_normalize(dz: Tensor, z: Tensor, raw: Tensor, n: Tensor) -> Tensor:
    """d/dx of z = x / max(|x|, eps) applied to dz: (dz − z·(z·dz)) / |x|, or dz / eps when clamped."""
    return torch.where(raw > _NORM_EPS, dz - z * (z * dz).sum(1, keepdim=True), dz) / n


def _is_2d(x: object) -> bool:
    return isinstance(x, Tensor) and x.dim() == 2
