"""Gradient caching inside the loss's backward: the whole-batch loss over K micro-batches, in any loop.

    cache = wholebatch.GradCache(ddp_model)            # embed_fn default: model(micro_batch)
    for micro_batches in loader:                       # this rank's K micro-batches
        loss = cache(micro_batches, lambda q_ND, d_ND: wholebatch.clip_loss(q_ND, d_ND, scale))
        loss.backward()                                # or scaler.scale(loss).backward()
        optimizer.step(); optimizer.zero_grad()        # the caller's, as in any loop

Contrastive losses do not split over micro-batches (K small losses have fewer
negatives). Gradient caching (Gao et al., arXiv:2101.06983) computes the
whole-batch loss on cached embeddings; here the second pass runs INSIDE
`loss.backward()`, so every trainer that calls backward on a loss (the Hugging
Face `Trainer`, `SentenceTransformerTrainer`, Accelerate, Lightning, a user's
loop with GradScaler and its own accumulation) keeps working:

1. pass 1 (the call): micro-batches 0..K-2 embedded under `no_grad`, the RNG
   state (CPU, and CUDA where initialised) and the autocast state recorded
   before each; micro-batch K-1 embedded WITH its graph, which is kept (its
   second forward is never needed);
2. the loss on the embeddings concatenated per output (rows: micro-batches in
   order), through an autograd node that holds no tensor;
3. `loss.backward()` reaches that node with the gradient of every embedding
   (times whatever the caller multiplied the loss by: a GradScaler's scale, an
   outer accumulation's 1/steps) and queues pass 2 to run when the outer
   backward is done (so every gradient the loss itself produced, e.g. a
   `logit_scale`'s, is already accumulated);
4. pass 2: the kept graph back-propagates its slice first, then micro-batches
   0..K-2 are re-run with their RNG and autocast state restored and
   back-propagate theirs. DDP reduces on the last one only (`no_sync` on the
   others; FSDP2: `set_requires_gradient_sync(False)`); when the caller's own
   `no_sync` was active at the call, on none. Gradients of parameters the loss
   uses that no wrapper reduces (outside the DDP module) are averaged over
   ranks as DDP averages the rest.

Legend: W ranks, K micro-batches on this rank, N_rank rows on this rank (all K), D dim.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel

from wholebatch.comm.agree import Field, agree_rows
from wholebatch.comm.groups import get_world_size, is_distributed
from wholebatch.comm.mesh import MeshSplit
from wholebatch.comm.meshgroup import check_replicas, fingerprint_fields, resolve_split
from wholebatch.conventions import GradReduction, check_grad_reduction
from wholebatch.errors import WholebatchError, WholebatchTypeError
from wholebatch.train.auxloss import refuse_terms
from wholebatch.train.feeds import check_feeds, feed_fields
from wholebatch.train.meshstep import MeshReduction
from wholebatch.train.wrappers import (
    ddp_of,
    fsdp_modules,
    fsdp_sync_state,
    is_dtensor,
    set_fsdp_sync,
    unwrapped_error,
)

if TYPE_CHECKING:  # annotations only: the engines import without a mesh in use
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["EmbedFn", "GradCache", "LossFn"]

Embeddings = tuple[Tensor, ...]
EmbedFn = Callable[[nn.Module, Any], "Tensor | Sequence[Tensor]"]
LossFn = Callable[..., Tensor]
RngState = tuple[Tensor, list[Tensor]]
AutocastState = tuple[tuple[str, bool, torch.dtype], ...]


def default_embed(model: nn.Module, micro_batch: Any) -> Any:
    """`embed_fn` when none is given: `model(micro_batch)`."""
    return model(micro_batch)


def _as_tuple(out: object) -> Embeddings | None:
    if isinstance(out, Tensor):
        return (out,)
    if isinstance(out, (tuple, list)) and out and all(isinstance(t, Tensor) for t in out):
        return tuple(out)
    return None


def _cuda_devices() -> list[int]:
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return list(range(torch.cuda.device_count()))
    return []


def _get_rng() -> RngState:
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in _cuda_devices()]


@contextlib.contextmanager
def replayed_rng(rng: RngState) -> Iterator[None]:
    """Run with the RNG state `rng` (CPU and initialised CUDA devices); on exit the RNG is
    where it was before (a replay draws the same numbers without consuming the stream)."""
    with torch.random.fork_rng(devices=_cuda_devices()):
        torch.set_rng_state(rng[0])
        for d, s in enumerate(rng[1]):
            torch.cuda.set_rng_state(s, d)
        yield


def rng_state() -> RngState:
    """The RNG state (CPU, and every initialised CUDA device), for `replayed_rng`."""
    return _get_rng()


def _get_autocast() -> AutocastState:
    # Trainers run the forward under autocast and the backward outside it: pass 2
    # (inside backward) must re-enter the autocast of pass 1, or it computes a
    # different network (fp32 instead of bf16) than the one the cached gradient is for.
    return tuple(
        (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        for dev in ("cpu", "cuda")
    )


def _agree(
    op: str,
    error: str | None,
    group: ProcessGroup | None,
    *,
    k: int | None = None,
    split: MeshSplit | None = None,
    parts: list[Embeddings] | None = None,
    inputs: Mapping[str, object] | None = None,
) -> None:
    """Raise the same `WholebatchError` on every rank if any rank has an `error` (one small all-gather).

    With `k`, also if the ranks' micro-batch counts differ: FSDP2 gathers the
    parameters in every forward (and DDP may broadcast buffers), so every rank
    must run as many forwards as every other. With `split` and `parts` (pass 1's
    embeddings), also if ranks that replicate the batch embedded different rows
    (their fingerprints travel in the same all-gather, `comm.meshgroup`). With `split`
    and `inputs` (the micro-batches, before the first forward), also if those ranks
    were fed different micro-batches (`wholebatch.train.feeds`).
    """
    row: dict[str, Field] = {"error": error is not None, "micro_batches": -1 if k is None else k}
    if inputs is not None:
        row.update(feed_fields(split, inputs))
    if split is not None and parts is not None:
        outputs = [list(p) for p in parts]  # one list per micro-batch: its outputs in order
        row.update(fingerprint_fields(split, {"embeddings": [t for p in outputs for t in p]}))
    rows = agree_rows(row, group=group)
    if not rows.ranks_where("error") and not rows.same("micro_batches"):
        ks = dict(enumerate(rows.ints("micro_batches")))
        raise WholebatchError(
            f"{op}: micro_batches differ in number across ranks {ks}; every "
            "rank must pass the same number (each forward of FSDP2 gathers parameters from "
            "every rank). Give a short rank micro-batches of 0 rows"
        )
    rows.error(op, error)
    if inputs is not None:
        check_feeds(op, split, rows, inputs)
    if split is not None and parts is not None:
        check_replicas(op, split, rows, ["embeddings"])


def _loss_leaves(loss: Tensor, stop: object) -> list[Tensor]:
    """Leaf tensors requiring grad that `loss` reaches without passing through the node `stop`."""
    leaves: list[Tensor] = []
    # Each visited node is held here for the walk: a node's Python wrapper lives only as long
    # as something references it, and a freed wrapper's id() is handed to the next one, so a
    # set of bare ids stops the walk early and finds no leaves (issue 36: `logit_scale` went
    # unaveraged across ranks on torch 2.4 and 2.8). Held, each wrapper is the node's own
    # cached one, so identity is the node's.
    seen: dict[int, object] = {}
    stack = [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn is stop or id(fn) in seen:
            continue
        seen[id(fn)] = fn
        variable = getattr(fn, "variable", None)
        if isinstance(variable, Tensor):
            leaves.append(variable)
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return leaves


@dataclasses.dataclass(kw_only=True)
class _Pending:
    """One call's pass-2 work, owned by the autograd node until the backward consumes it."""

    cache: GradCache
    model: nn.Module
    op: str
    micro_batches: list[Any]
    rngs: list[RngState]
    autocast: list[AutocastState]
    rows: list[list[int]]  # [K][outputs]: rows of each micro-batch's output j
    kept: Embeddings | None  # micro-batch K-1's outputs with their graph, or None
    parts: list[Embeddings] | None  # pass-1 outputs, until the node concatenates them
    sync: bool  # the call's data-parallel reduction (False under the caller's no_sync)
    zero_feed: list[Tensor] = dataclasses.field(default_factory=list)
    average: list[Tensor] = dataclasses.field(default_factory=list)
    grads: list[Tensor] | None = None
    done: bool = False


class _CacheNode(torch.autograd.Function):
    """Forward: the cached embeddings, concatenated per output. Backward: queue pass 2 with their gradient."""

    @staticmethod
    def forward(ctx: Any, pending: _Pending, anchor: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.pending = pending
        parts = pending.parts
        assert parts is not None
        pending.parts = None  # the concatenation is the only copy from here on
        return tuple(torch.cat([p[j] for p in parts]) for j in range(len(parts[0])))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[None, None]:  # type: ignore[override]
        pending: _Pending = ctx.pending
        ctx.pending = None
        if pending is None or pending.done:
            raise WholebatchError(
                "GradCache: a second backward through the same cached embeddings; pass 2 "
                "has run already (call the cache again for each backward)"
            )
        pending.grads = [g.detach() for g in grads]
        pending.done = True
        engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
        engine.queue_callback(lambda: pending.cache._second_pass(pending))
        return None, None


class GradCache:
    """The whole-batch loss of K micro-batches per rank at one micro-batch's activation memory.

    `cache(micro_batches, loss_fn)` embeds each micro-batch (`embed_fn(model,
    micro_batch)`: a tensor, or a tuple of tensors, rows first), calls
    `loss_fn(*embeddings)` with each output concatenated over the micro-batches
    (rows in micro-batch order) and returns its loss. `loss.backward()` then runs
    pass 2 (module docstring). The optimizer step is the caller's.

    What one micro-batch is: one call of `embed_fn`, i.e. one forward's worth of
    activations. It may return any number of outputs (queries, positives, k hard
    negatives), each with its own row count; the activation memory of the step
    is that of the largest micro-batch. Every rank passes the same K >= 1 (a
    rank with fewer rows passes micro-batches of 0 rows).

    Gradient contract: after `loss.backward()` (and the wrapper's reduction), every
    parameter's gradient is what one backward of `loss` would give if `loss_fn`
    ran on embeddings computed with graph in one pass (dropout masks as drawn in
    pass 1), with the loss's own leaf tensors (a `logit_scale` outside the DDP
    module) averaged over ranks as DDP averages the model's. With a
    `wholebatch.losses` function (same `grad_reduction`), that is one process's
    gradient of the loss on the whole batch of every rank. Scaling the loss
    before backward (GradScaler, 1/accumulation steps) scales every gradient alike.

    Where the loss's own parameters live:
    - outside the DDP or FSDP2 module: their gradient is all-reduced (mean, or
      sum with grad_reduction="sum") after pass 2, when the call synchronises;
    - inside the DDP module, unused by its forward: joined to the synchronised
      micro-batch's backward, so DDP's own reduction averages them (with
      find_unused_parameters=True, where DDP leaves an unused parameter's
      gradient alone, averaged as outside).

    Args:
        model: the module to train: DDP, FSDP2 (`fully_shard`), or plain (one
            process, or `rank_local=True`). A trainer that wraps it later passes
            the wrapped one per call (`model=`).
        embed_fn: `(model, micro_batch) -> Tensor | tuple[Tensor, ...]`; default
            `model(micro_batch)`. It must be deterministic given the RNG state.
        grad_reduction: how the wrapper combines rank gradients: "mean" (DDP,
            FSDP2) or "sum"; applied to the loss's own parameters outside it.
        rank_local: allow a plain module on W > 1 ranks: each rank trains on its
            own gradient (nothing is reduced). Without it that is an error.
        group: the data-parallel group; None: DDP's own, else the world.
        keep_last: keep micro-batch K-1's pass-1 graph for pass 2 (one forward fewer;
            its activations live while the loss runs: peak = one micro-batch PLUS the
            loss). False re-runs it (peak = the larger of the two): for a large loss.
        mesh: a `DeviceMesh` instead of `group` (docs/mesh.md). K and errors are agreed
            over the whole mesh, and in the same all-gather ranks that replicate the
            batch (the same coordinate on every batch dim) are checked to have embedded
            the same rows (else the same error on every rank); the loss's own leaves
            are averaged over the batch dims' ranks; after a synchronising pass 2 the
            model's gradients are multiplied by `MeshReduction.factor` / W_b (W_b the
            product of the batch dims' sizes for "mean", 1 for "sum"), as `CachedStep`
            rescales: 1, nothing done, for a mean over the batch dims. Pass the loss
            the same mesh and batch dims (`clip_loss(..., mesh=, batch_dims=)`).
        batch_dims: with `mesh`, the dims that split the batch; the others replicate it.
        check_inputs: on a mesh with replica dims, prove in the agreement before the
            first forward that replicas were fed the same micro-batches (a fingerprint
            of their tensors, `wholebatch.train.feeds`; no extra collective). With a
            tensor-parallel encoder the replicas' embeddings agree even when their
            inputs do not (the Rowwise all-reduce), so the embeddings' check alone
            cannot see it. False: trust it.
    """

    _replay_rng: bool = True  # tests turn these off to show what each is for
    _reuse_last: bool = True
    _mesh_rescale: bool = True

    def __init__(
        self,
        model: nn.Module,
        embed_fn: EmbedFn | None = None,
        *,
        grad_reduction: GradReduction = "mean",
        rank_local: bool = False,
        group: ProcessGroup | None = None,
        keep_last: bool = True,
        mesh: DeviceMesh | None = None,
        batch_dims: Sequence[str] | None = None,
        check_inputs: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise WholebatchTypeError(
                f"GradCache: model must be a torch.nn.Module, got {type(model).__name__}"
            )
        if embed_fn is not None and not callable(embed_fn):
            raise WholebatchTypeError(
                f"GradCache: embed_fn must be callable, got {type(embed_fn).__name__}"
            )
        check_grad_reduction("GradCache", grad_reduction)
        refuse_terms(model, "GradCache")
        self.model = model
        self.embed_fn: EmbedFn = embed_fn if embed_fn is not None else default_embed
        self.grad_reduction = grad_reduction
        self.rank_local = bool(rank_local)
        self.group = group
        self._reuse_last = bool(keep_last)
        self.check_inputs = bool(check_inputs)
        found = resolve_split("GradCache", group, mesh, batch_dims)
        self.split: MeshSplit | None = None if found is None else found[0]
        self._batch_group: ProcessGroup | None = None if found is None else found[1]
        self._reductions: dict[int, tuple[nn.Module, MeshReduction]] = {}

    # -- the call (pass 1 and the loss) ---------------------------------------------

    def __call__(
        self, micro_batches: Iterable[Any], loss_fn: LossFn, *, model: nn.Module | None = None
    ) -> Tensor:
        """Embed this rank's micro-batches, return `loss_fn(*whole_embeddings)`; its backward runs pass 2.

        Every rank of the group must call it (the loss gathers across ranks) and
        then call backward on the loss (DDP reduces inside that backward). Under
        `torch.no_grad()` only pass 1 and the loss run.

        Args:
            micro_batches: this rank's K >= 1 micro-batches (any iterable), the same K
                on every rank.
            loss_fn: `(*embeddings) -> scalar Tensor`, each argument one output of
                `embed_fn` concatenated over the micro-batches.
            model: the module for this call, if not the constructor's (e.g. the
                DDP-wrapped model a trainer's `compute_loss` receives).

        Raises:
            WholebatchError: on every rank, when a rank has no micro-batch, K differs
                across ranks, embed_fn returns something other than tensors with rows,
                or a plain module runs on W > 1 ranks without `rank_local=True`; when
                the loss is not a scalar.
        """
        loss, _ = self.run(micro_batches, loss_fn, model=model, op="GradCache")
        return loss

    def run(
        self,
        micro_batches: Iterable[Any],
        loss_fn: LossFn,
        *,
        model: nn.Module | None = None,
        op: str = "GradCache",
    ) -> tuple[Tensor, int]:
        """`__call__`, also returning this rank's row count (of the first output); `op` names errors."""
        model = self.model if model is None else model
        mbs = list(micro_batches)
        k = len(mbs)
        group = self._group(model)
        if self.split is not None:
            self._mesh_reduction(model, op)  # the wrapper reduces every batch dim (or raises)
        _agree(
            op,
            self._static_error(model, k, group),
            self._agree_group(model),
            k=k,
            split=self.split if self.check_inputs else None,
            inputs={"micro_batches": mbs},
        )
        grad = torch.is_grad_enabled()
        ddp = ddp_of(model)
        fsdp = fsdp_modules(model)
        sync = True
        if ddp is not None:
            sync = bool(ddp.require_backward_grad_sync)
        elif fsdp:
            sync = all(fsdp_sync_state(fsdp))
        # Keep micro-batch K-1's graph unless its forward would have to be the one DDP
        # synchronises on: that forward must come after every other pass-2 backward.
        keep = grad and self._reuse_last and not (ddp is not None and sync and k == 1)
        parts, rngs, autocasts, kept, error = self._first_pass(model, mbs, keep, ddp)
        _agree(op, error, self._agree_group(model), split=self.split, parts=parts)
        rows = [[t.shape[0] for t in p] for p in parts]
        n_rows = sum(r[0] for r in rows)
        if not grad:
            whole = [torch.cat([p[j] for p in parts]) for j in range(len(parts[0]))]
            del parts
            return self._check_loss(op, loss_fn(*whole)), n_rows
        pending = _Pending(
            cache=self,
            model=model,
            op=op,
            micro_batches=mbs,
            rngs=rngs,
            autocast=autocasts,
            rows=rows,
            kept=kept,
            parts=parts,
            sync=sync,
        )
        del parts, kept
        anchor = torch.empty(0, requires_grad=True)
        whole = _CacheNode.apply(pending, anchor)  # type: ignore[no-untyped-call]
        node = whole[0].grad_fn
        loss = self._check_loss(op, loss_fn(*whole))
        del whole
        self._sort_leaves(pending, _loss_leaves(loss, node), model, group)
        return loss, n_rows

    def _group(self, model: nn.Module) -> ProcessGroup | None:
        """The group the loss gathers over: on a mesh the batch dims', else `group` or DDP's."""
        if self.split is not None:
            return self._batch_group
        ddp = ddp_of(model)
        if self.group is None and ddp is not None:
            return ddp.process_group  # type: ignore[no-any-return]
        return self.group

    def _agree_group(self, model: nn.Module) -> ProcessGroup | None:
        """The group errors and K are agreed over: on a mesh every rank of it (the world)."""
        return None if self.split is not None else self._group(model)

    def _mesh_reduction(self, model: nn.Module, op: str) -> MeshReduction:
        """What `model`'s wrapper does on the mesh (read once per model; raises the same
        error on every rank when it does not reduce every batch dim)."""
        assert self.split is not None
        hit = self._reductions.get(id(model))
        if hit is None or hit[0] is not model:
            how = MeshReduction.of(
                model,
                self.split,
                grad_reduction=self.grad_reduction,
                allow_unreduced=self.rank_local,
                op=op,
            )
            hit = self._reductions[id(model)] = (model, how)
        return hit[1]

    def _static_error(self, model: nn.Module, k: int, group: ProcessGroup | None) -> str | None:
        ddp = ddp_of(model)
        if k == 0:
            return (
                "micro_batches is empty on this rank; every rank needs at least one micro-batch "
                "(a rank without data must still run a forward for DDP's reduction): give it "
                "a micro-batch with 0 rows"
            )
        if ddp is not None and ddp.static_graph:
            return (
                "DDP with static_graph=True expects one forward per backward; build "
                "DistributedDataParallel without static_graph for gradient caching"
            )
        if not self.rank_local and self.split is None:  # on a mesh: MeshReduction.of
            return unwrapped_error(model, get_world_size(group), "GradCache")
        return None

    def _first_pass(
        self,
        model: nn.Module,
        mbs: list[Any],
        keep: bool,
        ddp: DistributedDataParallel | None,
    ) -> tuple[
        list[Embeddings], list[RngState], list[AutocastState], Embeddings | None, str | None
    ]:
        """Embed every micro-batch: no graph but for the last when `keep`; the RNG before each."""
        parts: list[Embeddings] = []
        rngs: list[RngState] = []
        autocasts: list[AutocastState] = []
        kept: Embeddings | None = None
        error: str | None = None
        k = len(mbs)
        for i, mb in enumerate(mbs):
            with_graph = keep and i == k - 1
            if not with_graph:
                rngs.append(_get_rng())
                autocasts.append(_get_autocast())
            # The kept forward must not arm DDP's reducer: pass 2 back-propagates it first.
            no_sync = ddp.no_sync() if with_graph and ddp is not None else contextlib.nullcontext()
            with no_sync, torch.set_grad_enabled(with_graph):
                out = _as_tuple(self.embed_fn(model, mb))
            if out is None:
                error = error or (
                    f"embed_fn returned something other than a Tensor or a tuple of Tensors "
                    f"for micro-batch {i}"
                )
                continue
            if parts and len(out) != len(parts[0]):
                error = error or (
                    f"embed_fn returned {len(out)} tensors for micro-batch {i} but "
                    f"{len(parts[0])} for micro-batch 0"
                )
            if any(t.dim() == 0 for t in out):
                error = error or (
                    f"embed_fn returned a 0-d tensor for micro-batch {i}; embeddings are rows "
                    "(use parameters in loss_fn through a closure)"
                )
            if with_graph:
                kept = out
                out = tuple(t.detach() for t in out)
            parts.append(out)
        return parts, rngs, autocasts, kept, error

    @staticmethod
    def _check_loss(op: str, loss: object) -> Tensor:
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise WholebatchError(
                f"{op}: loss_fn must return a scalar Tensor, got {type(loss).__name__}"
                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else "")
            )
        return loss

    def _sort_leaves(
        self, pending: _Pending, leaves: list[Tensor], model: nn.Module, group: ProcessGroup | None
    ) -> None:
        """Which of the loss's own leaves DDP reduces (fed a zero) and which pass 2 averages."""
        ddp = ddp_of(model)
        managed: set[int] = set()
        if ddp is not None and not ddp.find_unused_parameters:
            # With find_unused_parameters=True DDP marks a parameter its forward did not
            # use as ready and leaves its gradient alone (a late gradient would be
            # "marked ready twice"): such leaves are averaged like outside ones; if the
            # forward does use one, DDP averages an already equal gradient: unchanged.
            ignored = set(getattr(ddp, "parameters_to_ignore", ()))
            managed = {
                id(p)
                for name, p in ddp.module.named_parameters()
                if name not in ignored and p.requires_grad
            }
        alone = self.rank_local or get_world_size(group) == 1
        for leaf in leaves:
            if id(leaf) in managed:
                pending.zero_feed.append(leaf)
            elif not alone and not is_dtensor(leaf):
                pending.average.append(leaf)

    # -- pass 2 (inside the backward) ------------------------------------------------

    def _second_pass(self, p: _Pending) -> None:
        """Back-propagate each micro-batch's slice of the embeddings' gradient; reduce once."""
        assert p.grads is not None
        grads, p.grads = p.grads, None
        model = p.model
        k = len(p.micro_batches)
        offsets = [
            list(itertools.accumulate([r[j] for r in p.rows], initial=0))
            for j in range(len(p.rows[0]))
        ]

        def slices(
            i: int, outs: Embeddings, grads: list[Tensor]
        ) -> tuple[list[Tensor], list[Tensor]]:
            ts, gs = [], []
            for j, t in enumerate(outs):
                if t.requires_grad:
                    ts.append(t)
                    gs.append(grads[j][offsets[j][i] : offsets[j][i + 1]])
            return ts, gs

        order = ([k - 1] if p.kept is not None else []) + [
            i for i in range(k) if p.kept is None or i != k - 1
        ]
        ddp = ddp_of(model)
        fsdp = fsdp_modules(model)
        fsdp_before = fsdp_sync_state(fsdp)
        error: str | None = None
        try:
            for n, i in enumerate(order):
                synced = p.sync and n == len(order) - 1
                set_fsdp_sync(fsdp, synced)
                if p.kept is not None and i == k - 1:
                    outs, p.kept = p.kept, None
                    ts, gs = slices(i, outs, grads)
                    del outs
                    if ts:
                        torch.autograd.backward(ts, gs)
                    del ts, gs
                    continue
                no_sync = (
                    ddp.no_sync() if ddp is not None and not synced else contextlib.nullcontext()
                )
                with no_sync, self._replay(p.rngs[i], p.autocast[i]), torch.enable_grad():
                    out = _as_tuple(self.embed_fn(model, p.micro_batches[i]))
                    if out is None or [t.shape[0] for t in out] != p.rows[i]:
                        error = error or (
                            f"embed_fn returned different rows for micro-batch {i} in the "
                            "second pass; it must be deterministic given the RNG state"
                        )
                        out = ()
                    ts, gs = slices(i, out, grads)
                    del out
                    if synced and ddp is not None:
                        # DDP waits for every parameter it manages in the synchronised
                        # backward: the loss's own (their gradient is in .grad already)
                        # join it with a zero, so DDP averages all they hold.
                        ts += p.zero_feed
                        gs += [torch.zeros_like(t) for t in p.zero_feed]
                    if ts:
                        torch.autograd.backward(ts, gs)
                    del ts, gs
        finally:
            set_fsdp_sync(fsdp, fsdp_before)
        del grads
        self._finish(p, error)

    @contextlib.contextmanager
    def _replay(self, rng: RngState, autocast: AutocastState) -> Iterator[None]:
        """Run with pass 1's RNG and autocast state; restore the RNG to where pass 1 left it."""
        with contextlib.ExitStack() as stack:
            for dev, enabled, dtype in autocast:
                stack.enter_context(torch.autocast(dev, dtype=dtype, enabled=enabled))
            if self._replay_rng:
                stack.enter_context(torch.random.fork_rng(devices=_cuda_devices()))
                torch.set_rng_state(rng[0])
                for d, s in enumerate(rng[1]):
                    torch.cuda.set_rng_state(s, d)
            yield

    @torch.no_grad()
    def _finish(self, p: _Pending, error: str | None) -> None:
        """Agree pass 2's errors; average the loss's own leaves that no wrapper reduces;
        on a mesh, rescale the model's reduced gradients (`_rescale_on_mesh`)."""
        group = self._group(p.model)
        leaves = p.average if p.sync else []
        numel = sum(t.numel() for t in leaves)
        rows = agree_rows(
            {"error": error is not None, "numel": numel}, group=self._agree_group(p.model)
        )
        rows.error(p.op, error)
        if not rows.same("numel"):
            raise WholebatchError(
                f"{p.op}: the loss's own parameters outside the data-parallel wrapper differ "
                f"across ranks (elements per rank {dict(enumerate(rows.ints('numel')))}); every "
                "rank's loss_fn must use the same ones"
            )
        if p.sync:
            self._rescale_on_mesh(p)
        if numel == 0 or not is_distributed(group):
            return
        for leaf in leaves:
            if leaf.grad is None:
                leaf.grad = torch.zeros_like(leaf)
        by_kind: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for leaf in leaves:
            g = leaf.grad
            assert g is not None
            by_kind.setdefault((g.device, g.dtype), []).append(g)
        for gs in by_kind.values():
            flat = torch.cat([g.reshape(-1) for g in gs])
            dist.all_reduce(flat, group=group)
            if self.grad_reduction == "mean":
                flat /= get_world_size(group)
            for g, new in zip(gs, torch.split(flat, [g.numel() for g in gs]), strict=True):
                g.copy_(new.view_as(g))

    def _rescale_on_mesh(self, p: _Pending) -> None:
        """On a mesh, multiply the model's (reduced) gradients by factor / W_b: what is left
        of `MeshReduction`'s rule once the loss carried W_b (the batch dims' size for
        "mean", 1 for "sum"). Exactly 1, and nothing done, for a mean over the batch dims."""
        if self.split is None or not self._mesh_rescale:
            return
        carried = float(self.split.batch_size) if self.grad_reduction == "mean" else 1.0
        rescale = self._mesh_reduction(p.model, p.op).factor / carried
        if rescale == 1.0:
            return
        for q in p.model.parameters():
            if q.grad is not None:
                q.grad.mul_(rescale)  # one by one: DTensor gradients may sit on different meshes
