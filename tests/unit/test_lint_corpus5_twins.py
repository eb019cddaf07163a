"""Bad and good twins of corpus 5's tuning-half false alarms (issue 33; the tuning half of
benchmarks/lint_corpus5.toml), written for these tests: each twin is a small tree of
files, linted as a folder; a line ending in `# expect: WBnnn` must be flagged with that
code, and nothing else may be.

- `trainer-base-only` (WB301, fact `hf-trainer-before-4-46`; axolotl's `SchedulerMixin`,
  RLAIF-V's `ZephyrTrainer`): under a transformers pinned below 4.46, with -100 labels,
  a subclass of the Trainer that the file names only as a base of its other classes (a
  mixin, never built or handed on) is not a trainer the run trains; its subclasses are.
  The good twin's subclasses compute their own loss (one overrides `compute_loss`, one
  puts TRL's `DPOTrainer` before the mixin's `Trainer` in the method order); the lint
  of f42b872 reports the base (a false alarm). The bad twin's subclass inherits the
  Trainer's loss through the base and is reported at its own `class` line; the lint of
  f42b872 reports the base instead.

- `override-calls-model` (WB301, fact `hf-trainer-compute-loss`; corpus 5's evaluation
  half, tuned on after its judgment: ChatGLM-Tuning's `ModifiedTrainer`, orpo's
  `ORPOTrainer`): a `compute_loss` override that calls the model itself with labels a
  collator of the file pads with -100, reading no `num_items_in_batch` and handing on no
  `**kwargs`, returns the model's mean over this micro-batch's labels in any version of
  transformers; the Trainer backpropagates it once per micro-batch (divided by the steps
  or, from 4.46 where the model takes loss kwargs, not even that). The bad twin is
  reported at its return; the lint of 58c23da reports nothing. The good twin hands its
  `**kwargs` (the step's count, from 4.46) on to the model, unpinned.
- `override-opaque-inputs` (the same fact; FlagEmbedding's rerankers, found by the
  regression run of that change over the earlier corpora): an override that hands the
  model the batch whole (`model(**inputs)`) does not show that the model is given
  labels: a reranker's or a retriever's `loss` is a mean over rows, and the good twin
  is not reported. The bad twin spells them out in a dict literal (`model(**{"input_ids":
  ..., "labels": ...})`, orpo's form), reported where its loss is last assigned.
- `override-kwargs-pinned` (the same fact under a pin below 4.46): there `**kwargs`
  hold no count, so handing them on changes nothing and the bad twin is reported (the
  lint of 58c23da does not); the good twin sums its token losses itself (a sum is
  exact up to one constant).
- Three of a LightningModule whose `training_step` returns the loss of a seq2seq model
  given labels with padding set to -100 while the Trainer accumulates (WB301, fact
  `lightning-accumulation`; flan-alpaca's `training.py`, tuned on after the judgment),
  each bad twin unreported by the lint of c6ce0e6:
  - `lightning-accumulates-unless-debug`: `accumulate_grad_batches=1 if debug else k`
    accumulates (only a literal 1 that is the whole value does not); the good twin
    passes a literal 1.
  - `lightning-first-element-helper`: a helper that assigns the model's first element
    (`loss = outputs[0]`, the loss of a model given labels) and returns that name
    returns a mean, as `return outputs[0]` does; the good twin's helper returns the
    logits' element (`outputs[1]`), no loss.
  - `lightning-fixed-rows-masked-tokens`: `DataLoader(drop_last=True)` fixes the rows of
    a micro-batch, not its tokens: where the file masks labels itself, the count
    varies; the good twin's labels are the inputs themselves (nothing masked).
- `trl-sft-default-collator` (WB301, fact `trl-sft-trainer`; rlhf-length-biases'
  `tunesft.py`, VL-RLHF's `VLSFTTrainer`, tuned on after the judgment): TRL's
  `SFTTrainer` is the Trainer with its own loss, and without packing its default
  collator masks each micro-batch's padding with -100 (transformers'
  `DataCollatorForLanguageModeling(mlm=False)`, tested below), so under a transformers
  pinned below 4.46 it divides a mean over a varying count by the steps. The bad twin
  (`packing=False`) is reported at the call; the lint of c6ce0e6 reports nothing. The
  good twin packs (fixed-length blocks, no padding).
- `conda-environment-pin` (WB301, fact `hf-trainer-before-4-46`; OpenChatKit's LoRA
  example, tuned on after the judgment): a conda `environment.yml` whose pip section
  pins `transformers==4.31.0` pins the project as a requirements file does; the bad
  twin's Trainer (an LM collator, 4 steps) is reported at its call, unreported by the
  lint of c6ce0e6. The good twin's environment pins 4.46.1.

    PYTHONPATH=src .venv/bin/python -m pytest tests/unit/test_lint_corpus5_twins.py -q
"""

from __future__ import annotations

from benchmarks.lint_twins import twin_tests

Twin = dict[str, str]

_PIN = "transformers==4.37.2\ntrl==0.8.6\ntorch\n"

_DATA = """
IGNORE_INDEX = -100


def supervised_labels(input_ids, prompt_len):
    labels = input_ids.clone()
    labels[:prompt_len] = IGNORE_INDEX
    return labels
"""

_TRAINERS = """
from transformers import Trainer
from trl import DPOTrainer


class SchedulerMixin(Trainer):
    def create_scheduler(self, num_training_steps, optimizer=None):
        return super().create_scheduler(num_training_steps, optimizer)


class PairTrainer(SchedulerMixin, DPOTrainer):
    pass


{heir}
"""

_OWN_LOSS = """class RankTrainer(SchedulerMixin):
    def compute_loss(self, model, inputs, return_outputs=False):
        scores = model(**inputs).logits
        return -scores.log_softmax(-1)[:, 0].sum()
"""

_INHERITS = """class LoggedTrainer(SchedulerMixin):  # expect: WB301
    def log(self, logs, *args, **kwargs):
        return super().log(logs, *args, **kwargs)
"""

_TRAIN = """
from transformers import TrainingArguments

from app.data import supervised_labels
from app.trainers import {name}


def train(model, dataset):
    args = TrainingArguments(output_dir="out", gradient_accumulation_steps=4)
    {name}(model=model, args=args, train_dataset=dataset).train()
"""


def _tree(heir: str, name: str) -> Twin:
    return {
        "requirements.txt": _PIN,
        "app/__init__.py": "",
        "app/data.py": _DATA,
        "app/trainers.py": _TRAINERS.format(heir=heir),
        "app/train.py": _TRAIN.format(name=name),
    }


_COLLATE = """
import torch
from transformers import Trainer


def collate(rows, pad_id):
    longest = max(len(r["input_ids"]) for r in rows)
    ids, labels = [], []
    for r in rows:
        gap = longest - len(r["input_ids"])
        ids.append(r["input_ids"] + [pad_id] * gap)
        labels.append([-100] * r["prompt_len"] + r["input_ids"][r["prompt_len"] :] + [-100] * gap)
    return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels)}


class LossTrainer(Trainer):
{override}
"""

_CALLS_MODEL = """    def compute_loss(self, model, inputs, return_outputs=False):
        return model(  # expect: WB301
            input_ids=inputs["input_ids"],
            labels=inputs["labels"],
        ).loss
"""

_HANDS_ON = """    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        out = model(**inputs, **kwargs)
        return (out.loss, out) if return_outputs else out.loss
"""

_OPAQUE = """    def compute_loss(self, model, inputs, return_outputs=False):
        outputs = model(**inputs)
        loss = outputs.loss
        return (loss, outputs) if return_outputs else loss
"""

_SPELLED = """    def compute_loss(self, model, inputs, return_outputs=False):
        outputs = model(**{"input_ids": inputs["input_ids"], "labels": inputs["labels"]})
        loss = outputs.loss  # expect: WB301
        return (loss, outputs) if return_outputs else loss
"""

_HANDS_ON_PINNED = """    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        out = model(input_ids=inputs["input_ids"], labels=inputs["labels"], **kwargs)
        return (out.loss, out) if return_outputs else out.loss  # expect: WB301
"""

_SUMS = """    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        logits = model(input_ids=inputs["input_ids"]).logits[:, :-1]
        labels = inputs["labels"][:, 1:]
        return torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), reduction="sum"
        )
"""


def _override(body: str, pin: str = "") -> Twin:
    files = {"app/__init__.py": "", "app/trainer.py": _COLLATE.replace("{override}", body)}
    return {**files, "requirements.txt": pin} if pin else files


_LIT = """
import pytorch_lightning as pl
from torch.utils.data import DataLoader


class Seq2Seq(pl.LightningModule):
    def __init__(self, model, pad_id, dataset):
        super().__init__()
        self.model, self.pad_id, self.dataset = model, pad_id, dataset

    def forward(self, input_ids, labels=None):
        return self.model(input_ids, labels=labels)

    def _step(self, batch):
        labels = batch["target_ids"]
        {mask}
        outputs = self(input_ids=batch["source_ids"], labels=labels)
        {returns}

    def training_step(self, batch, batch_idx):
        loss = self._step(batch)
        return loss  {expect}

    def train_dataloader(self):
        return DataLoader(self.dataset, batch_size=8, {loader})


def main(model, pad_id, dataset, debug, steps):
    trainer = pl.Trainer(accumulate_grad_batches={accumulate})
    trainer.fit(Seq2Seq(model, pad_id, dataset))
"""

_MASK = "labels[labels == self.pad_id] = -100"


def _lit(
    *,
    mask: str = _MASK,
    element: int = 0,
    loader: str = "shuffle=True",
    accumulate: str = "steps",
    expect: bool = True,
    named: bool = False,
) -> Twin:
    text = _LIT
    returns = (
        "loss = outputs[{element}]\n        return loss" if named else "return outputs[{element}]"
    )
    text = text.replace("{returns}", returns)
    for key, value in {
        "{mask}": mask,
        "{element}": str(element),
        "{loader}": loader,
        "{accumulate}": accumulate,
        "{expect}": "# expect: WB301" if expect else "",
    }.items():
        text = text.replace(key, value)
    return {"seq2seq.py": text}


_SFT = """
from transformers import TrainingArguments
from trl import SFTTrainer


def main(model, tokenizer, dataset):
    args = TrainingArguments(output_dir="out", gradient_accumulation_steps=4)
    trainer = SFTTrainer({expect}
        model=model,
        args=args,
        train_dataset=dataset,
        tokenizer=tokenizer,
        dataset_text_field="text",
        max_seq_length=512,
        packing={packing},
    )
    trainer.train()
"""


def _sft(packing: bool) -> Twin:
    mark = "" if packing else "  # expect: WB301"
    text = _SFT.replace("{expect}", mark).replace("{packing}", str(packing))
    return {"requirements.txt": _PIN, "sft.py": text}


_ENV = """
name: chat
dependencies:
  - python=3.10
  - pip
  - pip:
    - accelerate==0.21.0
    - transformers=={version}
"""

_LORA = """
import transformers


def main(model, tokenizer, data):
    trainer = transformers.Trainer({expect}
        model=model,
        train_dataset=data,
        args=transformers.TrainingArguments(gradient_accumulation_steps=4, output_dir="out"),
        data_collator=transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    trainer.train()
"""


def _conda(version: str, expect: bool) -> Twin:
    mark = "  # expect: WB301" if expect else ""
    return {
        "environment.yml": _ENV.replace("{version}", version),
        "training/lora.py": _LORA.replace("{expect}", mark),
    }


TWINS: dict[str, tuple[Twin, Twin]] = {
    "conda-environment-pin": (_conda("4.31.0", True), _conda("4.46.1", False)),
    "trl-sft-default-collator": (_sft(False), _sft(True)),
    "lightning-accumulates-unless-debug": (
        _lit(accumulate="1 if debug else steps"),
        _lit(accumulate="1", expect=False),
    ),
    "lightning-first-element-helper": (
        _lit(named=True),
        _lit(named=True, element=1, expect=False),
    ),
    "lightning-fixed-rows-masked-tokens": (
        _lit(loader="drop_last=True"),
        _lit(loader="drop_last=True", mask="labels = batch['source_ids']", expect=False),
    ),
    "trainer-base-only": (_tree(_INHERITS, "LoggedTrainer"), _tree(_OWN_LOSS, "RankTrainer")),
    "override-calls-model": (_override(_CALLS_MODEL), _override(_HANDS_ON)),
    "override-opaque-inputs": (_override(_SPELLED), _override(_OPAQUE)),
    "override-kwargs-pinned": (_override(_HANDS_ON_PINNED, _PIN), _override(_SUMS, _PIN)),
}
test_twin_is_judged_as_marked, test_each_kind_has_a_bad_and_a_good_twin = twin_tests(TWINS)


def test_the_lm_collator_masks_each_micro_batchs_padding() -> None:
    # Fact `trl-sft-trainer`: TRL's SFTTrainer (0.5 to 0.11) collates with transformers'
    # `DataCollatorForLanguageModeling(tokenizer, mlm=False)` when given none and not
    # packing. It pads to the longest row of the micro-batch and sets the padding's
    # labels to -100, so the count of tokens the model's mean is over varies.
    from tokenizers import Tokenizer, models
    from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "a": 2, "b": 3}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")),
        pad_token="[PAD]",
        unk_token="[UNK]",
    )
    collate = DataCollatorForLanguageModeling(tokenizer=tok, mlm=False)
    long, short = collate([{"input_ids": [2, 3, 3, 2]}, {"input_ids": [2, 3]}])["labels"].tolist()
    assert long == [2, 3, 3, 2] and short == [2, 3, -100, -100]
    again = collate([{"input_ids": [2, 3]}, {"input_ids": [3, 2]}])["labels"].tolist()
    assert again == [[2, 3], [3, 2]]  # another micro-batch: 4 counted tokens, not 6
