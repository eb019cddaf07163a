"""The package's layering (DESIGN.md, "Layers"), enforced from the imports.

Two checks: a static one that reads every module's imports (including those inside
functions) and fails when a layer imports one above it; and a run-time one that the
torch-free entry points (`import wholebatch`, `import wholebatch.lint`, the
`wholebatch lint` command, the flake8 plugin) leave torch out of `sys.modules`.
Both are mutation-tested: an upward import and a torch import are rejected.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import wholebatch

PKG = Path(wholebatch.__file__).parent

# Lower number = lower layer. A module may import its own layer and any lower one.
# `lint` stands apart: it may import only `errors` and itself (and never torch).
LAYERS: dict[str, int] = {
    "errors": 0,
    "conventions": 0,
    "_lazy": 0,
    "meter": 0,
    "comm": 1,
    "losses": 2,
    "train": 3,
    "verify": 4,
    "testing": 4,
    "plan": 4,
    "planner": 4,
    "integrations": 5,
    "cli": 6,
}
TOP = {"__init__", "__main__"}  # the package's front door may name every layer


def layer_of(module: str) -> str:
    """`wholebatch.comm.groups` -> `comm`; `wholebatch` -> `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports_of(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """Every absolute module name `source` imports, anywhere in the file, with its line."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append((node.lineno, name))
            # `from wholebatch import losses` imports the subpackage, and
            # `from wholebatch import clip_loss` the module the lazy name lives in.
            if name == "wholebatch":
                lazy = wholebatch._LAZY
                for a in node.names:
                    if a.name in lazy:
                        out.append((node.lineno, lazy[a.name]))
                    elif (PKG / a.name).is_dir() or a.name in LAYERS:
                        out.append((node.lineno, f"wholebatch.{a.name}"))
    return out


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """Imports in `source` (module `module`) that break the layering, as readable lines."""
    here = layer_of(module)
    found: list[str] = []
    for line, name in imports_of(source, module, is_package):
        top = name.split(".")[0]
        if here == "lint":
            if top == "torch" or (
                top == "wholebatch" and layer_of(name) not in ("lint", "__init__", "errors")
            ):
                found.append(f"{module}:{line} imports {name}: lint must not load torch or a layer")
            continue
        if here in TOP or top != "wholebatch" or name == "wholebatch":
            continue
        there = layer_of(name)
        if there == "lint":
            continue  # the CLI runs the linter; any layer may
        if there not in LAYERS or here not in LAYERS:
            found.append(f"{module}:{line} imports {name}: unknown layer (add it to LAYERS)")
        elif LAYERS[there] > LAYERS[here]:
            found.append(f"{module}:{line} imports {name}: `{here}` sits below `{there}`")
    return found


def package_modules() -> list[tuple[str, Path]]:
    mods = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods.append((".".join(parts), path))
    return mods


def test_no_layer_imports_a_higher_one() -> None:
    problems: list[str] = []
    for module, path in package_modules():
        problems += violations(path.read_text(), module, path.name == "__init__.py")
    assert not problems, "\n".join(problems)


def test_every_subpackage_is_a_known_layer() -> None:
    subpackages = {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()}
    assert subpackages - {"lint"} <= set(LAYERS), subpackages - set(LAYERS)
    assert {"comm", "losses", "train", "verify", "integrations", "cli", "lint"} <= subpackages


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("wholebatch.comm.collectives", "from wholebatch.losses import clip_loss\n"),
        ("wholebatch.comm.groups", "def f():\n    import wholebatch.train.cache\n"),
        ("wholebatch.losses.contrastive", "from wholebatch import train\n"),
        ("wholebatch.train.cache", "from ..verify import runner\n"),
        ("wholebatch.lint.engine", "import torch\n"),
        ("wholebatch.lint.rules", "from wholebatch.comm import all_gather\n"),
        ("wholebatch.lint.rules", "from wholebatch import all_gather\n"),
        ("wholebatch.comm.groups", "from wholebatch import CachedStep\n"),
    ],
)
def test_mutation_upward_import_is_caught(module: str, source: str) -> None:
    assert violations(source, module), f"{source!r} in {module} should break the layering"


def test_downward_imports_are_fine() -> None:
    assert not violations("from wholebatch.comm import all_gather\n", "wholebatch.losses.tiles")
    assert not violations("from wholebatch.errors import WholebatchError\n", "wholebatch.lint.cli")
    assert not violations("from . import collectives\n", "wholebatch.comm", is_package=True)


TORCH_FREE = {
    "import wholebatch": "import wholebatch",
    "import wholebatch.lint": "import wholebatch.lint",
    "wholebatch lint": (
        "import sys; from wholebatch.cli import main\n"
        "try:\n    main(['lint', '--help'])\nexcept SystemExit:\n    pass\n"
        "import wholebatch.lint; wholebatch.lint.lint_source('import torch\\nx = 1\\n', 'x.py')"
    ),
    "flake8 plugin": (
        "import ast; from wholebatch.lint.flake8 import Plugin\n"
        "list(Plugin(ast.parse('x = 1\\n'), 'x.py', ['x = 1\\n']).run())"
    ),
    "version": "import wholebatch; wholebatch.__version__; dir(wholebatch)",
    "wholebatch plan": (
        "from wholebatch.cli import main\n"
        "assert main(['plan', '--world', '65536', '--batch', '1048576', '--json']) == 0"
    ),
    "wholebatch plan --mesh": (
        "from wholebatch.cli import main\n"
        "assert main(['plan', '--mesh', 'dp=2,tp=2,cp=1,pp=1', '--loss', 'tokens', '--json']) == 0"
    ),
}


@pytest.mark.parametrize("entry", sorted(TORCH_FREE))
def test_torch_free_entry_points_never_load_torch(entry: str) -> None:
    code = TORCH_FREE[entry] + "\nimport sys\nprint('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "False", f"{entry} loaded torch"


def test_mutation_torch_check_can_fail() -> None:
    code = "import wholebatch; wholebatch.clip_loss\nimport sys\nprint('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "True"


def test_lazy_names_match_all_and_resolve() -> None:
    assert sorted(wholebatch.__all__) == sorted(["__version__", *wholebatch._LAZY])
    for name in wholebatch.__all__:
        assert getattr(wholebatch, name) is not None, name
    assert set(dir(wholebatch)) >= set(wholebatch.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = wholebatch.nope  # type: ignore[attr-defined]


def test_wholebatch_lints_its_own_source_clean() -> None:
    """The package passes its own linter (deliberate mistakes in demos carry a `# noqa`)."""
    from wholebatch.lint import lint_paths

    findings, files = lint_paths([PKG])
    assert files > 40
    assert not findings, "\n".join(f"{f.path}:{f.line}: {f.code} {f.message}" for f in findings)


def test_subpackages_load_on_attribute_access() -> None:
    """`import wholebatch as wb; wb.losses.clip_loss` works: the namespaces load like the names."""
    code = (
        "import sys, wholebatch as wb\n"
        "assert 'torch' not in sys.modules\n"
        "print(wb.losses.clip_loss.__module__, wb.train.checkpoint.__name__, wb.lint.__name__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split() == [
        "wholebatch.losses.contrastive",
        "wholebatch.train.checkpoint",
        "wholebatch.lint",
    ]
    for pkg in ("comm", "losses", "train", "verify", "planner", "integrations", "lint", "cli"):
        assert pkg in wholebatch.__all__, pkg


def test_lazy_table_is_read_from_the_type_checking_imports() -> None:
    from wholebatch._lazy import type_checking_imports

    src = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from wholebatch import losses as losses\n"
        "    from wholebatch.losses.contrastive import clip_loss as clip_loss\n"
        "from wholebatch.errors import WholebatchError\n"  # outside the block: not exported
    )
    assert type_checking_imports(src, "wholebatch") == {
        "losses": "wholebatch.losses",
        "clip_loss": "wholebatch.losses.contrastive",
    }
    # A renamed export would make the user-facing name differ from the defined one.
    renamed = "if TYPE_CHECKING:\n    from wholebatch.losses import clip_loss as clip\n"
    with pytest.raises(ImportError, match="renames"):
        type_checking_imports(renamed)


def test_no_function_in_the_package_is_over_100_lines() -> None:
    """Long functions hide the decisions they make (CONTRIBUTING.md, "Style")."""
    long = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > 100:
                    long.append(f"{path.relative_to(PKG)}:{node.name} ({lines} lines)")
    assert not long, long


def test_every_test_file_sits_in_a_tier() -> None:
    """A test file left flat in tests/ would escape `make test-fast` and the tier markers."""
    tests = Path(__file__).resolve().parents[1]
    flat = sorted(p.name for p in tests.glob("test_*.py"))
    assert not flat, f"move {flat} into one of tests/unit, tests/distributed, tests/e2e"
    for tier in ("unit", "distributed", "e2e"):
        assert list((tests / tier).glob("test_*.py")), tier
    support = sorted(p.name for p in (tests / "support").glob("test_*.py"))
    assert not support, f"tests/support holds no tests: {support}"


# FSDP and DTensor cost ~1.2 s to import (`torch.distributed.tensor` pulls in sympy): the
# engines and verify test isinstance against them only once someone else loaded them
# (`train.wrappers.loaded_class`: an FSDP module or a DTensor exists only after that).
_HEAVY_TORCH = ("torch.distributed.fsdp", "torch.distributed.tensor", "sympy")
_LOADS = "import wholebatch.train, wholebatch.verify.runner, wholebatch.verify.worker, wholebatch.losses\n"


def _heavy_loaded(code: str) -> list[str]:
    code += f"import sys\nprint([m for m in {_HEAVY_TORCH!r} if m in sys.modules])"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_engines_and_verify_leave_fsdp_and_dtensor_unloaded() -> None:
    assert _heavy_loaded(_LOADS) == []
    # mutation: a top-level import of FSDP in the engines' modules is seen
    assert "torch.distributed.fsdp" in _heavy_loaded("import torch.distributed.fsdp\n" + _LOADS)


def test_wrapper_detection_sees_fsdp_and_dtensor_once_loaded() -> None:
    code = (
        "import torch, torch.distributed as dist\n"
        "from wholebatch.train import wrappers\n"
        "m = torch.nn.Linear(2, 2)\n"
        "assert wrappers.fsdp2_class() is None and wrappers.fsdp_modules(m) == []\n"
        "assert not wrappers.is_dtensor(torch.ones(1))\n"
        "from torch.distributed.fsdp import FSDPModule\n"
        "from torch.distributed.tensor import DTensor\n"
        "assert wrappers.fsdp2_class() is FSDPModule and wrappers.dtensor_class() is DTensor\n"
        "import tempfile\n"
        "store = dist.FileStore(tempfile.mktemp(), 1)\n"
        "dist.init_process_group('gloo', store=store, rank=0, world_size=1)\n"
        "from torch.distributed.fsdp import fully_shard\n"
        "s = fully_shard(torch.nn.Linear(2, 2))\n"
        "assert wrappers.fsdp_modules(s) == [s] and wrappers.grad_sync_mode(s) == 'fsdp2'\n"
        "assert wrappers.is_dtensor(s.weight) and wrappers.is_sharded(s.weight)\n"
        "dist.destroy_process_group()\n"
        "assert wrappers.loaded_class('torch.nn', 'no_such_class') is None\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().endswith("ok"), out.stderr[-2000:]
