"""`wholebatch verify --mesh` from the command line: the flag overrides the spec's mesh.

The runs in-process: tests/distributed/test_verify_mesh.py.
"""

from __future__ import annotations

import pytest

from tests.e2e.test_cli import run_cli

TARGETS = "tests/support/verify_mesh_targets.py"


@pytest.mark.timeout(120)
def test_cli_mesh_flag_overrides_the_spec() -> None:
    # The spec says dp=2,tp=2; --mesh dp=4,tp=1 runs four data shards instead.
    result = run_cli(
        "verify", f"{TARGETS}:exact", "--mesh", "dp=4,tp=1", "--micro-batches", "2",
        timeout=110,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "4 ranks x 2 micro-batches (mesh dp=4,tp=1)" in result.stdout
