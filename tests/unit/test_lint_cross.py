"""`wholebatch lint` across functions and files: the rules follow a gathered tensor, a
zero_grad, a backward or a collective through helpers, methods (`self.`, `super()`)
and imports of the tree being linted, and each finding names the path it followed.

The single-file cases are tests/support/lint_cases/wrong_cross.py and right_cross.py (checked
line by line by tests/unit/test_lint.py); this file adds the packages (pkg_wrong, pkg_right),
the path in text and JSON, the flake8 plugin, and mutations of the right forms: each
right form, changed in one place, is flagged with the rule it illustrates.
"""

from __future__ import annotations

import ast
import io
import json
import re
from pathlib import Path

import pytest

from wholebatch.lint import lint_paths, lint_source, main
from wholebatch.lint.flake8 import Plugin

CASES = Path(__file__).resolve().parents[1] / "support" / "lint_cases"
_EXPECT = re.compile(r"#\s*expect:\s*(WB\d{3})")


def _expected_in(folder: Path) -> set[tuple[str, int, str]]:
    out: set[tuple[str, int, str]] = set()
    for f in sorted(folder.glob("*.py")):
        for i, line in enumerate(f.read_text().splitlines(), 1):
            for m in _EXPECT.finditer(line):
                out.add((f.name, i, m.group(1)))
    return out


def _found(source: str) -> set[tuple[int, str]]:
    return {(f.line, f.code) for f in lint_source(source)}


# -- across files --------------------------------------------------------------------------


def test_package_mistakes_across_files_are_flagged_where_marked() -> None:
    folder = CASES / "pkg_wrong"
    findings, files = lint_paths([folder])
    assert files == 4
    got = {(Path(f.path).name, f.line, f.code) for f in findings}
    expected = _expected_in(folder)
    assert len(expected) == 5
    assert got == expected, f"missing {expected - got}, unexpected {got - expected}"


def test_package_right_forms_are_clean() -> None:
    findings, files = lint_paths([CASES / "pkg_right"])
    assert files == 4
    assert findings == [], [f"{f.path}:{f.line}: {f.code} {f.message}" for f in findings]


def test_cross_file_path_names_the_other_file() -> None:
    findings, _ = lint_paths([CASES / "pkg_wrong"])
    wb101 = next(f for f in findings if f.code == "WB101")
    assert Path(wb101.path).name == "losses.py"  # where the gather is, the fix goes
    files = [Path(h.path).name for h in wb101.trace]
    functions = [h.function for h in wb101.trace]
    assert files == ["losses.py", "train.py", "train.py"]
    assert functions == ["gather_features", "ClipLoss.forward", "ClipLoss.forward"]
    assert "local slice is put back only when `not local_loss` (line 9)" in wb101.message
    assert "train.py:17" in wb101.message  # the call site, in the other file
    wb202 = next(f for f in findings if f.code == "WB202")
    assert Path(wb202.path).name == "train.py"
    assert [Path(h.path).name for h in wb202.trace] == ["steps.py"]


def test_one_file_of_a_package_reads_what_it_imports() -> None:
    """`wholebatch lint train.py` (pre-commit on a changed file) follows the modules it
    imports from its own package, and reports in train.py only."""
    findings, files = lint_paths([CASES / "pkg_wrong" / "train.py"])
    assert files == 1
    got = {(Path(f.path).name, f.line, f.code) for f in findings}
    assert got == {e for e in _expected_in(CASES / "pkg_wrong") if e[0] == "train.py"}
    right, _ = lint_paths([CASES / "pkg_right" / "train.py"])
    assert right == []
    # losses.py imports nothing of its package: its gather's loss is in train.py
    assert lint_paths([CASES / "pkg_wrong" / "losses.py"]) == ([], 1)


# -- the path, in text, JSON and flake8 ------------------------------------------------------


def test_text_and_json_name_the_path_followed() -> None:
    path = str(CASES / "wrong_cross.py")
    out = io.StringIO()
    assert main(["--select", "WB101", path], out=out) == 1
    first = out.getvalue().splitlines()[0]
    assert first.startswith(f"{path}:14:5: WB101 ")
    assert first.endswith(
        "path: `collect` line 14 (torch.distributed.all_gather fills `parts`) -> "
        "`clip_loss` line 19 (gets it from `collect()`) -> "
        "`clip_loss` line 21 (returned as the loss)"
    )
    out = io.StringIO()
    main(["--format", "json", "--select", "WB1,WB2", path], out=out)
    rows = json.loads(out.getvalue())
    by_line = {(r["line"], r["code"]): r for r in rows}
    trace = by_line[(14, "WB101")]["trace"]
    assert [(h["function"], h["line"]) for h in trace] == [
        ("collect", 14),
        ("clip_loss", 19),
        ("clip_loss", 21),
    ]
    assert set(trace[0]) == {"path", "line", "col", "function", "note"}
    # a helper that zeroes: the path goes into the helper
    assert [(h["function"], h["line"]) for h in by_line[(72, "WB202")]["trace"]] == [("reset", 65)]
    # a gather layer whose forward gathers in a helper: the path into the helper
    assert [(h["function"], h["line"]) for h in by_line[(155, "WB102")]["trace"]] == [
        ("HelperGatherLayer.forward", 152),
        ("_gather_list", 143),
    ]


def test_flake8_plugin_follows_calls_within_the_file() -> None:
    src = (CASES / "wrong_cross.py").read_text()
    plugin = Plugin(ast.parse(src), "wrong_cross.py", src.splitlines(keepends=True))
    rows = {(line, msg.split()[0]) for line, _, msg, _ in plugin.run()}
    assert (14, "WB101") in rows and (72, "WB202") in rows and (93, "WB201") in rows
    assert len(rows) == 11


# -- mutations: each right form, changed in one place, is flagged ---------------------------

RIGHT = (CASES / "right_cross.py").read_text()


@pytest.mark.parametrize(
    ("old", "new", "code"),
    [
        # the GAN's helper zeroes the optimizer that is about to step
        ("reset_opt(opt_g)  #", "reset_opt(opt_d)  #", "WB202"),
        # the local slice put back only on one path (open_clip's local_loss=True)
        ("    parts[rank] = x\n", "    if local:\n        parts[rank] = x\n", "WB101"),
        # MoCo's key gather without its no_grad: now it reads as a missing gradient
        ("@torch.no_grad()\ndef concat_all_gather", "def concat_all_gather", "WB101"),
        # a helper whose collective runs on every call, under `if rank == 0:`
        ("print(maybe_sync(loss, enabled=False))", "print(sync_metrics(loss))", "WB104"),
        (
            "    loss = sync_metrics(loss)  # every rank\n    if rank == 0:\n        print(loss.item())",
            "    if rank == 0:\n        loss = sync_metrics(loss)",
            "WB104",
        ),
        # train_step no longer zeroes: the loop that calls it piles gradients up
        ("        self.optimizer.zero_grad()\n        loss = self", "        loss = self", "WB201"),
        # a certain zero_grad between the backward and the step
        (
            "            self.maybe_clear(i)  # zeroes only sometimes: not a certain zero_grad\n",
            "            self.optimizer.zero_grad()\n",
            "WB202",
        ),
        # the gather layer's backward no longer reduces through its helper
        (
            "        return _sum_over_ranks(grads)[dist.get_rank()]",
            "        return torch.stack(grads)[dist.get_rank()]",
            "WB102",
        ),
        # the helper that ran the backward is gone
        (
            "        loss = run_batch(model, batch, criterion)\n",
            "        loss = criterion(model(batch[0]), batch[1])\n",
            "WB203",
        ),
    ],
)
def test_right_forms_mutated_are_flagged(old: str, new: str, code: str) -> None:
    assert _found(RIGHT) == set()
    assert old in RIGHT
    codes = {c for _, c in _found(RIGHT.replace(old, new))}
    assert codes == {code}


# -- recursion and unknown calls: no finding rather than a false one -----------------------


def test_recursion_and_long_chains_neither_crash_nor_guess() -> None:
    head = (
        "import torch\nimport torch.distributed as dist\n\n"
        "def f0(x, ws):\n    parts = [torch.zeros_like(x) for _ in range(ws)]\n"
        "    dist.all_gather(parts, x)\n    return torch.cat(parts)\n"
    )
    chain = "".join(f"def f{i}(x, ws):\n    return f{i - 1}(x, ws)\n" for i in range(1, 400))
    tail = "def my_loss(img, txt, ws):\n    return (img @ f399(txt, ws).T).sum()\n"
    assert _found(head + chain + tail) == {(6, "WB101")}
    # Defined callers first, the chain is followed depth first: past the depth cap the
    # rest is unknown (no finding), and nothing overflows the stack.
    backwards = "".join(
        f"def f{i}(x, ws):\n    return f{i - 1}(x, ws)\n" for i in range(399, 0, -1)
    )
    assert _found(
        head.split("def f0")[0] + tail + backwards + "def f0" + head.split("def f0")[1]
    ) <= {(3 + 2 + 2 * 399 + 3, "WB101")}
    mutual = (
        "import torch.distributed as dist\n"
        "def a(x):\n    return b(x)\n"
        "def b(x):\n    dist.barrier()\n    return a(x)\n"
        "def c(rank):\n    if rank == 0:\n        a(rank)\n"
        "def loop(opt, model, xs):\n"
        "    for x in xs:\n        model(x).sum().backward()\n        again(opt, 3)\n"
        "        opt.step()\n"
        "def again(opt, n):\n    if n:\n        opt.zero_grad()\n        again(opt, n - 1)\n"
    )
    # `c` may hang (a -> b -> barrier), but the cycle is cut where the walk meets it, so
    # it is not reported; `again` zeroes on some calls, so the loop is not "never zeroed".
    assert _found(mutual) == set()


def test_unknown_calls_add_nothing() -> None:
    src = (
        "def train(model, loader, optimizer, hooks):\n"
        "    for x in loader:\n"
        "        model(x).sum().backward()\n"
        "        hooks.after_backward()\n"  # unknown object: may zero, may not
        "        optimizer.step()\n"
        "        optimizer.zero_grad()\n"
    )
    assert _found(src) == set()


def test_static_and_class_qualified_methods_pair_their_arguments() -> None:
    src = (
        "import torch\nimport torch.distributed as dist\nimport torch.nn.functional as F\n\n"
        "class GatheredLoss(torch.nn.Module):\n"
        "    @staticmethod\n"
        "    def _gather(x, ws):\n"
        "        out = [torch.empty_like(x) for _ in range(ws)]\n"
        "        dist.all_gather(out, x)\n"
        "        return torch.cat(out)\n\n"
        "    def forward(self, img, txt):\n"
        "        return F.cross_entropy(img @ self._gather(txt, 4).T, torch.arange(len(img)))\n\n"
        "def train(img, txt):\n"
        "    (img @ GatheredLoss._gather(txt, 4).T).sum().backward()\n"
    )
    findings = lint_source(src)
    assert [(f.line, f.code) for f in findings] == [(9, "WB101")]
    assert [h.function for h in findings[0].trace] == [
        "GatheredLoss._gather",
        "GatheredLoss.forward",
        "GatheredLoss.forward",
    ]
    # the same helper, with the gradient kept: nothing
    fixed = src.replace("dist.all_gather(out, x)\n        return torch.cat(out)", "return x")
    assert lint_source(fixed) == []


def test_branches_join_by_union_and_both_branches_overwrite() -> None:
    base = (
        "import torch\nimport torch.distributed as dist\nimport torch.nn.functional as F\n"
        "import wholebatch\n\n"
        "def clip_loss(img, txt, ws, use_grad):\n"
        "    parts = [torch.zeros_like(txt) for _ in range(ws)]\n"
        "    dist.all_gather(parts, txt)\n"
        "    all_txt = torch.cat(parts)\n"
        "    if use_grad:\n"
        "        all_txt = wholebatch.all_gather(txt)\n"
        "    else:\n"
        "        all_txt = txt\n"
        "    return F.cross_entropy(img @ all_txt.T, torch.arange(len(img)))\n"
    )
    # both branches replace the gathered value: nothing reaches the loss
    assert _found(base) == set()
    # one branch only (or the other one nested deeper): the no-gradient value may reach it
    one = base.replace("    else:\n        all_txt = txt\n", "")
    nested = base.replace(
        "        all_txt = txt\n", "        if ws > 1:\n            all_txt = txt\n"
    )
    assert _found(one) == {(8, "WB101")}
    assert _found(nested) == {(8, "WB101")}


def test_reexports_and_files_without_any_rule_words(tmp_path: Path) -> None:
    """An `__init__.py` that only re-exports, and a loop file that names no training call
    itself (all of it in helpers of another file): both are still followed."""
    pkg = tmp_path / "proj"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .helpers import reset, run_step\n")
    (pkg / "helpers.py").write_text(
        "def reset(model):\n    model.zero_grad()\n\n\n"
        "def run_step(model, opt, x):\n    model(x).sum().backward()\n    opt.step()\n"
    )
    (pkg / "train.py").write_text(
        "from proj import reset\n\n\n"
        "def train(model, loader, opt):\n"
        "    for x in loader:\n"
        "        model(x).sum().backward()\n"
        "        reset(model)\n"
        "        opt.step()\n"
    )
    (pkg / "loop.py").write_text(
        "from proj import run_step\n\n\n"
        "def fit(model, opt, batches):\n"
        "    for x in batches:\n"
        "        run_step(model, opt, x)\n"
    )
    findings, files = lint_paths([pkg])
    assert files == 4
    got = {(Path(f.path).name, f.line, f.code) for f in findings}
    assert got == {("train.py", 7, "WB202"), ("loop.py", 6, "WB201")}
