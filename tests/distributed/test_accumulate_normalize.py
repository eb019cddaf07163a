"""`Accumulator.step(..., normalize=Normalize(mode, items=...))` on W = 3 gloo ranks x K = 3 micro-batches.

Every mode against one process computing the mode's definition on the whole
batch (float64; tolerance 1e-12: sums of ~100 float64 terms round at ~1e-15),
with sequences and groups that straddle micro-batches and ranks, a fully masked
sequence and an empty micro-batch. Mutation: the per-micro-batch version of each
mode (`Normalize._scope = "micro_batch"`) must fail the same comparison. The
counting pass runs no forward (counted). Bad input: the same error on every
rank, parameters untouched.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from tests.support.harness import RankError, run_ranks, run_ranks_outcomes
from wholebatch import Accumulator, Normalize
from wholebatch.train import normalize
from wholebatch.train.normalize import match_normalization, mismatch_text, mode_weights

W, K, D = 3, 3, 3
TOL = 1e-12
LENGTHS = [5, 9, 3, 7, 6, 4, 8, 2, 5, 7, 6, 3]  # 12 sequences, groups of 3 -> 4 groups
CUTS = [7, 11, 0, 9, 6, 8, 10, 5, 9]  # items per micro-batch, rank-major: one empty micro-batch
Batch = dict[str, Tensor]


def make_data() -> list[list[Batch]]:
    """[rank][micro-batch] of packed items; sequence s is in group s // 3."""
    gen = torch.Generator().manual_seed(7)
    seq = torch.cat([torch.full((n,), s) for s, n in enumerate(LENGTHS)])
    n = seq.numel()
    assert sum(CUTS) == n
    mask = torch.rand(n, generator=gen) > 0.25
    mask[seq == 4] = False  # a sequence with every item masked out (a truncated completion)
    mask[seq == 3] = True  # its group still has items
    x = torch.randn(n, D, generator=gen, dtype=torch.float64)
    y = torch.randn(n, generator=gen, dtype=torch.float64)
    parts, start = [], 0
    for c in CUTS:
        sl = slice(start, start + c)
        parts.append(
            {"x": x[sl], "y": y[sl], "mask": mask[sl], "seq": seq[sl], "grp": seq[sl] // 3}
        )
        start += c
    return [parts[r * K : (r + 1) * K] for r in range(W)]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 4), nn.Tanh(), nn.Linear(4, 1)).double()


def per_item(net: nn.Module, mb: Batch) -> Tensor:
    out: Tensor = (net(mb["x"]).squeeze(-1) - mb["y"]) ** 2  # [I]
    return out


def items_of(mb: Batch) -> dict[str, Tensor]:
    return {"mask": mb["mask"], "sequence": mb["seq"], "group": mb["grp"]}


def constant_of(data: list[list[Batch]]) -> float:
    # Dr. GRPO's constant: max completion length x number of sequences.
    return float(max(LENGTHS) * len(LENGTHS))


def definition(mode: str, data: list[list[Batch]]) -> tuple[float, list[Tensor]]:
    """One process, the whole batch: the mode's formula written out, and its gradient."""
    net = model()
    whole = {k: torch.cat([mb[k] for rank in data for mb in rank]) for k in data[0][0]}
    loss_I, m = per_item(net, whole), whole["mask"]
    if mode == "token":
        loss = loss_I[m].sum() / m.sum()
    elif mode == "constant":
        loss = loss_I[m].sum() / constant_of(data)
    else:
        key = whole["seq"] if mode == "sequence" else whole["grp"]
        units = sorted(set(key.tolist()))
        terms = []
        for u in units:
            sel = (key == u) & m
            terms.append(loss_I[sel].sum() / max(int(sel.sum()), 1))
        loss = torch.stack(terms).sum() / len(units)
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in net.parameters()]  # type: ignore[union-attr]


def _rank_step(mode: str, scope: str, inline_rows: int = 64) -> dict[str, Any]:
    rank = dist.get_rank()
    default_rows = normalize.INLINE_ROWS
    normalize.INLINE_ROWS = inline_rows  # 2: the table does not fit in begin's row
    data = make_data()
    net = model()
    forwards = [0]
    net.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    at_items: list[int] = []

    def items(mb: Batch) -> dict[str, Tensor]:
        at_items.append(forwards[0])
        return items_of(mb)

    before = [p.detach().clone() for p in net.parameters()]
    acc = Accumulator(
        nn.parallel.DistributedDataParallel(net), torch.optim.SGD(net.parameters(), lr=1.0)
    )
    constant = constant_of(data) if mode == "constant" else None
    Normalize._scope = scope  # type: ignore[assignment]
    try:
        stats = acc.step(
            data[rank], per_item, normalize=Normalize(mode, items=items, constant=constant)
        )  # type: ignore[arg-type]
    finally:
        Normalize._scope = "step"
        normalize.INLINE_ROWS = default_rows
    step = [
        b - p.detach() for b, p in zip(before, net.parameters(), strict=True)
    ]  # lr 1: the gradient
    return {
        "loss": stats.loss,
        "items": stats.items,
        "grad": step,
        "at_items": at_items,
        "forwards": forwards[0],
    }


def _max_err(got: list[Tensor], want: list[Tensor]) -> float:
    return max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize(
    ("mode", "inline_rows"),
    [
        ("token", 64),
        ("sequence", 64),
        ("constant", 64),
        ("group", 64),
        ("sequence", 2),
        ("group", 2),
    ],
)
def test_each_mode_equals_its_whole_batch_definition(mode: str, inline_rows: int) -> None:
    # inline_rows 64: the table rides on begin's all-gather; 2: it takes its own all-gather.
    data = make_data()
    want_loss, want_grad = definition(mode, data)
    got = run_ranks(W, _rank_step, mode, "step", inline_rows)
    for r in got:
        assert _max_err(r["grad"], want_grad) <= TOL, (mode, _max_err(r["grad"], want_grad))
        assert abs(r["loss"] - want_loss) <= TOL * max(1.0, abs(want_loss))
        assert r["forwards"] == K
        if mode != "token":  # the counting pass: K items() calls before the first forward
            assert r["at_items"] == [0] * K, r["at_items"]
    assert len({r["loss"] for r in got}) == 1  # StepStats.loss: the same on every rank
    assert got[0]["items"] == float(sum(int(mb["mask"].sum()) for rank in data for mb in rank))


@pytest.mark.parametrize("mode", ["token", "sequence", "constant", "group"])
def test_the_per_micro_batch_version_of_each_mode_is_caught(mode: str) -> None:
    # Mutation: each micro-batch normalised on its own, the K x W losses averaged.
    _, want_grad = definition(mode, make_data())
    got = run_ranks(W, _rank_step, mode, "micro_batch")
    assert _max_err(got[0]["grad"], want_grad) > 1e-6


def test_mode_weights_and_match_name_the_normalisation() -> None:
    # The pure helper verify can call: which mode (whole step or per micro-batch) weights match.
    data = make_data()
    items = [[items_of(mb) for mb in rank] for rank in data]
    for mode in ("token", "sequence", "group"):
        for scope in ("step", "micro_batch"):
            w = mode_weights(mode, items, scope=scope)  # type: ignore[arg-type]
            assert match_normalization(items, w) == (mode, scope)
    text = mismatch_text(("sequence", "micro_batch"), ("sequence", "step"))
    assert text == (
        "the step takes the mean of sequence means per micro-batch; the reference takes "
        "the mean of sequence means over the whole step"
    )


# -- bad input: the same error on every rank, nothing stepped ------------------------


def _rank_bad(case: str) -> list[Tensor]:
    rank = dist.get_rank()
    data = make_data()
    net = model()
    forwards = [0]
    net.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    before = [p.detach().clone() for p in net.parameters()]
    acc = Accumulator(
        nn.parallel.DistributedDataParallel(net), torch.optim.SGD(net.parameters(), lr=1.0)
    )
    mode, constant = "sequence", None
    mbs = [dict(mb) for mb in data[rank]]
    loss_fn = per_item
    if case == "masked_item_without_id" and rank == 1:
        mbs[0]["seq"] = torch.where(mbs[0]["mask"], -1, mbs[0]["seq"])
    if case == "empty_group":
        mode = "group"
        for mb in mbs:  # group 2 (sequences 6, 7, 8) keeps its ids but loses every item
            mb["mask"] = mb["mask"] & (mb["grp"] != 2)
    if case == "sequence_in_two_groups":
        mode = "group"
        if rank == 2:
            mbs[0]["grp"] = mbs[0]["grp"] + 100 * (mbs[0]["seq"] == mbs[0]["seq"][0])
    if case == "mode_differs":
        mode = "group" if rank == 0 else "sequence"
    if case == "constant_differs":
        mode, constant = "constant", 10.0 + rank
    items_fn = items_of
    if case == "items_raise" and rank == 0:

        def items_fn(mb: Batch) -> dict[str, Tensor]:
            raise ValueError("no ids in this batch")

    if case == "loss_shape" and rank == 2:

        def loss_fn(net: nn.Module, mb: Batch) -> Tensor:
            return per_item(net, mb)[:-1] if mb["x"].shape[0] else per_item(net, mb)

    try:
        acc.step(mbs, loss_fn, normalize=Normalize(mode, items=items_fn, constant=constant))  # type: ignore[arg-type]
    finally:
        assert all(torch.equal(b, p) for b, p in zip(before, net.parameters(), strict=True))
        assert all(p.grad is None for p in net.parameters())
        if case != "loss_shape":
            assert forwards[0] == 0  # refused before any forward
    return []


BAD = {
    "masked_item_without_id": "items in the mask have no sequence id (ids < 0 mark padding)",
    "empty_group": "normalize='group': groups [2] have no item in the mask on any rank",
    "sequence_in_two_groups": "carry more than one group id",
    "mode_differs": "normalize differs across ranks {0: 'group', 1: 'sequence', 2: 'sequence'}",
    "constant_differs": "Normalize constant differs across ranks {0: 10, 1: 11, 2: 12}",
    "items_raise": "items(micro_batches[0]) raised ValueError: no ids in this batch (on ranks [0])",
    "loss_shape": "loss_fn returned losses of shape (9,) for micro_batches[0] but items() gave a mask of shape (10,)",
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_raises_the_same_error_on_every_rank(case: str) -> None:
    outcomes = run_ranks_outcomes(W, _rank_bad, case, timeout=60)
    assert all(isinstance(o, RankError) for o in outcomes), outcomes
    messages = {o.message for o in outcomes if isinstance(o, RankError)}
    assert len(messages) == 1, messages
    assert BAD[case] in messages.pop()
