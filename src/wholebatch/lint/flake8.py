"""flake8 plugin: the `wholebatch lint` rules as flake8 checks (codes `WB...`).

Registered in pyproject.toml under `[project.entry-points."flake8.extension"]` as
`WB = "wholebatch.lint.flake8:Plugin"`, so after `pip install wholebatch`:

    flake8 --select WB train.py

flake8 handles `# noqa` and `--select/--ignore` itself; this adapter only runs the rules
on the tree flake8 already parsed.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Sequence
from typing import Any

from wholebatch import __version__
from wholebatch.lint.engine import lint_tree

__all__ = ["Plugin"]


class Plugin:
    """A flake8 AST plugin (flake8 passes `tree`, `filename` and `lines` by name)."""

    name = "wholebatch-lint"
    version = __version__

    def __init__(self, tree: ast.Module, filename: str = "<string>", lines: Sequence[str] = ()):
        self.tree = tree
        self.filename = filename
        self.source = "".join(lines)

    def run(self) -> Iterator[tuple[int, int, str, type[Any]]]:
        """Yield (line, 0-based column, "CODE message", plugin type) per finding."""
        for f in lint_tree(self.tree, self.source, self.filename):
            yield f.line, f.col - 1, f"{f.code} {f.message}", type(self)
