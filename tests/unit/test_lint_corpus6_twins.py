"""Bad and good twins of what corpus 6 showed after its judgment (issue 33; both halves of
benchmarks/lint_corpus6.toml, tuned on after the evaluation half was judged at
5d06de0), written for these tests: each twin is a small tree of files, linted as a
folder; a line ending in `# expect: WBnnn` must be flagged with that code, and nothing
else may be. Each kind has one twin that the lint of 5d06de0 misjudges.

- `guarded-masked-mean` (WB301; EasyR1's `masked_mean`, LLaVA-NeXT): a helper's
  `(values * mask).sum(dim=dim) / (mask.sum(dim=dim) + eps)` with `dim=None` is a mean
  over every unmasked item of the micro-batch where a caller leaves `dim` unset, the
  `+ eps` only keeping the count off zero; the bad twin divides it by the steps,
  unreported by 5d06de0. The good twin asks for per-row means (`dim=-1`) and averages
  them over the rows.
- `singular-requirement-file` (WB301, fact `hf-trainer-before-4-46`; LESS and
  LLM-Shearing): a `requirement.txt` (their `setup.py` reads it) pins as
  `requirements.txt` does; the bad twin pins 4.33.0, unread by 5d06de0. The good twin's
  file pins 4.46.1.
- `environment-export-beside-spec` (the same fact; pyreft): a conda `environment.yml`
  is one machine's export; where an install spec of the same folder names transformers
  (`requirements.txt`: `transformers>=4.48.2`) the spec decides. The good twin has both
  (5d06de0 takes the export's 4.39.3 and reports); the bad twin has the export alone.
- `base-only-own-loss` (the same fact; pyreft's `ReftTrainer`): a Trainer subclass named
  only as a base whose own `compute_loss` calls the model opaquely hands its heirs that
  loss, not the Trainer's: the good twin's heirs are not reported (5d06de0 reports them
  at their `class` lines). The bad twin's base has no loss of its own.
- `own-loop-calls-step` (the same fact; LLaVA-NeXT's `LLaVATrainer`): a subclass with its
  own `_inner_training_loop` that still calls `self.training_step(...)` keeps the
  Trainer's step and its division: the bad twin is reported at its `class` line (5d06de0
  skips every subclass with its own loop). The good twin's loop backpropagates a sum it
  computes itself and never calls the Trainer's step.
- `micro-batch-range-loop` (WB301; mistral-finetune's `train.py`): `for i in
  range(args.num_microbatches)` backpropagating a masked token mean (`torch.sum(l * m) /
  torch.sum(m)`, the function form of a whole count) every iteration, with the step after
  the loop and only the detached, logged sum divided: the gradient is a sum of k
  micro-batch means. The bad twin is reported at its backward (5d06de0 reports
  nothing). The good twin divides each micro-batch's summed loss by the step's token
  count, counted before the loop.
- `deepspeed-save-checkpoint` (WB104, fact `deepspeed-save-checkpoint`; DALLE-pytorch's
  `train_vae.py`, whose engine is built in another file and saved through a helper:
  this twin is the plain form): the engine `deepspeed.initialize` returns synchronises
  every rank in `save_checkpoint` (a barrier; `test_deepspeed_save_checkpoint_syncs`
  reads it in the installed deepspeed), so calling it under `if rank == 0:` hangs the
  other ranks. The bad twin does so (5d06de0 reports nothing); the good twin saves on
  every rank and writes its own file on rank 0 only.

    PYTHONPATH=src .venv/bin/python -m pytest tests/unit/test_lint_corpus6_twins.py -q
"""

from __future__ import annotations

from benchmarks.lint_twins import twin_tests

Twin = dict[str, str]

_PIN = "transformers==4.37.2\ntorch\n"

_MASKED_MEAN = """
import torch


def masked_mean(values, mask, dim=None, eps=1e-8):
    return (values * mask).sum(dim=dim) / (mask.sum(dim=dim) + eps)


def update(model, micro_batches, optimizer, gradient_accumulation):
    for mb in micro_batches:
        logp = model(mb["input_ids"]).log_softmax(-1)
        {loss}
        (loss / gradient_accumulation).backward(){mark}
    optimizer.step()
    optimizer.zero_grad()
"""


def _mean(loss: str, bad: bool) -> Twin:
    text = _MASKED_MEAN.replace("{loss}", loss).replace(
        "{mark}", "  # expect: WB301" if bad else ""
    )
    return {"actor.py": text}


_TRAINER = """
from transformers import Trainer

IGNORE_INDEX = -100


def collate(rows, pad_id):
    longest = max(len(r) for r in rows)
    return [r + [IGNORE_INDEX] * (longest - len(r)) for r in rows]


def main(model, args, data):
    trainer = Trainer(model=model, args=args, train_dataset=data){mark}
    trainer.train()
"""


def _pinned(files: dict[str, str], bad: bool) -> Twin:
    text = _TRAINER.replace("{mark}", "  # expect: WB301" if bad else "")
    return {**files, "train.py": text}


_ENV = "name: reft\ndependencies:\n  - pip:\n    - torch==2.2.2\n    - transformers==4.39.3\n"

_BASE = """
from transformers import Trainer

IGNORE_INDEX = -100


def collate(rows):
    return [r + [IGNORE_INDEX] for r in rows]


class BaseTrainer(Trainer):
{body}

class CausalTrainer(BaseTrainer):{mark}
    def get_train_dataloader(self):
        return super().get_train_dataloader()


def main(model, args, data):
    CausalTrainer(model=model, args=args, train_dataset=data).train()
"""

_OPAQUE_LOSS = """    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        output = model(**inputs)
        return (output, output) if return_outputs else output.loss
"""

_NO_LOSS = """    def log(self, logs, *args, **kwargs):
        return super().log(logs, *args, **kwargs)
"""


def _base(body: str, bad: bool) -> Twin:
    text = _BASE.replace("{body}", body).replace("{mark}", "  # expect: WB301" if bad else "")
    return {"requirements.txt": _PIN, "trainers.py": text}


_LOOP = """
from transformers import Trainer

IGNORE_INDEX = -100


def collate(rows):
    return [r + [IGNORE_INDEX] for r in rows]


class LoopTrainer(Trainer):{mark}
    def _inner_training_loop(self, batch_size=None, args=None, **kwargs):
        model = self._wrap_model(self.model_wrapped)
        for step, inputs in enumerate(self.get_train_dataloader()):
            with self.accelerator.accumulate(model):
                {step}
            self.optimizer.step()
            self.optimizer.zero_grad()


def main(model, args, data):
    LoopTrainer(model=model, args=args, train_dataset=data).train()
"""

_CALLS_STEP = "self.training_step(model, inputs)"
_OWN_SUM = "self.accelerator.backward(model(**inputs).logits.logsumexp(-1).sum())"


def _loop(step: str, bad: bool) -> Twin:
    text = _LOOP.replace("{step}", step).replace("{mark}", "  # expect: WB301" if bad else "")
    return {"requirements.txt": _PIN, "trainer.py": text}


_LOSS_PY = """
import torch
from torch.nn import functional as F


def masked_loss(logits, target, mask):
    ce = F.cross_entropy(logits, target, reduction="none")
    return torch.sum(ce * mask) / torch.sum(mask)


def summed_loss(logits, target, mask):
    return torch.sum(F.cross_entropy(logits, target, reduction="none") * mask)
"""

_RANGE_TRAIN = """
import torch

from finetune.loss import masked_loss, summed_loss


def train(args, model, batches, optimizer):
    for step in range(args.max_steps):
        optimizer.zero_grad()
        loss = torch.tensor([0.0])
        micro = [next(batches) for _ in range(args.num_microbatches)]
        step_tokens = sum(int(b.mask.sum()) for b in micro)
        for i in range(args.num_microbatches):
            b = micro[i]
            {loss}
            mb_loss.backward(){mark}
            loss += mb_loss.detach()
        loss /= args.num_microbatches
        for p in model.parameters():
            p.grad.div_(args.num_microbatches)
        optimizer.step()
"""


def _range(loss: str, bad: bool) -> Twin:
    text = _RANGE_TRAIN.replace("{loss}", loss).replace(
        "{mark}", "  # expect: WB301" if bad else ""
    )
    return {"finetune/__init__.py": "", "finetune/loss.py": _LOSS_PY, "train.py": text}


_DS_SAVE = """
import deepspeed
import torch
import torch.distributed as dist


def train(args, model, loader):
    engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model)
    for step, batch in enumerate(loader):
        engine.backward(engine(batch))
        engine.step()
    {save}
"""

_SAVE_ON_ROOT = """if dist.get_rank() == 0:
        engine.save_checkpoint(args.out)  # expect: WB104"""

_SAVE_EVERYWHERE = """engine.save_checkpoint(args.out)
    if dist.get_rank() == 0:
        torch.save({"step": step}, args.out + "/meta.pt")"""


TWINS: dict[str, tuple[Twin, Twin]] = {
    "deepspeed-save-checkpoint": (
        {"train.py": _DS_SAVE.replace("{save}", _SAVE_ON_ROOT)},
        {"train.py": _DS_SAVE.replace("{save}", _SAVE_EVERYWHERE)},
    ),
    "guarded-masked-mean": (
        _mean('loss = -masked_mean(logp[..., 0], mb["mask"])', True),
        _mean('loss = -masked_mean(logp[..., 0], mb["mask"], dim=-1).mean()', False),
    ),
    "singular-requirement-file": (
        _pinned({"requirement.txt": "transformers==4.33.0\n"}, True),
        _pinned({"requirement.txt": "transformers==4.46.1\n"}, False),
    ),
    "environment-export-beside-spec": (
        _pinned({"environment.yml": _ENV}, True),
        _pinned({"environment.yml": _ENV, "requirements.txt": "transformers>=4.48.2\n"}, False),
    ),
    "base-only-own-loss": (_base(_NO_LOSS, True), _base(_OPAQUE_LOSS, False)),
    "own-loop-calls-step": (_loop(_CALLS_STEP, True), _loop(_OWN_SUM, False)),
    "micro-batch-range-loop": (
        _range("mb_loss = masked_loss(model(b.x), b.y, b.mask)", True),
        _range("mb_loss = summed_loss(model(b.x), b.y, b.mask) / step_tokens", False),
    ),
}
test_twin_is_judged_as_marked, test_each_kind_has_a_bad_and_a_good_twin = twin_tests(TWINS)


def test_deepspeed_save_checkpoint_syncs() -> None:
    # Fact `deepspeed-save-checkpoint`, read in the installed deepspeed: the engine's
    # save_checkpoint calls `dist.barrier()` on every rank, outside any rank test, and
    # says so in its docstring.
    import inspect

    import pytest

    engine = pytest.importorskip("deepspeed.runtime.engine")
    source = inspect.getsource(engine.DeepSpeedEngine.save_checkpoint)
    body = source.split('"""')[-1]
    assert "dist.barrier()" in body
    barrier = next(line for line in body.splitlines() if "dist.barrier()" in line)
    assert len(barrier) - len(barrier.lstrip()) == 8  # the method's own level: every rank
    assert "hang waiting to synchronize" in inspect.getdoc(engine.DeepSpeedEngine.save_checkpoint)
