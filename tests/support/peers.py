"""Load the peer libraries' loss modules straight from their installed files.

Why not `import open_clip` / `import lightly.loss`: both packages are installed
with `--no-deps` (Makefile, `NODEPS_PEERS`) because each pulls in torchvision,
whose PyPI build cannot load beside the CPU torch these tests run on. Their
package `__init__`s import torchvision (open_clip's for its transforms and
model factory, lightly's through `lightly.models`), so importing them fails.
The modules compared against need none of it:

- `open_clip/loss.py` imports only torch (horovod optionally);
- `lightly/loss/ntx_ent_loss.py` imports `lightly.utils.dist` (torch only) and
  `lightly.models.modules.memory_bank`, which imports `lightly.models.utils`;
  that file imports `torchvision.ops.StochasticDepth` at the top for one
  function the loss never calls.

So each loader executes the real files under their real names, with bare
parent packages (and, for lightly, a placeholder `torchvision.ops`) present
in `sys.modules` only while the files execute; every injected entry is removed
afterwards, so nothing else in the test session sees a fake torchvision or a
half-built `lightly` package. Nothing is copied from the peers.

Each loader returns None when the package is not installed; tests skip then,
with `SKIP_REASON`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "SKIP_REASON",
    "accelerate_on_harness_group",
    "load_lightly_ntxent",
    "load_open_clip_loss",
    "load_open_clip_train",
    "peer_root",
]

SKIP_REASON = "{} is not installed; `make .venv/.peers` installs the peer libraries"


def peer_root(package: str) -> Path | None:
    """The folder of an installed top-level package, found without importing it."""
    for entry in sys.path:
        folder = Path(entry or ".") / package
        if (folder / "__init__.py").is_file():
            return folder
    return None


@contextlib.contextmanager
def _transient_modules(names: list[str]) -> Iterator[None]:
    """Remove every `sys.modules` entry named in `names` (or added under them) on exit."""
    before = set(sys.modules)
    try:
        yield
    finally:
        for key in list(sys.modules):
            if key not in before and any(key == n or key.startswith(n + ".") for n in names):
                del sys.modules[key]


def _package(name: str, folder: Path) -> None:
    """A bare package module (no `__init__` executed) whose submodules load from `folder`."""
    mod = types.ModuleType(name)
    mod.__path__ = [str(folder)]
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    sys.modules[name] = mod


def _exec_file(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@functools.cache
def load_open_clip_loss() -> types.ModuleType | None:
    """open_clip 3.3.0's `loss.py` (ClipLoss, SigLipLoss), or None if open_clip is absent."""
    root = peer_root("open_clip")
    if root is None:
        return None
    with _transient_modules(["open_clip"]):
        _package("open_clip", root)
        return _exec_file("open_clip.loss", root / "loss.py")


@functools.cache
def load_lightly_ntxent() -> types.ModuleType | None:
    """lightly 1.6.0's `loss/ntx_ent_loss.py` (NTXentLoss), or None if lightly is absent."""
    root = peer_root("lightly")
    if root is None:
        return None
    with _transient_modules(["lightly", "torchvision"]):
        for name, folder in [
            ("lightly", root),
            ("lightly.utils", root / "utils"),
            ("lightly.models", root / "models"),
            ("lightly.models.modules", root / "models" / "modules"),
            ("lightly.loss", root / "loss"),
        ]:
            _package(name, folder)
        if "torchvision" not in sys.modules:
            # Only `StochasticDepth` is imported by name, for a function NTXentLoss never calls.
            tv, ops = types.ModuleType("torchvision"), types.ModuleType("torchvision.ops")
            ops.StochasticDepth = type("StochasticDepth", (), {})  # type: ignore[attr-defined]
            tv.ops = ops  # type: ignore[attr-defined]
            sys.modules.update({"torchvision": tv, "torchvision.ops": ops})
        return _exec_file("lightly.loss.ntx_ent_loss", root / "loss" / "ntx_ent_loss.py")


@contextlib.contextmanager
def accelerate_on_harness_group() -> Iterator[None]:
    """Let accelerate (and so a Hugging Face `Trainer`) use a harness worker's gloo group.

    accelerate reads torchrun's environment variables to decide it is distributed
    (`MULTI_CPU` with `use_cpu=True` / `cpu=True`) and initialises a process group
    only when none exists: the harness's, already initialised, is reused. Its
    state is a process-wide singleton: it is reset on entry and on exit, and the
    environment restored on exit, so the reused worker is left as it was. Run
    the `Accelerator` / `Trainer` inside the block, in the worker.
    """
    import os

    import torch.distributed as dist
    from accelerate.state import AcceleratorState, GradientState

    r, w = dist.get_rank(), dist.get_world_size()
    env = {
        "RANK": str(r), "WORLD_SIZE": str(w), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(w),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": os.environ.get("MASTER_PORT", "29500"),
    }  # fmt: skip
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# The names open_clip_train/train.py (and the zero_shot.py it imports) take from the
# `open_clip` package. The package's __init__ needs torchvision (see above), so while
# those two real files execute, a bare `open_clip` holds these: `train_one_epoch`
# uses only `get_input_dtype`, whose open_clip answer for "fp32" (the precision of the
# tests) is None; the others are used by `evaluate` / zero-shot only.
_OPEN_CLIP_TRAIN_NAMES = (
    "CLIP", "CustomTextCLIP", "get_tokenizer", "build_zero_shot_classifier",
    "IMAGENET_CLASSNAMES", "OPENAI_IMAGENET_TEMPLATES",
)  # fmt: skip


@functools.cache
def load_open_clip_train() -> types.ModuleType | None:
    """open_clip_train 3.3.0's real `train.py` (its `train_one_epoch`), or None if absent.

    Only for precision "fp32": the bare `open_clip` it runs against answers
    `get_input_dtype(...)` with None, open_clip's answer for fp32.
    """
    root, train_root = peer_root("open_clip"), peer_root("open_clip_train")
    if root is None or train_root is None:
        return None
    with _transient_modules(["open_clip", "open_clip_train"]):
        _package("open_clip", root)
        bare = sys.modules["open_clip"]
        for name in _OPEN_CLIP_TRAIN_NAMES:
            setattr(bare, name, type(name, (), {}))
        bare.get_input_dtype = lambda precision: None  # type: ignore[attr-defined]
        _package("open_clip_train", train_root)
        for sub in ("distributed", "precision", "zero_shot"):
            _exec_file(f"open_clip_train.{sub}", train_root / f"{sub}.py")
        return _exec_file("open_clip_train.train", train_root / "train.py")
