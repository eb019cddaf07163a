"""Skips for what the installed torch (or the triton beside it) lacks, each naming what it needs.

wholebatch accepts torch >= 2.8 (`wholebatch.comm._c10d.MIN_TORCH`); a few things a
test needs arrived later or depend on the environment. Each is one entry of
`FEATURES`: a probe of the installed packages (what exists, never a version
compare alone, except where torch's behaviour rather than an API differs: then the
releases measured) and the reason a skip prints, which names the version that has it:

    from tests.support.features import requires
    @requires("triton_kernels")
    def test_fused(): ...

    skip_module_unless("triton_kernels")      # at a module's top, after its imports

A feature wholebatch itself would use on such a torch is refused there by name
(a `WholebatchError` from wholebatch.comm._c10d); these skips are for the tests
that exercise it. `make test-compat` runs the suite on the oldest accepted torch,
a middle release and the newest tested, so every skip here is seen on the torch it is for.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable

import pytest

__all__ = [
    "FEATURES",
    "Feature",
    "has",
    "reason",
    "requires",
    "requires_peer",
    "skip_module_unless",
    "skip_unless",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Feature:
    """One thing a test may need that an accepted torch may lack."""

    probe: Callable[[], str | None]
    """None when the installed packages have it; else why not (the skip's reason)."""


def _triton_kernels() -> str | None:
    """The fused kernels run here: triton imports, and under TRITON_INTERPRET=1 its
    interpreter runs a kernel whose loop bound is a scalar argument."""
    try:
        import triton
    except ImportError:
        return "triton is not installed (the `triton` extra)"
    if os.environ.get("TRITON_INTERPRET", "") != "1":
        return None
    return _interpreter_runs(triton.__version__)


@functools.cache
def _interpreter_runs(version: str) -> str | None:
    import numpy as np
    import torch
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[misc]  # untyped decorator
    def count(out_ptr, n):  # type: ignore[no-untyped-def]
        for _ in range(0, n, 1):
            tl.store(out_ptr, tl.load(out_ptr) + 1)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        count[(1,)](out, 3)
    except Exception as e:
        # triton <= 3.6's interpreter passes a scalar argument as a 1-element array and
        # reads it with int(), which numpy >= 2.4 refuses (triton 3.8 squeezes it first).
        return (
            f"triton {version}'s interpreter cannot run the kernels beside numpy "
            f"{np.__version__} ({e!r}); it needs numpy < 2.4 (`make test-compat` installs it) "
            "or triton >= 3.8"
        )
    if int(out[0]) != 3:
        return f"triton {version}'s interpreter ran a 3-step loop {int(out[0])} times"
    return None


def _mesh_flatten() -> str | None:
    from torch.distributed.device_mesh import DeviceMesh

    if callable(getattr(DeviceMesh, "_flatten", None)):
        return None
    import torch

    return f"torch {torch.__version__} has no DeviceMesh._flatten (torch 2.5 to 2.13 have it)"


def _fsdp_tp_uneven() -> str | None:
    """FSDP2 over tensor-parallel parameters whose sharded dim does not divide evenly.

    torch's behaviour, not an API, differs, and one probe would need a 4-rank mesh:
    so the releases measured (tests/distributed/test_mesh_dist.py's dp x tp cases, TinyLM's
    6 rows over dp 2 x tp 2): 2.6 refuses it (NotImplementedError: "FSDP+TP sharding does
    not support uneven sharding"), 2.8 shards it but its `full_tensor()` of such a
    parameter is wrong (measured at init, before any step); 2.10, 2.11 and 2.13 are right
    (2.9 not measured: treated as 2.8). The same bound as wholebatch.comm._c10d.full_tensor.
    Training on that layout is exact on 2.8 (each rank's local pieces of the gradients and
    parameters, and the forward, equal one process's), so the training tests read the local
    pieces (`tests.support.mesh_cases.read_params`) and run on every torch; this feature is
    for what reads the full tensor back: `wholebatch verify` on such a mesh.
    """
    from wholebatch.comm._c10d import FULL_TENSOR_UNEVEN_STRIDED, torch_version

    if torch_version() >= FULL_TENSOR_UNEVEN_STRIDED:
        return None
    import torch

    return (
        f"torch {torch.__version__}: DTensor.full_tensor() of an FSDP2 x tensor-parallel "
        "parameter with uneven shards is wrong (measured on 2.8: at init, before any "
        "step); torch >= 2.10 reads it right"
    )


FEATURES: dict[str, Feature] = {
    "triton_kernels": Feature(probe=_triton_kernels),
    "mesh_flatten": Feature(probe=_mesh_flatten),
    "fsdp_tp_uneven": Feature(probe=_fsdp_tp_uneven),
}


@functools.cache
def reason(name: str) -> str | None:
    """Why the installed packages lack feature `name` (None: they have it)."""
    return FEATURES[name].probe()


def has(name: str) -> bool:
    """Whether the installed packages have feature `name`."""
    return reason(name) is None


def requires(name: str) -> pytest.MarkDecorator:
    """A skip marker for a test that needs feature `name`, with its reason."""
    why = reason(name)
    return pytest.mark.skipif(why is not None, reason=why or "")


def requires_peer(module: str, package: str | None = None) -> pytest.MarkDecorator:
    """A skip marker for a test that compares against peer library `module` (found, not imported).

    The peers are the `peers` extra, pinned for torch 2.13; `make test-compat` runs
    without them on older torch, where their tests skip with this reason.
    """
    import importlib.util

    from tests.support.peers import SKIP_REASON

    missing = importlib.util.find_spec(module) is None
    return pytest.mark.skipif(missing, reason=SKIP_REASON.format(package or module))


def skip_unless(name: str) -> None:
    """Skip the running test when feature `name` is missing (for one case of a parametrized test)."""
    why = reason(name)
    if why is not None:
        pytest.skip(why)


def skip_module_unless(name: str) -> None:
    """Skip the calling test module when feature `name` is missing (call at module level)."""
    why = reason(name)
    if why is not None:
        pytest.skip(why, allow_module_level=True)
