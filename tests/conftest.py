"""The suite's tiers, one folder each (CONTRIBUTING.md, "Tests"):

    tests/unit         one process, fast: `make test-fast` runs these alone (under a minute)
    tests/distributed  real gloo process groups on loopback (shared worker pools, hard timeouts)
    tests/e2e          torchrun, the `wholebatch` command in subprocesses, real trainers, the demo
    tests/support      what the tiers share: the worker harness, models, references, cases

Every test is marked with its folder's tier (`-m unit`, `-m "not e2e"`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

TIERS = ("unit", "distributed", "e2e")
_HERE = Path(__file__).resolve().parent

# Workers and this process each use one thread: the suite runs on 2 cores
# with up to 4 ranks at a time, and oversubscribed BLAS threads crawl.
os.environ.setdefault("OMP_NUM_THREADS", "1")


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
