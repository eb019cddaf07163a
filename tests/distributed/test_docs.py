"""The examples in docs/ run, and print the numbers the docs say they print."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from tests.support.harness import run_ranks

DOCS = Path(__file__).resolve().parents[2] / "docs"
# A python block that starts with "# example: NAME", then a text block of "rank r: output" lines.
_EXAMPLE = re.compile(r"```python\n(# example: ([\w-]+)\n.*?)```\s*```text\n(.*?)```", re.S)


def _examples(doc: str) -> list[tuple[str, str, dict[int, str]]]:
    found = []
    for source, name, printed in _EXAMPLE.findall((DOCS / doc).read_text()):
        expected = {}
        for line in printed.strip().splitlines():
            rank, _, out = line.partition(": ")
            expected[int(rank.removeprefix("rank "))] = out
        found.append((name, source, expected))
    return found


def _exec_example(source: str) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(source, "<docs example>", "exec"), {"__name__": "__docs_example__"})
    return buf.getvalue().strip()


SEMANTICS = _examples("semantics.md")


def test_semantics_has_the_three_examples() -> None:
    assert [name for name, _, _ in SEMANTICS] == ["no-gradient", "local-slice", "gather-vs-reduce"]


@pytest.mark.parametrize("name,source,expected", SEMANTICS, ids=[e[0] for e in SEMANTICS])
def test_semantics_example_prints_what_the_doc_says(
    name: str, source: str, expected: dict[int, str]
) -> None:
    printed = run_ranks(len(expected), _exec_example, source)
    assert {r: p for r, p in enumerate(printed)} == expected


# The contracts users asked for in runnable form: the pipeline's loss_fn and step (mesh.md),
# `Normalize` with its constant= and DDP made to sum for grad_reduction="sum"
# (accumulation.md). Each prints the one-process answer beside its own.
CONTRACTS = _examples("mesh.md") + _examples("accumulation.md")


def test_the_contract_examples_are_there() -> None:
    assert sorted(name for name, _, _ in CONTRACTS) == ["ddp-sum", "normalize", "pipeline"]


@pytest.mark.parametrize("name,source,expected", CONTRACTS, ids=[e[0] for e in CONTRACTS])
def test_contract_example_prints_what_the_doc_says(
    name: str, source: str, expected: dict[int, str]
) -> None:
    printed = run_ranks(len(expected), _exec_example, source)
    assert {r: p for r, p in enumerate(printed)} == expected
