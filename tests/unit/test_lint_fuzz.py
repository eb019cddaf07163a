"""A small sample of the lint fuzz (benchmarks/lint_fuzz.py runs 10,000 modules): mutated
training files and generated programs never crash the linter, and the fuzz does find a
crash when one is put back (the IndexError of issue 33), so it can fail.
"""

from __future__ import annotations

import ast
import random

import pytest

from benchmarks import lint_fuzz
from wholebatch.lint import dataflow

_SAMPLE = 300  # about 1.5 s; the benchmark runs the 10,000


def test_mutants_and_generated_programs_never_crash_the_linter() -> None:
    fuzz = lint_fuzz.run(_SAMPLE, seed=33, sources=lint_fuzz.project_sources())
    assert fuzz.modules >= _SAMPLE
    assert fuzz.trees > 0 and fuzz.kinds["wrap"] > 0 and fuzz.kinds["generated"] > 0
    assert len(fuzz.findings) > 5  # the mutants reach the rules, not only the parser
    assert fuzz.crashes == [], fuzz.crashes[0].error + "\n" + fuzz.crashes[0].source


def test_mutants_are_valid_python_most_of_the_time() -> None:
    rng = random.Random(0)
    sources = lint_fuzz.project_sources()
    parsed = 0
    for _ in range(50):
        text, _ = lint_fuzz.mutant(rng, rng.choice(sources))
        try:
            ast.parse(text)
            parsed += 1
        except SyntaxError:
            pass
    assert parsed >= 40  # the text mutations (one in ten) may break the syntax


def _old_restored(self: dataflow.Flow, tag: str) -> bool:
    """`Flow._restored` as it was before issue 33 (the default of `next` evaluated first)."""
    here = self._st.path if self._st else ()
    entered = self.entered.get(tag, ())
    if entered[: len(here)] == here:
        return True
    next((p for p, q in zip(here, entered, strict=False) if p != q), here[len(entered)])
    return False


def test_the_fuzz_finds_the_crash_when_it_is_put_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dataflow.Flow, "_restored", _old_restored)
    fuzz = lint_fuzz.run(_SAMPLE, seed=33, sources=lint_fuzz.project_sources(), stop=True)
    assert fuzz.crashes, "the fuzz no longer reaches a gather in a later elif arm"
    assert "IndexError" in fuzz.crashes[0].error
