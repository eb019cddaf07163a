"""Bad and good twins of corpus 4's WB301 kinds through Hugging Face's Trainer (issue 33;
the evaluation half of benchmarks/lint_corpus4.toml, now tuning data), written for these
tests: each twin is a small tree of files, linted as a folder; a line ending in
`# expect: WBnnn` must be flagged with that code, and nothing else may be.

- `copied-labels-blocks` (WB301, fact `hf-trainer-before-4-46`): a causal LM script
  under a transformers pinned below 4.46 groups its texts into blocks of one length and
  copies its labels from the input ids (`result["labels"] = result["input_ids"].copy()`),
  collated by `default_data_collator`: every micro-batch counts the same tokens, so the
  Trainer's division by the steps is exact, though a package of the run it imports
  masks labels (`-100`) for its own prompts. The lint of 161f3c0 reports the good twin
  (a false alarm: the mask of another file read as this script's); the bad twin's
  script pads its own labels with `label_pad_token_id=-100` (a varying count) and is
  reported by both.
- `forward-without-kwargs` (WB301, fact `hf-trainer-compute-loss`): a plain
  `Trainer(model=model, ...)` of an unpinned transformers trains a model class of the
  run (`model = ToyForCausalLM.from_pretrained(path)`) whose `forward` computes its own
  `CrossEntropyLoss()` mean from `labels` and takes no `**kwargs`, on labels the run
  masks with `-100`, the steps read from the command line: whatever the version the
  Trainer passes such a forward no `num_items_in_batch` and divides its per-micro-batch
  mean by the steps. The lint of 161f3c0 misses the bad twin; the good twin's forward
  takes `**kwargs` (so a 4.46 Trainer gives it the step's count).
- `transformers-model-unpinned` (WB301, fact `hf-trainer-compute-loss`): the same run,
  its model chosen at run time between the class of the run and transformers'
  `AutoModelForCausalLM` (a value assigned on one branch of an `if` may be the one the
  Trainer gets, as the linter's dataflow reads branches). The lint of 161f3c0 misses the
  bad twin; the good twin builds only the unvendored transformers class under an
  unpinned transformers (today's Trainer gives it `num_items_in_batch`: no table of
  transformers' classes by version is kept).
- `subclass-forward-without-kwargs` (WB301, fact `hf-trainer-compute-loss`): as
  `forward-without-kwargs`, through a direct subclass of the Trainer in the script
  (`LoggingTrainer(Trainer)`, its `log` its own, no `compute_loss`), reported at its
  `class` line as the pinned Trainer's subclasses are. The lint of 161f3c0 misses the
  bad twin; the good twin's forward takes `**kwargs`.
- `one-step-run-model` (WB301, fact `hf-trainer-compute-loss`): the bad twin is
  `forward-without-kwargs`'s (missed by the lint of 161f3c0); the good twin's script
  builds its own `TrainingArguments(output_dir, ...)` that leaves
  `gradient_accumulation_steps` at 1: nothing is accumulated or divided.

    PYTHONPATH=src .venv/bin/python -m pytest tests/unit/test_lint_loss_kwargs_twins.py -q
"""

from __future__ import annotations

from benchmarks.lint_twins import twin_tests

Twin = dict[str, str]

_PIN = "transformers==4.37.2\ntorch\n"

_LIB_INIT = "from lib.prompts import prompt_labels\n"

_LIB_PROMPTS = """
def prompt_labels(input_ids, prompt_len):
    labels = input_ids.clone()
    labels[:, :prompt_len] = -100
    return labels
"""

_BLOCKS = """
from itertools import chain

from transformers import Trainer, TrainingArguments{imports}

from lib import prompt_labels

BLOCK = 1024


def group_texts(examples):
    joined = {{k: list(chain(*examples[k])) for k in examples}}
    total = len(joined["input_ids"]) // BLOCK * BLOCK
    result = {{k: [t[i : i + BLOCK] for i in range(0, total, BLOCK)] for k, t in joined.items()}}
    result["labels"] = result["input_ids"].copy()
    return result


def main(model, tokenizer, raw, output_dir, steps):
    blocks = raw.map(group_texts, batched=True)
    args = TrainingArguments(output_dir, gradient_accumulation_steps=steps)
    trainer = Trainer({mark}
        model=model, args=args, train_dataset=blocks, data_collator={collator}
    )
    trainer.train()
"""


def _blocks(collator: str, imports: str, mark: str) -> Twin:
    return {
        "requirements.txt": _PIN,
        "lib/__init__.py": _LIB_INIT,
        "lib/prompts.py": _LIB_PROMPTS,
        "train.py": _BLOCKS.format(collator=collator, imports=imports, mark=mark),
    }


_TOY_MODEL = """
from torch.nn import CrossEntropyLoss, Linear
from transformers import PreTrainedModel


class ToyForCausalLM(PreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.head = Linear(config.hidden_size, config.vocab_size)

    def forward(self, input_ids, attention_mask=None, labels=None{kwargs}):
        logits = self.head(self.embed(input_ids))
        loss = None
        if labels is not None:
            shift_logits = logits[..., :-1, :].reshape(-1, logits.size(-1))
            loss = CrossEntropyLoss()(shift_logits, labels[..., 1:].reshape(-1))
        return (loss, logits) if loss is not None else (logits,)
"""

_PROMPTS = """
IGNORE_INDEX = -100


def build_example(tokenizer, prompt, answer):
    prompt_ids = tokenizer.encode(prompt)
    answer_ids = tokenizer.encode(answer)
    return {{"input_ids": prompt_ids + answer_ids, "labels": [IGNORE_INDEX] * len(prompt_ids) + answer_ids}}
"""

_SFT = """
from transformers import (
    AutoModelForCausalLM,
    DataCollatorForSeq2Seq,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
)

from data import build_example
from models.toy import ToyForCausalLM


def main(tokenizer, raw, path, output_dir, vendored):
{args}
{build}
    train = raw.map(lambda r: build_example(tokenizer, r["prompt"], r["answer"]))
    trainer = Trainer({mark}
        model=model, args=args, train_dataset=train, data_collator=DataCollatorForSeq2Seq(tokenizer)
    )
    trainer.train()
"""


# How the script builds its model: a class of the run, an unvendored transformers class,
# or either, chosen at run time (a value assigned on one branch may be the one read).
_RUN_CLASS = "    model = ToyForCausalLM.from_pretrained(path)"
_AUTO_CLASS = "    model = AutoModelForCausalLM.from_pretrained(path)"
_EITHER_CLASS = """    if vendored:
        model = ToyForCausalLM.from_pretrained(path)
    else:
        model = AutoModelForCausalLM.from_pretrained(path)"""

# The steps read from the command line, or left at one step by the script itself.
_PARSED = "    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()"
_ONE_STEP = "    args = TrainingArguments(output_dir, per_device_train_batch_size=4)"


def _sft(kwargs: str, mark: str, build: str = _RUN_CLASS, args: str = _PARSED) -> Twin:
    return {
        "requirements.txt": "transformers\ntorch\n",
        "models/__init__.py": "",
        "models/toy.py": _TOY_MODEL.format(kwargs=kwargs),
        "data.py": _PROMPTS.format(),
        "train.py": _SFT.format(mark=mark, build=build, args=args),
    }


_SUBCLASS = """
from transformers import HfArgumentParser, Trainer, TrainingArguments

from data import build_example
from models.toy import ToyForCausalLM


class LoggingTrainer(Trainer):{mark}
    def log(self, logs, *args, **kwargs):
        logs["lr"] = self.lr_scheduler.get_last_lr()[0]
        super().log(logs, *args, **kwargs)


def main(tokenizer, raw, path):
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    model = ToyForCausalLM.from_pretrained(path)
    train = raw.map(lambda r: build_example(tokenizer, r["prompt"], r["answer"]))
    LoggingTrainer(model=model, args=args, train_dataset=train).train()
"""


def _subclass(kwargs: str, mark: str) -> Twin:
    return {**_sft(kwargs, ""), "train.py": _SUBCLASS.format(mark=mark)}


TWINS: dict[str, tuple[Twin, Twin]] = {
    "copied-labels-blocks": (
        _blocks(
            "DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)",
            ", DataCollatorForSeq2Seq",
            "  # expect: WB301",
        ),
        _blocks("default_data_collator", ", default_data_collator", ""),
    ),
    "forward-without-kwargs": (_sft("", "  # expect: WB301"), _sft(", **kwargs", "")),
    "transformers-model-unpinned": (
        _sft("", "  # expect: WB301", build=_EITHER_CLASS),
        _sft("", "", build=_AUTO_CLASS),
    ),
    "subclass-forward-without-kwargs": (
        _subclass("", "  # expect: WB301"),
        _subclass(", **kwargs", ""),
    ),
    "one-step-run-model": (
        _sft("", "  # expect: WB301"),
        _sft("", "", args=_ONE_STEP),
    ),
}
test_twin_is_judged_as_marked, test_each_kind_has_a_bad_and_a_good_twin = twin_tests(TWINS)
