"""The `wholebatch` command: demo, verify, selftest, bench, lint (docs/cli.md).

Importing this package loads no torch: `wholebatch lint` runs without it, and
each other command imports what it needs when it runs.
"""

from __future__ import annotations

from wholebatch.cli.main import main

__all__ = ["main"]
