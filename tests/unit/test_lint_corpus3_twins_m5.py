"""Bad and good twins of corpus 3's tuning-half misses, part 5 (issue 33; the WB301 misses
of benchmarks/lint_corpus3.toml), written for these tests: each twin is a small tree of
files, linted as a folder; a line ending in `# expect: WBnnn` must be flagged with that
code, and nothing else may be. The lint of fbad846 misses the bad twin of every kind:

- `hf-trainer-pinned-before-4-46` (WB301; LLaVA's llava_trainer.py): a Trainer subclass
  with the Trainer's own `compute_loss`, in a project whose pyproject.toml pins
  transformers below 4.46, with -100 labels: that Trainer divides the model's own mean
  over this micro-batch's unmasked labels by the steps
  (`frameworks.FACTS["hf-trainer-before-4-46"]`). The good twin pins 4.46, which gives the
  model the step's item count; a plain modern Trainer is never reported.

    PYTHONPATH=src .venv/bin/python -m pytest tests/unit/test_lint_corpus3_twins_m5.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.lint_twins import check_twin
from wholebatch.lint.frameworks import hf_pinned_before_446

Twin = dict[str, str]

_PYPROJECT = """
[project]
name = "vlm"
dependencies = ["torch==2.1.2", "{pin}", "sentence-transformers==2.2.2"]
"""

_TRAINER = """
from transformers import Trainer


class VlmTrainer(Trainer):{mark}
    def _get_train_sampler(self):
        return super()._get_train_sampler()
"""

_DATA = """
import torch

IGNORE_INDEX = -100


def supervised_labels(input_ids, prompt_len):
    labels = input_ids.clone()
    labels[:prompt_len] = IGNORE_INDEX
    return labels
"""

_TRAIN = """
from transformers import TrainingArguments

from vlm.data import supervised_labels
from vlm.trainer import VlmTrainer


def train(model, dataset):
    args = TrainingArguments(output_dir="out", gradient_accumulation_steps=4)
    VlmTrainer(model=model, args=args, train_dataset=dataset).train()
"""


def _pinned(pin: str, mark: str) -> Twin:
    return {
        "pyproject.toml": _PYPROJECT.format(pin=pin),
        "vlm/__init__.py": "",
        "vlm/train/train.py": _TRAIN,  # a folder of the package without __init__.py
        "vlm/trainer.py": _TRAINER.format(mark=mark),
        "vlm/data.py": _DATA,
    }


TWINS: dict[str, tuple[Twin, Twin]] = {
    "hf-trainer-pinned-before-4-46": (
        _pinned("transformers==4.37.2", "  # expect: WB301"),
        _pinned("transformers==4.46.0", ""),
    ),
}
_CASES = [(kind, side) for kind in TWINS for side in ("bad", "good")]


@pytest.mark.parametrize(("kind", "side"), _CASES, ids=[f"{k}-{s}" for k, s in _CASES])
def test_twin_is_judged_as_marked(tmp_path: Path, kind: str, side: str) -> None:
    bad, good = TWINS[kind]
    check_twin(tmp_path, bad if side == "bad" else good, bad=side == "bad")


def test_each_kind_has_a_bad_twin_that_is_flagged_and_a_good_one_that_is_not() -> None:
    for kind, (bad, good) in TWINS.items():
        assert sum(t.count("# expect:") for t in bad.values()), kind
        assert not sum(t.count("# expect:") for t in good.values()), kind


def test_a_modern_trainer_is_not_reported(tmp_path: Path) -> None:
    # no pin at all: the Trainer of today gives the model `num_items_in_batch`
    bad, _ = TWINS["hf-trainer-pinned-before-4-46"]
    unpinned = {k: v.replace("  # expect: WB301", "") for k, v in bad.items()}
    del unpinned["pyproject.toml"]
    check_twin(tmp_path, unpinned, bad=False)


def test_hf_pins_read_below_4_46() -> None:
    """The pins `hf_pinned_before_446` reads (pyproject, requirements, setup.py): an exact
    version or an upper bound below 4.46 is one; a lower bound, a later pin, another
    package whose name ends in `transformers` are not."""
    for text in (
        "transformers==4.37.2",
        '"transformers>=4.30,<4.46",',
        "transformers[torch]~=4.40.0",
        "transformers <= 4.45.2",
        "install_requires=['transformers==4.31.0']",
    ):
        assert hf_pinned_before_446(text), text
    for text in (
        "transformers>=4.37.2",
        "transformers==4.46.0",
        "transformers<4.50",
        "sentence-transformers==2.2.2",
        "transformers",
        "transformers<5.0",
    ):
        assert not hf_pinned_before_446(text), text
