"""`wholebatch lint`: static detection of the classic gradient mistakes in PyTorch
training code, with Python's `ast` (the code is never imported or run).

    wholebatch lint train.py src/      # or: python -m wholebatch lint ...

    from wholebatch.lint import lint_source
    findings = lint_source(open("train.py").read(), "train.py", select=["WB1"])

Rule codes: WB1xx distributed, WB2xx optimisation loop, WB3xx accumulation and AMP;
every rule, with a wrong and a right example, is in docs/lint.md.
"""

from __future__ import annotations

from wholebatch.lint.cli import main
from wholebatch.lint.engine import (
    Report,
    UsageError,
    iter_python_files,
    lint_paths,
    lint_run,
    lint_source,
    lint_tree,
)
from wholebatch.lint.rules import RULES, Finding, Rule

__all__ = [
    "RULES",
    "Finding",
    "Report",
    "Rule",
    "UsageError",
    "iter_python_files",
    "lint_paths",
    "lint_run",
    "lint_source",
    "lint_tree",
    "main",
]
