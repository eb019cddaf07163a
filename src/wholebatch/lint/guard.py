"""The linter never aborts a run: an internal error while one function (or one file) is
analysed becomes one WB001 finding that names the file, the function and the exception,
and every other function and file is still judged.

A checker that passed what it did not judge would be worse than one that crashed, so
the note is a finding like any other: it makes the exit status 1 and it is reported
whatever `--select` says (only an explicit `--ignore WB001` hides it).

    WHOLEBATCH_LINT_RAISE=1 wholebatch lint src/   # re-raise instead (to debug the linter)
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from wholebatch.lint.rules import RULES, Finding

__all__ = ["Failure", "Failures", "describe", "internal_finding", "raising"]

_T = TypeVar("_T")
_LINT_DIR = Path(__file__).resolve().parent
MODULE_LEVEL = "(module)"


def raising() -> bool:
    """Re-raise internal errors (`WHOLEBATCH_LINT_RAISE=1`) rather than report them."""
    return os.environ.get("WHOLEBATCH_LINT_RAISE", "") not in ("", "0")


def describe(err: BaseException) -> str:
    """`IndexError: tuple index out of range (lint/dataflow.py:312, in _restored)`: the
    exception and the innermost frame of the linter's own code that raised it."""
    where = ""
    for frame in reversed(traceback.extract_tb(err.__traceback__)):
        p = Path(frame.filename)
        if p.parent == _LINT_DIR:
            where = f" (lint/{p.name}:{frame.lineno}, in {frame.name})"
            break
    text = str(err).splitlines()[0] if str(err) else ""
    text = text if len(text) <= 80 else text[:77] + "..."
    return f"{type(err).__name__}{': ' + text if text else ''}{where}"


@dataclass(frozen=True, kw_only=True)
class Failure:
    """One internal error: where the linter was and what it raised.

    Attributes:
        function: `Class.method`, `function`, or "(module)".
        line: the line of the function's `def` (1 for the module).
        error: the exception, as `describe` writes it.
    """

    function: str
    line: int
    error: str


class Failures:
    """The internal errors of one file, one per function (the first one is kept)."""

    def __init__(self) -> None:
        self.items: dict[str, Failure] = {}

    def note(self, function: str, line: int, err: BaseException) -> None:
        """Record that `function` (at `line`) was not fully checked because of `err`."""
        if raising():
            raise err
        key = function or MODULE_LEVEL
        if key not in self.items:
            self.items[key] = Failure(function=key, line=line, error=describe(err))

    def run(self, function: str, line: int, fn: Callable[[], _T], default: _T) -> _T:
        """`fn()`, or `default` if it raises (the error noted against `function`)."""
        try:
            return fn()
        except Exception as err:  # the point of this module: any internal error
            self.note(function, line, err)
            return default

    def findings(self, path: str) -> list[Finding]:
        """One WB001 finding per function that raised, in line order."""
        return [
            internal_finding(path, f)
            for f in sorted(self.items.values(), key=lambda f: (f.line, f.function))
        ]


def internal_finding(path: str, failure: Failure) -> Finding:
    """The WB001 finding for one internal error."""
    what = "this file" if failure.function == MODULE_LEVEL else f"`{failure.function}`"
    return Finding(
        path=path,
        line=failure.line,
        col=1,
        code="WB001",
        message=f"internal error while checking {what}: {failure.error}; it was not fully "
        "checked (the rest of the run was), please report it",
        fix=RULES["WB001"].fix,
    )
