"""Each integration module imports without its peer; where the peer is needed, the error names it."""

from __future__ import annotations

import subprocess
import sys

import pytest

MODULES = ["open_clip", "lightly", "huggingface", "lightning", "trl", "deepspeed"]
PEERS = (
    "open_clip",
    "open_clip_train",
    "lightly",
    "transformers",
    "accelerate",
    "lightning",
    "pytorch_lightning",
    "trl",
    "deepspeed",
)


def _python(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("name", MODULES)
def test_imports_without_loading_its_peer(name: str) -> None:
    # A `None` entry in sys.modules makes `import transformers` (etc.) fail: peers "absent".
    code = (
        "import sys\n"
        f"for peer in {PEERS!r}:\n"
        "    sys.modules[peer] = None\n"
        f"import wholebatch.integrations.{name} as m\n"
        "print(sorted(m.__all__))"
    )
    assert _python(code).startswith("[")


def test_trainer_without_transformers_names_the_package() -> None:
    code = (
        "import sys\nsys.modules['transformers'] = None\n"
        "from wholebatch.integrations import huggingface\n"
        "try:\n    huggingface.WholeBatchTrainer\n"
        "except ImportError as e:\n    print(e)\n"
    )
    msg = _python(code)
    assert "WholeBatchTrainer needs the `transformers` package" in msg
    assert "pip install transformers" in msg


def test_mutation_a_peer_import_at_the_top_is_caught() -> None:
    # The same check fails for a module that imports its peer: the test can fail.
    code = "import sys\nsys.modules['transformers'] = None\nimport transformers"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "ModuleNotFoundError" in out.stderr


def test_lightning_callback_without_lightning_names_the_package() -> None:
    code = (
        "import sys\nsys.modules['lightning'] = None\n"
        "from wholebatch.integrations.lightning import WholeBatchAccumulation\n"
        "try:\n    WholeBatchAccumulation()\n"
        "except ImportError as e:\n    print(e)\n"
    )
    msg = _python(code)
    assert "WholeBatchAccumulation needs the `lightning` package" in msg
