"""The rule registry (`wholebatch.lint.rules.RULES`) is the whole story of a rule: each
rule names the family of checks that runs it and its own gate words (`Rule.words`), and
the engine asks nothing else. A gate word missing from a rule silently turns it off in
every file that lacks it, so every snippet that triggers a rule (each `# wrong: WBxxx`
block of docs/lint.md, each `# expect:` line of tests/support/lint_cases/) is linted with and
without the gates: the gated run must find the same, and the snippet must open the
gate of every rule it triggers.
"""

from __future__ import annotations

import ast
import re
from dataclasses import replace
from pathlib import Path

import pytest

from wholebatch.lint import RULES, engine, lint_source
from wholebatch.lint.engine import lint_tree
from wholebatch.lint.rules import OWN

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "lint.md"
CASES = ROOT / "tests" / "support" / "lint_cases"
_FENCE = re.compile(r"```python\n(.*?)```", re.DOTALL)


def _wrong_snippets() -> list[tuple[str, str]]:
    """(label, source) of every snippet that triggers a rule."""
    out: list[tuple[str, str]] = []
    for i, block in enumerate(_FENCE.findall(DOC.read_text())):
        m = re.match(r"#\s*wrong:\s*(WB\d{3})", block)
        if m:
            out.append((f"lint.md#{i}:{m.group(1)}", block))
    out += [(p.name, p.read_text()) for p in sorted(CASES.glob("wrong_*.py"))]
    return out


SNIPPETS = _wrong_snippets()


def _codes(source: str, *, gate: bool) -> set[tuple[int, str]]:
    tree = ast.parse(source)
    return {(f.line, f.code) for f in lint_tree(tree, source, gate=gate)}


def _uncovered(source: str) -> set[str]:
    """The rules `source` triggers (gates off) whose gate words it lacks."""
    return {code for _, code in _codes(source, gate=False) if not RULES[code].gate_open(source)}


@pytest.mark.parametrize(("label", "source"), SNIPPETS, ids=[s[0] for s in SNIPPETS])
def test_gate_words_cover_every_wrong_snippet(label: str, source: str) -> None:
    assert _codes(source, gate=False), f"{label} triggers nothing"
    assert _uncovered(source) == set(), f"{label}: gate words miss the snippet"
    assert _codes(source, gate=True) == _codes(source, gate=False)


def test_every_rule_is_triggered_by_a_snippet_and_run_by_a_checker() -> None:
    triggered = {code for _, s in SNIPPETS for _, code in _codes(s, gate=False)}
    assert triggered == set(RULES) - OWN
    for code, rule in RULES.items():
        if code in OWN:
            assert rule.check == ""  # the engine's own: a file that does not parse, a crash
            continue
        assert rule.check in engine._CHECKERS, f"{code}: no checker {rule.check!r}"


def test_missing_gate_words_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation: WB302 gated on a word its snippet lacks is reported as uncovered, and
    the gated run then loses the finding the ungated run has (the silent skip)."""
    source = dict(SNIPPETS)[next(label for label, _ in SNIPPETS if label.endswith("WB302"))]
    assert _uncovered(source) == set()
    broken = replace(RULES["WB302"], words=("never_written_here",))
    monkeypatch.setitem(RULES, "WB302", broken)
    assert _uncovered(source) == {"WB302"}
    gated = {c for _, c in _codes(source, gate=True)}
    assert "WB302" in {c for _, c in _codes(source, gate=False)} - gated


def test_a_rule_without_words_is_never_gated() -> None:
    rule = replace(RULES["WB201"], words=())
    assert rule.gate_open("")
    assert rule.gate_open("anything at all")


def test_gates_skip_files_without_words() -> None:
    # A file with none of the words is not analysed: it can hold no finding.
    source = "def f(x):\n    return x + 1\n"
    assert not any(r.gate_open(source) for r in RULES.values() if r.words)
    assert lint_source(source) == []
