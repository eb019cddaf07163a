"""What `wholebatch verify` checks: the specs a TARGET returns, how a TARGET is loaded, the config.

Three kinds of TARGET:

- `VerifySpec`: a step written as `step(model, optimizer, micro_batches)`; verify
  cuts the whole batch into W·K contiguous chunks, wraps the model in DDP and
  hands each rank its K chunks.
- `TrainerSpec`: a trainer that owns the split (the Hugging Face `Trainer`, an
  Accelerate loop, Lightning): `train(run)` builds it around `run.model`,
  `run.optimizer` and the whole batch `run.dataset`, with `run.per_device_rows`
  rows per device and `run.micro_batches` accumulation steps, and trains one
  optimizer step. On a mesh (`mesh="dp=2,tp=2"`) `run.mesh`, `run.batch_dims`,
  `run.data_shards`, `run.data_rank` and `run.shard` say how to shard the rows.
- `wholebatch.verify.replay.ReplaySpec`: a trainer that builds its batch inside
  `train(run)` (trl's GRPOTrainer samples and scores completions): it calls
  `run.record(micro_batch)` for every micro-batch its loss reads, and the
  reference runs on what every rank recorded.

All give the same whole-batch reference: `reference_loss(model, whole_batch)` in
one process. Legend: W ranks, K micro-batches per rank, N rows of the whole batch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

import torch
from torch import Tensor, nn

from wholebatch.errors import WholebatchError, WholebatchTypeError
from wholebatch.train.normalize import Normalize
from wholebatch.verify.batches import (
    Batch,
    dataset_rows,
    fingerprint,
    rows,
    select_rows,
    split_batch,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from wholebatch.verify.replay import ReplaySpec

__all__ = [
    "Batch",
    "Spec",
    "TargetError",
    "TrainerRun",
    "TrainerSpec",
    "VerifyConfig",
    "VerifySpec",
    "dataset_rows",
    "fingerprint",
    "load_spec",
    "rows",
    "select_rows",
    "split_batch",
    "target_of",
]

Wrap = Literal["ddp", "none"]


class TargetError(WholebatchError):
    """TARGET cannot be found, imported, or does not return a spec (a usage error: exit 2)."""


def _check_common(spec: Any, kind: str, *, has_batch: bool = True) -> None:
    """The fields every spec kind shares; `has_batch`: it holds a `batch` (and `equal_batch`)."""
    for name in ("build_model", "reference_loss"):
        if not callable(getattr(spec, name)):
            raise WholebatchTypeError(
                f"{kind}: {name} must be callable, got {type(getattr(spec, name)).__name__}"
            )
    if spec.count_items is not None and not callable(spec.count_items):
        raise WholebatchTypeError(f"{kind}: count_items must be callable or None")
    if spec.rtol is not None and not (
        isinstance(spec.rtol, float | int) and not isinstance(spec.rtol, bool) and spec.rtol > 0
    ):
        raise WholebatchError(f"{kind}: rtol={spec.rtol!r} must be a positive number or None")
    if has_batch:
        rows(spec.batch, "batch")
        if spec.equal_batch is not None:
            rows(spec.equal_batch, "equal_batch")
    if spec.normalize is not None and not isinstance(spec.normalize, Normalize):
        raise WholebatchTypeError(
            f"{kind}: normalize must be a wholebatch.Normalize or None, got "
            f"{type(spec.normalize).__name__}"
        )
    if (spec.normalize is None) != (spec.item_losses is None):
        given, missing = (
            ("normalize", "item_losses")
            if spec.item_losses is None
            else ("item_losses", "normalize")
        )
        raise WholebatchError(
            f"{kind}: {given} is given without {missing}; verify reads how the step weights "
            "each item from both (normalize: the items' ids; item_losses(model, batch): their "
            "losses shaped like the mask), so give both or neither"
        )
    if spec.item_losses is not None and not callable(spec.item_losses):
        raise WholebatchTypeError(
            f"{kind}: item_losses must be callable, got {type(spec.item_losses).__name__}"
        )
    if spec.aux_loss is not None and not callable(spec.aux_loss):
        raise WholebatchTypeError(
            f"{kind}: aux_loss must be callable or None, got {type(spec.aux_loss).__name__}"
        )


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
    backward however the user's training does (collectives, accumulation, caching) and calls
    `optimizer.step()` at most once (an optimizer step per micro-batch fails). It must not
    clip gradients."""

    reference_loss: Callable[[nn.Module, Batch], Tensor]
    """The whole-batch loss on one process: `reference_loss(model, batch)` -> scalar. Plain
    math on the whole batch; it must pass all rows through each dropout module once, in
    order. Verify also calls it on parts of the batch (to find how a wrong step weights its
    micro-batches), so it should work on any subset of rows."""

    equal_batch: Batch | None = None
    """Optional: a batch like `batch` but with every row holding the same number of items
    (no padding). If given and the step fails, verify also runs it: a step that fails only
    on the ragged `batch` normalises a mean of means. (Verify finds that without it too,
    from the weighting the wrong gradient implies, when the loss is a mean over items.)"""

    count_items: Callable[[Batch], int | Tensor] | None = None
    """Optional: the number of items (tokens, samples) the loss averages over in a batch.
    Lets a diagnosis name the counts (e.g. "divides by 186 where the batch has 162"). For a
    dict batch with "labels", verify tries the counts of labels != -100 with and without the
    causal shift by itself."""

    wrap: Wrap = "ddp"
    """"ddp": verify wraps the model in DistributedDataParallel and compares the gradients
    after its mean over ranks. "none": the step gets the plain module and must reduce the
    gradients itself; every rank's gradients are compared."""

    seed: int = 0
    """Seed for `build_model` (rank r's step runs with seed + 1 + r)."""

    rtol: float | None = None
    """Largest accepted error per parameter, relative to the reference's largest entry.
    None: from the model's own dtypes: 1e-10 when everything it computes is float64,
    1e-5 when its least precise computation is float32, 1e-2 below that; under autocast
    (bf16, fp16; CPU or CUDA) at least 4x the reference's own difference when computed
    under the step's autocast."""

    normalize: Normalize | None = None
    """Optional, with `item_losses`: the whole batch's loss as a `wholebatch.Normalize`
    (mode "token", "sequence", "constant" or "group", and `items(batch)` giving each
    item's mask and global sequence/group ids from a batch's columns; verify calls it
    on each micro-batch's rows). When the step fails, verify reads the weight the
    split gradient gives every item and names the normalisation it applies
    (cause `normalization-mode`: "the step takes the mean of sequence means per
    micro-batch; the reference takes the mean of sequence means over the whole
    step"). Ids must be global to the batch (a column, not a position in a
    micro-batch)."""

    item_losses: Callable[[nn.Module, Batch], Tensor] | None = None
    """Optional, with `normalize`: `item_losses(model, batch)` -> the per-item losses,
    shaped like `normalize.items(batch)["mask"]` (what `Accumulator.step(...,
    normalize=)` takes as `loss_fn`). Each item's loss must depend on its own row only."""

    aux_loss: Callable[[nn.Module, Batch], Tensor] | None = None
    """Optional: the part of `reference_loss` that is not a sum over items but a function
    of the whole batch's statistics (an MoE load-balancing or router z-loss:
    `aux_loss(model, batch)` runs the model on `batch` and returns that term alone).
    When the step fails, verify writes its gradient as weights of the main term
    (`reference_loss` - `aux_loss`) on each micro-batch, of `aux_loss` on the whole
    batch and of `aux_loss` on each micro-batch alone, and names an aux loss taken
    per micro-batch (`aux-per-micro-batch`) or scaled (`aux-scaled`: 1/W when DDP's
    mean is not compensated) with its factor."""

    mesh: str | None = None
    """Optional: the device mesh to split the step over, as dims and sizes ("dp=2,tp=2";
    `--mesh` overrides it). Verify then runs product-of-sizes processes, builds the
    `DeviceMesh` (named dims, gloo), deals the batch's rows over `batch_dims` only (the
    ranks of every other dim get the same rows), and gathers each parameter's full
    gradient (DTensor shards via `full_tensor()`) on every rank. The step reads the mesh
    from `wholebatch.verify.current_mesh()` (docs/mesh.md, "verify on a mesh")."""

    batch_dims: tuple[str, ...] | None = None
    """With a mesh: the dims whose ranks get different rows of the batch (data parallel).
    None: every dim except those named "tp", "cp" and "pp". A context-parallel dim is left
    out here (its ranks get the same rows; the step keeps its slice of the tokens) and
    named in the step's own `Accumulator(batch_dims=...)`."""

    parallelize: Callable[[nn.Module, Any], nn.Module | None] | None = None
    """With a mesh: `parallelize(model, mesh)` applies the model's parallelism in place
    (`parallelize_module`, `fully_shard`) or returns the wrapped module; the step gets
    that module (`wrap` is not applied). None: the plain model, wrapped in DDP over the
    batch dims when `wrap="ddp"` (a model replicated over the other dims)."""

    def __post_init__(self) -> None:
        if self.mesh is not None:
            _check_mesh(self, "VerifySpec")
        if not callable(self.step):
            raise WholebatchTypeError(
                f"VerifySpec: step must be callable, got {type(self.step).__name__}"
            )
        if self.wrap not in ("ddp", "none"):
            raise WholebatchError(f"VerifySpec: wrap={self.wrap!r}; expected 'ddp' or 'none'")
        _check_common(self, "VerifySpec")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerRun:
    """What `TrainerSpec.train` gets on each rank: build the trainer around these, train one step."""

    model: nn.Module
    """The plain model (verify built it; the trainer wraps it in DDP itself)."""

    optimizer: torch.optim.Optimizer
    """Give this optimizer to the trainer (HF: `optimizers=(run.optimizer, None)`; Accelerate:
    `accelerator.prepare(..., run.optimizer)`). It records the gradient at `step()`."""

    batch: Batch
    """The whole batch (every rank gets all of it, as every rank of a trainer reads the whole
    dataset and the trainer's sampler shards it)."""

    dataset: list[Any]
    """`batch` as a list of rows (a dict per row for a dict batch), for a map-style dataset."""

    world_size: int
    """W: the processes (on a mesh, the product of its sizes)."""

    rank: int
    """This process's rank."""

    micro_batches: int
    """K: pass as gradient accumulation steps."""

    per_device_rows: int
    """N / (W·K) (on a mesh N / (B·K), B = `data_shards`): pass as the per-device batch
    size, so the one epoch is one optimizer step."""

    output_dir: str
    """A fresh temporary folder (HF `TrainingArguments.output_dir`)."""

    seed: int
    """The spec's seed."""

    mesh: DeviceMesh | None = None
    """On a mesh (`TrainerSpec.mesh`): the `DeviceMesh` verify built (named dims, gloo;
    also `current_mesh()`). Size the trainer's parallelism from it, e.g. Lightning's
    `ModelParallelStrategy(data_parallel_size=run.mesh["dp"].size(), ...)`, since verify
    also re-runs the trainer on the mesh with its replica dims of size 1. None: a flat
    world."""

    batch_dims: tuple[str, ...] = ()
    """On a mesh: the dims whose ranks get different rows (the spec's `batch_dims`, or every
    dim but tp, cp and pp). Shard the data over these dims only."""

    data_shards: int = 0
    """On a mesh: B, the row shards (the product of the batch dims' sizes); flat: W."""

    data_rank: int = 0
    """On a mesh: which row shard (0..B-1) this rank holds, row-major over the batch dims
    (a `DistributedSampler(num_replicas=run.data_shards, rank=run.data_rank)` deals
    rows the same way, interleaved); ranks that differ only on the other dims
    (the replicas) get the same. Flat: the rank."""

    shard: list[Any] = dataclasses.field(default_factory=list)
    """On a mesh: the rows of this rank's row shard (contiguous rows data_rank·N/B onwards,
    as `dataset` rows), for a trainer fed without a sampler. Replicas get the same rows.
    Flat: this rank's N/W contiguous rows."""

    record: Callable[[Mapping[str, Tensor]], None] = dataclasses.field(
        default=lambda micro_batch: _not_recording()
    )
    """A `ReplaySpec`'s trainer calls `run.record(micro_batch)` for every micro-batch its
    loss reads, in order: a dict of the tensors the loss reads (rows first), e.g.
    completions, their mask, advantages. Verify computes the reference on every rank's
    recorded micro-batches, concatenated. Not for a `TrainerSpec` (its batch is known)."""


def _not_recording() -> None:
    raise WholebatchError(
        "run.record: only a ReplaySpec's trainer records its micro-batches; a TrainerSpec's "
        "batch is the spec's own"
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerSpec:
    """A TARGET for a trainer that owns the split: it is run one optimizer step on W·K parts.

    Dropout is switched off for a trainer (every `nn.Dropout`, and code that reads its
    `p`): the trainer's sampler decides which rows each micro-batch holds, so masks
    cannot be matched to rows; verify checks that nothing else draws random numbers.
    """

    build_model: Callable[[], nn.Module]
    """As `VerifySpec.build_model`."""

    batch: Batch
    """The whole batch: one epoch of the trainer is one optimizer step over it. Its rows
    must divide by W·K."""

    train: Callable[[TrainerRun], object]
    """Builds the trainer around `run` and trains exactly one optimizer step, without
    clipping (HF: `max_steps=1, max_grad_norm=0`)."""

    reference_loss: Callable[[nn.Module, Batch], Tensor]
    """As `VerifySpec.reference_loss` (the sampler may reorder rows: the loss must not
    depend on their order)."""

    equal_batch: Batch | None = None
    """As `VerifySpec.equal_batch`."""

    count_items: Callable[[Batch], int | Tensor] | None = None
    """As `VerifySpec.count_items`."""

    seed: int = 0
    """As `VerifySpec.seed`."""

    rtol: float | None = None
    """As `VerifySpec.rtol`."""

    row_key: str | None = None
    """Optional: the batch column (a dict batch's key) verify recognises rows by in the
    model's forward, e.g. an item id column the forward receives. Default: "input_ids",
    else the batch's first tensor, matched by content with padding removed (through
    `attention_mask`), so a collator that pads each micro-batch to its own longest row
    is fine. Only the diagnosis of a failing trainer needs the rows."""

    normalize: Normalize | None = None
    """As `VerifySpec.normalize` (read on the rows verify recognised in each micro-batch)."""

    item_losses: Callable[[nn.Module, Batch], Tensor] | None = None
    """As `VerifySpec.item_losses`."""

    aux_loss: Callable[[nn.Module, Batch], Tensor] | None = None
    """As `VerifySpec.aux_loss`."""

    mesh: str | None = None
    """Optional: the device mesh the trainer splits the step over, as dims and sizes
    ("dp=2,tp=2"; `--mesh` overrides it). Verify runs product-of-sizes processes, builds
    the `DeviceMesh` (`run.mesh`, `current_mesh()`), hands every rank the whole batch
    and its row shard's rows (`run.shard`: the ranks of the non-batch dims get the
    same), and gathers each parameter's full gradient (DTensor shards via
    `full_tensor()`) after the trainer's one optimizer step (docs/mesh.md, "verify on a
    mesh"). The rows must divide by B·K (B: the product of the batch dims' sizes)."""

    batch_dims: tuple[str, ...] | None = None
    """As `VerifySpec.batch_dims`: the dims whose ranks get different rows."""

    parallelize: Callable[[nn.Module, Any], nn.Module | None] | None = None
    """With a mesh, optional: `parallelize(model, mesh)` applied by verify before the
    trainer gets `run.model` (in place, or the module it returns). None: the trainer
    parallelises the model itself (Lightning's `configure_model`)."""

    def __post_init__(self) -> None:
        if self.mesh is not None:
            _check_mesh(self, "TrainerSpec")
        if self.row_key is not None and not (
            isinstance(self.batch, Mapping) and isinstance(self.batch.get(self.row_key), Tensor)
        ):
            raise WholebatchError(
                f"TrainerSpec: row_key={self.row_key!r} is not a tensor column of the batch"
                + (f" (its keys: {sorted(self.batch)})" if isinstance(self.batch, Mapping) else "")
            )
        if not callable(self.train):
            raise WholebatchTypeError(
                f"TrainerSpec: train must be callable, got {type(self.train).__name__}"
            )
        _check_common(self, "TrainerSpec")


Spec: TypeAlias = "VerifySpec | TrainerSpec | ReplaySpec"
"""Any spec a TARGET may return."""


def _check_mesh(spec: VerifySpec | TrainerSpec, kind: str) -> None:
    """A spec's mesh fields: a parseable shape, batch dims among its dims, a callable."""
    from wholebatch.comm.mesh import parse_mesh_shape

    if not isinstance(spec.mesh, str):
        raise WholebatchTypeError(
            f"{kind}: mesh={spec.mesh!r} must be a string of dims and sizes, e.g. 'dp=2,tp=2'"
        )
    dims = parse_mesh_shape(spec.mesh)
    if spec.batch_dims is not None:
        if isinstance(spec.batch_dims, str):
            raise WholebatchTypeError(
                f"{kind}: batch_dims={spec.batch_dims!r} is a string; pass a tuple of dim "
                f"names, e.g. batch_dims=({spec.batch_dims!r},)"
            )
        unknown = [d for d in spec.batch_dims if d not in dims]
        if unknown:
            raise WholebatchError(
                f"{kind}: batch_dims {unknown} are not dims of mesh={spec.mesh!r}; its dims "
                f"are {tuple(dims)}"
            )
    if spec.parallelize is not None and not callable(spec.parallelize):
        raise WholebatchTypeError(
            f"{kind}: parallelize must be callable or None, got {type(spec.parallelize).__name__}"
        )


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

    mesh: str = ""
    """A device mesh to split the step over, e.g. "dp=2,tp=2" (dims and sizes; the
    processes are the product of the sizes, --nproc is not used); overrides the spec's
    mesh. Empty: the spec's mesh, else a flat world of --nproc ranks."""

    def __post_init__(self) -> None:
        if self.mesh:
            from wholebatch.comm.mesh import parse_mesh_shape

            parse_mesh_shape(self.mesh)
        for name in ("nproc", "micro_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise WholebatchError(f"{name}={value!r} must be an integer >= 1")
        if not self.timeout > 0:
            raise WholebatchError(f"timeout={self.timeout!r} must be > 0 seconds")


# ---------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------


def _module_name_for(path: Path) -> str:
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
    return f"_wholebatch_target_{path.stem}_{digest}"


def load_module(where: str) -> Any:
    """Import TARGET's module: a file path, or a module name importable from the current directory.

    A file's folder goes first on `sys.path`, as `python path/to/file.py` puts it, so a
    spec imports its sibling modules from wherever verify is run.
    """
    if where.endswith(".py") or os.sep in where or "/" in where:
        path = Path(where).resolve()
        if not path.is_file():
            raise TargetError(f"verify: TARGET file {where!r} does not exist")
        folder = str(path.parent)
        if not sys.path or sys.path[0] != folder:
            sys.path.insert(0, folder)
        name = _module_name_for(path)
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise TargetError(f"verify: cannot load {where!r} as a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
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


def split_target(target: str) -> tuple[str, str]:
    """'module:function' -> (module, function), or a TargetError."""
    where, sep, attr = target.rpartition(":")
    if not sep or not where or not attr:
        raise TargetError(
            f"verify: TARGET {target!r} must be 'module:function' or 'path/to/file.py:function'"
        )
    return where, attr


def load_spec(target: str) -> Spec:
    """Resolve TARGET (`module:function` or `file.py:function`), call it, check it gave a spec."""
    where, attr = split_target(target)
    module = load_module(where)
    fn: Any = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            names = sorted(
                n
                for n, v in vars(module).items()
                if inspect.isfunction(v)
                and v.__module__ == module.__name__
                and not n.startswith("_")
            )
            raise TargetError(
                f"verify: {where!r} has no {attr!r}; its functions: {', '.join(names)}"
            )
    if not callable(fn):
        raise TargetError(f"verify: {target!r} is a {type(fn).__name__}, not a function")
    from wholebatch.verify.replay import ReplaySpec

    spec = fn()
    if not isinstance(spec, VerifySpec | TrainerSpec | ReplaySpec):
        raise TargetError(
            f"verify: {target}() returned {type(spec).__name__}; it must return a "
            "wholebatch.verify.VerifySpec, TrainerSpec or ReplaySpec"
        )
    return spec


def target_of(fn: Callable[[], Spec] | str) -> str:
    """A TARGET string for a module-level function (or the string itself).

    Verify calls the function in fresh processes, so it must be importable there: a
    function defined at the top level of a module or file (not inside another function).
    """
    if isinstance(fn, str):
        split_target(fn)
        return fn
    qualname = getattr(fn, "__qualname__", "")
    if not callable(fn) or not qualname or "<locals>" in qualname or "<lambda>" in qualname:
        raise WholebatchTypeError(
            f"verify: {fn!r} must be a module-level function returning a VerifySpec or "
            "TrainerSpec (verify calls it again in fresh processes), or a 'module:function' string"
        )
    module = getattr(fn, "__module__", None)
    source = inspect.getsourcefile(fn)
    if module and module != "__main__":
        loaded = sys.modules.get(module)
        if loaded is not None and getattr(loaded, "__spec__", None) is not None:
            found = (
                importlib.util.find_spec(module) if not module.startswith("_wholebatch") else None
            )
            if found is not None and found.origin and source and Path(found.origin) == Path(source):
                return f"{module}:{qualname}"
    if source is None:
        raise WholebatchTypeError(f"verify: cannot find the source file of {qualname}")
    return f"{source}:{qualname}"
