"""Bad and good twins of what benchmarks/lint_corpus2.toml still misjudged after its
judgment (issue 33, part 2), written for these tests: each twin is a small tree of
files, linted as a folder; a line ending in `# expect: WBnnn` must be flagged with that
code, and nothing else may be. The lint of 7431978 misjudges one twin of every kind:

- `gathered-size` (WB101, a false alarm; LLaMA-Factory's sequence_parallel.py:140): a
  sequence length gathered as an int64 tensor, only to agree a pad size, is data: an
  integer tensor carries no gradient and needs none. The bad twin gathers a float
  computed from the model's output and scales the loss by it.
- `batch-weights` (WB101, a false alarm; the same file, line 187): the batch's loss
  weights (a field of what `model(**batch)` is given) are gathered plainly and
  multiplied in, while the log-probs go through `torch.distributed.nn.all_gather`.
  The bad twin swaps the two gathers.
- `mask-indexed-mean` (WB301, a miss; fairseq's nat_loss.py, tacotron2_loss.py): the
  mean of `losses[mask]` (a boolean mask of the data) is a mean over the items the mask
  keeps, a different count per micro-batch; returned with `sample_size = 1` the
  trainer divides the micro-batch means' sum by the micro-batches. The good twin
  returns the masked sum with the masked count.

    PYTHONPATH=src .venv/bin/python -m pytest tests/unit/test_lint_data_gather_twins.py -q
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.lint_twins import twin_tests

Twin = dict[str, str]

_SIZE = """
import torch
import torch.distributed as dist
import torch.nn.functional as F


def padded_loss(model, batch, group, world):
    logits = model(batch["input_ids"])
    {local}
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local, group=group){mark}
    scale = torch.stack(parts).float().mean()
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()) * scale
"""

_WEIGHTS = """
import torch
import torch.distributed as dist
import torch.distributed.nn
import torch.nn.functional as F


def sequence_parallel_loss(model, batch, group, world):
    outputs = model(**batch)
    labels = batch["labels"]
    log_probs = -F.cross_entropy(
        outputs.logits.flatten(0, 1), labels.flatten(), reduction="none"
    ).view(labels.shape[0], -1)
    weights = batch["loss_weights"]
{gathers}
    loss = (-all_log_probs * all_weights).sum() / (all_weights.sum() + 1e-6)
    return loss
"""

_PLAIN = """\
    parts_{name} = [torch.empty_like({name}) for _ in range(world)]
    dist.all_gather(parts_{name}, {name}, group=group){mark}
    all_{name} = torch.cat(parts_{name}, dim=1)"""
_WITH_GRAD = """\
    all_{name} = torch.cat(torch.distributed.nn.all_gather({name}, group=group), dim=1)"""


def _gathers(plain: str, with_grad: str, mark: str) -> str:
    return "\n".join((_PLAIN.format(name=plain, mark=mark), _WITH_GRAD.format(name=with_grad)))


_CRITERION = """
import torch
from fairseq.criterions import FairseqCriterion


class FrameCriterion(FairseqCriterion):
    def forward(self, model, sample, reduce=True):
        out = model(**sample["net_input"])
        losses = (out - sample["target"]).abs()
        mask = sample["target_mask"]
        {loss}
        sample_size = {size}
        return loss, sample_size, {{"loss": loss.data, "sample_size": sample_size}}
"""

TWINS: dict[str, tuple[Twin, Twin]] = {
    "gathered-size": (
        {
            "sp.py": _SIZE.format(
                local="local = logits.logsumexp(-1).mean()", mark="  # expect: WB101"
            )
        },
        {
            "sp.py": _SIZE.format(
                local="local = torch.tensor(logits.shape[1], dtype=torch.int64)", mark=""
            )
        },
    ),
    "batch-weights": (
        {"sp.py": _WEIGHTS.format(gathers=_gathers("log_probs", "weights", "  # expect: WB101"))},
        {"sp.py": _WEIGHTS.format(gathers=_gathers("weights", "log_probs", ""))},
    ),
    "mask-indexed-mean": (
        {
            "criterion.py": _CRITERION.format(
                loss="loss = losses[mask].mean()", size="1  # expect: WB301"
            )
        },
        {"criterion.py": _CRITERION.format(loss="loss = losses[mask].sum()", size="mask.sum()")},
    ),
}
test_twin_is_judged_as_marked, test_each_kind_has_a_bad_and_a_good_twin = twin_tests(TWINS)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.uint8])
def test_autograd_refuses_integer_tensors(dtype: torch.dtype) -> None:
    """The framework fact behind `I` (lint/data.py): an integer or boolean tensor can
    never require a gradient, so all-gathering one without a gradient loses nothing."""
    with pytest.raises(RuntimeError, match="floating point"):
        torch.zeros(3, dtype=dtype).requires_grad_()
    # A mutation the same check rejects: a float tensor may require one.
    assert torch.zeros(3).requires_grad_().requires_grad


def test_integer_valued_reads_casts_dtypes_and_sizes() -> None:
    import ast

    from wholebatch.lint.data import integer_valued

    def judge(src: str) -> bool:
        node = ast.parse(src, mode="eval").body
        return integer_valued(node)

    for src in (
        "torch.tensor(v.shape[-1], device=v.device, dtype=torch.int64)",
        "torch.tensor(x.size(0) * 2)",
        "lengths.long().to(device)",
        "mask.to(torch.bool)",
        "torch.LongTensor([n])",
    ):
        assert judge(src), src
    for src in (
        "torch.tensor(x.shape[-1] * 0.5)",
        "torch.tensor(loss.item())",
        "feats.to(device)",
        "torch.ones(n, dtype=torch.float32)",
        "logits.float()",
    ):
        assert not judge(src), src
