"""PEP 562 lazy attributes for the package `__init__` modules: each name loads on first use.

A package writes its public names ONCE, as the imports of its
`if TYPE_CHECKING:` block (what mypy and IDEs read), each re-exported
explicitly:

    if TYPE_CHECKING:
        from wholebatch import losses as losses                # a subpackage
        from wholebatch.losses.contrastive import clip_loss as clip_loss

    _LAZY, __all__, __getattr__, __dir__ = lazy_package(globals())

`lazy_package` reads that block from the package's own source (`ast`, no
import) and builds the name -> module table, `__all__` and the PEP 562 hooks
from it: nothing to keep in step by hand. Standard library only, so
`import wholebatch` (and `wholebatch.lint`) stays torch-free.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_attributes", "lazy_package", "type_checking_imports"]


def type_checking_imports(source: str, package: str | None = None) -> dict[str, str]:
    """Name -> module for the imports of the module's top-level `if TYPE_CHECKING:` blocks.

    `from M import a as a` maps `a` to `M` (the attribute or submodule `a` of
    `M`; a rename `a as b` is refused: the name a user sees is the name
    defined); `from package import sub as sub` maps `sub` to the subpackage
    `package.sub`; `import M as b` maps `b` to the module `M` itself.
    """
    table: dict[str, str] = {}
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.If) and _is_type_checking(node.test)):
            continue
        for stmt in node.body:
            if isinstance(stmt, ast.ImportFrom) and stmt.module and stmt.level == 0:
                for alias in stmt.names:
                    if alias.asname not in (None, alias.name):
                        raise ImportError(
                            f"lazy names: 'from {stmt.module} import {alias.name} as "
                            f"{alias.asname}' renames; export a name under its own name"
                        )
                    sub = stmt.module == package
                    table[alias.name] = f"{package}.{alias.name}" if sub else stmt.module
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    table[alias.asname or alias.name.split(".")[0]] = alias.name
    return table


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def lazy_attributes(
    package: str, table: dict[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """(`__getattr__`, `__dir__`) for `package`, whose public names live in the modules of `table`.

    `table` maps a name to the module that defines it; a name that is its
    module's last component (`checkpoint`, `losses`) is the module itself. A
    loaded name is stored in `namespace` (the package's globals), so later
    lookups skip `__getattr__`.
    """

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if module.rsplit(".", 1)[-1] == name:
            value = importlib.import_module(module)
        else:
            loaded = importlib.import_module(module)
            try:
                value = getattr(loaded, name)
            except AttributeError:  # a submodule its package does not import itself
                value = importlib.import_module(f"{module}.{name}")
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *table})

    return __getattr__, __dir__


def lazy_package(
    namespace: dict[str, Any],
) -> tuple[dict[str, str], list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """(`_LAZY`, `__all__`, `__getattr__`, `__dir__`) of the package whose globals are `namespace`.

    The table comes from the package's `if TYPE_CHECKING:` imports
    (`type_checking_imports`); `__all__` is its names plus `__version__` where
    the package defines one.
    """
    with open(namespace["__file__"], encoding="utf-8") as f:
        source = f.read()
    table = type_checking_imports(source, namespace["__name__"])
    names = sorted(table) + (["__version__"] if "__version__" in namespace else [])
    getattr_, dir_ = lazy_attributes(namespace["__name__"], table, namespace)
    return table, names, getattr_, dir_
