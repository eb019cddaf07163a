"""Fuzz `wholebatch lint` (issue 33): real training files with statements deleted,
duplicated, reordered, moved, wrapped in `if/elif/else`, `with`, `for`, `try`, or
spliced in from other files, and programs generated from training-loop statements in
random control flow (helpers, methods, autograd Functions, packages of several files).
A crash is any exception out of the linter or any WB001 (internal error) finding.

    .venv/bin/python -m benchmarks.lint_fuzz                        # 10,000 modules
    .venv/bin/python -m benchmarks.lint_fuzz -n 2000 --seed 7
    .venv/bin/python -m benchmarks.lint_fuzz --root /tmp/corpus     # also mutate a corpus

Sources: tests/support/lint_cases, examples/, the linter's own tests' snippets and, with
`--root`, every `.py` file under that folder (e.g. the snapshots of
benchmarks/lint_corpus.toml). The unit tier runs a small sample of the same generator
(tests/unit/test_lint_fuzz.py); nothing here imports torch.
"""

from __future__ import annotations

import argparse
import ast
import copy
import os
import random
import tempfile
import textwrap
import time
import traceback
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from wholebatch.lint import lint_paths, lint_source

__all__ = ["Crash", "Fuzz", "generated", "main", "mutant", "project_sources"]

ROOT = Path(__file__).resolve().parents[1]

# Statements the rules care about, as a training file writes them (the generator's
# vocabulary, and what mutation splices in).
ATOMS = [
    "parts = [torch.zeros_like(x) for _ in range(world)]",
    "dist.all_gather(parts, x)",
    "torch.distributed.all_gather(out, feats)",
    "dist.all_gather_into_tensor(buf, x)",
    "parts[rank] = x",
    "parts[dist.get_rank()] = feats",
    "parts.pop(rank)",
    "all_x = torch.cat(parts)",
    "all_x = torch.cat([x, *parts])",
    "logits = x @ all_x.T",
    "loss = F.cross_entropy(logits, labels)",
    "loss = criterion(model(x), y)",
    "loss = model(x, labels=y).loss",
    "loss = out['loss']",
    "loss = loss / accum_steps",
    "loss /= gradient_accumulation_steps",
    "loss = loss_fn(logits, y, ignore_index=-100)",
    "loss = (logits * mask).sum() / mask.sum()",
    "loss.backward()",
    "scaler.scale(loss).backward()",
    "accelerator.backward(loss)",
    "self.manual_backward(loss)",
    "optimizer.step()",
    "scaler.step(optimizer)",
    "scaler.update()",
    "scaler.unscale_(optimizer)",
    "optimizer.zero_grad()",
    "model.zero_grad(set_to_none=True)",
    "p.grad = None",
    "p.grad = g",
    "p.data -= lr * p.grad",
    "p -= lr * p.grad",
    "p.data.add_(p.grad, alpha=-lr)",
    "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
    "dist.barrier()",
    "dist.all_reduce(t)",
    "dist.broadcast(t, src=0)",
    "wholebatch.all_gather(x)",
    "grads = [p.grad for p in model.parameters()]",
    "dist.all_gather(gathered, p.grad)",
    "p.grad = torch.cat(gathered)",
    "x = helper(x)",
    "x = self.helper(x)",
    "y = GatherLayer.apply(x)",
    "return loss",
    "return torch.cat(parts)",
    "return {'loss': loss, 'logits': logits}",
    "return",
    "continue",
    "break",
    "pass",
    "k = model(x2).detach()",
]
CONDITIONS = [
    "rank == 0",
    "dist.get_rank() != 0",
    "rank >= 0",
    "local_rank != -1",
    "not local_loss",
    "(step + 1) % accum_steps == 0",
    "is_main_process",
    "mode == 'a'",
    "torch.isfinite(loss)",
    "rank in ranks",
    "self.training",
    "x is None",
]
CONTEXTS = [
    "torch.no_grad()",
    "model.no_sync()",
    "accelerator.accumulate(model)",
    "torch.autocast('cuda')",
    "torch.enable_grad()",
    "contextlib.nullcontext()",
]
_HEADER = (
    "import contextlib\nimport torch\nimport torch.distributed as dist\n"
    "import torch.nn.functional as F\nimport wholebatch\n"
)


@dataclass(frozen=True)
class Crash:
    """One crash: the module that caused it and what the linter raised or reported."""

    source: str
    error: str


@dataclass
class Fuzz:
    """The running tally of one fuzz run."""

    modules: int = 0
    trees: int = 0
    findings: Counter[str] = field(default_factory=Counter)
    crashes: list[Crash] = field(default_factory=list)
    kinds: Counter[str] = field(default_factory=Counter)


# -- mutation of real files -------------------------------------------------------------


def _blocks(tree: ast.AST) -> list[list[ast.stmt]]:
    """Every statement list of the tree (bodies, `else`s, handlers, `finally`s)."""
    out: list[list[ast.stmt]] = []
    for node in ast.walk(tree):
        for name in ("body", "orelse", "finalbody"):
            block = getattr(node, name, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                out.append(block)
        if isinstance(node, ast.Try | ast.TryStar):
            out.extend(h.body for h in node.handlers)
        if isinstance(node, ast.Match):
            out.extend(c.body for c in node.cases)
    return out


def _stmt(text: str) -> ast.stmt:
    return ast.parse(text).body[0]


def _wrap(rng: random.Random, run: list[ast.stmt]) -> ast.stmt:
    """`run` inside a new compound statement."""
    kind = rng.randrange(6)
    cond = ast.parse(rng.choice(CONDITIONS), mode="eval").body
    if kind == 0:  # if / elif / else, the run in one arm, sometimes copies in others
        arms = rng.randrange(1, 4)
        where = rng.randrange(arms + 1)
        bodies = [
            copy.deepcopy(run) if (i == where or rng.random() < 0.3) else [ast.Pass()]
            for i in range(arms + 1)
        ]
        node: ast.stmt = ast.If(test=cond, body=bodies[0], orelse=[])
        cur = node
        for i in range(1, arms):
            test = ast.parse(rng.choice(CONDITIONS), mode="eval").body
            nxt = ast.If(test=test, body=bodies[i], orelse=[])
            assert isinstance(cur, ast.If)
            cur.orelse = [nxt]
            cur = nxt
        assert isinstance(cur, ast.If)
        cur.orelse = bodies[arms]
        return node
    if kind == 1:
        ctx = ast.parse(rng.choice(CONTEXTS), mode="eval").body
        return ast.With(items=[ast.withitem(context_expr=ctx)], body=run)
    if kind == 2:
        it = ast.parse("enumerate(loader)", mode="eval").body
        target = ast.parse("step, x", mode="eval").body
        for n in ast.walk(target):
            if isinstance(n, ast.Name | ast.Tuple):
                n.ctx = ast.Store()
        return ast.For(target=target, iter=it, body=run, orelse=[])
    if kind == 3:
        handler = ast.ExceptHandler(type=ast.Name(id="Exception"), name=None, body=[ast.Pass()])
        return ast.Try(body=run, handlers=[handler], orelse=[], finalbody=[])
    if kind == 4:
        return ast.While(test=cond, body=run, orelse=[])
    return ast.If(test=cond, body=run, orelse=copy.deepcopy(run) if rng.random() < 0.5 else [])


def _mutate_once(rng: random.Random, tree: ast.Module, donors: Sequence[ast.stmt]) -> str:
    blocks = _blocks(tree)
    if not blocks:
        tree.body.append(_stmt(rng.choice(ATOMS)))
        return "append"
    block = rng.choice(blocks)
    i = rng.randrange(len(block))
    op = rng.randrange(9)
    if op == 0 and len(block) > 1:
        del block[i]
        return "delete"
    if op == 1:
        block.insert(i, copy.deepcopy(block[i]))
        return "duplicate"
    if op == 2 and len(block) > 1:
        j = rng.randrange(len(block))
        block[i], block[j] = block[j], block[i]
        return "swap"
    if op == 3:
        end = min(len(block), i + rng.randrange(1, 4))
        block[i:end] = [_wrap(rng, block[i:end])]
        return "wrap"
    if op == 4:
        block.insert(i, _stmt(rng.choice(ATOMS)))
        return "atom"
    if op == 5 and donors:
        block.insert(i, copy.deepcopy(rng.choice(donors)))
        return "splice"
    if op == 6:
        other = rng.choice(blocks)
        st = block.pop(i) if len(block) > 1 else copy.deepcopy(block[i])
        other.insert(rng.randrange(len(other) + 1), st)
        return "move"
    if op == 7 and len(block) > 2:
        seg = block[i:]
        rng.shuffle(seg)
        block[i:] = seg
        return "reorder"
    block.insert(i, _stmt(rng.choice(("return", "continue", "break", "raise ValueError()"))))
    return "exit"


def mutant(rng: random.Random, source: str, donors: Sequence[ast.stmt] = ()) -> tuple[str, str]:
    """(mutated source, what was done): 1-6 statement mutations of `source`, or (one
    time in ten) a few lines deleted, duplicated or re-indented as text."""
    if rng.random() < 0.1:
        lines = source.splitlines()
        for _ in range(rng.randrange(1, 4)):
            if not lines:
                break
            i = rng.randrange(len(lines))
            op = rng.randrange(3)
            if op == 0:
                del lines[i]
            elif op == 1:
                lines.insert(i, lines[i])
            else:
                lines[i] = "    " + lines[i]
        return "\n".join(lines) + "\n", "text"
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError):
        return source, "unparsed"
    ops = [_mutate_once(rng, tree, donors) for _ in range(rng.randrange(1, 7))]
    for block in _blocks(tree):
        if not block:
            block.append(ast.Pass())
    ast.fix_missing_locations(tree)
    try:
        return ast.unparse(tree) + "\n", "+".join(ops)
    except (ValueError, AttributeError, TypeError, RecursionError):
        return source, "unparse-failed"


# -- generated programs ------------------------------------------------------------------


def _gen_block(rng: random.Random, depth: int, names: list[str]) -> list[str]:
    out: list[str] = []
    for _ in range(rng.randrange(1, 6)):
        r = rng.random()
        if depth < 3 and r < 0.3:
            head = rng.choice(
                [
                    f"if {rng.choice(CONDITIONS)}:",
                    "for step, (x, y) in enumerate(loader):",
                    f"with {rng.choice(CONTEXTS)}:",
                    f"while {rng.choice(CONDITIONS)}:",
                    "try:",
                ]
            )
            out.append(head)
            out += ["    " + s for s in _gen_block(rng, depth + 1, names)]
            if head.startswith("if") and rng.random() < 0.6:
                if rng.random() < 0.5:
                    out.append(f"elif {rng.choice(CONDITIONS)}:")
                    out += ["    " + s for s in _gen_block(rng, depth + 1, names)]
                out.append("else:")
                out += ["    " + s for s in _gen_block(rng, depth + 1, names)]
            if head == "try:":
                out.append("except Exception:")
                out += ["    " + s for s in _gen_block(rng, depth + 1, names)]
        elif r < 0.4 and names:
            name = rng.choice(names)
            call = f"{name}(x, parts, rank, world)"
            out.append(rng.choice([f"x = {call}", f"loss = {call}", call, f"return {call}"]))
        else:
            out.append(rng.choice(ATOMS))
    return out


def generated(rng: random.Random, n_files: int = 1) -> dict[str, str]:
    """A generated program: `n_files` files of functions, methods and an autograd
    Function, calling each other (and across files, through imports) at random."""
    files: dict[str, str] = {}
    for k in range(n_files):
        names = [f"f{k}_{i}" for i in range(rng.randrange(1, 5))]
        lines = [_HEADER]
        if k:
            lines.append(f"from .m{k - 1} import *  # noqa\nfrom . import m{k - 1}\n")
        for name in names:
            deco = rng.choice(["", "@torch.no_grad()\n", "@staticmethod\n"])
            lines.append(f"{deco}def {name}(x, parts, rank, world):")
            lines += ["    " + s for s in _gen_block(rng, 1, names)]
            lines.append("")
        lines.append(f"class Layer{k}(torch.autograd.Function):")
        for meth in ("forward", "backward"):
            lines.append("    @staticmethod")
            lines.append(f"    def {meth}(ctx, x, parts=None, rank=0, world=1):")
            lines += ["        " + s for s in _gen_block(rng, 2, names)]
        lines.append(f"\nclass Trainer{k}:")
        for meth in ("helper", "training_step", "train"):
            lines.append(f"    def {meth}(self, x, parts=None, rank=0, world=1):")
            lines += ["        " + s for s in _gen_block(rng, 2, [f"self.{m}" for m in names])]
        files[f"m{k}.py"] = "\n".join(lines) + "\n"
    return files


# -- running ------------------------------------------------------------------------------


def project_sources() -> list[str]:
    """The training files of this repository the fuzz starts from."""
    paths = sorted((ROOT / "tests" / "support" / "lint_cases").rglob("*.py"))
    paths += sorted((ROOT / "examples").glob("*.py"))
    return [p.read_text() for p in paths]


def _snippets_of_docs() -> list[str]:
    import re

    doc = ROOT / "docs" / "lint.md"
    if not doc.exists():
        return []
    return [textwrap.dedent(b) for b in re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)]


def _check_one(fuzz: Fuzz, source: str) -> None:
    fuzz.modules += 1
    try:
        found = lint_source(source, "fuzz.py")
    except Exception:
        fuzz.crashes.append(Crash(source=source, error=traceback.format_exc(limit=-3)))
        return
    for f in found:
        fuzz.findings[f.code] += 1
        if f.code == "WB001":
            fuzz.crashes.append(Crash(source=source, error=f.message))


def _check_tree(fuzz: Fuzz, files: dict[str, str]) -> None:
    fuzz.modules += len(files)
    fuzz.trees += 1
    with tempfile.TemporaryDirectory() as tmp:
        pkg = Path(tmp, "pkg")
        pkg.mkdir()
        (pkg / "__init__.py").write_text("")
        for name, text in files.items():
            (pkg / name).write_text(text)
        try:
            found, _ = lint_paths([pkg])
        except Exception:
            joined = "\n".join(f"# {n}\n{t}" for n, t in files.items())
            fuzz.crashes.append(Crash(source=joined, error=traceback.format_exc(limit=-3)))
            return
    for f in found:
        fuzz.findings[f.code] += 1
        if f.code == "WB001":
            fuzz.crashes.append(Crash(source="\n".join(files.values()), error=f.message))


def run(n: int, seed: int, sources: Sequence[str], *, stop: bool = False) -> Fuzz:
    """Lint `n` modules made from `sources`: about 70% mutants of them (single files),
    20% generated single files, 10% generated packages of 2-4 files (each file counts);
    `stop`: return at the first crash."""
    rng = random.Random(seed)
    fuzz = Fuzz()
    parsed: list[ast.Module] = []
    for s in sources:
        try:
            parsed.append(ast.parse(s))
        except (SyntaxError, ValueError, RecursionError):
            continue
    donors = [st for tree in parsed for st in ast.walk(tree) if isinstance(st, ast.stmt)]
    donors = rng.sample(donors, min(len(donors), 5000))
    while fuzz.modules < n and not (stop and fuzz.crashes):
        r = rng.random()
        if r < 0.7 and sources:
            text, kind = mutant(rng, rng.choice(sources), donors)
            fuzz.kinds[kind.split("+")[0]] += 1
            _check_one(fuzz, text)
        elif r < 0.9:
            fuzz.kinds["generated"] += 1
            _check_one(fuzz, generated(rng)["m0.py"])
        else:
            fuzz.kinds["package"] += 1
            _check_tree(fuzz, generated(rng, rng.randrange(2, 5)))
    return fuzz


def _corpus_sources(root: Path, limit: int, rng: random.Random) -> Iterator[str]:
    files = sorted(root.rglob("*.py"))
    rng.shuffle(files)
    kept = 0
    for f in files:
        if kept >= limit:
            return
        try:
            text = f.read_text()
        except (OSError, UnicodeDecodeError):
            continue
        if 200 < len(text) < 40_000:  # keep each module quick to lint
            kept += 1
            yield text


def main(argv: list[str] | None = None) -> int:
    """Run the fuzz; returns 1 if anything crashed."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lint_fuzz")
    parser.add_argument("-n", type=int, default=10_000, help="modules to lint (default 10000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", type=Path, help="also mutate the .py files under this folder")
    parser.add_argument("--corpus-files", type=int, default=400, help="files taken from --root")
    parser.add_argument("--show", type=int, default=3, help="crashes printed in full")
    args = parser.parse_args(argv)
    os.environ.pop("WHOLEBATCH_LINT_RAISE", None)
    sources = project_sources() + _snippets_of_docs()
    if args.root is not None:
        sources += list(_corpus_sources(args.root, args.corpus_files, random.Random(args.seed)))
    t0 = time.perf_counter()
    fuzz = run(args.n, args.seed, sources)
    dt = time.perf_counter() - t0
    print(f"sources        {len(sources)} files")
    print(f"modules        {fuzz.modules} linted ({fuzz.trees} generated packages), {dt:.1f} s")
    print(f"made by        {dict(fuzz.kinds.most_common())}")
    print(f"findings       {dict(sorted(fuzz.findings.items()))}")
    print(f"crashes        {len(fuzz.crashes)}")
    for c in fuzz.crashes[: args.show]:
        print("-" * 60)
        print(c.error)
        print(c.source[:3000])
    return 1 if fuzz.crashes else 0


if __name__ == "__main__":
    raise SystemExit(main())
