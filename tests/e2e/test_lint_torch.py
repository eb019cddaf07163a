"""`wholebatch lint` over every `.py` file of the installed torch package (2285 files, all
of them linted in one run, so calls are followed across torch's own modules): no crash,
and exactly the findings whose verdicts docs/lint.md lists (section "Run over the
installed torch package"). A new finding (or a lost one) fails here until its verdict
is written down there. The speed is benchmarks/bench_lint.py's business.

A finding is keyed on what does not move between torch releases: its file, its rule,
the function it sits in (qualified, `Class.method`) and the text of its line, never the
line number (torch 2.14 has the same findings as 2.13, 2 to 5 lines lower). The run
reports test files too (`tests=True`): eight of the ten findings are in torch/testing/.
"""

from __future__ import annotations

import ast
import re
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from benchmarks.bench_lint import torch_dir
from wholebatch.lint import lint_run

DOC = Path(__file__).resolve().parents[2] / "docs" / "lint.md"
# | `torch/x.py` | `Class.method` | `optimizer.step()` | WB201 | verdict |
_ROW = re.compile(
    r"^\| `(?P<path>torch/[^`]+)` \| `(?P<function>[^`]*)` \| `(?P<snippet>[^`]+)` "
    r"\| (?P<code>WB\d{3}) \|"
)
_MODULE = "(module)"  # the function column of a finding at module level
_Key = tuple[str, str, str, str]  # (path, function, code, text of the line)


def _documented() -> Counter[_Key]:
    text = DOC.read_text()
    section = text.split("## Run over the installed torch package", 1)[1].split("\n## ", 1)[0]
    out: Counter[_Key] = Counter()
    for line in section.splitlines():
        m = _ROW.match(line)
        if m:
            out[(m["path"], m["function"], m["code"], m["snippet"])] += 1
    return out


def _enclosing(tree: ast.Module | None, line: int) -> str:
    """The qualified name of the innermost function or class around `line`."""
    best = _MODULE
    stack: list[tuple[ast.AST, str]] = [(tree, "")] if tree is not None else []
    while stack:
        node, prefix = stack.pop()
        for child in ast.iter_child_nodes(node):
            inner = prefix
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                inner = f"{prefix}{child.name}."
                if child.lineno <= line <= (child.end_lineno or child.lineno):
                    best = inner[:-1]
            stack.append((child, inner))
    return best


def _key(path: Path, root: Path, line: int, code: str) -> _Key:
    source = path.read_text()
    try:
        tree: ast.Module | None = ast.parse(source)
    except SyntaxError:
        tree = None  # WB000: the file is reported at module level
    text = source.splitlines()[line - 1].strip()
    return (path.relative_to(root.parent).as_posix(), _enclosing(tree, line), code, text)


def test_enclosing_names_the_innermost_function() -> None:
    tree = ast.parse("class A:\n    def f(self):\n        def g():\n            pass\nx = 1\n")
    assert _enclosing(tree, 4) == "A.f.g"
    assert _enclosing(tree, 2) == "A.f"
    assert _enclosing(tree, 5) == _MODULE


def test_lint_whole_torch_package_matches_the_documented_verdicts(
    record_property: Callable[[str, object], None],
) -> None:
    root = torch_dir()
    t0 = time.perf_counter()
    report = lint_run([root], tests=True)
    seconds = time.perf_counter() - t0
    findings, files = report.findings, report.files
    # torch/testing/ is a test folder: its findings carry the test tier, and a default
    # run (tests off) does not report them (issue 33).
    assert {f.tier for f in findings if "/testing/" in f.path} == {"test"}
    assert {f.tier for f in findings if "/testing/" not in f.path} == {"code"}
    by_code = Counter(f.code for f in findings)
    record_property("files", files)
    record_property("findings", len(findings))
    record_property("seconds", round(seconds, 2))
    print(f"\nlint torch: {files} files, {len(findings)} findings {dict(by_code)}, {seconds:.1f} s")
    got = Counter(_key(Path(f.path), root, f.line, f.code) for f in findings)
    documented = _documented()
    assert files > 2000
    assert documented.total() >= 10  # the table was read
    assert got == documented, (
        f"not in docs/lint.md: {sorted((got - documented).elements())}; "
        f"documented but not found: {sorted((documented - got).elements())}"
    )
    # Generous bound so a loaded CI machine does not fail it; the benchmark tracks speed.
    assert seconds < 180
