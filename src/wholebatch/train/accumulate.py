"""Exact gradient accumulation: the whole-batch gradient from K micro-batches on W ranks.

    acc = Accumulator(ddp_model, optimizer, max_grad_norm=1.0)
    for micro_batches in loader:                 # each: a list of K micro-batches
        stats = acc.step(micro_batches, loss_fn) # forward+backward K times, then one step
    # loss_fn(model, mb) -> (sum of item losses: Tensor, number of items: int | Tensor)

The rule (DESIGN.md, "Normalise once, globally"): the step's gradient is that of
(sum of every item loss) / N, N the number of items in the whole step, across
all K micro-batches and all W ranks. Never a mean of per-micro-batch means: that
over-weights short micro-batches (the bug in the Hugging Face Trainer until late
2024). See docs/accumulation.md.

How N is applied: "rescale once after backward". `loss_fn` returns a micro-batch's
count only after its forward, so N is known only after the last forward; agreeing
it before any backward would hold all K graphs in memory (or need a second
counting pass over the data). Instead each micro-batch back-propagates its loss
SUM times one constant c, the same on every rank; after the last backward one
small all-gather agrees N (with the loss, the non-finite flags and the sharded
grad-norm part), and the accumulated gradient is multiplied once by
(W for DDP's mean, 1 for "sum") / (c · N). Gradients are linear in the loss, so
this equals back-propagating sum/N directly, to round-off. c is W/N' (or 1/N')
with N' the previous step's agreed count (1 on the first step): the gradient
flowing through the DDP hook and the GradScaler then has the size of a mean
loss's gradient, so AMP's inf checks and fp16 wires behave as for a mean loss
rather than overflowing on sums; the exact N is applied afterwards regardless.
The AMP scale is removed by `GradScaler.unscale_` before the norm, so clipping
and the reported norm are those of the true whole-batch gradient.

Other normalisations (`step(..., normalize=Normalize(mode, items=...))`: "sequence",
"constant", "group" over the whole step) cannot be applied after backward: their
normalisers are per sequence or group, not one scalar. A counting pass over the
micro-batches' index tensors (no forward) and the same all-gather that agrees K give
every item its exact weight first (`wholebatch.train.normalize`); on a mesh the
table holds each data shard's rows once (agreed over the batch dims, replicas checked).

Communication: micro-batches 0..K-2 run forward AND backward under `no_sync()`
(DDP) or `set_requires_gradient_sync(False)` (FSDP2); the last synchronises:
exactly one gradient reduction per step. Every rank must therefore run the same
K; it is agreed (one small all-gather) before the first forward and a mismatch
raises the same error on every rank. The iterable is materialised into a list
for that.

Legend: W world size, K micro-batches per step, N global item count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from wholebatch.comm.agree import agree_rows
from wholebatch.comm.mesh import MeshSplit
from wholebatch.conventions import GradReduction
from wholebatch.errors import WholebatchError, WholebatchTypeError
from wholebatch.train.auxloss import TermStep, find_terms
from wholebatch.train.compression import CommStats, GradCompression, register_compression
from wholebatch.train.feeds import check_feeds, feed_fields
from wholebatch.train.gradcache import replayed_rng, rng_state
from wholebatch.train.meshstep import ModuleDims
from wholebatch.train.normalize import (
    ItemIds,
    LocalRows,
    Normalize,
    StepWeights,
    begin_fields,
    check_agreed,
    concat_tables,
    count_items,
    local_rows,
    mesh_table,
    rank_tables,
    read_items,
)
from wholebatch.train.stepping import (
    OnNonFinite,
    StepConfig,
    StepFinisher,
    StepStats,
    sync_context,
)
from wholebatch.train.wrappers import ddp_of, fsdp_modules, fsdp_sync_state, set_fsdp_sync

if TYPE_CHECKING:  # annotations only: the engines import without a mesh in use
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Accumulator", "AccumulatorConfig", "LossFn", "LossReduction"]


def _nothing() -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


LossReduction = Literal["sum", "mean", "none"]
MB = TypeVar("MB")
LossFn = Callable[[nn.Module, MB], tuple[Tensor, int | float | Tensor] | Tensor]


@dataclasses.dataclass(frozen=True, kw_only=True)
class AccumulatorConfig:
    """How an `Accumulator` normalises, reduces, clips and compresses."""

    max_grad_norm: float | None = None
    """Clip the whole-batch gradient (after unscaling) to this L2 norm; None: no clipping."""

    grad_compression: str | GradCompression | None = None
    """None, "fp16", "bf16", "powersgd", or a `GradCompression`: a PyTorch DDP comm hook
    for the step's one gradient all-reduce (DDP only; needs grad_reduction="mean")."""

    grad_reduction: GradReduction = "mean"
    """How the wrapper combines rank gradients: "mean" (DDP, FSDP2) or "sum"."""

    loss_reduction: LossReduction = "sum"
    """What `loss_fn` returns. "sum": (sum of item losses, item count), e.g. token-level
    cross-entropy with reduction="sum". "mean": (mean over its items, item count or
    weight); the sum is mean × count, so a zero-count micro-batch must return a finite
    mean (cross_entropy(reduction="mean") over all-ignored targets is NaN: use "sum").
    "none": a tensor of per-item losses (items = its numel), e.g. per-sample losses
    for a per-sample mean."""

    on_nonfinite: OnNonFinite = "skip"
    """A non-finite loss/gradient on any rank, or a step with no items: "skip" the step
    on every rank (reported in StepStats) or "raise" NonFiniteStepError on every rank."""

    rank_local: bool = False
    """Allow a plain module (no DDP/FSDP) on W > 1 ranks, each rank stepping on its own
    gradient. Without it `step` raises the same error on every rank: nothing would reduce
    the gradients (accelerate's silent no-DDP mode, or `ddp.module` passed by mistake)."""

    def __post_init__(self) -> None:
        if self.loss_reduction not in ("sum", "mean", "none"):
            raise WholebatchError(
                f"Accumulator: loss_reduction={self.loss_reduction!r}; expected 'sum' "
                "(loss_fn returns (sum, count)), 'mean' ((mean, count)) or 'none' (per-item losses)"
            )
        spec = GradCompression.parse(self.grad_compression)
        if spec is not None and self.grad_reduction != "mean":
            raise WholebatchError(
                f"Accumulator: grad_compression={spec.kind!r} uses PyTorch's DDP hooks, which "
                f"average over ranks, but grad_reduction={self.grad_reduction!r}; use "
                "grad_reduction='mean' (the Accumulator compensates the 1/W)"
            )
        self.step_config()  # validates max_grad_norm, grad_reduction, on_nonfinite

    def step_config(self) -> StepConfig:
        """The part of this config that finishing a step needs."""
        return StepConfig(
            max_grad_norm=self.max_grad_norm,
            grad_reduction=self.grad_reduction,
            on_nonfinite=self.on_nonfinite,
            rank_local=self.rank_local,
        )


class Accumulator:
    """One optimizer step over K micro-batches with the whole-batch gradient.

    Every rank of the group calls `step` with the same number of micro-batches.
    After it, the parameters have taken one optimizer step on
    d(sum of item losses / N)/dθ (N: global item count) and their grads are None.

    Args:
        model: the module to train: DDP, FSDP2 (`fully_shard`), or plain. `loss_fn`
            receives it; call it, not its inner module, so DDP sees the forward.
        optimizer: steps the parameters; clipping and the norm cover its parameters.
        scaler: a `torch.amp.GradScaler` for fp16 AMP (the loss_fn runs autocast itself).
        max_grad_norm: see `AccumulatorConfig.max_grad_norm`.
        grad_compression: see `AccumulatorConfig.grad_compression`.
        grad_reduction: see `AccumulatorConfig.grad_reduction`.
        loss_reduction: see `AccumulatorConfig.loss_reduction`.
        on_nonfinite: see `AccumulatorConfig.on_nonfinite`.
        rank_local: see `AccumulatorConfig.rank_local`.
        group: the data-parallel group; None: DDP's process group, else the world.
        mesh: a `DeviceMesh` instead of `group` (docs/mesh.md): the model runs on it
            (FSDP2/DDP on some dims, tensor parallel on others) and items are counted
            over `batch_dims` only; ranks that replicate the batch must report the
            same items and loss (else the same error on every rank).
        batch_dims: with `mesh`, the dims that split the batch (data and context
            parallel); every other dim replicates it (tensor parallel).
        module_batch_dims: with `mesh`, submodules (or their names) whose data is split
            over other dims than `batch_dims`, e.g. `{model.encoder: ("dp_enc",)}` for a
            vision encoder data-parallel over every rank (a flattened dp x tp dim) beside
            a language model on dp x tp. Each module's gradient is rescaled by its own
            wrapper's reduction over its own dims (docs/mesh.md, "Modules on their own
            data-parallel dims"); N stays the loss's, counted over `batch_dims`.
        check_inputs: on a mesh with replica dims, prove before the first forward that
            the ranks replicating the batch were fed the same micro-batches (a
            fingerprint of their tensors rides in the agreement of K: no extra
            collective; `wholebatch.train.feeds`). False: trust it (a module that
            slices its own part of the shard, so the inputs differ by design).
        config: a whole `AccumulatorConfig`, instead of the keyword arguments above.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None = None,
        max_grad_norm: float | None = None,
        grad_compression: str | GradCompression | None = None,
        grad_reduction: GradReduction = "mean",
        *,
        loss_reduction: LossReduction = "sum",
        on_nonfinite: OnNonFinite = "skip",
        rank_local: bool = False,
        group: ProcessGroup | None = None,
        mesh: DeviceMesh | None = None,
        batch_dims: Sequence[str] | None = None,
        module_batch_dims: ModuleDims | None = None,
        check_inputs: bool = True,
        config: AccumulatorConfig | None = None,
    ) -> None:
        if config is None:
            config = AccumulatorConfig(
                max_grad_norm=max_grad_norm,
                grad_compression=grad_compression,
                grad_reduction=grad_reduction,
                loss_reduction=loss_reduction,
                on_nonfinite=on_nonfinite,
                rank_local=rank_local,
            )
        self.config = config
        self.model = model
        self.optimizer = optimizer
        split = MeshSplit.from_args("Accumulator", mesh, batch_dims, group=group)
        self.split = split
        self.check_inputs = bool(check_inputs)
        self.finisher = StepFinisher(
            model,
            optimizer,
            scaler=scaler,
            config=config.step_config(),
            group=group,
            split=split,
            module_dims=module_batch_dims,
        )
        self.scaler = self.finisher.scaler
        spec = GradCompression.parse(config.grad_compression)
        self.comm_stats: CommStats | None = (
            None if spec is None else register_compression(model, spec, self.finisher.group)  # type: ignore[arg-type]
        )
        # N' of the module docstring: the last agreed item count (same on every rank).
        self.items_estimate = 1.0
        # Auxiliary losses whose statistics are the whole batch's (wholebatch.train.auxloss).
        self.terms = find_terms(model)

    @property
    def steps(self) -> int:
        """Optimizer steps taken (skipped steps not counted)."""
        return self.finisher.steps

    def backward_scale(self, *, weighted: bool = False) -> float:
        """The constant c each micro-batch's loss sum is multiplied by before backward.

        `weighted`: the losses carry their exact weights (a `Normalize` mode), so
        there is no N to estimate: c = W ("mean") or 1 ("sum").
        """
        factor = self.finisher.reduce_factor  # W for "mean", 1 for "sum"; on a mesh, meshstep's
        return factor if weighted else factor / self.items_estimate

    def _sum_and_count(
        self, out: Any, index: int, *, graph: bool = True
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(sum of item losses, its float64 detached value, item count) of one micro-batch
        (`graph=False`: a forward without graph, the counting pass's)."""
        mode = self.config.loss_reduction
        where = f"Accumulator.step: loss_fn(model, micro_batches[{index}])"
        if mode == "none":
            if not isinstance(out, Tensor):
                raise WholebatchTypeError(
                    f"{where} returned {type(out).__name__}; with loss_reduction='none' it "
                    "must return a tensor of per-item losses"
                )
            losses = out
            loss, count = losses.sum(), torch.tensor(losses.numel(), device=losses.device)
        else:
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise WholebatchTypeError(
                    f"{where} returned {type(out).__name__}; with loss_reduction={mode!r} it "
                    f"must return ({mode} of item losses: Tensor, number of items: int | Tensor)"
                )
            loss, n = out
            if not isinstance(loss, Tensor) or loss.numel() != 1:
                raise WholebatchTypeError(
                    f"{where}: the loss must be a one-element Tensor, got "
                    f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, Tensor) else ''}"
                )
            if isinstance(n, Tensor):
                if n.numel() != 1:
                    raise WholebatchTypeError(
                        f"{where}: the item count must be one number, got shape {tuple(n.shape)}"
                    )
                count = n.detach().reshape(()).to(device=loss.device)
            elif isinstance(n, (int, float)) and not isinstance(n, bool):
                count = torch.tensor(n, device=loss.device)
            else:
                raise WholebatchTypeError(
                    f"{where}: the item count must be an int, float or Tensor, got {type(n).__name__}"
                )
            loss = loss.reshape(())
            if mode == "mean":
                loss = loss * count.to(loss.dtype)
        if graph and not loss.requires_grad:
            raise WholebatchError(
                f"{where}: the loss does not require grad, so backward cannot run (and DDP's "
                "reduction would wait forever on the peers); a micro-batch with no items must "
                "still return a loss computed from the model output, e.g. (logits.sum() * 0, 0)"
            )
        return loss, loss.detach().to(torch.float64), count.to(torch.float64)

    def step(
        self,
        micro_batches: Iterable[MB],
        loss_fn: LossFn[MB],
        *,
        normalize: Normalize | None = None,
    ) -> StepStats:
        """Forward and backward every micro-batch, then take one optimizer step.

        Args:
            micro_batches: the step's micro-batches (any iterable; materialised into a
                list so that K is agreed before the first forward). The same K on every rank.
            loss_fn: `loss_fn(model, micro_batch)`, returning what `loss_reduction` says
                (default: (sum of item losses, number of items)); with `normalize`, the
                per-item losses shaped like `normalize.items(micro_batch)["mask"]`. It runs
                with DDP's sync disabled on all but the last micro-batch; run autocast inside it.
            normalize: a `wholebatch.Normalize` ("token", "sequence", "constant" or "group"
                over the whole step; `wholebatch.train.normalize`); None: `loss_reduction`.
                The same mode (and constant) on every rank.

        Returns:
            `StepStats`: whole-batch loss (under `normalize`'s mode), item count, grad
            norm before clipping, skipped or not, micro-batch count (identical on every rank).

        Raises:
            WholebatchError: on every rank, when K differs across ranks or is 0, the
                parameters hold gradients before the step, the model is a plain module
                on W > 1 ranks without `rank_local=True`; with `normalize`, when a rank's
                ids are bad, ranks disagree on the mode, a group has no item, a loss's
                shape is not its mask's, or (on a mesh) replicas report different tables
                (nothing is stepped); on a mesh, when ranks that replicate the batch were
                fed different micro-batches (before any forward, naming the tensor).
            NonFiniteStepError: on every rank, with on_nonfinite="raise".
        """
        if normalize is not None and not isinstance(normalize, Normalize):
            raise WholebatchTypeError(
                f"Accumulator.step: normalize must be a wholebatch.Normalize or None, got "
                f"{type(normalize).__name__}"
            )
        mbs: Sequence[MB] = list(micro_batches)
        if self.terms:  # whole-batch auxiliary terms in the model: the counting pass
            if normalize is not None:
                raise WholebatchError(
                    "Accumulator.step: normalize= with whole-batch auxiliary terms in the model "
                    f"({', '.join(n for n, _ in self.terms)}) is not supported; the terms need "
                    "the default token mean (loss_reduction)"
                )
            return self._step_with_terms(mbs, loss_fn)
        k = len(mbs)
        weights = self._begin(mbs, normalize)  # agree K (and the weights) before any forward
        weighted = weights is not None
        c = self.backward_scale(weighted=weighted)
        loss_sum: Tensor | None = None  # this rank's sum of (weighted) item losses, float64
        items: Tensor | None = None
        error: str | None = None
        for i, mb in enumerate(mbs):
            with sync_context(self.model, i, k):
                out = loss_fn(self.model, mb)
                if normalize is None:
                    loss, stat, count = self._sum_and_count(out, i)
                else:
                    loss, stat, count, bad = self._normalized(out, normalize, weights, mb, i)
                    error = error or bad
                torch.autograd.backward(self.finisher.scale_loss(loss * c))
            loss_sum = stat if loss_sum is None else loss_sum + stat
            items = count if items is None else items + count.to(items.device)
        assert loss_sum is not None and items is not None  # k >= 1 after begin()
        stats = self.finisher.finish(
            loss_sum=loss_sum,
            items=items,
            micro_batches=k,
            backward_scale=c,
            normalize_by_items=not weighted,
            skip_if_empty=True,
            local_error=error,
            op="Accumulator.step",
        )
        if stats.items > 0 and not weighted:
            self.items_estimate = stats.items
        return stats

    def _step_with_terms(self, mbs: Sequence[MB], loss_fn: LossFn[MB]) -> StepStats:
        """A step whose model holds whole-batch terms (`wholebatch.train.auxloss`): the
        counting pass (0..K-2 without graph, K-1 with its graph kept), one all-gather of
        the routers' counts and the items, then K-1's backward and 0..K-2 replayed with
        their RNG. Every micro-batch back-propagates c x (its loss sum / N + the terms'
        share), c = the rescale factor: exact weights, nothing rescaled after."""
        op = "Accumulator.step"
        k = len(mbs)
        self._begin(mbs, None)  # K, stale gradients, replicas' inputs: before any forward
        model, ddp, fsdp = self.model, ddp_of(self.model), fsdp_modules(self.model)
        fsdp_before = fsdp_sync_state(fsdp)
        terms = TermStep(self.terms, k)
        rngs = []
        loss_sum = items = torch.zeros((), dtype=torch.float64)
        kept: Tensor | None = None
        try:
            for i, mb in enumerate(mbs):
                last = i == k - 1
                if not last:
                    rngs.append(rng_state())
                # The kept forward must not arm DDP's reducer unless its backward is the
                # step's synchronised one (K = 1): it is back-propagated first.
                quiet = ddp.no_sync() if ddp is not None and last and k > 1 else _nothing()
                with terms.pass1(i), quiet, torch.set_grad_enabled(last):
                    loss, stat, count = self._sum_and_count(loss_fn(model, mb), i, graph=last)
                loss_sum, items = loss_sum + stat.cpu(), items + count.cpu()
                if last:
                    kept = loss
            c = self.finisher.reduce_factor
            n, term_values = self._agree_terms(op, terms, loss_sum, items, c)
            w_main = c / n if n > 0 else 0.0
            for step_index, i in enumerate([k - 1, *range(k - 1)]):
                synced = step_index == k - 1
                set_fsdp_sync(fsdp, synced)
                if i == k - 1:
                    assert kept is not None
                    with terms.backward():
                        torch.autograd.backward(self.finisher.scale_loss(kept * w_main))
                    kept = None
                    continue
                quiet = ddp.no_sync() if ddp is not None and not synced else _nothing()
                with quiet, replayed_rng(rngs[i]):
                    with terms.replay(i):
                        loss, _, _ = self._sum_and_count(loss_fn(model, mbs[i]), i)
                    with terms.backward():
                        torch.autograd.backward(self.finisher.scale_loss(loss * w_main))
            share = (loss_sum / n if n > 0 else loss_sum * 0) + terms.shares()
            error = terms.error()
        finally:
            set_fsdp_sync(fsdp, fsdp_before)
            terms.close()
        stats = self.finisher.finish(
            loss_sum=share,
            items=items,
            micro_batches=k,
            backward_scale=c,
            normalize_by_items=False,
            skip_if_empty=True,
            local_error=error,
            op=op,
        )
        if stats.items > 0:
            self.items_estimate = stats.items
        names = [name for name, _ in self.terms]
        return dataclasses.replace(stats, aux=dict(zip(names, term_values, strict=True)))

    def _agree_terms(
        self, op: str, terms: TermStep, loss_sum: Tensor, items: Tensor, c: float
    ) -> tuple[float, list[float]]:
        """One all-gather before any backward: the items and every term's counts over the
        whole batch (each data shard once on a mesh, replicas checked); sets the terms'
        coefficients. Returns (N, each term's loss)."""
        row: dict[str, Any] = dict(terms.fields())
        row.update({"items": items, "error": terms.error() is not None})
        rows = agree_rows(row, group=self.finisher.group)
        rows.error(op, terms.error())  # errors of the counting pass: before any backward
        names = [n for n in row if n.startswith("term")]
        if self.split is None:
            totals: dict[str, tuple[float, ...]] = {
                name: tuple(math.fsum(col) for col in zip(*rows.vectors(name), strict=True))
                for name in names
            }
            n = rows.total("items")
        else:
            totals = self.split.shard_totals(op, rows, [*names, "items"], "router statistics")
            n = totals["items"][0]
        counts = [
            torch.tensor(totals[x], dtype=torch.float64) for x in names if x.endswith("counts")
        ]
        sums = [torch.tensor(totals[x], dtype=torch.float64) for x in names if x.endswith("sums")]
        amp = self.finisher.loss_scale or 1.0
        return n, terms.agree(counts, sums, scale=c * amp)

    def _begin(self, mbs: Sequence[MB], norm: Normalize | None) -> StepWeights | None:
        """Agree K; with a weighted mode, the counting pass and its table: every item's weight.

        The counting pass calls only `norm.items` (index tensors; no forward). Its facts,
        and the (sequence, group, count) rows when each rank has at most `INLINE_ROWS`,
        ride on `begin`'s all-gather; more rows take one more all-gather. Errors are
        raised on every rank before any forward.
        """
        op = "Accumulator.step"
        ids: list[ItemIds] = []
        error: str | None = None
        mine: LocalRows | None = None
        if norm is not None and norm.weighted:
            ids, error = count_items(norm, mbs)
            if error is None and norm.needs_table:
                mine = local_rows(norm, ids)
        extra = begin_fields(norm, mine, error)
        fed = self.split if self.check_inputs else None
        fed_with = {"micro_batches": mbs}
        extra.update(feed_fields(fed, fed_with))  # replicas fed alike: in the same all-gather
        rows = self.finisher.begin(len(mbs), op=op, extra=extra)
        check_feeds(op, fed, rows, fed_with)
        check_agreed(rows, op, error)
        if norm is None or not norm.weighted:
            return None
        table = None
        if norm.needs_table:
            empty = torch.empty(0, dtype=torch.long)
            tables = rank_tables(mine or (empty, empty, empty), rows, self.finisher.group)
            if self.split is None:
                table = concat_tables(tables)
            else:  # one copy of each data shard's rows; replicas checked (normalize.mesh_table)
                table = mesh_table(tables, self.split, self._table_dims(), op)
        shards = self.finisher.world_size if self.split is None else self.split.batch_size
        return StepWeights(norm, ids, world_size=shards, table=table)

    def _table_dims(self) -> tuple[str, ...]:
        """The mesh dims the normalisation table is agreed over: the batch dims (data and
        context parallel), so each data shard's rows count once (tests override it)."""
        assert self.split is not None
        return tuple(self.split.batch_dims)

    def _normalized(
        self,
        out: Any,
        norm: Normalize,
        weights: StepWeights | None,
        mb: Any,
        index: int,
    ) -> tuple[Tensor, Tensor, Tensor, str | None]:
        """(loss to back-propagate, its float64 detached value, item count, error) of one micro-batch.

        A loss whose shape is not the mask's is back-propagated as zero (the peers'
        backward still meets DDP's reduction) and reported: `finish` raises on every rank.
        """
        where = f"Accumulator.step: loss_fn(model, micro_batches[{index}])"
        if not isinstance(out, Tensor) or not out.requires_grad:
            raise WholebatchTypeError(
                f"{where} returned "
                + (
                    "a Tensor that does not require grad"
                    if isinstance(out, Tensor)
                    else type(out).__name__
                )
                + "; with normalize= it must return the per-item losses (a Tensor that requires "
                "grad, shaped like items(micro_batch)['mask'])"
            )
        ids: ItemIds | None
        if weights is not None:
            ids, error = weights.items[index], None
        else:
            ids, error = read_items(norm, mb, index)
        if error is None and ids is not None and tuple(out.shape) != ids.shape:
            error = (
                f"loss_fn returned losses of shape {tuple(out.shape)} for micro_batches[{index}] "
                f"but items() gave a mask of shape {ids.shape}; they must match item for item"
            )
        if error is not None or ids is None:
            zero = torch.zeros((), dtype=torch.float64, device=out.device)
            return out.sum() * 0, zero, zero, error
        mask = ids.mask_I.reshape(ids.shape)
        kept = out.masked_fill(~mask, 0)
        count = mask.sum().to(torch.float64)
        if weights is None:  # "token": sum now, divide by the agreed N after backward
            return kept.sum(), kept.detach().to(torch.float64).sum(), count, None
        w = weights.for_micro_batch(index).reshape(ids.shape)
        stat = (kept.detach().to(torch.float64) * w).sum()
        return (kept * w.to(out.dtype)).sum(), stat, count, None

    def state_dict(self) -> dict[str, Any]:
        """Counters, the GradScaler's state and the backward pre-scale estimate.

        The model and optimizer save themselves; PowerSGD's error-feedback memory is
        not saved (torch's PowerSGDState is rebuilt, restarting its plain all-reduce phase).
        """
        return {"finisher": self.finisher.state_dict(), "items_estimate": self.items_estimate}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        self.finisher.load_state_dict(state["finisher"])
        self.items_estimate = float(state["items_estimate"])
