"""Bad and good twins of four false alarms of corpus 3's tuning half (issue 33, part 3),
written for these tests: each twin is a small tree of files, linted as a folder; a line
ending in `# expect: WBnnn` must be flagged with that code, and nothing else may be. The
lint of fbad846 flags the good twin of every kind:

- `fsdp-no-sync` (WB302; LLaMA-Adapter's gorilla/finetune/util/misc.py:323): a helper
  wraps only the backward in `model.no_sync()`. FSDP decides in its post-backward hook
  (fact `fsdp-no-sync`), so that skips the reduce-scatter; DDP decided at forward time
  (fact `ddp-no-sync`), so it does not. The twins differ only in the wrapper the script
  that imports the helper builds.
- `part-of-params` (WB202; RL4LMs' trpo.py:393): `p.grad = None` between the backward
  and the step over a part of what the optimizer steps (the actor's parameters, in a
  critic update) holds that part still; over all of them the step sees nothing.
- `logged-gather` (WB101; prime-rl's utils/cp.py:136): a plain all_gather whose result
  is stored in an entry of the forward's output that only logging reads; the loss reads
  another entry, gathered with its gradient. The bad twin swaps the two gathers.
- `normalised-weights` (WB301; OpenMatch's meta_dist_train.py:480): weights computed
  from the model's output, normalised by their own sum, make a weighted sum, not a mean
  over a varying count. The bad twin divides by the count of a mask of the data.

    PYTHONPATH=src .venv/bin/python -m pytest tests/unit/test_lint_false_alarm_twins.py -q
"""

from __future__ import annotations

import inspect

from torch.distributed.fsdp import FullyShardedDataParallel, _runtime_utils
from torch.nn.parallel import DistributedDataParallel

from benchmarks.lint_twins import twin_tests

Twin = dict[str, str]

_ACCUMULATOR = """
class Accumulator:
    def __call__(self, loss, optimizer, model, update):
        if update:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        else:
            with model.no_sync():{mark}
                loss.backward()
"""

_SCRIPT = """
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.nn.parallel import DistributedDataParallel as DDP

from accumulate import Accumulator


def main(net, loader, k):
    model = {wrapper}(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = Accumulator()
    for i, batch in enumerate(loader):
        loss = model(batch).mean() / k
        step(loss, opt, model, update=(i + 1) % k == 0)
"""

_CRITIC = """
import torch
import torch.nn.functional as F


class ActorCritic:
    def __init__(self, policy):
        self.policy = policy
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=3e-4)

    def critic_update(self, batch):
        values = self.policy.value(batch["obs"])
        loss = F.mse_loss(values.flatten(), batch["returns"])
        self.optimizer.zero_grad()
        loss.backward()
        for p in {params}:
            p.grad = None{mark}
        self.optimizer.step()
"""

_LISTED = """

    def shared_update(self, batch):
        shared, _ = self.split_parameters()
        loss = self.policy.value(batch["obs"]).square().mean()
        self.optimizer.zero_grad()
        loss.backward()
        for p in shared:
            p.grad = None
        self.optimizer.step()
"""

_CP = """
import torch
import torch.distributed as dist
import torch.distributed.nn as dist_nn


def gather_with_grad(t, group):
    return torch.cat(dist_nn.all_gather(t, group=group), dim=1)


def gather_plain(t, world, group):
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t, group=group){mark}
    return torch.cat(parts, dim=1)


def train_step(model, batch, opt, group, world):
    out = model(batch["input_ids"])
    logits = out["logits"]
    out["logprobs"] = logits.log_softmax(-1)
    out["entropy"] = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    out["logprobs"] = {logprobs}(out["logprobs"]{args_lp})
    out["entropy"] = {entropy}(out["entropy"]{args_en})
    loss = -(out["logprobs"] * batch["advantages"]).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return {{"loss": loss.item(), "entropy": out["entropy"].detach().mean().cpu()}}
"""


def _cp(plain_on: str, mark: str) -> str:
    grad, plain = ("gather_with_grad", ", group"), ("gather_plain", ", world, group")
    lp, en = (plain, grad) if plain_on == "logprobs" else (grad, plain)
    return _CP.format(mark=mark, logprobs=lp[0], args_lp=lp[1], entropy=en[0], args_en=en[1])


_REWEIGHT = """
import torch


def reweighted_step(model, batch, opt, k, step):
    scores = model(batch["x"])
    losses = (scores - batch["y"]).square()  # per row, reduction none
    {weights}
    loss = torch.sum(losses * w) / k{mark}
    loss.backward()
    if (step + 1) % k == 0:
        opt.step()
        opt.zero_grad()
"""

TWINS: dict[str, tuple[Twin, Twin]] = {
    "fsdp-no-sync": (
        {
            "accumulate.py": _ACCUMULATOR.format(mark="  # expect: WB302"),
            "train.py": _SCRIPT.format(wrapper="DDP"),
        },
        {
            "accumulate.py": _ACCUMULATOR.format(mark=""),
            "train.py": _SCRIPT.format(wrapper="FSDP"),
        },
    ),
    "part-of-params": (
        {"agent.py": _CRITIC.format(params="self.policy.parameters()", mark="  # expect: WB202")},
        {"agent.py": _CRITIC.format(params="self.policy.actor.parameters()", mark="") + _LISTED},
    ),
    "logged-gather": (
        {"cp.py": _cp("logprobs", "  # expect: WB101")},
        {"cp.py": _cp("entropy", "")},
    ),
    "normalised-weights": (
        {
            "reweight.py": _REWEIGHT.format(
                weights="n = torch.sum(batch['mask'])\n    w = batch['mask'].float() / n",
                mark="  # expect: WB301",
            )
        },
        {
            "reweight.py": _REWEIGHT.format(
                weights="w_raw = torch.clamp(-scores.detach(), min=0)\n"
                "    norm = torch.sum(w_raw)\n"
                "    w = w_raw / norm",
                mark="",
            )
        },
    ),
}
test_twin_is_judged_as_marked, test_each_kind_has_a_bad_and_a_good_twin = twin_tests(TWINS)


def test_fsdp_decides_after_backward_and_ddp_at_forward() -> None:
    # Fact `fsdp-no-sync` (torch 2.13), read from torch's own source: FSDP's no_sync()
    # clears `_sync_gradients`, and its post-backward hook returns before the
    # reduce-scatter when it is clear, so the flag at backward time decides. DDP's
    # (fact `ddp-no-sync`) is read where its forward prepares the reducer.
    assert "_sync_gradients = False" in inspect.getsource(FullyShardedDataParallel.no_sync)
    hook = inspect.getsource(_runtime_utils._post_backward_hook)
    assert hook.index("if not state._sync_gradients") < hook.index("_reduce_grad(")
    assert "require_backward_grad_sync" in inspect.getsource(DistributedDataParallel.no_sync)
    forward = inspect.getsource(DistributedDataParallel._post_forward)
    assert "require_backward_grad_sync" in forward
    assert "prepare_for_backward" in forward
