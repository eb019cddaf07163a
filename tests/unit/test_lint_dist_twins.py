"""Bad and good twins for the gather and collective rules (WB101, WB102, WB104, WB105):
the shapes of the false alarms of the held-out judgment (docs/lint.md, "A held-out
judgment (ab6ca31)"), written here from their mechanism, not copied. Each twin is a
tree linted as a folder, as `wholebatch lint REPO` would; its findings must be exactly
its `# expect:` lines. Nothing is imported or run.

    PYTHONPATH=src .venv/bin/python -m pytest tests/unit/test_lint_dist_twins.py -q

Shapes: `W` world size, `B` local rows, `N` global rows, `D` dim, `V` vocab shard, `C`
classes.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

from wholebatch.lint import lint_paths

_EXPECT = re.compile(r"#\s*expect:\s*(WB\d{3})")
_Tree = dict[str, str]


def _judge(root: Path, files: _Tree) -> tuple[set[tuple[str, int, str]], list[str]]:
    """Write `files` under `root`, lint it; (findings, expected) as (file, line, code)."""
    expected: set[tuple[str, int, str]] = set()
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        body = textwrap.dedent(text).lstrip("\n")
        p.write_text(body)
        for i, line in enumerate(body.splitlines(), 1):
            expected.update((rel, i, m.group(1)) for m in _EXPECT.finditer(line))
    findings, _ = lint_paths([root])
    got = {(Path(f.path).relative_to(root).as_posix(), f.line, f.code) for f in findings}
    assert got == expected, (
        f"missing {sorted(expected - got)}, unexpected {sorted(got - expected)}: "
        f"{[f.message for f in findings]}"
    )
    return got, [f.message for f in findings]


# -- 1. a gather whose gradient is supplied by hand (all-gather's backward written out) ---
#
# The features of every rank are gathered with a plain all_gather, made a new leaf, and
# the loss over all of them backpropagated into it. Rank r's features then need the sum
# over ranks of `all_ND.grad`'s r-th slice: a reduce-scatter (sum) hands it back, the
# backward of all-gather done by hand. Handing back only this rank's slice of its own
# `.grad` loses the other ranks' terms, as a plain gather does.

_HAND_GATHER = """
import torch
import torch.distributed as dist
import torch.nn.functional as F


def step(feats_BD, labels_N, weight_CD):
    world = dist.get_world_size()
    parts = [torch.empty_like(feats_BD) for _ in range(world)]
    dist.all_gather(parts, feats_BD){mark}
    all_ND = torch.cat(parts).detach().requires_grad_()
    loss = F.cross_entropy(all_ND @ weight_CD.T, labels_N)
    loss.backward()
{hand_back}
    return loss.detach()
"""
_OWN_SLICE_BACK = """
    grad_BD = all_ND.grad.chunk(world)[dist.get_rank()]  # this rank's loss only
    feats_BD.backward(grad_BD)
"""
_REDUCE_SCATTER_BACK = """
    grad_BD = torch.empty_like(feats_BD)
    dist.reduce_scatter(grad_BD, list(all_ND.grad.chunk(world)))  # every rank's loss
    feats_BD.backward(grad_BD)
"""

# The same through a helper of another file, the leaf made by `requires_grad = True` and
# a hand-built gradient (`logits.backward(grad)`), its `.grad` summed by an all_reduce
# through another name before this rank's slice is taken.
_GATHER_HELPER = """
import torch
import torch.distributed as dist


def concat_all_gather(x):
    parts = [torch.ones_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x){mark}
    return torch.cat(parts)
"""
_LEAF_STEP = """
import torch
import torch.distributed as dist

from utils import concat_all_gather


class PartialClassifier(torch.nn.Module):
    def forward_backward(self, feats_BD, weight_CD):
        total_ND = concat_all_gather(feats_BD)
        total_ND.requires_grad = True
        logits_NC = total_ND @ weight_CD.T
        with torch.no_grad():
            grad_NC = torch.softmax(logits_NC, dim=1) / logits_NC.shape[0]
        logits_NC.backward(grad_NC)
        g_ND = total_ND.grad
{hand_back}
        return x_grad_BD
"""
_ALL_REDUCE_BACK = """
        dist.all_reduce(g_ND)
        x_grad_BD = g_ND.chunk(dist.get_world_size())[dist.get_rank()]
"""
_NO_SUM_BACK = """
        x_grad_BD = g_ND.chunk(dist.get_world_size())[dist.get_rank()]
"""


def _indent(text: str, by: str) -> str:
    return textwrap.indent(textwrap.dedent(text).strip("\n"), by)


@pytest.mark.parametrize("bad", [True, False], ids=["own-slice", "reduce-scatter"])
def test_hand_written_gather_backward_is_not_a_lost_gradient(tmp_path: Path, bad: bool) -> None:
    # Before: WB101 on both (the plain all_gather reaches `loss.backward()`).
    back = _OWN_SLICE_BACK if bad else _REDUCE_SCATTER_BACK
    text = _HAND_GATHER.format(
        mark="  # expect: WB101" if bad else "", hand_back=_indent(back, "    ")
    )
    _judge(tmp_path, {"train.py": text})


@pytest.mark.parametrize("bad", [True, False], ids=["no-sum", "all-reduce"])
def test_hand_written_gather_backward_through_a_helper(tmp_path: Path, bad: bool) -> None:
    # Before: WB101 on both, at the helper's gather, with the path through the method.
    back = _NO_SUM_BACK if bad else _ALL_REDUCE_BACK
    files = {
        "utils.py": _GATHER_HELPER.format(mark="  # expect: WB101" if bad else ""),
        "model.py": _LEAF_STEP.format(hand_back=_indent(back, "        ")),
    }
    _judge(tmp_path, files)


# -- 2. a gather inside an autograd.Function whose backward is written by hand -----------
#
# A vocab-parallel cross entropy: each rank of `group` holds a vocab shard V of the same
# B rows. The forward all-gathers the per-shard log-sum-exp; autograd records nothing
# inside a Function's forward, and the backward computes d loss / d local logits from
# the global log-sum-exp by hand: no gradient is meant to flow through the gather.
# Written as an nn.Module's forward instead, autograd does record it, and the gathered
# log-sum-exp cuts the softmax term out of the gradient.

_VOCAB_FORWARD = """
        world = dist.get_world_size(group)
        lse_B = torch.logsumexp(logits_BV, dim=-1)
        lse_WB = torch.empty(world, lse_B.shape[0], dtype=lse_B.dtype)
        dist.all_gather_into_tensor(lse_WB, lse_B.contiguous(), group=group){mark}
        total_B = torch.logsumexp(lse_WB, dim=0)
        start = dist.get_rank(group) * logits_BV.shape[1]
        local_B = labels_B - start
        mine_B = (local_B >= 0) & (local_B < logits_BV.shape[1])
        picked_B = logits_BV.gather(1, local_B.clamp(0, logits_BV.shape[1] - 1)[:, None])[:, 0]
        picked_B = picked_B * mine_B
        dist.all_reduce(picked_B, group=group)
"""
_VOCAB_FUNCTION = """
import torch
import torch.distributed as dist
import torch.nn.functional as F


class VocabParallelLossFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_BV, labels_B, group):
{forward}
        ctx.save_for_backward(logits_BV, total_B, local_B, mine_B)
        return total_B - picked_B

    @staticmethod
    def backward(ctx, grad_B):
        logits_BV, total_B, local_B, mine_B = ctx.saved_tensors
        probs_BV = torch.exp(logits_BV - total_B[:, None])
        vocab = probs_BV.shape[1]
        onehot_BV = F.one_hot(local_B.clamp(0, vocab - 1), vocab).to(probs_BV.dtype)
        grad_BV = grad_B[:, None] * (probs_BV - onehot_BV * mine_B[:, None])
        return grad_BV, None, None


def vocab_parallel_loss(logits_BV, labels_B, group):
    losses_B = VocabParallelLossFn.apply(logits_BV, labels_B, group)
    return losses_B.sum() / (labels_B >= 0).sum()
"""
_VOCAB_MODULE = """
import torch
import torch.distributed as dist


class VocabParallelLoss(torch.nn.Module):
    def forward(self, logits_BV, labels_B, group):
{forward}
        return (total_B - picked_B).mean()
"""


@pytest.mark.parametrize("bad", [True, False], ids=["module", "function"])
def test_gather_in_a_function_forward_wants_no_gradient(tmp_path: Path, bad: bool) -> None:
    # Before: WB101 on both; WB102 on the Function (its gather is on a group passed in,
    # its backward is not a gather's backward).
    fwd = _VOCAB_FORWARD.format(mark="  # expect: WB101" if bad else "")
    text = (_VOCAB_MODULE if bad else _VOCAB_FUNCTION).format(forward=_indent(fwd, "        "))
    _judge(tmp_path, {"loss.py": text})


# A gather layer on a group its caller passes in: the backward hands each rank its own
# slice of the incoming gradient (a batch gather's backward, without the sum over ranks:
# WB102), or the reduce-scatter (sum) that is all-gather's backward.
_GROUP_LAYER = """
import torch
import torch.distributed as dist


class GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows_BD, group):
        parts = [torch.empty_like(rows_BD) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, rows_BD, group=group)
        ctx.group = group
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad_ND):{mark}
{body}


def contrastive(rows_BD, group):
    all_ND = GatherRows.apply(rows_BD, group)
    return (rows_BD @ all_ND.T).logsumexp(dim=1).mean()
"""
_OWN_SLICE_BODY = """
        chunks = grad_ND.chunk(dist.get_world_size(ctx.group))
        return chunks[dist.get_rank(ctx.group)], None
"""
_SUMMED_BODY = """
        world = dist.get_world_size(ctx.group)
        grad_BD = torch.empty_like(grad_ND.chunk(world)[0])
        dist.reduce_scatter(grad_BD, list(grad_ND.chunk(world)), group=ctx.group)
        return grad_BD, None
"""


@pytest.mark.parametrize("bad", [True, False], ids=["own-slice", "reduce-scatter"])
def test_gather_layer_on_a_group_passed_in(tmp_path: Path, bad: bool) -> None:
    # The bad twin stays reported: a group passed in does not excuse a batch gather's
    # own-slice backward (before and after: both judged right; a guard on the change).
    text = _GROUP_LAYER.format(
        mark="  # expect: WB102" if bad else "",
        body=_indent(_OWN_SLICE_BODY if bad else _SUMMED_BODY, "        "),
    )
    _judge(tmp_path, {"layer.py": text})


# -- 3. the same collective on both paths, one of them through an early `continue` -------
#
# A sharded optimizer step: the rank that owns block `base + rank` updates it; a fresh
# state takes an early path. Collectives match by order, not by line: every rank must
# make the same sequence of them per iteration. The early path gathers and `continue`s
# past the gather after the `if`: one gather on every path (good). Without the
# `continue` the early path gathers twice while the others gather once: the ranks pair
# the wrong calls and hang (bad).

_SHARDED_STEP = """
import torch
import torch.distributed as dist


@torch.no_grad()
def step(params, state, lr):
    world, rank = dist.get_world_size(), dist.get_rank()
    padded = params + [torch.empty_like(params[-1])] * (world - len(params) % world)
    for base in range(0, len(params), world):
        if base + rank < len(params):
            p = params[base + rank]
            if p not in state:
                state[p] = torch.zeros_like(p)
                dist.all_gather(padded[base : base + world], padded[base + rank]){mark}
{early_exit}
            state[p].mul_(0.9).add_(p.grad)
            p.add_(state[p], alpha=-lr)
        dist.all_gather(padded[base : base + world], padded[base + rank])
"""


@pytest.mark.parametrize("bad", [True, False], ids=["no-continue", "continue"])
def test_collectives_match_by_order_along_each_path(tmp_path: Path, bad: bool) -> None:
    # Before: WB104 on both (the gather under the rank test has no twin in an `else`).
    text = _SHARDED_STEP.format(
        mark="  # expect: WB104" if bad else "",
        early_exit="" if bad else "                continue",
    )
    _judge(tmp_path, {"optim.py": text})


# Many `if`s after the one that splits the ranks: the paths join again after each, so
# the comparison stays linear in the statements (2**24 paths, one sequence).
_MANY_IFS = """
import torch.distributed as dist


def average(params, flags):
    rank = dist.get_rank()
    for p in params:
        if rank == 0:
            dist.all_reduce(p){mark}
{early_exit}
{ifs}
        dist.all_reduce(p)
"""


@pytest.mark.parametrize("bad", [True, False], ids=["no-continue", "continue"])
def test_the_paths_are_compared_past_many_ifs(tmp_path: Path, bad: bool) -> None:
    ifs = "\n".join(f"        if flags[{k}]:\n            p.mul_({k + 2})" for k in range(24))
    text = _MANY_IFS.format(
        mark="  # expect: WB104" if bad else "",
        early_exit="" if bad else "            continue",
        ifs=ifs,
    )
    _judge(tmp_path, {"avg.py": text})


# The same for a rank-local exit (WB105): a rank whose loss is not finite still joins
# this iteration's all_reduce (with zeros) before it `continue`s past the one the other
# ranks make.
_SKIP_STEP = """
import torch
import torch.distributed as dist


def train(model, loader, optimizer):
    for x in loader:
        loss = model(x).mean()
        if not torch.isfinite(loss):
{skip}
            continue{mark}
        loss.backward()
        flat = torch.cat([p.grad.flatten() for p in model.parameters()])
        dist.all_reduce(flat)
        optimizer.step()
        optimizer.zero_grad()
"""
_JOIN_WITH_ZEROS = """
            flat = torch.cat([torch.zeros_like(p).flatten() for p in model.parameters()])
            dist.all_reduce(flat)
"""
_JUST_SKIP = """
            optimizer.zero_grad()
"""


@pytest.mark.parametrize("bad", [True, False], ids=["skip", "join-then-skip"])
def test_an_exit_after_the_same_collective_hangs_nobody(tmp_path: Path, bad: bool) -> None:
    # Before: WB105 on both (the `continue` skips the all_reduce after the `if`).
    text = _SKIP_STEP.format(
        mark="  # expect: WB105" if bad else "",
        skip=_indent(_JUST_SKIP if bad else _JOIN_WITH_ZEROS, "            "),
    )
    _judge(tmp_path, {"train.py": text})


def test_a_function_forward_runs_with_gradient_recording_off() -> None:
    # The framework fact the WB101 exemption above reads (torch 2.13): nothing inside an
    # autograd.Function's forward is recorded; its backward alone gives the gradient.
    torch = pytest.importorskip("torch")
    seen: list[bool] = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            seen.append(torch.is_grad_enabled())
            return x * 2

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            return grad

    x = torch.ones(3, requires_grad=True)
    Probe.apply(x).sum().backward()
    assert seen == [False]
    assert torch.equal(x.grad, torch.ones(3))  # the hand-written backward, not 2 * ones


# Labels gathered to pair with the gathered features: an integer tensor used as an index
# (`scatter_`, `gather`, a loss's target) carries no gradient and needs none. The bad
# twin gathers the features themselves into the same loss.
_GATHERED_LABELS = """
import torch
import torch.distributed as dist


def concat_all_gather(x):
    parts = [torch.ones_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x){mark}
    return torch.cat(parts)


def margin_step(model, head, x, labels_B):
    feats_BD = model(x)
    all_labels_N = concat_all_gather(labels_B)
    all_feats_ND = {features}
    logits_NC = head(all_feats_ND, all_labels_N)
    onehot_NC = torch.zeros_like(logits_NC).scatter_(1, all_labels_N[:, None], 1.0)
    loss = -(logits_NC.log_softmax(dim=1) * onehot_NC).sum(dim=1).mean()
    loss.backward()
"""


@pytest.mark.parametrize("bad", [True, False], ids=["features", "labels-only"])
def test_gathered_labels_need_no_gradient(tmp_path: Path, bad: bool) -> None:
    # Before: WB101 on both (the gathered labels reach the loss through `head(...)`).
    text = _GATHERED_LABELS.format(
        mark="  # expect: WB101" if bad else "",
        features="concat_all_gather(feats_BD)" if bad else "feats_BD.repeat(2, 1)",
    )
    _judge(tmp_path, {"train.py": text})


# A gather layer used on both sides of the similarity: `torch.transpose(all_c, 0, 1)` is
# the gathered contexts (a function of an imported module reads its argument's rows), so
# every rank computes the same loss of the whole batch and its own slice of that loss's
# gradient is the whole gradient of its rows (a learning-rate scale): no WB102. The bad
# twin pairs this rank's own queries with the gathered contexts.
_BOTH_SIDES = """
import torch
import torch.distributed as dist
import torch.nn.functional as F


class GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BD):
        parts = [torch.empty_like(x_BD) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x_BD)
        return torch.cat(parts).contiguous()

    @staticmethod
    def backward(ctx, grad_ND):{mark}
        return grad_ND.chunk(dist.get_world_size())[dist.get_rank()].contiguous()


def retrieval_step(model, q_tokens, c_tokens):
    q_BD, c_BD = model(q_tokens, c_tokens)
    all_c_ND = GatherRows.apply(c_BD)
    queries = {queries}
    scores = torch.matmul(queries, torch.transpose(all_c_ND, 0, 1))
    labels = torch.arange(scores.shape[0])
    loss = F.nll_loss(F.log_softmax(scores, dim=1), labels) * dist.get_world_size()
    loss.backward()
"""


@pytest.mark.parametrize("bad", [True, False], ids=["own-queries", "gathered-queries"])
def test_a_transposed_gathered_operand_is_gathered(tmp_path: Path, bad: bool) -> None:
    # Before (6463f64): both misjudged, the root of `torch.transpose(all_c_ND, 0, 1)` read
    # as `torch`: the own-queries twin not reported, the gathered one reported.
    text = _BOTH_SIDES.format(
        mark="  # expect: WB102" if bad else "",
        queries="q_BD" if bad else "GatherRows.apply(q_BD)",
    )
    _judge(tmp_path, {"train.py": text})


# Per-domain statistics of the whole batch: the per-token losses and the integer domain
# ids are all-gathered, bucketed into a fresh `zeros(n_domains)` and divided by the
# counts and the sequence length (`losses_BT.shape[1]`, a number). The loss module
# returns them beside the loss it optimises, a mean of this rank's tokens; neither
# gather reaches a backward. The bad twin adds the gathered statistics to the optimised
# loss, where they carry no gradient of the other ranks' tokens.
_DOMAIN_STATS = """
import torch
import torch.distributed as dist
from torch import nn


def compute_per_domain_loss(losses_BT, domain_ids_B, n_domains):
    parts = [torch.empty_like(losses_BT) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, losses_BT.contiguous()){mark}
    losses_NT = torch.cat(parts)
    id_parts = [torch.empty_like(domain_ids_B) for _ in range(dist.get_world_size())]
    dist.all_gather(id_parts, domain_ids_B.contiguous())
    ids_N = torch.cat(id_parts)
    sums = torch.zeros(n_domains).index_add_(0, ids_N, losses_NT.sum(dim=-1))
    counts = torch.bincount(ids_N, minlength=n_domains)
    per_domain = sums / (counts * losses_BT.shape[1])
    return losses_NT, per_domain, counts


class LossWithDomainStats(nn.Module):
    def __init__(self, n_domains):
        super().__init__()
        self.n_domains = n_domains

    def forward(self, logits_BTV, labels_BT, domain_ids_B):
        losses_BT = nn.functional.cross_entropy(
            logits_BTV.transpose(1, 2), labels_BT, reduction="none"
        )
        ce_loss = losses_BT.mean()
        _, per_domain, counts = compute_per_domain_loss(losses_BT, domain_ids_B, self.n_domains)
        return {{"loss": {loss}, "domain_losses": per_domain, "counts": counts}}


def train_step(model, criterion, batch, optimizer):
    out = criterion(model(batch["tokens"]), batch["labels"], batch["domains"])
    out["loss"].backward()
    optimizer.step()
    optimizer.zero_grad()
    return out["domain_losses"].tolist()
"""


@pytest.mark.parametrize("bad", [True, False], ids=["stats-in-loss", "stats-beside"])
def test_gathered_statistics_beside_the_loss_are_no_loss(tmp_path: Path, bad: bool) -> None:
    # Before (6463f64): the stats-beside twin reported WB101 (the helper, named `*loss*`,
    # returns the gathered values, read as derived from this rank's input through the
    # sizes `zeros(n_domains)` and `.shape[1]`; and the module's dict read as one loss).
    text = _DOMAIN_STATS.format(
        mark="  # expect: WB101" if bad else "",
        loss="ce_loss + per_domain.mean()" if bad else "ce_loss",
    )
    _judge(tmp_path, {"train.py": text})


# -- a staggered context manager: the barriers split across __enter__ and __exit__ -------
#
# Objects built by every rank at once may not fit in memory, so even ranks wait at a
# barrier on the way into the `with` block and odd ranks at one on the way out, then
# every rank meets at a last one: two barriers per rank, matched by order, nobody hangs
# (good). When the way out tests the same parity as the way in (even ranks make three
# barriers, odd ones one), or only rank 1 (rank 3 makes none of them), the counts differ
# and the ranks hang (bad).

_STAGGERED = """
import torch.distributed as dist


class StaggeredCreation:
    def __init__(self, local_rank, world_size):
        self.local_rank = local_rank
        self.world_size = world_size

    def __enter__(self):
        if self.world_size > 1 and self.local_rank % 2 == 0:
            dist.barrier(){mark}
        return self

    def __exit__(self, *exc):
        if self.world_size > 1:
            if {exit_test}:
                dist.barrier(){mark}
            dist.barrier()


def build(local_rank, world_size, make):
    with StaggeredCreation(local_rank, world_size):
        return make()
"""


@pytest.mark.parametrize(
    "exit_test",
    ["self.local_rank % 2 == 1", "self.local_rank % 2 == 0", "self.local_rank == 1"],
    ids=["odd-on-exit", "even-on-both", "rank-one-on-exit"],
)
def test_barriers_split_across_enter_and_exit(tmp_path: Path, exit_test: str) -> None:
    # Before (5719fad): odd-on-exit reported WB104 on both barriers (each method was
    # judged alone, and each barrier has no twin in its own `if`'s other branch).
    bad = exit_test != "self.local_rank % 2 == 1"
    text = _STAGGERED.format(mark="  # expect: WB104" if bad else "", exit_test=exit_test)
    _judge(tmp_path, {"ctx.py": text})


# The same through an early `return` (WB105): odd ranks leave `__enter__` before the
# barrier and make it in `__exit__` instead, one barrier per rank (good); when the way
# out barriers on even ranks, even ranks make two and odd ones none (bad).
_LEAVE_EARLY = """
import torch.distributed as dist


class OddRanksLast:
    def __init__(self, local_rank):
        self.local_rank = local_rank

    def __enter__(self):
        if self.local_rank % 2 == 1:
            return self{exit_mark}
        dist.barrier()
        return self

    def __exit__(self, *exc):
        if self.local_rank % 2 == {parity}:
            dist.barrier(){mark}
"""


@pytest.mark.parametrize("bad", [True, False], ids=["even-on-exit", "odd-on-exit"])
def test_early_return_from_enter_met_in_exit(tmp_path: Path, bad: bool) -> None:
    # Before (5719fad): odd-on-exit reported WB105 on the return and WB104 on the barrier.
    text = _LEAVE_EARLY.format(
        exit_mark="  # expect: WB105" if bad else "",
        mark="  # expect: WB104" if bad else "",
        parity=0 if bad else 1,
    )
    _judge(tmp_path, {"ctx.py": text})
