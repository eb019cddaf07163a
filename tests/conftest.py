from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# Workers and this process each use one thread: the suite runs on 2 cores
# with up to 4 ranks at a time, and oversubscribed BLAS threads crawl.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def _stop_worker_worlds() -> Iterator[None]:
    yield
    from tests.harness import shutdown_worlds

    shutdown_worlds()
