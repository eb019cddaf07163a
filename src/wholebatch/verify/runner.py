"""`wholebatch verify`: run YOUR training step split over W ranks x K micro-batches, compare with one process.

    wholebatch verify examples/verify_clip.py:correct           # exit 0: every gradient matches
    wholebatch verify examples/verify_clip.py:gather_no_grad    # exit 1, with the likely cause
    wholebatch verify mypkg.checks:clip_step --nproc 3 --micro-batches 2 --json

TARGET names a function (`module:function` or `path/to/file.py:function`) that
returns a `VerifySpec` (a step written as `step(model, optimizer, micro_batches)`)
or a `TrainerSpec` (a trainer that owns the split: HF `Trainer`, an Accelerate
loop). Every process calls the function itself, so the spec holds plain
closures and never pickles; it must build the same model and batch every time.

What runs, per TARGET (docs/cli.md; processes: `wholebatch.verify.procs`):

1. The split run: W ranks, each a clean fork, joined in a gloo group. Each builds
   the model after `torch.manual_seed(spec.seed)`, verify wraps it in
   `DistributedDataParallel` (`wrap="ddp"`), reseeds with `seed + 1 + rank` and
   calls the step with its K chunks of the whole batch (W·K contiguous chunks,
   rank r holding chunks rK..rK+K-1), or the trainer with the whole batch. The
   optimizer is a `GradRecorder`: its `step()` records the gradients and changes
   nothing.
2. The reference: one process, `reference_loss(model, whole_batch).backward()`,
   replaying the dropout masks the split run drew in its first pass; run twice
   with different seeds (randomness verify cannot replay would differ).
3. The comparison of every parameter of every rank, and the evidence: a step
   that calls `optimizer.step()` more than once, changes parameters itself, or
   has nothing to judge fails whatever its gradients.
4. Only when it fails: the same step again with dropout off, on `equal_batch`,
   and at (W, 1), (1, K), (1, 1), each against its own reference; the reference
   on the batch with its rows reversed (the round-off floor) and on each
   micro-batch alone (the weights the wrong gradient gives each micro-batch);
   with the spec's `normalize` and `item_losses`, the weight it gives each item
   (`wholebatch.verify.normfit`: which normalisation mode, whole-step or per
   micro-batch).
   `wholebatch.verify.diagnose` reads the patterns.

Legend: W ranks, K micro-batches per rank, N rows of the whole batch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from wholebatch.comm.mesh import parse_mesh_shape
from wholebatch.errors import WholebatchError
from wholebatch.verify.batches import collate
from wholebatch.verify.diagnose import diagnose, error_report
from wholebatch.verify.mesh import (
    REPLICAS_ONE,
    mesh_world,
    rank_factors,
    replica_shape,
    row_dims,
)
from wholebatch.verify.precision import auto_rtol, eps_of
from wholebatch.verify.procs import ChildFailure, Session
from wholebatch.verify.replay import batch_key, empty_run_error
from wholebatch.verify.report import Comparison, Evidence, Fit, Floor, VerifyReport, compare
from wholebatch.verify.spec import (
    Spec,
    TargetError,
    TrainerRun,
    TrainerSpec,
    VerifyConfig,
    VerifySpec,
    load_spec,
    rows,
    split_batch,
    split_target,
    target_of,
)
from wholebatch.verify.worker import (
    Condition,
    Description,
    RankResult,
    RefRequest,
    RefResult,
    describe,
    reference,
    split_rank,
)

__all__ = [
    "TargetError",
    "TrainerRun",
    "TrainerSpec",
    "VerifyConfig",
    "VerifySpec",
    "load_spec",
    "rows",
    "run_verify",
    "split_batch",
]

# A measured reordering error above this is not round-off: the loss depends on row order.
_MAX_MEASURED_FLOOR = 1e-3
# The step's autocast changed the arithmetic when the reference under it differs from the
# reference without it by more than this many times the eps of the dtypes seen otherwise.
_AUTOCAST_SEEN = 10.0
# Under autocast the tolerance is at least this many times that measured difference: the
# split step rounds in the same dtype, on other shapes, so its error is of the same size.
_AUTOCAST_MARGIN = 4.0


class _Target:
    """One TARGET's runs and report."""

    def __init__(
        self, session: Session, target: str, desc: Description, config: VerifyConfig
    ) -> None:
        self.session = session
        self.target = target
        self.where = split_target(target)[0]
        self.desc = desc
        self.config = config
        self._refs: dict[tuple[Condition, float], RefResult] = {}
        self.replay = desc.kind == "replay"
        """A ReplaySpec: each split run's batch is what its trainer recorded."""
        self._padding: tuple[str, ...] = ()
        self.mesh = config.mesh or desc.mesh
        """The device mesh the split runs on ("dp=2,tp=2"); "" a flat world."""
        self.world = mesh_world(self.mesh) if self.mesh else config.nproc
        """W: the processes of the split run."""
        if self.mesh:
            _check_mesh_split(target, self.mesh, desc, config.micro_batches)

    def _split(
        self, condition: Condition, w: int, k: int, measure: bool = False
    ) -> list[RankResult] | ChildFailure:
        """One split run; `measure`: record the precision it computes in (the first run's only)."""
        values = self.session.call(
            self.where, split_rank, (self.target, condition, k, measure), nproc=w, distributed=True
        )
        failures = [v for v in values if isinstance(v, ChildFailure)]
        if failures:
            first = next((f for f in failures if f.kind == "raised"), failures[0])
            ranks = [f.rank for f in failures]
            first.message = f"on ranks {ranks}: {first.message}"
            return first
        outs = [v for v in values if isinstance(v, RankResult)]
        if self.replay:
            return self._recorded_rows(outs)
        return outs

    def _recorded_rows(self, outs: list[RankResult]) -> list[RankResult] | ChildFailure:
        """A ReplaySpec's run: each rank's pieces are the rows of its recorded micro-batches in
        the collated whole batch (rank order)."""
        counts = [len(o.recorded) for o in outs]
        if not all(counts):
            return ChildFailure(0, "raised", str(empty_run_error(self.target, counts)))
        try:
            _, pieces = collate([mb for o in outs for mb in o.recorded])
        except WholebatchError as exc:
            return ChildFailure(0, "raised", str(exc))
        start = 0
        for o, n in zip(outs, counts, strict=True):
            o.pieces = pieces[start : start + n]
            start += n
        return outs

    def _recorded(self, outs: list[RankResult]) -> tuple[tuple[dict[str, Any], ...], ...] | None:
        return tuple(tuple(o.recorded) for o in outs) if self.replay else None

    def _rows_of(self, outs: list[RankResult], condition: Condition) -> int:
        """N of the run: the spec's batch (or equal_batch), or what a ReplaySpec's trainer recorded."""
        if self.replay:
            return sum(len(p) for o in outs for p in o.pieces)
        return self.desc.equal_rows if condition.equal else self.desc.rows

    def _reference(self, req: RefRequest) -> RefResult | ChildFailure:
        reuse = req.masks is None and req.pieces is None and not req.floor
        # one whole batch for every mesh; a ReplaySpec's, per recorded batch
        key = (
            dataclasses.replace(req.condition, mesh=""),
            0.0 if req.recorded is None else batch_key(req.recorded),
        )
        if reuse and key in self._refs:
            return self._refs[key]
        (value,) = self.session.call(self.where, reference, (req,))
        if isinstance(value, ChildFailure):
            return value
        if not isinstance(value, RefResult):
            raise RuntimeError(f"verify: the reference process sent {type(value).__name__}")
        if reuse:
            self._refs[key] = value
        return value

    def _ref_for(
        self, condition: Condition, outs: list[RankResult], probe: bool = False
    ) -> RefResult | ChildFailure:
        replay = condition.dropout and self.desc.has_dropout
        autocast = tuple(sorted({a for o in outs for a in o.autocast})) if probe else ()
        # On a mesh the first replica of each row shard stands for the shard, in shard order.
        outs = sorted((o for o in outs if o.primary), key=lambda o: o.shard)
        return self._reference(
            RefRequest(
                target=self.target,
                condition=condition,
                masks=tuple(o.masks for o in outs) if replay else None,
                probe=probe,
                count_pieces=tuple(tuple(p) for o in outs for p in o.pieces) if probe else None,
                autocast=autocast,
                recorded=self._recorded(outs),
            )
        )

    def _error(self, failure: ChildFailure, what: str) -> VerifyReport:
        text = f"{what} {failure.message}"
        if failure.traceback:
            text += f"\n\nrank {failure.rank}'s traceback:\n{failure.traceback.rstrip()}"
        code = "step-hung" if failure.kind == "hung" else "step-raised"
        if what.startswith("the reference"):
            code = "reference-raised"
        return error_report(
            target=self.target,
            world_size=self.world,
            micro_batches=self.config.micro_batches,
            rows=self.desc.rows,
            wrap=self._wrap(),
            error=text,
            code=code,
        )

    def _wrap(self) -> str:
        """The report's wrapper column: the spec's, or the mesh the split ran on."""
        return f"mesh {self.mesh}" if self.mesh else self.desc.wrap

    def _check_same_inputs(self, outs: list[RankResult], ref: RefResult) -> None:
        for r, o in enumerate(outs):
            if abs(o.params_fp - ref.params_fp) > 1e-9 * max(1.0, abs(ref.params_fp)):
                raise TargetError(
                    f"verify: {self.target}: build_model() gave different parameters on rank {r} "
                    "than in the reference process; build it deterministically (verify seeds "
                    "torch first)"
                )
            if abs(o.batch_fp - ref.batch_fp) > 1e-9 * max(1.0, abs(ref.batch_fp)):
                raise TargetError(
                    f"verify: {self.target}: the spec's batch differs on rank {r} from the "
                    "reference process's; build it with a seeded generator"
                )

    def _rerun(
        self, condition: Condition, w: int, k: int, rtol: float, label: str
    ) -> tuple[Comparison, list[RankResult]] | None:
        outs = self._split(condition, w, k)
        if isinstance(outs, ChildFailure):
            return None
        ref = self._ref_for(condition, outs)
        if isinstance(ref, ChildFailure):
            return None
        cmp = compare(
            label,
            ref.grads,
            [o.grads for o in outs],
            rtol=rtol,
            step_calls=[o.calls for o in outs],
            world_size=w,
            micro_batches=k,
            dropout=condition.dropout and self.desc.has_dropout,
            equal=condition.equal,
        )
        return cmp, outs

    def _fit_and_floor(
        self, condition: Condition, outs: list[RankResult], rtol: float
    ) -> tuple[Fit | None, float | None]:
        n = self._rows_of(outs, condition)
        pieces: list[tuple[int, ...]] = []
        ranks: list[int] = []
        for r, o in enumerate(outs):
            for piece in o.pieces:
                pieces.append(tuple(piece))
                ranks.append(o.shard if self.mesh else r)  # on a mesh: the data shard
        # The fit needs each row in exactly one micro-batch (a trainer's recorded rows may not be).
        covered = sorted(i for p in pieces for i in p) == list(range(n))
        want_fit = covered and len(pieces) > 1
        missing = "" if covered else _rows_missing(outs, n)
        req = RefRequest(
            target=self.target,
            condition=Condition(dropout=False, equal=condition.equal),
            probe=False,
            floor=True,
            pieces=tuple(pieces) if want_fit else None,
            piece_ranks=tuple(ranks) if want_fit else (),
            fit_to=outs[0].grads if want_fit else None,
            recorded=self._recorded(outs),
        )
        value = self._reference(req)
        if isinstance(value, ChildFailure):
            return None, None
        measured = value.floor
        if measured is not None and measured > _MAX_MEASURED_FLOOR:
            measured = None
        if missing:
            return _no_fit(missing), measured
        if value.fit is not None:
            return dataclasses.replace(value.fit, tolerance=max(1e-5, rtol)), measured
        return value.fit, measured

    def _tolerance(self, outs: list[RankResult], ref: RefResult) -> Floor:
        """rtol and the floor from the dtypes both sides computed in, autocast included."""
        # The floor is set by the least precise arithmetic of either side: a float64 model
        # whose norms (or whose trainer's loss) compute in float32 agrees to float32's eps.
        seen = {*ref.dtypes, *(d for o in outs for d in o.dtypes)}
        split_autocast = {a for o in outs for a in o.autocast}
        autocast = tuple(sorted(split_autocast | set(ref.autocast)))
        dtypes = seen | {a.partition(":")[2] for a in ref.autocast}
        measured = ref.autocast_floor
        if measured is not None and measured > _AUTOCAST_SEEN * eps_of(tuple(dtypes)):
            # the step's autocast computed in its dtype (not only ops it leaves alone)
            dtypes |= {a.partition(":")[2] for a in split_autocast}
        names = tuple(sorted(dtypes))
        if self.desc.rtol is not None:
            rtol, rtol_from = self.desc.rtol, "from the spec"
        else:
            rtol, rtol_from = auto_rtol(names)
            if autocast and measured is not None and _AUTOCAST_MARGIN * measured > rtol:
                rtol = float(f"{_AUTOCAST_MARGIN * measured:.2g}")
                rtol_from = (
                    f"{_AUTOCAST_MARGIN:g}x the reference's own difference under the step's "
                    f"autocast ({', '.join(autocast)}): {measured:.1e}"
                )
        return Floor(
            dtypes=names,
            unit_roundoff=eps_of(names),
            measured=None,
            rtol=rtol,
            rtol_from=rtol_from,
            autocast=autocast,
            autocast_measured=measured,
        )

    def _variants(
        self, main: Comparison, outs: list[RankResult], rtol: float
    ) -> tuple[list[Comparison], Fit | None, float | None]:
        """A failing step again: dropout off, equal_batch, the (W, 1), (1, K), (1, 1) grid."""
        w, k, mesh = self.world, self.config.micro_batches, self.mesh
        main_cond = Condition(mesh=mesh)
        comparisons = [main]
        fit_cond, fit_outs = main_cond, outs
        if self.desc.has_dropout:
            off_cond = Condition(dropout=False, mesh=mesh)
            off = self._rerun(off_cond, w, k, rtol, "dropout off")
            if off is not None:
                comparisons.append(off[0])
                fit_cond, fit_outs = off_cond, off[1]
        if self.desc.has_equal:
            eq_cond = Condition(dropout=False, equal=True, mesh=mesh)
            eq = self._rerun(eq_cond, w, k, rtol, "equal items")
            if eq is not None:
                comparisons.append(eq[0])
        grid = [(w, 1)] if k > 1 else []
        if mesh:
            comparisons += self._mesh_reruns(rtol)
        grid += [(1, k)] if w > 1 and not mesh else []
        grid += [(1, 1)] if (w, k) != (1, 1) and (w > 1 or k > 1) and not mesh else []
        for gw, gk in dict.fromkeys(grid):
            again = self._rerun(main_cond, gw, gk, rtol, f"re-run W={gw}, K={gk}")
            if again is not None:
                comparisons.append(again[0])
        if any(c.rank_spread > rtol for c in main.params):
            return comparisons, None, None
        fit, measured = self._fit_and_floor(fit_cond, fit_outs, rtol)
        return comparisons, fit, measured

    def _mesh_evidence(self, outs: list[RankResult], ref: RefResult) -> dict[str, Any]:
        return _mesh_evidence_of(self.mesh, self.desc.batch_dims, outs, ref)

    def _mesh_reruns(self, rtol: float) -> list[Comparison]:
        """On a mesh: the same step with every replica dim of size 1 ("dp=2,tp=1")."""
        shape = replica_shape(self.mesh, self.desc.batch_dims)
        if not shape:
            return []
        again = self._rerun(
            Condition(mesh=shape),
            mesh_world(shape),
            self.config.micro_batches,
            rtol,
            f"{REPLICAS_ONE} ({shape})",
        )
        return [] if again is None else [again[0]]

    def verify(self) -> VerifyReport:
        w, k = self.world, self.config.micro_batches
        main_cond = Condition(mesh=self.mesh)
        outs = self._split(main_cond, w, k, measure=True)
        if isinstance(outs, ChildFailure):
            return self._error(outs, "the split step failed")
        ref = self._ref_for(main_cond, outs, probe=True)
        if isinstance(ref, ChildFailure):
            return self._error(ref, "the reference (reference_loss on the whole batch) failed:")
        self._check_same_inputs(outs, ref)
        floor = self._tolerance(outs, ref)
        rtol = floor.rtol
        main = compare(
            "as given",
            ref.grads,
            [o.grads for o in outs],
            rtol=rtol,
            step_calls=[o.calls for o in outs],
            world_size=w,
            micro_batches=k,
            dropout=self.desc.has_dropout,
            equal=False,
        )
        evidence = Evidence(
            kind=self.desc.kind,
            step_calls=tuple(o.calls for o in outs),
            changed=tuple(o.changed for o in outs),
            collectives=tuple(o.collectives for o in outs),
            reference_zero=all(g is None or not bool(g.any()) for g in ref.grads.values()),
            reference_spread=ref.spread,
            item_counts=ref.item_counts,
            in_functions=tuple(o.in_functions for o in outs),
            redrawn=tuple(o.redrawn for o in outs),
            rows_note=_rows_missing(outs, self._rows_of(outs, main_cond)),
            **self._mesh_evidence(outs, ref),
        )
        comparisons: list[Comparison] = [main]
        fit: Fit | None = None
        if not main.ok and ref.spread <= rtol:
            comparisons, fit, measured = self._variants(main, outs, rtol)
            floor = dataclasses.replace(floor, measured=measured)
        report = diagnose(
            target=self.target,
            world_size=w,
            micro_batches=k,
            rows=self._rows_of(outs, main_cond),
            wrap=self._wrap(),
            comparisons=comparisons,
            evidence=evidence,
            floor=floor,
            fit=fit,
        )
        notes = _blind_spots(ref.piece_counts)
        if not main.ok and evidence.rows_note:
            notes += (evidence.rows_note,)
        return dataclasses.replace(report, notes=notes)


def _check_mesh_split(target: str, mesh: str, desc: Description, k: int) -> None:
    """A TargetError (the same for every rank: checked before any runs) unless the spec can
    run on `mesh`: batch dims among its dims, at least B·K rows (a trainer: a multiple)."""
    try:
        shape = parse_mesh_shape(mesh)
        dims = row_dims(shape, desc.batch_dims)
    except WholebatchError as exc:
        raise TargetError(f"verify: {target}: --mesh {mesh}: {exc}") from None
    b = math.prod(shape[d] for d in dims)
    for what, n in (("batch", desc.rows), ("equal_batch", desc.equal_rows)):
        if n and n < b * k:
            raise TargetError(
                f"verify: {target}: the spec's {what} has {n} rows, fewer than B·K = {b}·{k} = "
                f"{b * k} (B: the row shards of mesh {mesh}, the product of {dims}); lower "
                "--micro-batches or make the batch larger"
            )
        if n and desc.kind == "trainer" and n % (b * k):
            raise TargetError(
                f"verify: {target}: a trainer takes a fixed batch per device, so the spec's "
                f"{what} rows ({n}) must divide by B·K = {b}·{k} = {b * k} (B: the row shards "
                f"of mesh {mesh}, the product of {dims}); change the batch or --micro-batches"
            )


def _mesh_evidence_of(
    mesh: str, batch_dims: tuple[str, ...] | None, outs: list[RankResult], ref: RefResult
) -> dict[str, Any]:
    """Evidence fields of a mesh run (none for a flat world)."""
    if not mesh:
        return {}
    shape = parse_mesh_shape(mesh)
    return {
        "mesh": shape,
        "row_dims": row_dims(shape, batch_dims),
        "shards": tuple(o.shard for o in outs),
        "inputs": tuple(o.inputs for o in outs),
        "owned": tuple(o.owned for o in outs),
        "rank_factors": rank_factors([o.local for o in outs], ref.grads),
    }


def _rows_missing(outs: list[RankResult], n: int) -> str:
    """The first rank's note on the rows it could not match, or why rows are not covered."""
    for r, o in enumerate(outs):
        if o.rows_note:
            return f"rank {r}: {o.rows_note}."
    seen = sorted(i for o in outs for p in o.pieces for i in p)
    if seen and seen != list(range(n)):
        return (
            f"the micro-batches verify recognised hold {len(seen)} rows ({len(set(seen))} "
            f"distinct) where the batch has {n}: the rows each micro-batch held are not known."
        )
    return ""


def _no_fit(note: str) -> Fit:
    """A fit that could not be made, saying why."""
    return Fit(
        ranks=(),
        split=(),
        reference=(),
        split_residual=math.inf,
        reference_residual=math.inf,
        counts={},
        note=note,
    )


def _blind_spots(piece_counts: dict[str, list[int]]) -> tuple[str, ...]:
    """What this batch cannot reveal: with equal micro-batches a mean of means is exact."""
    rules = {k: v for k, v in piece_counts.items() if k != "rows"} or piece_counts
    if not rules or any(len(v) < 2 or len(set(v)) > 1 for v in rules.values()):
        return ()
    (rule, counts), *_ = rules.items()
    if rule == "rows":
        return (
            f"every micro-batch holds {counts[0]} rows. If the loss is a mean over rows, a mean "
            "of per-micro-batch means equals it on this batch, so a step that normalises per "
            "micro-batch would pass too: use a row count not divisible by W·K to test that.",
        )
    return (
        f"every micro-batch holds {counts[0]} items ({rule}). On such a batch a mean of "
        "per-micro-batch means equals the whole-batch mean, so a step that normalises per "
        "micro-batch would pass too: give a ragged batch to test normalisation.",
    )


def _describe(session: Session, target: str, config: VerifyConfig) -> Description:
    where = split_target(target)[0]
    (value,) = session.call(
        where, describe, (target, config.nproc, config.micro_batches, config.mesh)
    )
    if isinstance(value, str):
        raise TargetError(value)
    if isinstance(value, ChildFailure):
        raise TargetError(f"verify: {target}() raised {value.message}")
    assert isinstance(value, Description)
    return value


def run_verify(
    targets: Sequence[str | Callable[[], Spec]], config: VerifyConfig | None = None
) -> list[VerifyReport]:
    """Check each TARGET's step: split over `config.nproc` ranks x `config.micro_batches` vs one process.

    TARGET: 'module:function', 'path/to/file.py:function', or the module-level function
    itself. Every run of every target starts from a clean fork of a process that
    has only imported the target's module (`wholebatch.verify.procs`).

    Raises:
        TargetError: a TARGET cannot be loaded or gives no spec, its batch is too small,
            or its model or batch is not the same in every process.
    """
    config = config or VerifyConfig()
    names = [target_of(t) for t in targets]
    with Session(timeout_s=config.timeout) as session:
        descs = {t: _describe(session, t, config) for t in dict.fromkeys(names)}
        return [_Target(session, t, descs[t], config).verify() for t in names]
