"""`wholebatch lint` never aborts a run (issue 33): an internal error while one function
or file is analysed becomes one WB001 finding naming the file, the function and the
exception, and everything else is still judged; the exit status says so.

The faults are injected into the linter's own functions (the rules, the summaries, the
file walk), one at a time, so each guard is shown to catch what it is there for; the
first test is the crash that lost a whole repository.
"""

from __future__ import annotations

import io
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from wholebatch.lint import lint_paths, lint_source, loop_rules, main, scope, summaries
from wholebatch.lint.facts import Facts
from wholebatch.lint.rules import Finding

# The shape that raised IndexError in dataflow._restored: the local slice put back in an
# earlier arm of an if/elif/else chain, the gather in the third arm (its path is the
# longer one), in a loop (the second walk over the loop meets the put-back after the
# gather), and a loss that reads the gathered list.
_ELIF_GATHER = """
import torch
import torch.distributed as dist


def gather(parts, xs, mode, rank):
    for x in xs:
        if mode == "a":
            parts[rank] = x
        elif mode == "b":
            pass
        else:
            dist.all_gather(parts, x)
    return torch.cat(parts)


def clip_loss(img, txt, parts, mode, rank):
    return (img @ gather(parts, txt, mode, rank).T).mean()
"""

# Two functions with a finding each (WB201 in `train`, WB203 in `evaluate_step`).
_TWO = """
def train(model, loader, opt):
    for x in loader:
        model(x).sum().backward()
        opt.step()


def evaluate_step(model, x, opt):
    loss = model(x).sum()
    opt.step()
    return loss
"""


def test_a_gather_in_a_later_elif_arm_than_the_put_back_is_judged() -> None:
    found = lint_source(textwrap.dedent(_ELIF_GATHER))
    assert [(f.line, f.code) for f in found] == [(13, "WB101")]
    # The put-back is on another branch: on the gather's path nothing is restored.
    assert "put back only when `mode == 'a'` (line 9), a branch the gather is not on" in (
        found[0].message
    )


def _boom_in(name: str) -> Callable[[scope.FileContext, scope.Scope], Iterator[Finding]]:
    """WB201's check, raising in function `name` (a stand-in for any rule's bug)."""
    real = loop_rules._ON_EVENTS["WB201"]

    def check(ctx: scope.FileContext, sc: scope.Scope) -> Iterator[Finding]:
        if sc.qual == name:
            raise IndexError("tuple index out of range")
        return real(ctx, sc)

    return check


def test_an_error_in_one_function_is_one_note_and_the_rest_is_judged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(loop_rules._ON_EVENTS, "WB201", _boom_in("train"))
    found = lint_source(textwrap.dedent(_TWO), "t.py")
    assert [(f.line, f.code) for f in found] == [(2, "WB001"), (10, "WB203")]
    note = found[0]
    assert note.message.startswith(
        "internal error while checking `train`: IndexError: tuple index out of range"
    )
    assert "not fully checked (the rest of the run was)" in note.message


def test_the_note_names_the_linters_own_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(self: object, sc: scope.Scope, d: object, shell: object) -> object:
        raise KeyError("x")

    monkeypatch.setattr(summaries.Resolver, "_summarise", fail)
    found = lint_source(textwrap.dedent(_TWO))
    # Each function's summary failed, once; the rules still judged each function itself.
    assert [f.code for f in found] == ["WB001", "WB201", "WB001", "WB203"]
    assert "KeyError: 'x' (lint/summaries.py:" in found[0].message


def test_an_error_in_a_summary_leaves_that_function_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `step()` raises while summarised: its callers see an unknown call (no WB203 from a
    # guess), and `train`'s own WB201 is still found.
    real = summaries.Resolver._summarise

    def fail(self: summaries.Resolver, sc: scope.Scope, d: Any, shell: Facts) -> Facts:
        if sc.qual == "step":
            raise RuntimeError("summary failed")
        return real(self, sc, d, shell)

    monkeypatch.setattr(summaries.Resolver, "_summarise", fail)
    source = _TWO + "\n\ndef step(opt):\n    opt.step()\n\n\ndef loop(opt):\n    step(opt)\n"
    found = lint_source(textwrap.dedent(source), "t.py")
    codes = [(f.code, f.message.split(":")[0]) for f in found]
    assert ("WB001", "internal error while checking `step`") in codes
    assert (
        "WB201",
        "`opt` steps in a loop (line 3) that calls backward but never zeroes gradients",
    ) in [(f.code, f.message.split(":")[0]) for f in found]


def _tree(root: Path) -> list[Path]:
    (root / "a.py").write_text(textwrap.dedent(_TWO))
    (root / "b.py").write_text(textwrap.dedent(_ELIF_GATHER))
    return [root / "a.py", root / "b.py"]


def test_an_error_building_one_file_is_a_note_for_that_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    real = scope.FileContext._classify_scope

    def fail(self: scope.FileContext, sc: scope.Scope) -> None:
        if self.path.endswith("a.py"):
            raise RecursionError("maximum recursion depth exceeded")
        return real(self, sc)

    monkeypatch.setattr(scope.FileContext, "_classify_scope", fail)
    _tree(tmp_path)
    found, files = lint_paths([tmp_path])
    assert files == 2
    got = [(Path(f.path).name, f.line, f.code) for f in found]
    assert got == [("a.py", 1, "WB001"), ("b.py", 13, "WB101")]
    assert found[0].message.startswith("internal error while checking this file: RecursionError")


def test_exit_status_and_selection(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(loop_rules._ON_EVENTS, "WB201", _boom_in("train"))
    a, _ = _tree(tmp_path)

    def run(*args: str) -> tuple[int, str]:
        out = io.StringIO()
        return main([*args, str(a)], out=out), out.getvalue()

    code, text = run()
    assert code == 1 and "WB001" in text and "WB203" in text
    # Selecting other rules still shows that `train` was not judged...
    code, text = run("--select", "WB201")
    assert code == 1 and "WB001" in text and "WB203" not in text
    # ... only an explicit ignore hides it.
    code, text = run("--select", "WB201", "--ignore", "WB001")
    assert code == 0 and "All checks passed!" in text


def test_raise_mode_re_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(loop_rules._ON_EVENTS, "WB201", _boom_in("train"))
    monkeypatch.setenv("WHOLEBATCH_LINT_RAISE", "1")
    with pytest.raises(IndexError):
        lint_source(textwrap.dedent(_TWO))
