"""Mesh training runs for the distributed tests and the bench: dp x tp, dp x cp, pp x dp.

Every function named `run_*` runs on each rank of a 4-rank gloo world (tests.support.harness)
and returns this rank's `MeshResult`; `reference` runs the same steps in one process
on the whole batch. Data: per step, per data shard, per micro-batch, a tuple of
sequence lengths (1 = a sequence with no target: a micro-batch of only such
sequences holds zero items). Token counts differ per rank and micro-batch.

Engines (`MeshCase.engine`):
- "accumulator": `Accumulator(model, opt, mesh=..., batch_dims=...)` (or, on a
  pipeline, `PipelineAccumulator`).
- "hand": a hand-written exact loop on the same mesh (sync only on the last
  micro-batch; the count all-reduced over the batch group; grads x dp / N).
- mutations of the hand loop: "hand_count_world" (counts over every rank: x tp
  replicas counted), "hand_count_dp" (context parallel's counts dropped),
  "hand_stage0_unscaled" (one pipeline stage not rescaled), "torch_mean" (the
  pipeline's own scale_grads over per-micro-batch means).

Legend: S sequences, T tokens per sequence (padded), K micro-batches, B data shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tests.support.models import (
    IGNORE,
    PAD,
    VOCAB,
    MicroBatch,
    TinyLM,
    lm_loss_sum,
    make_sequences,
    micro_batch,
)

Lengths = tuple[tuple[tuple[int, ...], ...], ...]  # [shard][micro-batch] -> sequence lengths

_MESHES: dict[tuple[tuple[str, int], ...], DeviceMesh] = {}


def get_mesh(shape: tuple[tuple[str, int], ...]) -> DeviceMesh:
    """The mesh of `shape` (dim name, size) over the world; built once per worker process."""
    mesh = _MESHES.get(shape)
    if mesh is None:
        names = tuple(n for n, _ in shape)
        mesh = init_device_mesh("cpu", tuple(s for _, s in shape), mesh_dim_names=names)
        if names == ("dp", "cp"):
            from wholebatch.comm._c10d import flatten_mesh

            flatten_mesh(mesh["dp", "cp"], "dp_cp")
        _MESHES[shape] = mesh
    return mesh


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshCase:
    """One run: mesh, roles, data and engine."""

    shape: tuple[tuple[str, int], ...]
    batch_dims: tuple[str, ...]
    steps: tuple[Lengths, ...]
    """steps[s][b][k]: lengths of the sequences of data shard b's k-th micro-batch."""
    engine: str = "accumulator"
    schedule: str = "1f1b"  # pipeline only: "1f1b" | "gpipe"
    lr: float = 0.5
    max_grad_norm: float | None = None
    replica_differs: bool = False  # mutation: rank 1 (a tp/cp replica) gets other rows
    feed: str = "same"
    """What tp rank 1 of every data shard is fed (ranks 1 and 3): "same"; "shifted_ids":
    (ids + 1) % V with the same labels (an augmentation seeded by the global rank: the
    Rowwise all-reduce then hands both replicas the same loss and count); "wider": one
    more padding column in micro-batch 0 (rows of another shape)."""
    check_inputs: bool = True  # False: the mutation that turns the replicas' fingerprint off
    count_reductions: bool = False
    seconds: bool = False  # time each step (bench)


@dataclasses.dataclass(frozen=True)
class Piece:
    """This rank's local shard of a DTensor parameter and where it starts in the full tensor."""

    local: Tensor
    offset: tuple[int, ...]

    def of(self, full: Tensor) -> Tensor:
        """The same piece cut from a full tensor (the reference's)."""
        index = tuple(slice(o, o + n) for o, n in zip(self.offset, self.local.shape, strict=True))
        return full[index]


def read_params(model: nn.Module) -> dict[str, Tensor | Piece]:
    """This rank's parameters by TinyLM name; a DTensor's as its local piece (no collective).

    The piece rather than `full_tensor()`: torch 2.8 reads an FSDP2 x tensor-parallel
    parameter with uneven shards back wrong (wholebatch.comm._c10d.full_tensor refuses
    it there) while training on it is exact, and the tests judge the training. Every
    rank's piece is compared, so all ranks together judge the whole tensor; the offsets
    (`shard_offset`) are checked against FSDP2's own construction in
    tests/distributed/test_c10d_shim.py.
    """
    from wholebatch.comm._c10d import shard_offset

    out: dict[str, Tensor | Piece] = {}
    for k, p in model.named_parameters():
        name = k.replace("module.", "")
        if hasattr(p, "to_local"):
            out[name] = Piece(p.to_local().detach().clone(), shard_offset(p))
        else:
            out[name] = p.detach().clone()
    return out


def local(t: Tensor | Piece) -> Tensor:
    """The tensor this rank holds."""
    return t.local if isinstance(t, Piece) else t


@dataclasses.dataclass
class MeshResult:
    params: dict[str, Tensor | Piece]  # after the run, by TinyLM name (`read_params`)
    losses: list[float]  # the step's whole-batch loss as the engine reported it
    items: list[float]
    grad_norms: list[float]
    reductions: list[int]  # gradient reductions (reduce-scatter / all-reduce) per step
    seconds: list[float]


def ragged_steps(
    shards: int, k: int, steps: int, *, seed: int, per_mb: int | None = None
) -> tuple[Lengths, ...]:
    """Ragged lengths 1..8; micro-batch 1 of shard 0 at step 0 holds no items (all length 1).

    per_mb: a fixed number of sequences per micro-batch (pipelines need equal shapes);
    None: 1-3, different per shard and micro-batch.
    """
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s in range(steps):
        step = []
        for b in range(shards):
            mbs = []
            for j in range(k):
                n = per_mb if per_mb is not None else 1 + (b + 2 * j + b * j + s) % 3
                lens = tuple(int(x) for x in torch.randint(1, 9, (n,), generator=gen))
                if s == 0 and b == 0 and j == 1:
                    lens = (1,) * n  # the empty micro-batch: zero target tokens
                mbs.append(lens)
            step.append(tuple(mbs))
        out.append(tuple(step))
    return tuple(out)


def _sequences(case: MeshCase, s: int, seed: int = 0) -> list[list[list[Tensor]]]:
    """Step s's sequences as [shard][micro-batch] -> list of token tensors."""
    flat = [n for shard in case.steps[s] for mb in shard for n in mb]
    seqs = make_sequences(flat, seed=1000 + s + 100 * seed)
    out, i = [], 0
    for shard in case.steps[s]:
        mbs = []
        for mb in shard:
            mbs.append(seqs[i : i + len(mb)])
            i += len(mb)
        out.append(mbs)
    return out


WIDTH = 8  # lengths are 1..8, so 7 targets at most; even for cp = 2; fixed for pipelines


def _width(case: MeshCase, s: int) -> int:
    """The padded width of every micro-batch: one shape for all steps (a pipeline stage's
    buffers are sized on its first step), even (context parallel cuts it in two)."""
    return WIDTH


def reference(case: MeshCase) -> MeshResult:
    """The whole batch of every step in one process: sum of token losses / all tokens."""
    torch.manual_seed(0)
    model = TinyLM().double()
    opt = torch.optim.SGD(model.parameters(), lr=case.lr)
    losses, items, norms = [], [], []
    for s in range(len(case.steps)):
        seqs = [t for shard in _sequences(case, s) for mb in shard for t in mb]
        loss_sum, n = lm_loss_sum(model, micro_batch(seqs))
        loss = loss_sum / n
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), case.max_grad_norm if case.max_grad_norm else float("inf")
        )
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        items.append(float(n))
        norms.append(float(norm))
    params: dict[str, Tensor | Piece] = {k: v.detach().clone() for k, v in model.named_parameters()}
    return MeshResult(params, losses, items, norms, [], [])


# ---------------------------------------------------------------------------
# dp x tp and dp x cp: one model, FSDP2 on the data dims, TP on tp
# ---------------------------------------------------------------------------


class ReduceScatterCount:
    """How many gradient reduce-scatters FSDP2 ran (see `count_reduce_scatters`)."""

    def __init__(self) -> None:
        self.calls = 0


# FSDP2 reduces gradients with `dist.reduce_scatter_tensor` (torch 2.8-2.12) or
# `dist.reduce_scatter_single` (2.13+), looked up on `torch.distributed` at each call.
_RS_NAMES = ("reduce_scatter_tensor", "reduce_scatter_single")


@contextlib.contextmanager
def count_reduce_scatters() -> Iterator[ReduceScatterCount]:
    """Within the block, count every reduce-scatter called through `torch.distributed`.

    Pass-through wrappers (the real gloo collective runs); the public names only, so
    the count works on every accepted torch (FSDP2's own `set_custom_reduce_scatter`
    hook is torch >= 2.10 and its default implementation is private). A call that
    enters the other name from inside counts once.
    """
    count = ReduceScatterCount()
    depth = [0]
    real = {n: getattr(dist, n) for n in _RS_NAMES if hasattr(dist, n)}

    def wrap(fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            count.calls += depth[0] == 0
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return counted

    for name, fn in real.items():
        setattr(dist, name, wrap(fn))
    try:
        yield count
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


def _my_batch(case: MeshCase, mesh: DeviceMesh, s: int) -> list[MicroBatch]:
    """This rank's micro-batches at step s: its data shard's (cp: its column slice)."""
    from wholebatch.comm.mesh import MeshSplit

    split = MeshSplit(mesh=mesh, batch_dims=_true_batch_dims(case))
    coord = split.coordinate()
    # The sequences are dealt over the data shards; cp cuts each one's tokens.
    shard = coord["dp"] if "cp" in split.sizes else split.batch_index()
    seqs = _sequences(case, s)
    if case.replica_differs and dist.get_rank() == 1:
        # Other rows of the same shapes (a sampler seeded by the global rank): a shape
        # mismatch would already fail inside tensor parallel's own collectives.
        seqs = _sequences(case, s, seed=7)
    width = _width(case, s)
    mbs = [micro_batch(mb, width=width) for mb in seqs[shard]]
    if case.feed != "same" and split.coordinate().get("tp") == 1:
        if case.feed == "shifted_ids":
            mbs = [((t + 1) % VOCAB, y) for t, y in mbs]
        elif case.feed == "wider":
            t, y = mbs[0]
            mbs[0] = (F.pad(t, (0, 1), value=PAD), F.pad(y, (0, 1), value=IGNORE))
        else:
            raise ValueError(f"MeshCase.feed={case.feed!r}")
    if "cp" in split.sizes:
        cp, c = split.sizes["cp"], coord["cp"]
        part = width // cp
        mbs = [(t[:, c * part : (c + 1) * part], y[:, c * part : (c + 1) * part]) for t, y in mbs]
    return mbs


def _true_batch_dims(case: MeshCase) -> tuple[str, ...]:
    """How the data is really split (the case's batch_dims may be a deliberate mistake)."""
    names = [n for n, _ in case.shape]
    return tuple(d for d in ("dp", "cp", "rep", "shard") if d in names)


def _fsdp_model(case: MeshCase, mesh: DeviceMesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = TinyLM().double()
    names = [n for n, _ in case.shape]
    if "tp" in names:
        parallelize_module(
            model, mesh["tp"], {"hidden": ColwiseParallel(), "out": RowwiseParallel()}
        )
        fully_shard(model, mesh=mesh["dp"])
    elif "cp" in names:
        fully_shard(model, mesh=mesh["dp_cp"])
    else:  # HSDP: replicate over "rep", shard over "shard" (a 2-D FSDP2 mesh)
        fully_shard(model, mesh=mesh)
    return model


def run_fsdp(case: MeshCase) -> MeshResult:
    """dp x tp (FSDP2 on dp, TP on tp) or dp x cp (FSDP2 on dp_cp, sequence sharding)."""
    from wholebatch.train.accumulate import Accumulator

    mesh = get_mesh(case.shape)
    model = _fsdp_model(case, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=case.lr)
    acc = None
    if case.engine == "accumulator":
        acc = Accumulator(
            model,
            opt,
            mesh=mesh,
            batch_dims=case.batch_dims,
            max_grad_norm=case.max_grad_norm,
            check_inputs=case.check_inputs,
        )
    losses, items, norms, reductions, seconds = [], [], [], [], []
    with count_reduce_scatters() as counter:
        for s in range(len(case.steps)):
            mbs = _my_batch(case, mesh, s)
            before = counter.calls
            t0 = time.perf_counter()
            if acc is not None:
                st = acc.step(mbs, lm_loss_sum)
                losses.append(st.loss)
                items.append(st.items)
                norms.append(st.grad_norm)
            else:
                loss, n = _hand_step(case, mesh, model, opt, mbs)
                losses.append(loss)
                items.append(n)
            seconds.append(time.perf_counter() - t0)
            reductions.append(counter.calls - before)
    return MeshResult(read_params(model), losses, items, norms, reductions, seconds)


def run_misfed(case: MeshCase) -> dict[str, Any]:
    """The first step of `case` on the Accumulator: its error (None if it stepped), how many
    forwards ran, and whether the parameters are still the initial ones."""
    from wholebatch.errors import WholebatchError
    from wholebatch.train.accumulate import Accumulator

    mesh = get_mesh(case.shape)
    model = _fsdp_model(case, mesh)
    before = read_params(model)
    forwards: list[int] = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    opt = torch.optim.SGD(model.parameters(), lr=case.lr)
    acc = Accumulator(
        model, opt, mesh=mesh, batch_dims=case.batch_dims, check_inputs=case.check_inputs
    )
    error = None
    try:
        acc.step(_my_batch(case, mesh, 0), lm_loss_sum)
    except WholebatchError as e:
        error = str(e)
    after = read_params(model)
    unchanged = all(torch.equal(local(after[k]), local(before[k])) for k in before)
    return {"error": error, "forwards": len(forwards), "unchanged": unchanged}


def _hand_step(
    case: MeshCase,
    mesh: DeviceMesh,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    mbs: list[MicroBatch],
) -> tuple[float, float]:
    """The exact loop a careful user writes on this mesh (or, per `engine`, a broken one)."""
    k = len(mbs)
    loss_sum = torch.zeros((), dtype=torch.float64)
    items = torch.zeros((), dtype=torch.float64)
    for i, mb in enumerate(mbs):
        model.set_requires_gradient_sync(i == k - 1)  # type: ignore[operator]
        loss, n = lm_loss_sum(model, mb)
        loss.backward()
        loss_sum += loss.detach()
        items += n
    model.set_requires_gradient_sync(True)  # type: ignore[operator]
    data = mesh["dp"] if "tp" in dict(case.shape) else mesh["dp_cp"]
    group = {
        "hand": data.get_group(),
        "hand_count_world": None,  # mutation: counts tp replicas as items
        "hand_count_dp": mesh["dp"].get_group(),  # mutation: cp's counts dropped
    }[case.engine]
    row = torch.stack([loss_sum, items])
    dist.all_reduce(row, group=group)
    n = float(row[1])
    factor = data.size() / n  # FSDP2 averaged over the data ranks
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(row[0]) / n, n


# ---------------------------------------------------------------------------
# pp x dp: two stages of TinyLM, FSDP2 on dp, torch.distributed.pipelining
# ---------------------------------------------------------------------------


class Stage0(nn.Module):
    """Embedding and hidden layer of `TinyLM` (the first pipeline stage)."""

    def __init__(self, lm: TinyLM) -> None:
        super().__init__()
        self.emb, self.hidden = lm.emb, lm.hidden

    def forward(self, tokens_ST: Tensor) -> Tensor:
        return torch.tanh(self.hidden(self.emb(tokens_ST)))  # h_STD


class Stage1(nn.Module):
    """The vocabulary projection of `TinyLM` (the last pipeline stage)."""

    def __init__(self, lm: TinyLM) -> None:
        super().__init__()
        self.out = lm.out

    def forward(self, h_STD: Tensor) -> Tensor:
        return self.out(h_STD)  # logits_STV


def token_loss_sum(logits_STV: Tensor, targets_ST: Tensor) -> tuple[Tensor, Tensor]:
    """(sum of token cross-entropies, target tokens) of one pipeline micro-batch."""
    loss = F.cross_entropy(
        logits_STV.reshape(-1, logits_STV.shape[-1]),
        targets_ST.reshape(-1),
        ignore_index=IGNORE,
        reduction="sum",
    )
    return loss, (targets_ST != IGNORE).sum()


def run_pipeline(case: MeshCase) -> MeshResult:
    """pp x dp: this rank's stage (pp coordinate) of its data shard (dp coordinate)."""
    from torch.distributed.pipelining import PipelineStage

    from wholebatch.comm.mesh import MeshSplit
    from wholebatch.train.pipeline import PipelineAccumulator

    mesh = get_mesh(case.shape)
    split = MeshSplit(mesh=mesh, batch_dims=("dp",), pipeline_dim="pp")
    coord = split.coordinate()
    pp = coord["pp"]
    lm = TinyLM().double()
    stage_mod: nn.Module = Stage0(lm) if pp == 0 else Stage1(lm)
    # FSDP2 on dp per stage (torchtitan's PP x FSDP). DDP stages trip DDP's bucket
    # rebuild under GPipe on torch 2.13: the stage's first-step metadata inference runs
    # an extra backward ("rebuilt parameter indices size is not same").
    from torch.distributed.fsdp import fully_shard

    wrapped = fully_shard(stage_mod, mesh=mesh["dp"])
    own = dict(wrapped.named_parameters())  # Stage0/Stage1 keep TinyLM's parameter names
    opt = torch.optim.SGD(wrapped.parameters(), lr=case.lr)
    stage = PipelineStage(wrapped, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    k = len(case.steps[0][0])
    acc = None
    hand = None
    if case.engine == "accumulator":
        acc = PipelineAccumulator(
            stage,
            opt,
            mesh=mesh,
            batch_dims=case.batch_dims,
            pipeline_dim="pp",
            schedule=case.schedule,
            n_microbatches=k,
            loss_fn=token_loss_sum,
            max_grad_norm=case.max_grad_norm,
        )
    else:
        hand = _HandPipeline(case, stage, opt, mesh, k)
    losses, items, norms, reductions, seconds = [], [], [], [], []
    with count_reduce_scatters() as counter:
        for s in range(len(case.steps)):
            seqs = _sequences(case, s)[coord["dp"]]
            width = _width(case, s)
            mbs = [micro_batch(mb, width=width) for mb in seqs]
            tokens = torch.cat([t for t, _ in mbs])  # [K*S, T]: the schedule cuts K chunks
            targets = torch.cat([y for _, y in mbs])
            before = counter.calls
            t0 = time.perf_counter()
            if acc is not None:
                st = acc.step(tokens, target=targets)
                losses.append(st.loss)
                items.append(st.items)
                norms.append(st.grad_norm)
            else:
                assert hand is not None
                loss, n = hand.step(tokens, targets)
                losses.append(loss)
                items.append(n)
            seconds.append(time.perf_counter() - t0)
            reductions.append(counter.calls - before)
    params = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in own.items()
    }
    return MeshResult(params, losses, items, norms, reductions, seconds)


class _HandPipeline:
    """A hand-written exact pipeline step, and its broken variants (see the module docstring)."""

    def __init__(
        self, case: MeshCase, stage: Any, opt: torch.optim.Optimizer, mesh: DeviceMesh, k: int
    ) -> None:
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        self.case, self.stage, self.opt, self.mesh = case, stage, opt, mesh
        self.parts: list[Tensor] = []
        cls = Schedule1F1B if case.schedule == "1f1b" else ScheduleGPipe
        torch_mean = case.engine == "torch_mean"

        def loss_fn(out: Tensor, tgt: Tensor) -> Tensor:
            loss, n = token_loss_sum(out, tgt)
            self.parts.append(torch.stack([loss.detach(), n.to(loss.dtype)]))
            return loss / n.clamp(min=1) if torch_mean else loss

        self.schedule = cls(stage, n_microbatches=k, loss_fn=loss_fn, scale_grads=torch_mean)

    def step(self, tokens: Tensor, targets: Tensor) -> tuple[float, float]:
        self.parts = []
        if self.stage.is_first:
            self.schedule.step(tokens)
        else:
            self.schedule.step(target=targets)
        parts = self.parts[-len(self.case.steps[0][0]) :]  # first step: one metadata call first
        mine = torch.stack(parts).sum(0) if parts else torch.zeros(2, dtype=torch.float64)
        dist.all_reduce(mine)  # only the last stages hold counts: the world sum is N
        loss_sum, n = float(mine[0]), float(mine[1])
        factor = self.mesh["dp"].size() / n  # FSDP2 averaged over dp
        if self.case.engine == "torch_mean":
            factor = 1.0  # trusts the schedule's 1/K and FSDP2's 1/dp
        if self.case.engine == "hand_stage0_unscaled" and self.stage.is_first:
            factor = 1.0
        with torch.no_grad():
            for p in self.stage.submod.parameters():
                if p.grad is not None:
                    p.grad.mul_(factor)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss_sum / n, n


def params_close(
    got: Mapping[str, Tensor | Piece], ref: Mapping[str, Tensor | Piece], tol: float = 1e-10
) -> list[str]:
    """The parameter names whose values differ from `ref` beyond `tol` (relative and absolute);
    a `Piece` against the same piece of the reference's full tensor."""
    bad = []
    for name, value in got.items():
        full = ref[name]
        if isinstance(full, Piece):
            raise TypeError(
                f"params_close: the reference's {name!r} is a piece, not the full tensor"
            )
        t, want = (value.local, value.of(full)) if isinstance(value, Piece) else (value, full)
        if t.shape != want.shape or not torch.allclose(t, want, rtol=tol, atol=tol):
            bad.append(name)
    return bad


def case_names(cases: Sequence[MeshCase]) -> list[str]:
    return [f"{c.engine}-{c.schedule}" for c in cases]


# ---------------------------------------------------------------------------
# MeshSplit and MeshReduction on the 4-rank world (no training)
# ---------------------------------------------------------------------------


def split_facts() -> dict[str, Any]:
    """Shape facts, factors and errors of MeshSplit / MeshReduction on this rank."""
    from wholebatch.comm.mesh import MeshSplit
    from wholebatch.errors import WholebatchError
    from wholebatch.train.meshstep import MeshReduction

    mesh = get_mesh((("dp", 2), ("tp", 2)))
    split = MeshSplit(mesh=mesh, batch_dims=("dp",))
    out: dict[str, Any] = {
        "coordinate": split.coordinate(),
        "batch_index": split.batch_index(),
        "replica_dims": split.replica_dims,
        "batch_size": split.batch_size,
        "dims_of_tp_group": split.dims_of(dist.get_process_group_ranks(mesh["tp"].get_group())),
        "dims_of_world": split.dims_of(range(4)),
        "describe": split.describe(),
        "batch_group": dist.get_process_group_ranks(split.batch_group()),
        "cp_batch_group": dist.get_process_group_ranks(
            MeshSplit(mesh=get_mesh((("dp", 2), ("cp", 2))), batch_dims=("dp", "cp")).batch_group()
        ),
    }
    factors = {}
    for dims, how, divisor in [
        (("dp",), "mean", None),  # FSDP2 on dp: x dp
        (("dp", "tp"), "mean", None),  # mean over dp x tp: tp replicas' share is 1
        (("dp",), "sum", None),
        (("dp", "tp"), "sum", None),  # sum over tp replicas doubles: / tp
        (("dp",), "mean", 8.0),  # set_gradient_divide_factor(8)
    ]:
        r = MeshReduction(split=split, dims=dims, grad_reduction=how, divisor=divisor)  # type: ignore[arg-type]
        factors[f"{'x'.join(dims)}-{how}-{divisor}"] = r.factor
    out["factors"] = factors
    errors = {}
    bad: dict[str, dict[str, Any]] = {
        "unknown": {"batch_dims": ("dp", "cp")},
        "empty": {"batch_dims": ()},
        "string": {"batch_dims": "dp"},
        "twice": {"batch_dims": ("dp", "dp")},
        "pipeline_is_batch": {"batch_dims": ("dp",), "pipeline_dim": "dp"},
        "pipeline_unknown": {"batch_dims": ("dp",), "pipeline_dim": "pp"},
    }
    for name, kw in bad.items():
        try:
            MeshSplit(mesh=mesh, **kw)
        except WholebatchError as e:
            errors[name] = str(e)
    # A plain module on the mesh: nothing reduces the dp shards.
    try:
        MeshReduction.of(nn.Linear(2, 2), split)
    except WholebatchError as e:
        errors["plain"] = str(e)
    out["errors"] = errors
    return out


# ---------------------------------------------------------------------------
# CachedStep on dp2 x tp2 (the model replicated over tp, DDP over dp)
# ---------------------------------------------------------------------------


def run_cached(
    k: int, batch_dims: tuple[str, ...], replica_differs: bool, world_loss: bool = False
) -> dict[str, Tensor]:
    """CachedStep(mesh=, batch_dims=) with a CLIP loss over the batch dims' group
    (`world_loss`: the mutation gathering over every rank, tp replicas' rows twice)."""
    import gc

    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.distributed.test_cache import _batches, _build, embed
    from wholebatch.comm.mesh import MeshSplit
    from wholebatch.losses.contrastive import clip_loss
    from wholebatch.train.cache import CachedStep

    mesh = get_mesh((("dp", 2), ("tp", 2)))
    split = MeshSplit(mesh=mesh, batch_dims=("dp",))
    dp = split.coordinate()["dp"]
    model, scale = _build("inside")
    wrapped = DDP(model, process_group=mesh["dp"].get_group())
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    where: dict[str, Any] = {"group": None} if world_loss else {"mesh": mesh, "batch_dims": ("dp",)}

    def loss_fn(i: Tensor, t: Tensor) -> Tensor:
        return clip_loss(i, t, scale, tile_size=2, **where)

    step = CachedStep(wrapped, opt, embed, loss_fn, mesh=mesh, batch_dims=batch_dims)
    mine = _batches(2, k)[dp]
    if replica_differs and dist.get_rank() == 1:
        mine = [(a.flip(0), b) for a, b in mine]  # other pairs, same shapes
    torch.manual_seed(100 + dp)  # the tp replicas draw the same dropout
    try:
        stats = step.step(mine)
        out = {n: p.detach().clone() for n, p in model.named_parameters()}
        out["loss"] = torch.tensor(stats.loss, dtype=torch.float64)
        return out
    finally:
        del step, wrapped, opt  # leave no DDP reducer behind in the reused worker
        gc.collect()


def run_gradcache_misfed() -> dict[str, Any]:
    """`GradCache(mesh=, batch_dims=("dp",))` (DDP on dp, CLIP over dp) where tp rank 1 of
    dp 0 is fed other pairs of the same shapes: its error, and how many forwards ran."""
    import gc

    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.distributed.test_cache import _batches, _build, embed
    from wholebatch.comm.mesh import MeshSplit
    from wholebatch.errors import WholebatchError
    from wholebatch.losses.contrastive import clip_loss
    from wholebatch.train.gradcache import GradCache

    mesh = get_mesh((("dp", 2), ("tp", 2)))
    dp = MeshSplit(mesh=mesh, batch_dims=("dp",)).coordinate()["dp"]
    model, scale = _build("inside")
    wrapped = DDP(model, process_group=mesh["dp"].get_group())
    forwards: list[int] = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    cache = GradCache(wrapped, embed, mesh=mesh, batch_dims=("dp",))
    mine = _batches(2, 3)[dp]
    if dist.get_rank() == 1:
        mine = [(a + 0.25, b) for a, b in mine]  # the images of an augmentation seeded by rank
    error = None
    try:
        loss = cache(mine, lambda i, t: clip_loss(i, t, scale, mesh=mesh, batch_dims=("dp",)))
        loss.backward()
    except WholebatchError as e:
        error = str(e)
    finally:
        del cache, wrapped  # leave no DDP reducer behind in the reused worker
        gc.collect()
    return {"error": error, "forwards": len(forwards)}


class _TPEncoder(nn.Module):
    """Two linear layers, tensor parallel (Colwise, Rowwise): replicas' outputs are summed."""

    def __init__(self, d_in: int, d_out: int, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.up = nn.Linear(d_in, 8).double()
        self.down = nn.Linear(8, d_out).double()
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)

    def forward(self, x_BD: Tensor) -> Tensor:
        return F.normalize(self.down(torch.tanh(self.up(x_BD))), dim=-1)


def run_tp_loss_misfed(check: bool) -> str | None:
    """A bare `clip_loss(mesh=, batch_dims=("dp",))` on tensor-parallel towers (dp2 x tp2)
    where tp rank 1 of each dp shard is fed other image inputs (same text): the loss's
    replica check sees only the embeddings, which the Rowwise all-reduce makes equal;
    `check`: the loop calls `check_fed_alike` on its inputs first (as the docs say).
    Returns the error raised, or None."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from wholebatch.comm.mesh import MeshSplit
    from wholebatch.errors import WholebatchError
    from wholebatch.losses.contrastive import clip_loss

    mesh = get_mesh((("dp", 2), ("tp", 2)))
    coord = MeshSplit(mesh=mesh, batch_dims=("dp",)).coordinate()
    towers = []
    for seed in (1, 2):
        tower = _TPEncoder(4, 3, seed)
        parallelize_module(tower, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        towers.append(tower)
    gen = torch.Generator().manual_seed(10 + coord["dp"])
    image = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    text = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    if coord["tp"] == 1:
        image = image + 0.5  # an augmentation seeded by the global rank
    scale = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    try:
        if check:
            from wholebatch import check_fed_alike

            check_fed_alike({"image": image, "text": text}, mesh=mesh, batch_dims=("dp",))
        clip_loss(towers[0](image), towers[1](text), scale, mesh=mesh, batch_dims=("dp",))
    except WholebatchError as e:
        return str(e)
    return None
