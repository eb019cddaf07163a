"""`wholebatch verify`: run YOUR training step split over W ranks x K micro-batches, compare with one process.

    wholebatch verify examples/verify_clip.py:correct           # exit 0: every gradient matches
    wholebatch verify examples/verify_clip.py:gather_no_grad    # exit 1, with the likely cause
    wholebatch verify mypkg.checks:clip_step --nproc 3 --micro-batches 2 --json

TARGET names a function (`module:function` or `path/to/file.py:function`) that
returns a `VerifySpec`: how to build the model, the whole batch, the split step
and the whole-batch reference loss. Every process (W ranks and the reference)
calls the function itself, so the spec holds plain closures and never pickles;
it must therefore build the same model and batch every time (seed generators).

What runs (see docs/verify.md):

1. W processes (torchrun's launcher, gloo). Each builds the model after
   `torch.manual_seed(spec.seed)`, wraps it in `DistributedDataParallel` (unless
   `spec.wrap == "none"`), reseeds with `seed + 1 + rank` (ranks draw different
   dropout masks, as in training) and calls `spec.step(model, optimizer, micro_batches)`
   with its K micro-batches: the whole batch's rows cut into W·K contiguous
   chunks, rank r holding chunks rK..rK+K-1. The optimizer is a `GradRecorder`:
   its `step()` records the gradients and changes nothing, so the step may call
   `optimizer.step()`/`zero_grad()` (an `Accumulator` or `CachedStep` does). If
   it never steps, the parameters' `.grad` after the step are compared.
2. One process: the same model, `spec.reference_loss(model, whole_batch).backward()`.
   `nn.Dropout` modules replay the masks the split step drew in its first pass
   (the first calls on each rank that cover that rank's rows), so a correct step
   with dropout matches exactly.
3. Every parameter of every rank against the reference (max abs and relative
   error, relative to the reference's largest entry), and the ratio
   <g, g_ref> / <g_ref, g_ref>. If the model has dropout, the same again with
   dropout off; if the spec gives `equal_batch`, the same on it (dropout off).
   The diagnosis reads the patterns (`wholebatch.verify.diagnose`).

Legend: W ranks, K micro-batches per rank, N rows of the whole batch.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from wholebatch.comm.launch import LaunchSpec, launch
from wholebatch.errors import WholebatchError, WholebatchTypeError
from wholebatch.verify.diagnose import Comparison, VerifyReport, compare, diagnose, error_report
from wholebatch.verify.recording import GradRecorder, install_tape_dropout

__all__ = [
    "TargetError",
    "VerifyConfig",
    "VerifySpec",
    "load_spec",
    "rows",
    "run_verify",
    "split_batch",
]

Batch = Any
Wrap = Literal["ddp", "none"]


class TargetError(WholebatchError):
    """TARGET cannot be found, imported, or does not return a `VerifySpec` (a usage error: exit 2)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerifySpec:
    """What `wholebatch verify` needs to check one training step. Returned by the TARGET function."""

    build_model: Callable[[], nn.Module]
    """Builds the model; called after `torch.manual_seed(seed)` in every process, so it must
    give the same parameters each time. Every trained parameter (a `logit_scale` included)
    must be in it."""

    batch: Batch
    """The whole batch: a Tensor, or a tuple/list/dict of Tensors with the same number of
    rows (dim 0). Built deterministically (a seeded generator): every process builds it."""

    step: Callable[[nn.Module, torch.optim.Optimizer, list[Batch]], object]
    """The split step under test: `step(model, optimizer, micro_batches)` on every rank, with
    the model wrapped as `wrap` says and this rank's K micro-batches. It runs forward and
    backward however the user's training does (collectives, accumulation, caching); it may
    call `optimizer.step()` once and `zero_grad()`. It must not clip gradients."""

    reference_loss: Callable[[nn.Module, Batch], Tensor]
    """The whole-batch loss on one process: `reference_loss(model, batch)` -> scalar. Plain
    math on the whole batch; it must pass all rows through each dropout module once, in order."""

    equal_batch: Batch | None = None
    """Optional: a batch like `batch` but with every row holding the same number of items
    (no padding), rows divisible by W·K. If given, verify also runs it: a step that fails
    only on the ragged `batch` normalises a mean of means."""

    wrap: Wrap = "ddp"
    """"ddp": verify wraps the model in DistributedDataParallel and compares the gradients
    after its mean over ranks. "none": the step gets the plain module and must reduce the
    gradients itself; every rank's gradients are compared."""

    seed: int = 0
    """Seed for `build_model` (rank r's step runs with seed + 1 + r)."""

    rtol: float = 1e-5
    """Largest accepted error per parameter, relative to the reference's largest entry. The
    default suits float32; float64 models agree to about 1e-14."""

    def __post_init__(self) -> None:
        for name in ("build_model", "step", "reference_loss"):
            if not callable(getattr(self, name)):
                raise WholebatchTypeError(
                    f"VerifySpec: {name} must be callable, got {type(getattr(self, name)).__name__}"
                )
        if self.wrap not in ("ddp", "none"):
            raise WholebatchError(f"VerifySpec: wrap={self.wrap!r}; expected 'ddp' or 'none'")
        if not (isinstance(self.rtol, float | int) and self.rtol > 0):
            raise WholebatchError(f"VerifySpec: rtol={self.rtol!r} must be a positive number")
        rows(self.batch, "batch")
        if self.equal_batch is not None:
            rows(self.equal_batch, "equal_batch")


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerifyConfig:
    """How `wholebatch verify` splits the batch. (The CLI's flags.)"""

    nproc: int = 2
    """W: processes (ranks) to run the split step on."""

    micro_batches: int = 3
    """K: micro-batches per rank."""

    timeout: float = 120.0
    """Seconds a collective may wait for a peer before the run fails."""

    json: bool = False
    """Print the report as JSON (for CI) instead of the table."""

    def __post_init__(self) -> None:
        for name in ("nproc", "micro_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise WholebatchError(f"{name}={value!r} must be an integer >= 1")
        if not self.timeout > 0:
            raise WholebatchError(f"timeout={self.timeout!r} must be > 0 seconds")


# ---------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------


def rows(batch: Batch, what: str = "batch") -> int:
    """Rows (dim 0) of a batch: a Tensor, or a tuple/list/dict of Tensors with equal rows."""
    if isinstance(batch, Tensor):
        if batch.dim() == 0:
            raise WholebatchError(f"VerifySpec: {what} is a 0-d tensor; it needs rows (dim 0)")
        return int(batch.shape[0])
    parts = list(batch.values()) if isinstance(batch, Mapping) else batch
    if not isinstance(parts, (tuple, list)) or not parts:
        raise WholebatchTypeError(
            f"VerifySpec: {what} must be a Tensor or a non-empty tuple/list/dict of Tensors, "
            f"got {type(batch).__name__}"
        )
    counts = {rows(p, what) for p in parts}
    if len(counts) != 1:
        raise WholebatchError(
            f"VerifySpec: the tensors of {what} have different row counts {sorted(counts)}; "
            "row i of each must be the same sample"
        )
    return counts.pop()


def split_batch(batch: Batch, parts: int) -> list[Batch]:
    """Cut a batch's rows into `parts` contiguous chunks (sizes differ by at most one)."""
    if isinstance(batch, Tensor):
        return list(torch.tensor_split(batch, parts))
    if isinstance(batch, Mapping):
        cols = {k: split_batch(v, parts) for k, v in batch.items()}
        return [{k: v[i] for k, v in cols.items()} for i in range(parts)]
    pieces = [split_batch(b, parts) for b in batch]
    return [type(batch)(p[i] for p in pieces) for i in range(parts)]


def _fingerprint(batch: Batch) -> float:
    if isinstance(batch, Tensor):
        return float(batch.detach().double().sum()) + float((batch != 0).sum())
    values = batch.values() if isinstance(batch, Mapping) else batch
    return sum(_fingerprint(b) for b in values)


# ---------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------


def _load_module(where: str) -> Any:
    if where.endswith(".py") or os.sep in where or "/" in where:
        path = Path(where)
        if not path.is_file():
            raise TargetError(f"verify: TARGET file {where!r} does not exist")
        name = "_wholebatch_target_" + path.resolve().stem
        spec = importlib.util.spec_from_file_location(name, path.resolve())
        if spec is None or spec.loader is None:
            raise TargetError(f"verify: cannot load {where!r} as a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    # As `python -m` does, let the current directory's modules be found.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as exc:
        if exc.name and (where == exc.name or where.startswith(exc.name + ".")):
            raise TargetError(
                f"verify: no module named {where!r} (from TARGET); pass 'module:function' "
                "importable from the current directory, or 'path/to/file.py:function'"
            ) from None
        raise


def load_spec(target: str) -> VerifySpec:
    """Resolve TARGET (`module:function` or `file.py:function`), call it, and check it gave a `VerifySpec`."""
    where, sep, attr = target.rpartition(":")
    if not sep or not where or not attr:
        raise TargetError(
            f"verify: TARGET {target!r} must be 'module:function' or 'path/to/file.py:function'"
        )
    module = _load_module(where)
    fn = getattr(module, attr, None)
    if fn is None:
        names = sorted(
            n
            for n, v in vars(module).items()
            if inspect.isfunction(v) and v.__module__ == module.__name__ and not n.startswith("_")
        )
        raise TargetError(f"verify: {where!r} has no {attr!r}; its functions: {', '.join(names)}")
    if not callable(fn):
        raise TargetError(f"verify: {target!r} is a {type(fn).__name__}, not a function")
    spec = fn()
    if not isinstance(spec, VerifySpec):
        raise TargetError(
            f"verify: {target}() returned {type(spec).__name__}; it must return a "
            "wholebatch.verify.VerifySpec"
        )
    return spec


# ---------------------------------------------------------------------------
# The split run (on each rank) and the reference (one process)
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Variant:
    name: str
    equal: bool  # use spec.equal_batch
    dropout: bool  # dropout on (recorded, replayed in the reference)


def _variants(spec: VerifySpec, has_dropout: bool) -> list[_Variant]:
    out = [_Variant(name="as given", equal=False, dropout=True)]
    if has_dropout:
        out.append(_Variant(name="dropout off", equal=False, dropout=False))
    if spec.equal_batch is not None:
        out.append(_Variant(name="equal items, dropout off", equal=True, dropout=False))
    return out


def _build(spec: VerifySpec, dropout: bool) -> tuple[nn.Module, dict[str, Any]]:
    torch.manual_seed(spec.seed)
    model = spec.build_model()
    if not isinstance(model, nn.Module):
        raise WholebatchTypeError(
            f"VerifySpec: build_model() returned {type(model).__name__}, not a torch.nn.Module"
        )
    tapes = install_tape_dropout(model, "record" if dropout else "off")
    return model, tapes


def _param_fingerprint(model: nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def _run_variant(spec: VerifySpec, variant: _Variant, k: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank, w = dist.get_rank(), dist.get_world_size()
    model, tapes = _build(spec, variant.dropout)
    module: nn.Module = DistributedDataParallel(model) if spec.wrap == "ddp" else model
    optimizer = GradRecorder(model.parameters())
    batch = spec.equal_batch if variant.equal else spec.batch
    mine = split_batch(batch, w * k)[rank * k : (rank + 1) * k]
    torch.manual_seed(spec.seed + 1 + rank)
    spec.step(module, optimizer, mine)
    my_rows = sum(rows(mb) for mb in mine)
    grads = {}
    for name, p in model.named_parameters():
        g = optimizer.gradient(p)
        grads[name] = None if g is None else g.cpu()
    return {
        "grads": grads,
        "masks": {n: t.first_rows(my_rows) for n, t in tapes.items()},
        "calls": optimizer.calls,
        "params": _param_fingerprint(model),
        "batch": _fingerprint(batch),
    }


def _rank_main(targets: Sequence[str], cwd: str, k: int) -> dict[str, Any]:
    """One rank: load each spec itself and run every variant of its split step.

    A step that raises gives its traceback for that target (the others still run);
    a rank that raises alone leaves its peers waiting until the group's timeout.
    """
    import traceback

    os.chdir(cwd)
    out: dict[str, Any] = {}
    for target in targets:
        try:
            spec = load_spec(target)
            _, tapes = _build(spec, True)
            out[target] = {v.name: _run_variant(spec, v, k) for v in _variants(spec, bool(tapes))}
        except Exception as exc:
            out[target] = {
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
    return out


def _reference(
    spec: VerifySpec, variant: _Variant, masks: list[dict[str, Tensor | None]]
) -> dict[str, Tensor]:
    model, tapes = _build(spec, variant.dropout)
    for name, tape in tapes.items() if variant.dropout else ():
        per_rank = [m.get(name) for m in masks]
        if any(m is None for m in per_rank):
            raise WholebatchError(
                f"verify: dropout {name!r} drew no masks covering the rows of ranks "
                f"{[r for r, m in enumerate(per_rank) if m is None]} in the split step's first "
                "pass (is it called once per micro-batch, on the micro-batch's rows?)"
            )
        tape.tape = [m for m in per_rank if m is not None]
        tape.mode = "replay"
    batch = spec.equal_batch if variant.equal else spec.batch
    loss = spec.reference_loss(model, batch)
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise WholebatchError(
            f"VerifySpec: reference_loss returned {type(loss).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else "")
            + "; it must return a scalar Tensor"
        )
    torch.autograd.backward(loss.reshape(()))
    return {
        name: (
            p.grad.detach().double().clone()
            if p.grad is not None
            else torch.zeros_like(p, dtype=torch.float64)
        )
        for name, p in model.named_parameters()
    }


def _check_target(target: str, config: VerifyConfig) -> VerifySpec:
    spec = load_spec(target)
    w, k = config.nproc, config.micro_batches
    for what, batch in (("batch", spec.batch), ("equal_batch", spec.equal_batch)):
        if batch is not None and rows(batch) < w * k:
            raise TargetError(
                f"verify: {target}: the spec's {what} has {rows(batch)} rows, fewer than "
                f"W·K = {w}·{k} = {w * k}; lower --nproc/--micro-batches or make the batch larger"
            )
    return spec


def _report(
    target: str, spec: VerifySpec, outs: list[dict[str, Any]], config: VerifyConfig
) -> VerifyReport:
    w, k = config.nproc, config.micro_batches
    common: dict[str, Any] = dict(
        target=target, world_size=w, micro_batches=k, rows=rows(spec.batch), wrap=spec.wrap
    )
    failed = [(r, o) for r, o in enumerate(outs) if "error" in o]
    if failed:
        r, o = failed[0]
        ranks = [fr for fr, _ in failed]
        return error_report(
            **common, error=f"the split step raised on ranks {ranks}: {o['error']}\n\n"
            f"rank {r}'s traceback:\n{o['traceback'].rstrip()}",
        )  # fmt: skip
    probe, tapes = _build(spec, True)
    fingerprint = _param_fingerprint(probe)
    comparisons: list[Comparison] = []
    for v in _variants(spec, bool(tapes)):
        per_rank = [o[v.name] for o in outs]
        batch = spec.equal_batch if v.equal else spec.batch
        for r, o in enumerate(per_rank):
            if abs(o["params"] - fingerprint) > 1e-9 * max(1.0, abs(fingerprint)):
                raise TargetError(
                    f"verify: {target}: build_model() gave different parameters on rank {r} than "
                    "in the reference process; build it deterministically (verify seeds torch first)"
                )
            if abs(o["batch"] - _fingerprint(batch)) > 1e-9 * max(1.0, abs(_fingerprint(batch))):
                raise TargetError(
                    f"verify: {target}: the spec's batch differs on rank {r} from the reference "
                    "process's; build it with a seeded generator"
                )
        ref = _reference(spec, v, [o["masks"] for o in per_rank])
        comparisons.append(
            compare(
                v.name,
                ref,
                [o["grads"] for o in per_rank],
                rtol=spec.rtol,
                step_calls=[o["calls"] for o in per_rank],
            )
        )
    return diagnose(**common, comparisons=comparisons)


def run_verify(targets: Sequence[str], config: VerifyConfig | None = None) -> list[VerifyReport]:
    """Check each TARGET's step: split over `config.nproc` ranks x `config.micro_batches` vs one process.

    All targets run in one launch of `config.nproc` processes.

    Raises:
        TargetError: a TARGET cannot be loaded or gives no VerifySpec, or its batch is too small.
        wholebatch.comm.launch.LaunchError: a rank died (a step that raises is reported in its report).
    """
    config = config or VerifyConfig()
    specs = {t: _check_target(t, config) for t in targets}
    outs = launch(
        _rank_main,
        (list(specs), os.getcwd(), config.micro_batches),
        spec=LaunchSpec(nproc=config.nproc, timeout_s=config.timeout),
        name="wholebatch-verify",
    )
    return [_report(t, spec, [o[t] for o in outs], config) for t, spec in specs.items()]
