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

- `zero-labels-ignored` (WB301; LLaMA-Adapter's gorilla/finetune, here in one file): a
  model whose forward returns `self.criterion(...)`, a `CrossEntropyLoss(ignore_index=0)`
  built in `__init__`, called through an FSDP wrapper by position (`model(examples,
  labels)`), in a script whose dataset writes 0 into the prompt's and padding's labels:
  the loss is a mean over this micro-batch's answer tokens, divided by the steps. The
  good twin writes no 0 into labels (fixed-length blocks): its `ignore_index=0` masks
  nothing the file shows. (Across files, the loop's module linted before the script that
  gives it the model, the real case is still missed.)

    PYTHONPATH=src .venv/bin/python -m pytest tests/unit/test_lint_pinned_trainer_twins.py -q
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.lint_twins import check_twin, twin_tests
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


_FINETUNE = """
import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.utils.data import Dataset


class MetaModel(nn.Module):
    def __init__(self, dim, vocab):
        super().__init__()
        self.head = nn.Linear(dim, vocab)
        self.criterion = torch.nn.CrossEntropyLoss(ignore_index=0)

    def forward(self, examples, labels):
        logits_BTV = self.head(examples)[:, :-1, :]
        labels = labels[:, 1:]
        c_loss = self.criterion(logits_BTV.reshape(-1, logits_BTV.shape[-1]), labels.flatten())
        return c_loss, c_loss * 0


class FinetuneDataset(Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        prompt, answer = self.items[i]
        example = torch.cat([prompt, answer])
        labels = example.clone()
        {labels}
        return example, labels


def train_one_epoch(model, data_loader, optimizer, accum_iter):
    for step, (examples, labels) in enumerate(data_loader):
        c_loss, m_loss = model(examples, labels)
        loss = c_loss + m_loss * 0
        loss /= accum_iter{mark}
        loss.backward()
        if (step + 1) % accum_iter == 0:
            optimizer.step()
            optimizer.zero_grad()


def main(items, dim, vocab, accum_iter):
    model = MetaModel(dim, vocab)
    model = FSDP(model, use_orig_params=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = torch.utils.data.DataLoader(FinetuneDataset(items), batch_size=4)
    train_one_epoch(model, loader, optimizer, accum_iter)
"""
_ZEROED = "labels[: len(prompt)] = -1\n        labels[~labels.ge(0)] = 0"

TWINS: dict[str, tuple[Twin, Twin]] = {
    "zero-labels-ignored": (
        {"finetune.py": _FINETUNE.format(labels=_ZEROED, mark="  # expect: WB301")},
        {"finetune.py": _FINETUNE.format(labels="labels = labels.long()", mark="")},
    ),
    "hf-trainer-pinned-before-4-46": (
        _pinned("transformers==4.37.2", "  # expect: WB301"),
        _pinned("transformers==4.46.0", ""),
    ),
}
test_twin_is_judged_as_marked, test_each_kind_has_a_bad_and_a_good_twin = twin_tests(TWINS)


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
