"""Bad and good twins of corpus 4's rank-local exits and two of its false alarms (issue 33,
round 5; the evaluation half of benchmarks/lint_corpus4.toml, now tuning data), written
for these tests: each twin is a small tree of files, linted as a folder; a line ending in
`# expect: WBnnn` must be flagged with that code, and nothing else may be. The lint of
161f3c0 misses the bad twin of the first two kinds and flags the good twin of the last
two (and, in `tensor-leaf-gather`'s bad twin, the same lengths gather beside the true
finding):

- `partial-sum-exit` (WB105; D-Adaptation's Adam and Prodigy steps): the step sums a
  statistic of this rank's own gradients into `sk_l1`, returns `if sk_l1 == 0`, and only
  then writes `sk_l1` into a buffer it all-reduces (`if sharded:`): the function itself
  says the value is this rank's part of a sum, so one rank can leave while the others
  wait in the all-reduce. The good twin all-reduces first and leaves on the global sum.
- `ddp-backward-exit` (WB105; a trainer's `_run_step`): the model is wrapped in
  `DistributedDataParallel` in `setup`; the step returns on a non-finite local loss
  (`if strict: raise ... else: return`) before `self.scaler.scale(loss).backward()`,
  whose backward all-reduces the gradients (fact `ddp-backward`). The good twin agrees
  on the check first (an all-reduced flag).
- `tensor-leaf-gather` (WB101): lengths read from the forward's inputs, made a tensor by
  `torch.tensor(lengths, device=rewards.device)` (a new leaf with no autograd history,
  tested below) and `.contiguous()`, are all-gathered plainly beside rewards whose local
  slot is put back: nothing is lost. The bad twin gathers the rewards without putting
  their slot back.
- `literal-kwargs-forward` (WB301): `model(**inputs)[0] / accum` where `inputs` is a dict
  literal with no `labels` key: the model is given no labels, so its first output is no
  Hugging Face token mean; the run's own forward returns a mean over every row of the
  micro-batch (exact under the division). The bad twin's dict holds `labels` padded with
  -100: the model's token mean over a varying count.

- `type-test-pass-through` (WB105; the GradCache copies vendored by three corpus
  repositories, found by the regression run of this round's change): a helper returns
  its argument untouched `if not isinstance(t, Tensor)` and all-gathers it otherwise: a
  test of the value's type, the same on every rank, not of its values (the good twin,
  flagged by the first version of `partial-sum-exit`'s mechanism). The bad twin returns
  `if t.numel() == 0`, this rank's own size.

    PYTHONPATH=src .venv/bin/python -m pytest tests/unit/test_lint_local_exit_twins.py -q
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.lint_twins import twin_tests

Twin = dict[str, str]

_PARTIAL = """
import torch
import torch.distributed as dist
from torch.optim import Optimizer


class AdaptiveAdam(Optimizer):
    @torch.no_grad()
    def step(self, closure=None):
        group = self.param_groups[0]
        sharded = group["sharded"]
        sk_l1 = 0.0
        for p in group["params"]:
            if p.grad is None:
                continue
            s = self.state[p].setdefault("s", torch.zeros_like(p))
            s.mul_(0.9).add_(p.grad, alpha=group["lr"])
            sk_l1 += s.abs().sum().item()
{body}
        for p in group["params"]:
            if p.grad is not None:
                p.add_(p.grad, alpha=-group["lr"] * global_sk_l1)
"""
_PARTIAL_FIRST = """\
        if sk_l1 == 0:
            return  # expect: WB105
        global_sk_l1 = sk_l1
        if sharded:
            buf = torch.zeros(1, device="cuda")
            buf[0] = sk_l1
            dist.all_reduce(buf, op=dist.ReduceOp.SUM)
            global_sk_l1 = buf[0].item()"""
_PARTIAL_AGREED = """\
        global_sk_l1 = sk_l1
        if sharded:
            buf = torch.zeros(1, device="cuda")
            buf[0] = sk_l1
            dist.all_reduce(buf, op=dist.ReduceOp.SUM)
            global_sk_l1 = buf[0].item()
        if global_sk_l1 == 0:
            return"""

_DDP = """
import math

import torch
import torch.distributed as dist
from torch import nn


class Trainer:
    def __init__(self, model, optim, local_rank):
        self.model, self.optim, self.local_rank = model, optim, local_rank
        self.scaler = torch.cuda.amp.GradScaler()

    def setup(self):
        self.model = nn.parallel.DistributedDataParallel(self.model, device_ids=[self.local_rank])

    def _step(self, batch, model):
        return {{"loss": model(batch["x"]).pow(2).mean()}}

    def run_step(self, batch, strict=True):
        self.optim.zero_grad(set_to_none=True)
        losses = self._step(batch, self.model)
        loss = losses["loss"]
{check}
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optim)
        self.scaler.update()
"""
_DDP_LOCAL = """\
        if not math.isfinite(loss.item()):
            if strict:
                raise FloatingPointError(f"loss is {loss.item()}")
            else:
                return  # expect: WB105"""
_DDP_AGREED = """\
        bad = torch.tensor(float(not math.isfinite(loss.item())), device=loss.device)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad.item() > 0:
            if strict:
                raise FloatingPointError(f"loss is {loss.item()}")
            else:
                return"""

_LENGTHS = """
import torch
import torch.distributed as dist
import torch.nn.functional as F


def compute_loss(model, inputs):
    rewards = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])[0]
    lengths = torch.tensor(inputs["lengths"], device=rewards.device)  # (B,)
    local_lengths = lengths.contiguous()
    local_rewards = rewards.contiguous()  # (B, 2)
    all_lengths = [torch.zeros_like(local_lengths) for _ in range(dist.get_world_size())]
    all_rewards = [torch.zeros_like(local_rewards) for _ in range(dist.get_world_size())]
    dist.all_gather(all_lengths, local_lengths)
{gather}
    lengths_N = torch.cat(all_lengths).float()
    rewards_N2 = torch.cat(all_rewards)
    ranking = -F.logsigmoid(rewards[0::2, 0] - rewards[1::2, 0]).mean()
    corr = torch.corrcoef(torch.stack((lengths_N, rewards_N2[:, 1])))[0, 1]
    return ranking + corr.abs()
"""
_LENGTHS_PUT_BACK = """\
    dist.all_gather(all_rewards, local_rewards)
    all_rewards[dist.get_rank()] = local_rewards"""
_LENGTHS_CUT = """\
    dist.all_gather(all_rewards, local_rewards)  # expect: WB101"""

_MODELS = """
import torch
import torch.nn.functional as F
from torch import nn


class PairEncoder(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.q, self.d = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, query, doc_pos, doc_neg=None):
        q = self.q(query)  # (B, D)
        if doc_neg is None:
            return (q, self.d(doc_pos))
        pos, neg = (q * self.d(doc_pos)).sum(-1), (q * self.d(doc_neg)).sum(-1)  # (B,)
        lsm = F.log_softmax(torch.stack([pos, neg], dim=1), dim=1)  # (B, 2)
        return ((-lsm[:, 0]).mean(),)  # a mean over the B rows: the same B every step


def span_loss(start_logits, start_positions):
    ignored = start_logits.size(1)
    start_positions = start_positions.clamp(0, ignored)
    return F.cross_entropy(start_logits, start_positions, ignore_index=ignored)
"""
_PAIR_TRAIN = """
import torch
from model.models import PairEncoder


def pair_pass(args, model, batch):
    inputs = {"query": batch[0], "doc_pos": batch[1], "doc_neg": batch[2]}
    loss = model(**inputs)[0]
    if args.accum > 1:
        loss = loss / args.accum
    return loss


def train(args, model, loader, optimizer):
    for step, batch in enumerate(loader):
        pair_pass(args, model, batch).backward()
        if (step + 1) % args.accum == 0:
            optimizer.step()
            optimizer.zero_grad()


def main(args, loader):
    model = PairEncoder(8)
    train(args, model, loader, torch.optim.SGD(model.parameters(), lr=0.1))
"""
_LM_TRAIN = """
import torch
from transformers import AutoModelForCausalLM


def collate(rows, pad_id):
    ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad_id)
    labels = ids.clone()
    labels[ids == pad_id] = -100
    return ids, ids != pad_id, labels


def lm_pass(args, model, batch):
    inputs = {"input_ids": batch[0], "attention_mask": batch[1], "labels": batch[2]}
    loss = model(**inputs)[0]
    if args.accum > 1:
        loss = loss / args.accum  # expect: WB301
    return loss


def train(args, model, loader, optimizer):
    for step, batch in enumerate(loader):
        lm_pass(args, model, batch).backward()
        if (step + 1) % args.accum == 0:
            optimizer.step()
            optimizer.zero_grad()


def main(args, loader):
    model = AutoModelForCausalLM.from_pretrained(args.path)
    train(args, model, loader, torch.optim.SGD(model.parameters(), lr=0.1))
"""

_PASS_THROUGH = """
import torch
import torch.distributed as dist
from torch import Tensor


def maybe_gather(t, axis):
    if {test}:
        return t{mark}
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    parts[dist.get_rank()] = t
    return torch.cat(parts, dim=axis)
"""

TWINS: dict[str, tuple[Twin, Twin]] = {
    "partial-sum-exit": (
        {"optim.py": _PARTIAL.format(body=_PARTIAL_FIRST)},
        {"optim.py": _PARTIAL.format(body=_PARTIAL_AGREED)},
    ),
    "ddp-backward-exit": (
        {"trainer.py": _DDP.format(check=_DDP_LOCAL)},
        {"trainer.py": _DDP.format(check=_DDP_AGREED)},
    ),
    "tensor-leaf-gather": (
        {"loss.py": _LENGTHS.format(gather=_LENGTHS_CUT)},
        {"loss.py": _LENGTHS.format(gather=_LENGTHS_PUT_BACK)},
    ),
    "literal-kwargs-forward": (
        {"train.py": _LM_TRAIN},
        {"model/__init__.py": "", "model/models.py": _MODELS, "train.py": _PAIR_TRAIN},
    ),
    "type-test-pass-through": (
        {"gather.py": _PASS_THROUGH.format(test="t.numel() == 0", mark="  # expect: WB105")},
        {"gather.py": _PASS_THROUGH.format(test="not isinstance(t, Tensor)", mark="")},
    ),
}

test_twin_is_judged_as_marked, test_each_kind_has_a_bad_and_a_good_twin = twin_tests(TWINS)


def test_torch_tensor_makes_a_leaf_with_no_history() -> None:
    # `tensor-leaf-gather`'s fact (torch's docs of `torch.tensor`: it copies its data into
    # a new leaf, `requires_grad=False` unless given): even of a tensor that requires
    # grad, the result has no autograd history, so a plain gather of it loses nothing.
    w = torch.ones(3, dtype=torch.float64, requires_grad=True)
    lengths = (w * 2).detach().tolist()
    made = torch.tensor(lengths, dtype=torch.float64)
    assert made.is_leaf and not made.requires_grad and made.grad_fn is None
    asked = torch.tensor(lengths, dtype=torch.float64, requires_grad=True)
    assert asked.requires_grad  # the one way it records: told to


def test_ddp_backward_all_reduces() -> None:
    # Fact `ddp-backward` (torch 2.13): the backward of a DDP model's output runs the
    # reducer's all-reduce (seen through a communication hook, which replaces it), so a
    # rank that skips the backward leaves the others waiting in it; under `no_sync()`
    # the backward makes none. One gloo process is enough to see the call.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = nn.parallel.DistributedDataParallel(nn.Linear(3, 1, dtype=torch.float64))
        buckets: list[int] = []

        # (no annotations: DDP checks the hook's, and this module postpones them)
        def all_reduce(state, bucket):  # type: ignore[no-untyped-def]
            buckets.append(bucket.index())
            work = dist.all_reduce(bucket.buffer(), async_op=True)
            assert work is not None
            return work.get_future().then(lambda f: f.value()[0])

        model.register_comm_hook(None, all_reduce)
        x_B3 = torch.ones(2, 3, dtype=torch.float64)
        model(x_B3).sum().backward()
        assert buckets == [0]
        buckets.clear()
        with model.no_sync():
            model(x_B3).sum().backward()
        assert buckets == []
    finally:
        dist.destroy_process_group()
