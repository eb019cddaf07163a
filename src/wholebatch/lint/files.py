"""The files of a lint run: which `.py` files the paths name, how each is read, and its
tier: training code, or a test (a fixture suite's deliberate mistakes and throw-away
loops would drown the training code's findings, issue 33).

A file is a test when the path below the folder it was found in has a `tests`, `test`
or `testing` folder, or its name is `test_*.py`, `*_test.py` or `conftest.py`. Its
findings are reported only when asked (`--tests`), when the file is named on the
command line, or when the folder given is itself a test folder (`wholebatch lint
tests/`); every finding carries its tier (`Finding.tier`).
"""

from __future__ import annotations

import os
import tokenize
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CODE", "TEST", "Walked", "iter_python_files", "read", "tier_of", "walk"]

CODE = "code"
TEST = "test"
_SKIP_DIRS = frozenset({"__pycache__", "node_modules"})
_TEST_DIRS = frozenset({"tests", "test", "testing"})


class UsageError(ValueError):
    """A bad command line: unknown rule prefix, missing path."""


def tier_of(parts: Iterable[str]) -> str:
    """`TEST` for the path parts of a test file (below the folder it was found in), else
    `CODE`."""
    names = list(parts)
    if not names:
        return CODE
    *dirs, name = names
    if any(d in _TEST_DIRS for d in dirs):
        return TEST
    if name == "conftest.py" or name.startswith("test_") or name.endswith("_test.py"):
        return TEST
    return CODE


@dataclass(frozen=True)
class Walked:
    """One file of the run.

    Attributes:
        path: the file, as the paths given spell it.
        tier: `CODE` or `TEST`.
        shown: its findings are reported by default (not a test found in a code folder).
    """

    path: Path
    tier: str
    shown: bool


def walk(paths: Iterable[str | os.PathLike[str]]) -> Iterator[Walked]:
    """The `.py` files named or found (recursively) under `paths`, each once (in the
    order found: folders sorted), with their tier.

    Hidden folders, `__pycache__` and `node_modules` met while walking are skipped; a
    path given explicitly is always used. A file is judged once, whatever names it:
    a symbolic link met while walking is skipped where its target is a file under a
    folder given (judged under its own name there), a dangling one always.

    Raises:
        UsageError: a path that does not exist.
    """
    given = [Path(raw) for raw in paths]
    missing = next((p for p in given if not p.is_dir() and not p.is_file()), None)
    if missing is not None:
        raise UsageError(f"{missing}: no such file or folder")
    folders = [p.resolve() for p in given if p.is_dir()]
    seen: set[Path] = set()
    for p in given:
        if p.is_dir():
            # A folder of tests given as such: its tests are what was asked for.
            asked = tier_of([*p.resolve().parts, ""]) == TEST
            for root, dirs, names in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _SKIP_DIRS)
                for name in sorted(names):
                    f = Path(root, name)
                    if not name.endswith(".py") or not _judged_here(f, folders):
                        continue
                    real = f.resolve()
                    if real not in seen:
                        seen.add(real)
                        tier = tier_of(f.relative_to(p).parts)
                        yield Walked(path=f, tier=tier, shown=tier == CODE or asked)
        elif (real := p.resolve()) not in seen:
            seen.add(real)
            yield Walked(path=p, tier=tier_of([p.name]), shown=True)


def _judged_here(f: Path, folders: list[Path]) -> bool:
    """Is `f`, met while walking, judged under this name: a file, not a link to a file
    that the walk of `folders` meets under its own name?"""
    if not f.is_symlink():
        return True
    target = f.resolve()
    return target.is_file() and not any(target.is_relative_to(d) for d in folders)


def iter_python_files(paths: Iterable[str | os.PathLike[str]]) -> Iterator[Path]:
    """The `.py` files named or found (recursively) under `paths`, each once (`walk`).

    Raises:
        UsageError: a path that does not exist.
    """
    for w in walk(paths):
        yield w.path


def read(path: Path) -> str:
    """The text of a source file, honouring a PEP 263 coding line."""
    with tokenize.open(path) as fh:
        return fh.read()
