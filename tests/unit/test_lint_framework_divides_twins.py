"""Bad and good twins of frameworks that divide by the accumulation steps with no `/ k`
in the source (issue 33, round 4: corpus 3's WB301 misses), written for these tests: each
twin is a small tree of files, linted as a folder; a line ending in `# expect: WBnnn` must
be flagged with that code, and nothing else may be. The lint of 46bfca3 misses the bad
twin of every kind:

- `mmengine-accumulative-counts` (xtuner's model/sft.py, llava.py): an mmengine
  `BaseModel` whose `forward(mode='loss')` returns `compute_loss`'s dict of losses, its
  `loss` the HF model's mean over this micro-batch's unmasked (-100) labels, in a run
  whose config gives the OptimWrapper `accumulative_counts=16`: `OptimWrapper.
  update_params` divides each micro-batch's loss by 16, a mean of micro-batch means
  (`frameworks.FACTS["mmengine-optim-wrapper"]`). A detached entry whose key holds
  "loss" (`"reduced_loss"`, logged) carries no gradient and is not reported. The good
  twin's config accumulates nothing (`accumulative_counts = 1`).

- `plain-trainer-pinned-before-4-46` (Firefly's train.py, Qwen's finetune.py): the
  transformers `Trainer` class itself (no subclass), in a project whose requirements.txt
  pins 4.34, with -100 labels written by a collator in a folder beside the script that
  has no `__init__.py` (`component/collator.py`, imported as `component.collator`): that
  Trainer divides the model's own mean by the steps
  (`frameworks.FACTS["hf-trainer-before-4-46"]`). The good twin pins 4.46; a Trainer
  whose `TrainingArguments(...)` above it leave the steps at 1 divides nothing.

- `readme-pin` (WizardCoder's README, no pin file naming transformers): an install line
  of the README pins it where every version it names is below 4.46; the good twin's
  README also asks for a later one, so pins nothing.

- `sub-project-pin` (starcoder's chat/, its own requirements.txt): the pin that governs a
  script is the nearest folder's above it that names transformers. The bad twin pins
  4.30 in the sub-project's requirements only (the top of the tree names no
  transformers); the good twin pins 4.28.1 at the top but its sub-project's own
  requirements ask only `transformers>=4.28.1`: unpinned there, never reported.

    PYTHONPATH=src .venv/bin/python -m pytest tests/unit/test_lint_framework_divides_twins.py -q
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.lint_twins import check_twin, twin_tests
from wholebatch.lint.frameworks import Evidence, loss_entries, names_transformers

Twin = dict[str, str]

_CONFIG = """
from mmengine.optim import AmpOptimWrapper
from torch.optim import AdamW

from sft.dataset import encode
from sft.model import SupervisedFinetune

accumulative_counts = {k}
model = dict(type=SupervisedFinetune, llm="internlm2-7b")
train_dataset = dict(type="jsonl", map_fn=encode)
optim_wrapper = dict(
    type=AmpOptimWrapper,
    optimizer=dict(type=AdamW, lr=2e-4),
    accumulative_counts=accumulative_counts,
)
"""

_MODEL = """
from mmengine.model import BaseModel
from transformers import AutoModelForCausalLM


class SupervisedFinetune(BaseModel):
    def __init__(self, llm):
        super().__init__()
        self.llm = AutoModelForCausalLM.from_pretrained(llm)

    def forward(self, data, data_samples=None, mode="loss"):
        if mode == "loss":
            return self.compute_loss(data, data_samples)
        return self.llm(**data)

    def compute_loss(self, data, data_samples=None):
        outputs = self.llm(**data)
        loss_dict = {{"loss": outputs.loss, "reduced_loss": outputs.loss.detach()}}{mark}
        return loss_dict
"""

_MM_DATA = """
IGNORE_INDEX = -100


def encode(prompt_ids, answer_ids):
    input_ids = prompt_ids + answer_ids
    labels = [IGNORE_INDEX] * len(prompt_ids) + answer_ids
    return {"input_ids": input_ids, "labels": labels}
"""


def _mmengine(k: int, mark: str) -> Twin:
    return {
        "configs/sft_config.py": _CONFIG.format(k=k),
        "sft/__init__.py": "",
        "sft/model.py": _MODEL.format(mark=mark),
        "sft/dataset.py": _MM_DATA,
    }


_COLLATOR = """
import torch


class SFTDataCollator:
    def __call__(self, batch):
        input_ids = torch.tensor([x["input_ids"] for x in batch])
        target_mask = torch.tensor([x["target_mask"] for x in batch])
        labels = torch.where(target_mask == 1, input_ids, -100)
        return {"input_ids": input_ids, "labels": labels}
"""

_TRAIN = """
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from component.collator import SFTDataCollator


def build(model_path, dataset):
    model = AutoModelForCausalLM.from_pretrained(model_path)
    args = TrainingArguments(output_dir="out", gradient_accumulation_steps=16)
    trainer = Trainer({mark}
        model=model,
        args=args,
        train_dataset=dataset,
        data_collator=SFTDataCollator(),
    )
    return trainer
"""


def _plain(pin: str, mark: str) -> Twin:
    return {
        "requirements.txt": f"torch\n{pin}\ntransformers_stream_generator\n",
        "train.py": _TRAIN.format(mark=mark),
        "component/collator.py": _COLLATOR,  # no __init__.py
    }


_CHAT_TRAINER = """
from transformers import Trainer


class ChatTrainer(Trainer):{mark}
    def log(self, logs, *args):
        super().log(logs, *args)
"""

_CHAT_TRAIN = """
from dialogues import mask_user_labels
from trainer import ChatTrainer


def train(model, args, dataset):
    ChatTrainer(model=model, args=args, train_dataset=dataset).train()
"""

_DIALOGUES = """
IGNORE_INDEX = -100


def mask_user_labels(labels, user_spans):
    for start, end in user_spans:
        labels[start:end] = [IGNORE_INDEX] * (end - start)
    return labels
"""


def _sub(top: str, own: str, mark: str) -> Twin:
    return {
        "requirements.txt": top,
        "chat/requirements.txt": own,
        "chat/train.py": _CHAT_TRAIN,
        "chat/trainer.py": _CHAT_TRAINER.format(mark=mark),
        "chat/dialogues.py": _DIALOGUES,
    }


def _readme(text: str, mark: str) -> Twin:
    # no pin file names transformers; the README's install line does (WizardCoder's)
    twin = _sub("torch\n", "deepspeed\n", mark)
    twin["chat/README.md"] = text
    return twin


TWINS: dict[str, tuple[Twin, Twin]] = {
    "mmengine-accumulative-counts": (
        _mmengine(16, "  # expect: WB301"),
        _mmengine(1, ""),
    ),
    "plain-trainer-pinned-before-4-46": (
        _plain("transformers==4.34", "  # expect: WB301"),
        _plain("transformers==4.46.0", ""),
    ),
    "readme-pin": (
        _readme("Train with `transformers==4.29.2` and `deepspeed==0.9.2`.\n", "  # expect: WB301"),
        _readme("`pip install transformers==4.31.0`; training needs `transformers>=4.46`.\n", ""),
    ),
    "sub-project-pin": (
        _sub("torch\ndatasets\n", "transformers==4.30.2\ndeepspeed\n", "  # expect: WB301"),
        _sub("transformers==4.28.1\n", "transformers>=4.28.1\ntokenizers\n", ""),
    ),
}
test_twin_is_judged_as_marked, test_each_kind_has_a_bad_and_a_good_twin = twin_tests(TWINS)


def test_an_unpinned_plain_trainer_is_not_reported(tmp_path: Path) -> None:
    # no pin file at all: today's Trainer gives the model `num_items_in_batch`
    bad, _ = TWINS["plain-trainer-pinned-before-4-46"]
    unpinned = {k: v.replace("  # expect: WB301", "") for k, v in bad.items()}
    del unpinned["requirements.txt"]
    check_twin(tmp_path, unpinned, bad=False)


def test_a_trainer_whose_train_is_its_own_loop_is_not_reported(tmp_path: Path) -> None:
    # a subclass whose `train` neither calls `super().train()` nor a step (MeZO's
    # LinearHeadTrainer, a closed-form fit of a linear head): no `training_step` runs
    bad, _ = TWINS["sub-project-pin"]
    own = dict(bad)
    own["chat/trainer.py"] = own["chat/trainer.py"].replace("  # expect: WB301", "") + (
        "\n    def train(self):\n        return self.fit_head(self.train_dataset)\n"
    )
    check_twin(tmp_path, own, bad=False)


def test_a_plain_trainer_of_one_micro_batch_is_not_reported(tmp_path: Path) -> None:
    # `TrainingArguments(gradient_accumulation_steps=1)` (or none given) built above the
    # Trainer: nothing is divided by the steps (Open-Sora-Plan's prompt_refiner/train.py)
    bad, _ = TWINS["plain-trainer-pinned-before-4-46"]
    for steps in ("gradient_accumulation_steps=1", "logging_steps=1"):
        one = {
            k: v.replace("  # expect: WB301", "").replace("gradient_accumulation_steps=16", steps)
            for k, v in bad.items()
        }
        check_twin(tmp_path / steps, one, bad=False)


def test_mmengine_accumulation_read_from_the_config() -> None:
    """`Evidence.mmengine_accumulates`: any `accumulative_counts` but a literal 1 (a
    name whose every assignment is 1 counts as 1; the keyword `accumulative_counts=
    accumulative_counts` is no assignment of it)."""
    for text in (
        "accumulative_counts = 16\noptim_wrapper = dict(accumulative_counts=accumulative_counts)",
        "optim_wrapper = dict(type=OptimWrapper, accumulative_counts=4)",
        "cfg['accumulative_counts'] = args.k",
        "optim_wrapper = dict(accumulative_counts=k)",
    ):
        assert Evidence.of([text]).mmengine_accumulates, text
    for text in (
        "accumulative_counts = 1\noptim_wrapper = dict(accumulative_counts=accumulative_counts)",
        "optim_wrapper = dict(type=OptimWrapper, accumulative_counts=1)",
        "k = cfg.optim_wrapper.get('accumulative_counts', 1)",
    ):
        assert not Evidence.of([text]).mmengine_accumulates, text


def test_mmengine_sums_the_entries_named_loss() -> None:
    """`loss_entries`: mmengine's `parse_losses` sums the entries whose key holds 'loss'."""
    import ast

    d = ast.parse('{"loss": a, "nll_loss": b, "acc": c, "reward_margin": m}').body[0]
    assert isinstance(d, ast.Expr) and isinstance(d.value, ast.Dict)
    assert [ast.unparse(v) for v in loss_entries(d.value)] == ["a", "b"]


def test_transformers_named_in_pin_files() -> None:
    """`names_transformers`: a requirement of transformers, versioned or not, decides its
    folder's pin; other packages with the word in their names do not."""
    for text in ("transformers\n", "transformers>=4.28.1", '"transformers[torch]==4.40"'):
        assert names_transformers(text), text
    for text in ("sentence-transformers==2.2.2", "transformers_stream_generator==0.0.4", ""):
        assert not names_transformers(text), text
