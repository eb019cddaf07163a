"""What each forked run of `wholebatch verify` does: describe a TARGET, run its split step, or the reference.

These functions run inside the processes `wholebatch.verify.procs` forks (one
per rank, or one for the reference) and return plain picklable values.

- `describe`: load the spec, check it against W and K.
- `split_rank`: one rank of a split run: build the model (seeded), wrap it, run
  the step (or the trainer) with a `GradRecorder` as optimizer; the gradients it
  stepped with, how often it stepped, what it changed, the dropout masks of its
  first pass, the collectives without gradient it called, the rows of each
  micro-batch, the precision its arithmetic ran in (`PrecisionMeter`, forward and
  backward), and for a `ReplaySpec` the micro-batches its trainer recorded.
- `reference`: the whole batch in one process (dropout masks replayed; a
  `ReplaySpec`'s: every rank's recorded micro-batches, collated), run twice with
  different seeds (randomness verify cannot replay shows as a difference), the
  precision it computes in; on request the same batch with its rows reversed (the
  round-off floor) and each micro-batch alone (the weights, `wholebatch.verify.fit`).

Legend: W ranks, K micro-batches per rank, N rows, P parameter entries, J micro-batches in all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import tempfile
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from wholebatch.errors import WholebatchError, WholebatchTypeError
from wholebatch.verify.batches import collate
from wholebatch.verify.fit import fit_weights, item_counts, piece_counts
from wholebatch.verify.precision import PrecisionMeter, dtype_names
from wholebatch.verify.recording import (
    DropoutMode,
    GradRecorder,
    TapeDropout,
    collectives_in_functions,
    collectives_seen,
    install_tape_dropout,
)
from wholebatch.verify.replay import Recorder, ReplaySpec
from wholebatch.verify.report import Fit, param_scales
from wholebatch.verify.rows import RowRecorder
from wholebatch.verify.spec import (
    Batch,
    Spec,
    TargetError,
    TrainerRun,
    TrainerSpec,
    VerifySpec,
    dataset_rows,
    fingerprint,
    load_spec,
    rows,
    select_rows,
    split_batch,
)

__all__ = [
    "Condition",
    "Description",
    "RankResult",
    "RefRequest",
    "RefResult",
    "describe",
    "reference",
    "split_rank",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Condition:
    """What a run varies besides the split."""

    dropout: bool = True
    """Dropout as the model has it (recorded, replayed in the reference); False: all off."""

    equal: bool = False
    """Run on `equal_batch` instead of `batch`."""

    mesh: str = ""
    """The device mesh the split runs on ("dp=2,tp=2"); "" a flat world."""

    @property
    def label(self) -> str:
        """ "as given", "dropout off", "equal items, dropout off"."""
        if self.equal:
            return "equal items" + ("" if self.dropout else ", dropout off")
        return "as given" if self.dropout else "dropout off"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Description:
    """What the parent needs to know about a TARGET before running it."""

    kind: str
    wrap: str
    rows: int
    equal_rows: int
    has_dropout: bool
    has_equal: bool
    rtol: float | None
    mesh: str = ""
    batch_dims: tuple[str, ...] | None = None


@dataclasses.dataclass(kw_only=True)
class RankResult:
    """One rank of a split run."""

    grads: dict[str, Tensor | None]
    calls: int
    changed: tuple[str, ...]
    masks: dict[str, Tensor | None]
    collectives: dict[str, int]
    pieces: list[list[int]]
    dtypes: tuple[str, ...]
    params_fp: float
    batch_fp: float
    autocast: tuple[str, ...] = ()
    in_functions: dict[str, int] = dataclasses.field(default_factory=dict)
    redrawn: tuple[str, ...] = ()
    rows_note: str = ""
    shard: int = -1
    """On a mesh: the row shard this rank held (ranks of one shard replicate it)."""
    primary: bool = True
    """On a mesh: the first replica of its shard (its rows and masks stand for the shard)."""
    inputs: tuple[float, ...] = ()
    """On a mesh: a fingerprint of each forward's arguments (replicas must agree)."""
    owned: tuple[str, ...] = ()
    """On a mesh: the parameters this rank's step gave a gradient (its pipeline stage's)."""
    local: dict[str, tuple[Tensor, tuple[int, ...]]] = dataclasses.field(default_factory=dict)
    """On a mesh: this rank's piece of each sharded gradient and its offset in the full one."""
    recorded: list[dict[str, Tensor]] = dataclasses.field(default_factory=list)
    """A ReplaySpec: the micro-batches this rank's trainer recorded, in order."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RefRequest:
    """What the reference process computes."""

    target: str
    condition: Condition
    masks: tuple[Mapping[str, Tensor | None], ...] | None = None
    probe: bool = True
    floor: bool = False
    pieces: tuple[tuple[int, ...], ...] | None = None
    piece_ranks: tuple[int, ...] = ()
    fit_to: Mapping[str, Tensor | None] | None = None
    count_pieces: tuple[tuple[int, ...], ...] | None = None
    autocast: tuple[str, ...] = ()
    recorded: tuple[tuple[dict[str, Tensor], ...], ...] | None = None
    """A ReplaySpec: every rank's recorded micro-batches; the whole batch is their collation."""


@dataclasses.dataclass(kw_only=True)
class RefResult:
    """The reference's gradients and what else was asked."""

    grads: dict[str, Tensor | None]
    dtypes: tuple[str, ...]
    spread: float
    floor: float | None
    fit: Fit | None
    item_counts: dict[str, int]
    piece_counts: dict[str, list[int]]
    params_fp: float
    batch_fp: float
    autocast: tuple[str, ...] = ()
    autocast_floor: float | None = None


def _batch(spec: Spec, condition: Condition) -> Batch:
    if isinstance(spec, ReplaySpec):
        raise WholebatchError("verify: a ReplaySpec's batch is what its trainer records")
    if condition.equal:
        if spec.equal_batch is None:
            raise WholebatchError("verify: no equal_batch in the spec")
        return spec.equal_batch
    return spec.batch


def _build(spec: Spec, mode: DropoutMode) -> tuple[nn.Module, dict[str, TapeDropout]]:
    torch.manual_seed(spec.seed)
    model = spec.build_model()
    if not isinstance(model, nn.Module):
        raise WholebatchTypeError(
            f"{type(spec).__name__}: build_model() returned {type(model).__name__}, not a "
            "torch.nn.Module"
        )
    return model, install_tape_dropout(model, mode)


def _params_fp(model: nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def describe(target: str, world_size: int, micro_batches: int, mesh: str = "") -> Description | str:
    """Load TARGET and check it can be split W x K; a Description, or the usage error's text.

    On a mesh (`mesh`, else the spec's) the rows are checked against the mesh's row
    shards by the parent instead (`runner._check_mesh_split`)."""
    try:
        spec = load_spec(target)
        if isinstance(spec, ReplaySpec):
            if mesh:
                raise TargetError(
                    f"verify: {target}: a ReplaySpec runs on a flat world of --nproc ranks; "
                    "--mesh is not supported for it"
                )
            _build(spec, "off")
            return Description(
                kind="replay",
                wrap="replay",
                rows=0,
                equal_rows=0,
                has_dropout=False,
                has_equal=False,
                rtol=None if spec.rtol is None else float(spec.rtol),
            )
        w, k = world_size, micro_batches
        for what, batch in (("batch", spec.batch), ("equal_batch", spec.equal_batch)):
            if batch is None or mesh or spec.mesh:
                continue
            n = rows(batch)
            if n < w * k:
                raise TargetError(
                    f"verify: {target}: the spec's {what} has {n} rows, fewer than W·K = "
                    f"{w}·{k} = {w * k}; lower --nproc/--micro-batches or make the batch larger"
                )
            if isinstance(spec, TrainerSpec) and n % (w * k):
                raise TargetError(
                    f"verify: {target}: a trainer takes a fixed batch per device, so the spec's "
                    f"{what} rows ({n}) must divide by W·K = {w}·{k} = {w * k}; change the "
                    "batch or --nproc/--micro-batches"
                )
        _, tapes = _build(spec, "record")
    except TargetError as exc:
        return str(exc)
    except WholebatchError as exc:
        return f"verify: {target}: {exc}"
    return Description(
        kind="trainer" if isinstance(spec, TrainerSpec) else "step",
        wrap="trainer" if isinstance(spec, TrainerSpec) else spec.wrap,
        rows=rows(spec.batch),
        equal_rows=0 if spec.equal_batch is None else rows(spec.equal_batch),
        has_dropout=bool(tapes) and not isinstance(spec, TrainerSpec),
        has_equal=spec.equal_batch is not None,
        rtol=None if spec.rtol is None else float(spec.rtol),
        mesh=getattr(spec, "mesh", None) or "",
        batch_dims=getattr(spec, "batch_dims", None),
    )


def split_rank(
    target: str,
    condition: Condition,
    micro_batches: int,
    measure: bool,
    rank: int,
    world_size: int,
) -> RankResult:
    """One rank of the split run (called in a forked process that joined the W-rank group).

    `measure`: record the precision the step runs in (the first run; its re-runs' is not read).
    """
    spec = load_spec(target)
    if condition.mesh:
        from wholebatch.verify.mesh import split_rank_mesh

        return split_rank_mesh(spec, condition, micro_batches, measure, rank, world_size)
    replay = isinstance(spec, ReplaySpec)
    batch = None if replay else _batch(spec, condition)
    trainer = isinstance(spec, TrainerSpec | ReplaySpec)
    model, tapes = _build(spec, "record" if condition.dropout and not trainer else "off")
    params_fp = _params_fp(model)
    named = list(model.named_parameters())
    before = [p.detach().clone() for _, p in named]
    optimizer = GradRecorder([p for _, p in named])
    k = micro_batches
    collectives_seen(reset=True)
    collectives_in_functions(reset=True)
    meter = PrecisionMeter(active=measure)
    with meter:
        ran = _run_step(spec, model, tapes, optimizer, batch, k, rank, world_size)
    collectives = collectives_seen(reset=True)
    in_functions = collectives_in_functions(reset=True)
    changed = tuple(
        name for (name, p), b in zip(named, before, strict=True) if not torch.equal(p.detach(), b)
    )
    grads = {name: optimizer.gradient(p) for name, p in named}
    return RankResult(
        grads={k_: None if g is None else g.cpu() for k_, g in grads.items()},
        calls=optimizer.calls,
        changed=changed,
        masks=ran.masks,
        collectives=collectives,
        pieces=ran.pieces,
        dtypes=dtype_names(meter.dtypes),
        params_fp=params_fp,
        batch_fp=0.0 if batch is None else fingerprint(batch),
        autocast=tuple(sorted(meter.autocast)),
        in_functions=in_functions,
        redrawn=ran.redrawn,
        rows_note=ran.rows_note,
        recorded=ran.recorded,
    )


@dataclasses.dataclass(kw_only=True)
class _Ran:
    """What running the step showed besides its gradients."""

    pieces: list[list[int]]
    masks: dict[str, Tensor | None]
    redrawn: tuple[str, ...] = ()
    rows_note: str = ""
    recorded: list[dict[str, Tensor]] = dataclasses.field(default_factory=list)


def _run_step(
    spec: Spec,
    model: nn.Module,
    tapes: dict[str, TapeDropout],
    optimizer: GradRecorder,
    batch: Batch,
    k: int,
    rank: int,
    world_size: int,
) -> _Ran:
    """Run the step (or the trainer): the rows of each micro-batch, the first pass's masks."""
    if isinstance(spec, ReplaySpec):
        data = list(spec.data)
        record = Recorder()
        with tempfile.TemporaryDirectory(prefix="wholebatch-trainer-") as out:
            share = len(data) // world_size
            run = TrainerRun(
                model=model,
                optimizer=optimizer,
                batch=None,
                dataset=data,
                world_size=world_size,
                rank=rank,
                micro_batches=k,
                per_device_rows=len(data) // (world_size * k),
                output_dir=out,
                seed=spec.seed,
                data_shards=world_size,
                data_rank=rank,
                shard=data[rank * share : (rank + 1) * share],
                record=record,
            )
            torch.manual_seed(spec.seed + 1 + rank)
            spec.train(run)
        return _Ran(pieces=[], masks={}, recorded=record.micro_batches)
    n = rows(batch)
    if isinstance(spec, TrainerSpec):
        recorder = RowRecorder(model, batch, spec.row_key)
        with tempfile.TemporaryDirectory(prefix="wholebatch-trainer-") as out:
            run = TrainerRun(
                model=model,
                optimizer=optimizer,
                batch=batch,
                dataset=dataset_rows(batch),
                world_size=world_size,
                rank=rank,
                micro_batches=k,
                per_device_rows=n // (world_size * k),
                output_dir=out,
                seed=spec.seed,
                data_shards=world_size,
                data_rank=rank,
                shard=dataset_rows(split_batch(batch, world_size)[rank]),
            )
            torch.manual_seed(spec.seed + 1 + rank)
            spec.train(run)
        recorder.remove()
        return _Ran(
            pieces=recorder.calls, masks={}, rows_note=_rows_note(recorder, n // world_size)
        )
    assert isinstance(spec, VerifySpec)
    module: nn.Module = model
    if spec.wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        module = DistributedDataParallel(model)
    chunks = torch.tensor_split(torch.arange(n), world_size * k)[rank * k : (rank + 1) * k]
    pieces = [c.tolist() for c in chunks]
    mine = split_batch(batch, world_size * k)[rank * k : (rank + 1) * k]
    torch.manual_seed(spec.seed + 1 + rank)
    spec.step(module, optimizer, mine)
    my_rows = sum(len(c) for c in pieces)
    return _Ran(
        pieces=pieces,
        masks={name: t.first_rows(my_rows) for name, t in tapes.items()},
        redrawn=tuple(name for name, t in tapes.items() if t.redrawn(my_rows)),
    )


def _rows_note(recorder: RowRecorder, expected: int) -> str:
    """What is missing when the trainer's forwards could not all be matched to batch rows."""
    matched = sum(len(c) for c in recorder.calls)
    if matched >= expected:
        return ""
    if recorder.forwards and not recorder.missed:
        return (
            f"the model's {recorder.forwards} forward call(s) on this rank held {matched} "
            f"rows of the batch, every one recognised, where this rank's share is {expected}: "
            "the trainer's sampler dealt the rows over more ranks than the data shards (on a "
            "mesh: by the global rank, not the batch index), so the rows each micro-batch "
            "should hold are not known"
        )
    return (
        f"verify recognised {matched} of this rank's {expected} rows in the model's "
        f"{recorder.forwards} forward call(s) in grad mode: it looks for the contents of the "
        f"batch's {recorder.key_name} (padding removed through their masks) in the integer "
        "tensors the forward receives, by argument name and inside dicts (equal, or holding "
        "them between other tokens), and the trainer fed the model something else (remapped "
        "or embedded ids, packed rows, text tokenized to other ids). So the rows each "
        "micro-batch held, and the weight each gets, are unknown. Give the TrainerSpec a "
        "row_key: a batch column with an id per row that the model's forward receives"
    )


# ---------------------------------------------------------------------------
# The reference
# ---------------------------------------------------------------------------


def _autocasts(names: Sequence[str]) -> contextlib.ExitStack:
    """Enter the autocasts named "device:dtype" ("cpu:bfloat16")."""
    stack = contextlib.ExitStack()
    for name in names:
        device, _, dtype = name.partition(":")
        stack.enter_context(torch.autocast(device, dtype=getattr(torch, dtype)))
    return stack


def _ref_grads(
    spec: Spec,
    batch: Batch,
    masks: Sequence[Mapping[str, Tensor | None]] | None,
    seed: int,
    autocast: Sequence[str] = (),
    measure: bool = False,
) -> tuple[dict[str, Tensor | None], PrecisionMeter]:
    """The reference gradient of `batch` and (`measure`) the precision its forward and backward
    ran in."""
    model, tapes = _build(spec, "record" if masks is not None else "off")
    for name, tape in tapes.items():
        if masks is None:
            break
        per_rank = [m.get(name) for m in masks]
        if any(m is None for m in per_rank):
            raise WholebatchError(
                f"verify: dropout {name!r} drew no masks covering the rows of ranks "
                f"{[r for r, m in enumerate(per_rank) if m is None]} in the split step's first "
                "pass (is it called once per micro-batch, on the micro-batch's rows?)"
            )
        tape.tape = [m for m in per_rank if m is not None]
        tape.mode = "replay"
    torch.manual_seed(seed)
    with PrecisionMeter(active=measure) as meter:
        with _autocasts(autocast):
            loss = spec.reference_loss(model, batch)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise WholebatchError(
                f"{type(spec).__name__}: reference_loss returned {type(loss).__name__}"
                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else "")
                + "; it must return a scalar Tensor"
            )
        torch.autograd.backward(loss.reshape(()))
    grads = {
        name: None if p.grad is None else p.grad.detach().double().clone()
        for name, p in model.named_parameters()
    }
    return grads, meter


def _rel_diff(a: Mapping[str, Tensor | None], b: Mapping[str, Tensor | None]) -> float:
    """The largest |a - b| entry of any parameter relative to its scale (`param_scales` of a)."""
    scales = param_scales(a)
    worst = 0.0
    for name, x in a.items():
        y = b.get(name)
        if x is None and y is None:
            continue
        if x is None or y is None:
            return math.inf
        err = float((x - y).abs().max()) if x.numel() else 0.0
        worst = max(worst, err / scales[name])
    return worst


def reference(req: RefRequest) -> RefResult:
    """The whole-batch reference (one process), with what `req` asks for besides."""
    spec = load_spec(req.target)
    if req.recorded is not None:
        batch, _ = collate([mb for per_rank in req.recorded for mb in per_rank], spec_padding(spec))
    else:
        batch = _batch(spec, req.condition)
    replaying = req.condition.dropout and isinstance(spec, VerifySpec)
    masks = (req.masks if req.masks is not None else ()) if replaying else None
    seed = spec.seed + 10_007
    grads, meter = _ref_grads(spec, batch, masks, seed, measure=req.probe)
    autocast_floor = None
    if req.autocast:
        # The same reference computed under the step's autocast: the round-off of that dtype.
        under, _ = _ref_grads(spec, batch, masks, seed, req.autocast)
        autocast_floor = _rel_diff(grads, under)
    spread = 0.0
    if req.probe:
        again, _ = _ref_grads(spec, batch, masks, seed + 7_919)
        spread = _rel_diff(grads, again)
    floor = None
    plain = None
    if req.floor:
        plain, _ = _ref_grads(spec, batch, None, seed)
        backwards = select_rows(batch, list(range(rows(batch) - 1, -1, -1)))
        reordered, _ = _ref_grads(spec, backwards, None, seed)
        floor = _rel_diff(plain, reordered)
    fit: Fit | None = None
    if req.pieces is not None and req.fit_to is not None:
        whole = plain if plain is not None else _ref_grads(spec, batch, None, seed)[0]
        fit = fit_weights(
            spec,
            batch,
            req.pieces,
            req.piece_ranks,
            req.fit_to,
            whole,
            lambda: _build(spec, "off")[0],
            seed,
        )
    model, _ = _build(spec, "off")
    return RefResult(
        grads=grads,
        dtypes=dtype_names(meter.dtypes),
        autocast=tuple(sorted(meter.autocast)),
        autocast_floor=autocast_floor,
        spread=spread,
        floor=floor,
        fit=fit,
        item_counts=item_counts(spec, batch),
        piece_counts=piece_counts(spec, batch, req.count_pieces or ()),
        params_fp=_params_fp(model),
        batch_fp=0.0 if req.recorded is not None else fingerprint(batch),
    )


def spec_padding(spec: Spec) -> tuple[str, ...]:
    """The recorded columns a ReplaySpec pads on the left (none for other specs)."""
    return spec.left_padded if isinstance(spec, ReplaySpec) else ()
