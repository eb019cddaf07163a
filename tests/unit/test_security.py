"""No pickle in collective paths: no `*_object` collectives, no pickle loads, torch.load weights-only."""

from __future__ import annotations

import ast
from pathlib import Path

import wholebatch

PKG = Path(wholebatch.__file__).resolve().parent


def _offences(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        attr = node.func.attr
        owner = node.func.value.id if isinstance(node.func.value, ast.Name) else ""
        if attr.endswith(("_object", "_object_list")):
            found.append(f"{owner}.{attr} (pickles its payload)")
        elif owner in ("pickle", "cPickle", "dill") and attr in ("load", "loads"):
            found.append(f"{owner}.{attr}")
        elif owner == "torch" and attr == "load":
            kw = {k.arg: k.value for k in node.keywords}
            weights_only = kw.get("weights_only")
            if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                found.append(f"torch.load without weights_only=True (line {node.lineno})")
    return found


def test_no_pickle_in_the_package() -> None:
    offenders = {}
    for path in sorted(PKG.rglob("*.py")):
        found = _offences(ast.parse(path.read_text()))
        if found:
            offenders[str(path.relative_to(PKG))] = found
    assert not offenders, f"pickle-based calls in the package: {offenders}"


def test_the_check_can_fail() -> None:
    bad = "import torch, torch.distributed as dist\ndist.all_gather_object(out, x)\ntorch.load(p)\n"
    assert len(_offences(ast.parse(bad))) == 2
