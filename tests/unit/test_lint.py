"""Tests for `wholebatch lint`: every rule on wrong snippets (flagged with the exact code
at the exact line) and right snippets (no finding at all), plus the command line,
selection, `# noqa`, JSON, syntax errors, the flake8 plugin and the docs snippets.

Snippets live in tests/support/lint_cases/: a line ending in `# expect: WB123` must be flagged
with that code; every other line must not be. Files named right_* expect nothing.
"""

from __future__ import annotations

import ast
import io
import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from wholebatch.lint import RULES, UsageError, lint_paths, lint_source, main
from wholebatch.lint.flake8 import Plugin
from wholebatch.lint.rules import OWN

ROOT = Path(__file__).resolve().parents[2]
CASES = ROOT / "tests" / "support" / "lint_cases"
DOC = ROOT / "docs" / "lint.md"
_EXPECT = re.compile(r"#\s*expect:\s*(WB\d{3})")
_LINE = re.compile(r"^(?P<path>.+):(?P<line>\d+):(?P<col>\d+): (?P<code>WB\d{3}) .+$")


def _expected(source: str) -> set[tuple[int, str]]:
    return {
        (i, m.group(1))
        for i, line in enumerate(source.splitlines(), 1)
        for m in _EXPECT.finditer(line)
    }


def _found(source: str, **kw: object) -> set[tuple[int, str]]:
    return {(f.line, f.code) for f in lint_source(source, **kw)}  # type: ignore[arg-type]


CASE_FILES = sorted(CASES.glob("*.py"))


@pytest.mark.parametrize("path", CASE_FILES, ids=lambda p: p.name)
def test_cases_flag_exactly_the_marked_lines(path: Path) -> None:
    source = path.read_text()
    expected = _expected(source)
    if path.name.startswith("right_"):
        assert expected == set(), "right_* files must not carry expect markers"
    else:
        assert expected, "wrong_* files must mark what they expect"
    got = _found(source, path=str(path))
    assert got == expected, f"missing {sorted(expected - got)}, unexpected {sorted(got - expected)}"


def test_every_rule_has_a_wrong_case() -> None:
    marked = {code for p in CASE_FILES for _, code in _expected(p.read_text())}
    assert marked == set(RULES) - OWN


# -- one rule at a time: the same loop with one mutation is flagged, without it is not --


RIGHT_LOOP = """\
for i, (x, y) in enumerate(loader):
    loss = criterion(model(x), y, reduction="sum")
    loss.backward()
    if (i + 1) % accum_steps == 0:
        optimizer.step()
        optimizer.zero_grad()
"""


@pytest.mark.parametrize(
    ("mutation", "code", "line"),
    [
        # zero_grad dropped: gradients of every step pile up
        (("        optimizer.zero_grad()\n", ""), "WB201", 5),
        # backward dropped: the loss is never backpropagated
        (("    loss.backward()\n", "    print(loss)\n"), "WB203", 5),
        # zero_grad moved before step
        (
            (
                "        optimizer.step()\n        optimizer.zero_grad()\n",
                "        optimizer.zero_grad()\n        optimizer.step()\n",
            ),
            "WB202",
            5,
        ),
        # zero_grad moved to the top of every micro-batch
        (
            ("    loss = criterion", "    optimizer.zero_grad()\n    loss = criterion"),
            "WB304",
            2,
        ),
    ],
)
def test_accumulation_loop_mutations(mutation: tuple[str, str], code: str, line: int) -> None:
    assert _found(RIGHT_LOOP) == set()
    old, new = mutation
    assert old in RIGHT_LOOP
    src = RIGHT_LOOP.replace(old, new)
    assert (line, code) in _found(src), src


def test_mean_over_steps_needs_varying_item_counts() -> None:
    fixed = "loss = model(x, y)[1]\nloss = loss / grad_accum_steps\nloss.backward()\n"
    varying = "loss = model(**batch).loss\nloss = loss / grad_accum_steps\nloss.backward()\n"
    tokens = "batch['labels'][pad] = -100\n"  # labels masked out (frameworks.masks_labels)
    assert _found(fixed) == set()
    assert _found(tokens + varying) == {(3, "WB301")}
    # A model's mean loss where no label is masked out (images, rows, one label per
    # sequence, fixed-length blocks): not reported (issue 33: timm, accelerate's MRPC).
    assert _found(varying) == set()


def test_wholebatch_usage_is_clean() -> None:
    src = """\
import wholebatch
from wholebatch import all_gather

acc = wholebatch.Accumulator(model, opt)
for mbs in loader:
    feats = model(mbs[0])
    all_feats = all_gather(feats)
    g = wholebatch.all_reduce(feats.sum())
    acc.step(mbs, loss_fn)
cached = wholebatch.CachedStep(model, opt, loss_fn)
for mbs in loader:
    cached.step(mbs)
"""
    assert _found(src) == set()


# -- noqa, select, ignore --------------------------------------------------------------


NEVER_ZEROED = """\
for x in loader:
    model(x).sum().backward()
    optimizer.step(){comment}
"""


def test_noqa_with_the_code_suppresses() -> None:
    assert _found(NEVER_ZEROED.format(comment="")) == {(3, "WB201")}
    assert _found(NEVER_ZEROED.format(comment="  # noqa: WB201")) == set()
    assert _found(NEVER_ZEROED.format(comment="  # noqa: E501, WB201")) == set()
    assert _found(NEVER_ZEROED.format(comment="  # noqa")) == set()


def test_noqa_with_another_code_does_not_suppress() -> None:
    assert _found(NEVER_ZEROED.format(comment="  # noqa: WB202")) == {(3, "WB201")}


def test_select_and_ignore_prefixes() -> None:
    src = (CASES / "wrong_wb2.py").read_text()
    every = {c for _, c in _found(src)}
    assert {"WB201", "WB202", "WB203", "WB204", "WB205"} <= every
    assert {c for _, c in _found(src, select=["WB20"], ignore=["WB204", "WB205"])} == {
        "WB201",
        "WB202",
        "WB203",
    }
    assert _found(src, select=["WB1"]) == set()
    with pytest.raises(UsageError, match="unknown rule selector 'WB9'"):
        lint_source(src, select=["WB9"])


# -- files that do not parse, never executed --------------------------------------------


def test_syntax_error_is_a_finding_not_a_crash(tmp_path: Path) -> None:
    (tmp_path / "bad.py").write_text("def f(:\n    pass\n")
    (tmp_path / "good.py").write_text("x = 1\n")
    findings, files = lint_paths([tmp_path])
    assert files == 2
    assert [(Path(f.path).name, f.code, f.line) for f in findings] == [("bad.py", "WB000", 1)]


def test_code_is_never_imported_or_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    (tmp_path / "evil.py").write_text(
        f"import no_such_module_anywhere\nopen({str(marker)!r}, 'w').write('x')\n"
        "raise SystemExit(3)\n"
    )
    findings, _ = lint_paths([tmp_path])
    assert findings == []
    assert not marker.exists()


def test_hidden_and_cache_folders_are_skipped(tmp_path: Path) -> None:
    for d in (".venv", "__pycache__"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "x.py").write_text("def f(:\n")
    assert lint_paths([tmp_path]) == ([], 0)


# -- the command line --------------------------------------------------------------------


def _run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    rc = main(argv, out=out)
    return rc, out.getvalue()


def test_main_exit_codes_and_ruff_style_lines() -> None:
    rc, text = _run([str(CASES / "wrong_wb3.py")])
    assert rc == 1
    lines = text.splitlines()
    assert all(_LINE.match(line) for line in lines[:-1]), lines
    assert lines[-1].startswith("Found ") and lines[-1].endswith(" in 1 file.")
    got = {(int(m["line"]), m["code"]) for m in map(_LINE.match, lines[:-1]) if m}
    assert got == _expected((CASES / "wrong_wb3.py").read_text())
    rc, text = _run([str(CASES / "right_wb3.py"), str(CASES / "right_wb2.py")])
    assert (rc, text.strip()) == (0, "All checks passed! (2 files)")


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--bogus", "x.py"],
        ["--select", "NOPE", "x.py"],
        ["no/such/file.py"],
        ["--format", "xml"],
    ],
)
def test_main_usage_errors_return_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(argv)[0] == 2
    assert "wholebatch lint" in capsys.readouterr().err


def test_main_help_and_rules_return_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["--help"])[0] == 0
    rc, text = _run(["--list-rules"])
    assert rc == 0
    assert [line.split()[0] for line in text.splitlines()] == list(RULES)


def test_json_format_and_exit_zero() -> None:
    rc, text = _run(["--format", "json", "--exit-zero", str(CASES / "wrong_wb1.py")])
    assert rc == 0
    rows = json.loads(text)
    assert {(r["line"], r["code"]) for r in rows} == _expected((CASES / "wrong_wb1.py").read_text())
    assert set(rows[0]) >= {"path", "line", "col", "code", "message", "fix", "name", "docs"}
    # everything in one function: a value's path has its start and its harm, nothing else
    for r in rows:
        functions = {h["function"] for h in r["trace"]}
        assert len(r["trace"]) == (2 if r["code"] in ("WB101", "WB103") else 0), r
        assert len(functions) <= 1 and "path:" not in r["message"]


def test_module_entry_point_runs_lint() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wholebatch",
            "lint",
            "--select",
            "WB2",
            str(CASES / "wrong_wb2.py"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr
    assert "WB201" in proc.stdout and "WB101" not in proc.stdout


# -- ecosystem hooks ----------------------------------------------------------------------


def test_flake8_plugin_reports_the_same_findings() -> None:
    import ast

    src = (CASES / "wrong_wb2.py").read_text()
    plugin = Plugin(ast.parse(src), "wrong_wb2.py", src.splitlines(keepends=True))
    rows = list(plugin.run())
    assert {(line, msg.split()[0]) for line, _, msg, _ in rows} == _expected(src)
    assert all(col >= 0 and cls is Plugin for _, col, _, cls in rows)


def test_flake8_entry_point_is_registered() -> None:
    eps = metadata.entry_points(group="flake8.extension")
    assert any(ep.name == "WB" and ep.value == "wholebatch.lint.flake8:Plugin" for ep in eps)


def test_pre_commit_hook_runs_wholebatch_lint() -> None:
    text = (ROOT / ".pre-commit-hooks.yaml").read_text()
    assert "- id: wholebatch-lint\n" in text
    assert "entry: wholebatch lint\n" in text and "types: [python]" in text


# -- the project's own docs and examples ----------------------------------------------------


_FENCE = re.compile(r"```python\n(.*?)```", re.DOTALL)


def test_docs_have_a_section_per_rule() -> None:
    text = DOC.read_text()
    for code, rule in RULES.items():
        if code in OWN:
            assert f"`{code}`" in text, code  # the linter's own: "When the linter fails"
            continue
        assert f"## {code} {rule.name}" in text, code


def test_docs_snippets_lint_as_labelled() -> None:
    """Blocks starting `# wrong: WBxxx` must give exactly that code; all others nothing."""
    # docs/semantics.md shows a broken GatherLayer on purpose (WB102 finds it); it joins
    # this list once that block is labelled `# wrong: WB102`.
    docs = [DOC, ROOT / "README.md"]
    checked = 0
    for doc in docs:
        if not doc.exists():
            continue
        for block in _FENCE.findall(doc.read_text()):
            first = block.splitlines()[0] if block.strip() else ""
            m = re.match(r"#\s*wrong:\s*(WB\d{3})", first)
            codes = {c for _, c in _found(block, path=str(doc))}
            assert codes == ({m.group(1)} if m else set()), f"{doc.name}:\n{block}"
            checked += 1
    assert checked >= 2 * (len(RULES) - len(OWN))


def _docstring_at(path: Path, line: int) -> str:
    """The docstring of the innermost function around `line` of `path`."""
    best = ""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.lineno <= line <= (node.end_lineno or 0):
            best = ast.get_docstring(node) or best
    return best


def test_examples_lint_clean_but_for_their_marked_mistakes() -> None:
    # The examples show wholebatch verify catching mistakes on purpose (`"""MISTAKE: ..."""`
    # in a spec's docstring); lint may find those, and nothing else.
    if not (ROOT / "examples").exists():
        pytest.skip("no examples/")
    findings, _ = lint_paths([ROOT / "examples"])
    unmarked = [
        f for f in findings if not _docstring_at(Path(f.path), f.line).startswith("MISTAKE")
    ]
    assert unmarked == [], "\n".join(f"{f.path}:{f.line}: {f.code} {f.message}" for f in unmarked)
    # `accelerator.backward(model(**mb).loss)` inside accumulate(): a mean of means.
    assert ("verify_hf.py", "WB301") in {(Path(f.path).name, f.code) for f in findings}


def test_a_linked_file_is_judged_once_under_its_own_name(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    bad = (CASES / "wrong_wb3.py").read_text()
    (tmp_path / "real" / "train.py").write_text(bad)
    (tmp_path / "copy.py").symlink_to(tmp_path / "real" / "train.py")
    (tmp_path / "gone.py").symlink_to(tmp_path / "nowhere.py")
    found, files = lint_paths([tmp_path])
    assert files == 1 and found
    assert {Path(f.path).name for f in found} == {"train.py"}
    # Named alone, the link is judged: its target is under no folder given.
    alone, _ = lint_paths([tmp_path / "copy.py"])
    assert [(f.line, f.code) for f in alone] == [(f.line, f.code) for f in found]
