"""PEP 562 lazy attributes for the package `__init__` modules: each name loads on first use.

Standard library only, so `import wholebatch` (and `wholebatch.lint`) stays torch-free.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_attributes(
    package: str, table: dict[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """(`__getattr__`, `__dir__`) for `package`, whose public names live in the modules of `table`.

    `table` maps a name to the module that defines it; a name equal to its
    module's last component (`checkpoint`) is the module itself. A loaded name
    is stored in `namespace` (the package's globals), so later lookups skip
    `__getattr__`.
    """

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        loaded = importlib.import_module(module)
        value = loaded if module.rsplit(".", 1)[1] == name else getattr(loaded, name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *table})

    return __getattr__, __dir__
