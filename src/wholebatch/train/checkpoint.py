"""Checkpoints that resume exactly: model, optimizer, engine, RNG and data position, per rank.

    ckpt = wholebatch.checkpoint
    ckpt.save("runs/a", step, model=model, optimizer=opt, engine=acc, data_position=i)
    state = ckpt.load_latest("runs/a", model=model, optimizer=opt, engine=acc)   # None: start fresh
    start_step, i = state.step, state.data_position

A checkpoint is a folder `step-NNNNNNNN/` holding one file per rank
(`rank-R.pt`: that rank's RNG states and data position, which differ per rank,
with the model and optimizer state) and a `COMPLETE` marker that rank 0 writes
only after every rank has written its file. Every file is written to a
temporary name and renamed (atomic on POSIX), so a crash mid-save leaves the
previous checkpoint untouched and the torn one without its marker.
`load_latest` takes the newest complete checkpoint. Loading uses
`torch.load(weights_only=True)`: no pickle code runs. A torn, truncated or
foreign file raises `CheckpointError` naming the file.

Save and load at an optimizer-step boundary (after `Accumulator.step` /
`CachedStep.step`), on every rank: both are collective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.distributed import ProcessGroup

from wholebatch.comm.groups import (
    all_ranks_agree,
    comm_device,
    get_rank,
    get_world_size,
    is_distributed,
)
from wholebatch.errors import WholebatchError

__all__ = [
    "CheckpointError",
    "Resumed",
    "capture_rng",
    "load",
    "load_latest",
    "restore_rng",
    "save",
]

_FORMAT = "wholebatch-checkpoint/1"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(WholebatchError):
    """A checkpoint file that is torn, truncated, foreign or from another world size."""


class _Stateful(Protocol):
    def state_dict(self) -> Mapping[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any], /) -> Any: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class Resumed:
    """What `load`/`load_latest` restored."""

    step: int
    """The optimizer step the checkpoint was saved after."""
    data_position: Any
    """What the caller saved as `data_position` (e.g. the next micro-batch index)."""
    path: Path
    """The checkpoint folder."""
    extra: dict[str, Any]
    """What the caller saved as `extra`."""


def capture_rng() -> dict[str, Any]:
    """This process's RNG states: torch CPU, CUDA (every device, where present), Python's `random`."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": _py_state_to_tensor()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Restore what `capture_rng` captured."""
    torch.set_rng_state(state["torch"])
    _py_state_from_tensor(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))


def _py_state_to_tensor() -> dict[str, torch.Tensor]:
    # weights_only loading accepts tensors, not arbitrary tuples of ints.
    version, internal, gauss = random.getstate()
    return {
        "state": torch.tensor([version, *internal], dtype=torch.int64),
        "gauss": torch.tensor([] if gauss is None else [gauss], dtype=torch.float64),
    }


def _py_state_from_tensor(saved: Mapping[str, torch.Tensor]) -> None:
    vals = saved["state"].tolist()
    gauss = saved["gauss"].tolist()
    random.setstate((vals[0], tuple(vals[1:]), gauss[0] if gauss else None))


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def _atomic_save(obj: Any, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save(
    root: str | os.PathLike[str],
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    engine: _Stateful | None = None,
    data_position: Any = None,
    extra: Mapping[str, Any] | None = None,
    keep: int = 2,
    group: ProcessGroup | None = None,
) -> Path:
    """Write this rank's part of checkpoint `step` under `root`; every rank must call it.

    Args:
        root: the folder holding the run's checkpoints (created if absent).
        step: the optimizer step just finished.
        model: its `state_dict()` is saved (a DDP wrapper or the module itself).
        optimizer: its `state_dict()` is saved, if given.
        engine: an `Accumulator` or `CachedStep` (anything with state_dict), if given.
        data_position: where this rank's data stream resumes (ints, lists, dicts, tensors).
        extra: anything else to save, of the same simple kinds.
        keep: complete checkpoints to keep; older ones are deleted by rank 0.
        group: the process group (default: the world).
    Returns the checkpoint folder.
    """
    root_p = Path(root)
    rank, world = get_rank(group), get_world_size(group)
    folder = _step_dir(root_p, step)
    ok = True
    error = ""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        payload = {
            "format": _FORMAT,
            "step": int(step),
            "rank": rank,
            "world_size": world,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "engine": dict(engine.state_dict()) if engine is not None else None,
            "rng": capture_rng(),
            "data_position": data_position,
            "extra": dict(extra or {}),
        }
        _atomic_save(payload, folder / f"rank-{rank}.pt")
    except OSError as exc:
        ok, error = False, str(exc)
    # Agree before the marker: a checkpoint is complete only if every rank wrote its part.
    if not all_ranks_agree(ok, group=group):
        raise CheckpointError(
            f"checkpoint.save: step {step} was not written on every rank"
            + (f" (this rank: {error})" if error else "")
            + f"; the previous checkpoint under {root_p} is untouched"
        )
    if rank == 0:
        marker = folder / "COMPLETE"
        marker.write_text(f"{_FORMAT}\nworld_size={world}\n")
        for old in _complete_steps(root_p)[:-keep] if keep > 0 else []:
            _remove(_step_dir(root_p, old))
    if is_distributed(group):
        all_ranks_agree(True, group=group)  # the marker exists before anyone goes on
    return folder


def _remove(folder: Path) -> None:
    (folder / "COMPLETE").unlink(
        missing_ok=True
    )  # incomplete first: never a half-deleted "complete" one
    for f in folder.iterdir():
        f.unlink(missing_ok=True)
    folder.rmdir()


def _complete_steps(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    steps = []
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and (d / "COMPLETE").exists():
            steps.append(int(m.group(1)))
    return sorted(steps)


def load(
    folder: str | os.PathLike[str],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    engine: _Stateful | None = None,
    group: ProcessGroup | None = None,
) -> Resumed:
    """Restore this rank's part of the checkpoint in `folder` (model, optimizer, engine, RNG).

    Raises `CheckpointError` if the file is missing, torn, foreign, or from a
    different world size or rank.
    """
    path = Path(folder) / f"rank-{get_rank(group)}.pt"
    state = _read(path, get_rank(group), get_world_size(group))
    return _restore(state, path, model=model, optimizer=optimizer, engine=engine)


def _restore(
    state: dict[str, Any],
    path: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    engine: _Stateful | None,
) -> Resumed:
    """Put a read checkpoint `state` (from `path`) into the model, optimizer, engine and RNG."""
    model.load_state_dict(state["model"])
    if optimizer is not None:
        if state["optimizer"] is None:
            raise CheckpointError(f"checkpoint.load: {path} holds no optimizer state")
        optimizer.load_state_dict(state["optimizer"])
    if engine is not None and state["engine"] is not None:
        engine.load_state_dict(state["engine"])
    restore_rng(state["rng"])
    return Resumed(
        step=int(state["step"]),
        data_position=state["data_position"],
        path=path.parent,
        extra=state["extra"],
    )


def _read(path: Path, rank: int, world: int) -> dict[str, Any]:
    if not path.exists():
        raise CheckpointError(f"checkpoint.load: {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for torn/foreign files
        raise CheckpointError(
            f"checkpoint.load: {path} is not a readable checkpoint ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200]}); it may be truncated or foreign"
        ) from None
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise CheckpointError(f"checkpoint.load: {path} is not a {_FORMAT} file")
    if state["world_size"] != world or state["rank"] != rank:
        raise CheckpointError(
            f"checkpoint.load: {path} was written by rank {state['rank']} of {state['world_size']}, "
            f"loading on rank {rank} of {world}; resume with the same world size"
        )
    return state


def load_latest(
    root: str | os.PathLike[str],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    engine: _Stateful | None = None,
    group: ProcessGroup | None = None,
) -> Resumed | None:
    """Load the newest complete checkpoint under `root` that every rank can read; None if none.

    A checkpoint that is unreadable on any rank (a torn file) is skipped on all
    ranks together, falling back to the one before it.
    """
    rank, world = get_rank(group), get_world_size(group)
    local = _complete_steps(Path(root))
    bound = None
    # Ranks may see different folders (no shared file system, a crash mid-save):
    # agree on the newest step complete everywhere, then on whether every rank
    # can read it, else try the next older one; every rank loops the same times.
    while True:
        candidates = [s for s in local if bound is None or s < bound]
        step = _agree_min(candidates[-1] if candidates else -1, group)
        if step < 0:
            return None
        path = _step_dir(Path(root), step) / f"rank-{rank}.pt"
        state: dict[str, Any] | None = None
        with contextlib.suppress(CheckpointError):
            state = _read(path, rank, world) if step in local else None
        if all_ranks_agree(state is not None, group=group):
            assert state is not None
            return _restore(state, path, model=model, optimizer=optimizer, engine=engine)
        bound = step


def _agree_min(value: int, group: ProcessGroup | None) -> int:
    if not is_distributed(group):
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=comm_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())
