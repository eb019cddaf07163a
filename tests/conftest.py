"""The suite's tiers, one folder each (CONTRIBUTING.md, "Tests"):

    tests/unit         one process, fast: `make test-fast` runs these alone (under a minute)
    tests/distributed  real gloo process groups on loopback (shared worker pools, hard timeouts)
    tests/e2e          torchrun, the `wholebatch` command in subprocesses, real trainers, the demo
    tests/support      what the tiers share: the worker harness, models, references, cases

Every test is marked with its folder's tier (`-m unit`, `-m "not e2e"`). Across the tiers,
the heaviest tests (`HEAVY`: whole real trainers and CLIs run again for more cases of what
the default run already covers, long fault drills, a memory measurement) are also marked
`heavy`: `make test` leaves them out (`-m "not heavy"`, under 15 minutes on 2 cores),
`make test-heavy` runs them alone and `make test-all` (or plain `pytest`) runs everything.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

TIERS = ("unit", "distributed", "e2e")
# Node-id prefixes of the heavy tier, with their seconds on the shared 2-core machine.
HEAVY = (
    "tests/e2e/test_verify_round3.py",  # 131 s: one verify call over every round-3 target
    "tests/e2e/test_open_clip_train_cli.py",  # 80 s: open_clip_train's real CLI, 2 losses
    "tests/e2e/test_faults.py::test_resume_that_forgets_state_is_caught",  # 33 s
    "tests/e2e/test_faults.py::test_crash_restart_resume_is_bitwise_exact",  # 33 s
    "tests/e2e/test_faults.py::test_debug_mode_names",  # 28 s, two drills
    "tests/e2e/test_demo.py::test_demo_gather_still_shows_the_two_gradients",  # 22 s
    "tests/distributed/test_plan_dist.py::test_planned_loss_memory_within_15_percent",  # 43 s
    "tests/distributed/test_loss_gpu_script.py",  # 26 s: benchmarks/gpu.sh --cpu-check
    "tests/e2e/test_lint_torch.py",  # 35 s: lint over the whole torch package
    "tests/e2e/test_integrations_deepspeed.py",  # 40 s: DeepSpeed's JIT op and ZeRO engines
    "tests/e2e/test_verify_mesh_trainer.py",  # 29 s: trainers on a mesh (the loops stay)
    "tests/distributed/test_comm.py::test_losses_inside_torch_compile",  # 20 s: a guard
)
_HERE = Path(__file__).resolve().parent

# Workers and this process each use one thread: the suite runs on 2 cores
# with up to 4 ranks at a time, and oversubscribed BLAS threads crawl.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Triton reads TRITON_INTERPRET when it decorates a kernel, at the first import of
# wholebatch.losses._triton_tiles, whichever test module that is: set it for the whole
# suite (the fused tiles run on CPU tensors under the interpreter). `make gpu`
# (benchmarks/gpu.sh) sets TRITON_INTERPRET=0 to compile them for the device.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def _stop_worker_worlds() -> Iterator[None]:
    yield
    from tests.support.harness import shutdown_worlds

    shutdown_worlds()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).resolve().relative_to(_HERE).parts
        if len(parts) > 1 and parts[0] in TIERS:
            item.add_marker(getattr(pytest.mark, parts[0]))
        if item.nodeid.startswith(HEAVY):
            item.add_marker(pytest.mark.heavy)
