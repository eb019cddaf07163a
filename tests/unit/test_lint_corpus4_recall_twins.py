"""Bad and good twins of corpus 4's WB301 misses (issue 33; the tuning half of
benchmarks/lint_corpus4.toml), written for these tests: each twin is a small tree of
files, linted as a folder; a line ending in `# expect: WBnnn` must be flagged with that
code, and nothing else may be. The lint of 46bfca3 misses the bad twin of every kind:

- `reciprocal-steps` (WB301): `loss_scale = 1.0 / accumulate_steps` before the
  micro-batch loop, then `(loss_scale * loss).backward()`; the loss is
  `F.cross_entropy(...)` with no `ignore_index=` (PyTorch's default, -100) on labels a
  helper of the file pads with `IGNORE_INDEX = -100`. The good twin sums the loss and
  scales it by one over the step's target-token count.
- `weighted-mean-reciprocal` (WB301): `(loss * weights).sum() / (weights.sum() + 1e-6)`
  with `weights` from the batch (data: a varying total), times the reciprocal of the
  steps. The good twin's weights are the model's own (`T`: real-valued computed
  weights, no item count).
- `hydra-accumulate` (WB301): a LightningModule's `training_step` returns
  `(loss * mask).sum() / mask.sum()`, and the Trainer is built by Hydra from
  `configs/config.yaml`, whose `accumulate_grad_batches:` is an interpolation. The good
  twin's config sets it to 1.
- `undivided-sum` (WB301): a token mean backpropagated every micro-batch while the
  optimizer steps `if step % k == 0`, nothing divided by the steps: the sum of k
  micro-batch means. The good twin sums the tokens (`reduction="sum"`), a sum of sums.

    PYTHONPATH=src .venv/bin/python -m pytest tests/unit/test_lint_corpus4_recall_twins.py -q
"""

from __future__ import annotations

from benchmarks.lint_twins import twin_tests

Twin = dict[str, str]

_RECIPROCAL = """
import torch.nn.functional as F

IGNORE_INDEX = -100


def forward_with_loss(model, input_ids, labels):
    logits = model(input_ids)[..., :-1, :]  # (B, T-1, V)
    labels = labels[..., 1:]  # (B, T-1)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1){reduction})


def prepare(labels, pad_id):
    labels[labels == pad_id] = IGNORE_INDEX
    return labels


def train(model, optimizer, loader, accumulate_steps, micro):
    for batch in loader:
        model.zero_grad()
        input_ids, labels = batch["input_ids"], prepare(batch["labels"], 0)
        loss_scale = {scale}
        for i in range(0, input_ids.size(0), micro):
            loss = forward_with_loss(model, input_ids[i : i + micro], labels[i : i + micro])
            (loss_scale * loss).backward(){mark}
        optimizer.step()
"""

_WEIGHTED = """
def forward_with_loss(model, input_ids, labels, weights):
    pred, gate = model(input_ids)
    loss = (pred - labels) ** 2
    weights = {weights}
    return (loss * weights).sum() / (weights.sum() + 1e-6)


def train(model, optimizer, loader, accumulate_steps):
    for step, batch in enumerate(loader):
        loss = forward_with_loss(model, batch["input_ids"], batch["labels"], batch["weights"])
        loss_scale = 1.0 / accumulate_steps
        (loss * loss_scale).backward(){mark}
        if (step + 1) % accumulate_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
"""

_LIGHTNING = """
import hydra
import lightning as L


class Diffusion(L.LightningModule):
    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone

    def training_step(self, batch, batch_idx):
        nll = self.backbone(batch["input_ids"])  # (B, T)
        mask = batch["attention_mask"]
        loss = (nll * mask).sum() / mask.sum()
        return loss{mark}


@hydra.main(version_base=None, config_path="configs", config_name="config")
def main(config):
    trainer = hydra.utils.instantiate(config.trainer)
    trainer.fit(Diffusion(hydra.utils.instantiate(config.model)))
"""

_CONFIG = """
trainer:
  _target_: lightning.Trainer
  devices: 4
  accumulate_grad_batches: {accumulate}
  gradient_clip_val: 1.0
"""

_UNDIVIDED = """
from torch import nn


def train(model, optimizer, loader, gradient_accumulation_steps):
    criterion = nn.CrossEntropyLoss({reduction})
    for step, (input_ids, labels) in enumerate(loader):
        labels[labels == 0] = -100
        logits = model(input_ids)  # (B, T, V)
        loss = criterion(logits.view(-1, logits.size(-1)), labels.view(-1))
        loss.backward(){mark}
        if (step + 1) % gradient_accumulation_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
"""

_MARK = "  # expect: WB301"

TWINS: dict[str, tuple[Twin, Twin]] = {
    "reciprocal-steps": (
        {"train.py": _RECIPROCAL.format(reduction="", scale="1.0 / accumulate_steps", mark=_MARK)},
        {
            "train.py": _RECIPROCAL.format(
                reduction=', reduction="sum"',
                scale="1.0 / (labels[..., 1:] != IGNORE_INDEX).sum()",
                mark="",
            )
        },
    ),
    "weighted-mean-reciprocal": (
        {"train.py": _WEIGHTED.format(weights="weights.float()", mark=_MARK)},
        {"train.py": _WEIGHTED.format(weights="gate.softmax(-1)", mark="")},
    ),
    "hydra-accumulate": (
        {
            "main.py": _LIGHTNING.format(mark=_MARK),
            "configs/config.yaml": _CONFIG.format(accumulate="${div_up:512, 64}"),
        },
        {
            "main.py": _LIGHTNING.format(mark=""),
            "configs/config.yaml": _CONFIG.format(accumulate="1  # no accumulation"),
        },
    ),
    "undivided-sum": (
        {"train.py": _UNDIVIDED.format(reduction="", mark=_MARK)},
        {"train.py": _UNDIVIDED.format(reduction='reduction="sum"', mark="")},
    ),
}
test_twin_is_judged_as_marked, test_each_kind_has_a_bad_and_a_good_twin = twin_tests(TWINS)
