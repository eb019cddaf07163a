"""`wholebatch.integrations.lightly.NTXentLoss` against the real lightly 1.6.0 NT-Xent, on gloo ranks.

A tiny encoder (float64) applied to both views, wrapped in DDP, runs a few
steps (forward + backward, no optimizer: the memory bank changes between
steps) on every rank; its parameter gradients after DDP's mean are compared
with the REFERENCE (one process, the whole batch in rank order) and, where
lightly is exact (equal rows, `gather_distributed=True`), with lightly itself
on the same ranks. Reference without a bank: SimCLR's formula over 2N views.
Reference with a bank: lightly's own loss in ONE process on the whole batch,
which is what the integration's whole-batch semantics are defined as.

Mutations: lightly's default `gather_distributed=False` under DDP (each rank
its own negatives, and its own bank) must fail the same assertions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.support.harness import run_ranks, run_ranks_outcomes
from tests.support.peers import SKIP_REASON, load_lightly_ntxent
from wholebatch.comm import get_rank, get_world_size
from wholebatch.errors import WholebatchError
from wholebatch.integrations.lightly import NTXentLoss

# float64; sums of a few hundred terms of size <= ~10: round-off ~1e-13.
F64: dict[str, float] = dict(rtol=1e-10, atol=1e-10)
D_IN, D = 5, 4
STEPS = 3  # the bank fills and wraps within these (K = 7 rows, N = 4 .. 6 per step)
BANK = (7, D)

needs_peer = pytest.mark.skipif(load_lightly_ntxent() is None, reason=SKIP_REASON.format("lightly"))

Steps = list[tuple[float, dict[str, Tensor]]]


class TwoViews(nn.Module):
    """One encoder for both views, in one forward (as DDP wants)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(D_IN, 6), nn.Tanh(), nn.Linear(6, D))

    def forward(self, x0: Tensor, x1: Tensor) -> tuple[Tensor, Tensor]:
        return self.enc(x0), self.enc(x1)


def _views(sizes: Sequence[int], step: int) -> list[tuple[Tensor, Tensor]]:
    """Rank r's two views at `step`, seeded per rank and step: every rank's data differs."""
    out = []
    for r, n in enumerate(sizes):
        gen = torch.Generator().manual_seed(1000 * step + r)
        out.append(
            (
                torch.randn(n, D_IN, generator=gen, dtype=torch.float64),
                torch.randn(n, D_IN, generator=gen, dtype=torch.float64),
            )
        )
    return out


def _loss(impl: str, kwargs: dict[str, Any]) -> nn.Module:
    torch.manual_seed(7)  # lightly draws its bank at construction: the same draw for both
    cls = NTXentLoss if impl == "ours" else load_lightly_ntxent().NTXentLoss  # type: ignore[union-attr]
    return cls(**kwargs).double()


def _steps(model: nn.Module, loss_fn: nn.Module, batches: list[tuple[Tensor, Tensor]]) -> Steps:
    out: Steps = []
    for x0, x1 in batches:
        loss = loss_fn(*model(x0, x1))
        loss.backward()
        inner = model.module if isinstance(model, DDP) else model
        out.append((float(loss.detach()), {n: p.grad.clone() for n, p in inner.named_parameters()}))  # type: ignore[union-attr]
        model.zero_grad()
    return out


def _rank_steps(impl: str, kwargs: dict[str, Any], sizes: list[int]) -> Steps:
    r, w = get_rank(), get_world_size()
    torch.manual_seed(0)
    model = TwoViews().double()
    wrapped: nn.Module = DDP(model) if w > 1 else model
    batches = [_views(sizes, s)[r] for s in range(STEPS)]
    return _steps(wrapped, _loss(impl, kwargs), batches)


def _reference(kwargs: dict[str, Any], sizes: list[int]) -> Steps:
    """One process on the whole batch of each step."""
    torch.manual_seed(0)
    model = TwoViews().double()
    batches = []
    for s in range(STEPS):
        views = _views(sizes, s)
        batches.append((torch.cat([a for a, _ in views]), torch.cat([b for _, b in views])))
    if kwargs.get("memory_bank_size", 0):
        return _steps(model, _loss("peer", {**kwargs, "gather_distributed": False}), batches)
    tau = kwargs["temperature"]

    def simclr(out0: Tensor, out1: Tensor) -> Tensor:  # SimCLR's formula over 2N views
        z = F.normalize(torch.cat([out0, out1]), dim=1)
        n = out0.shape[0]
        logits = (z @ z.T / tau).masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
        return F.cross_entropy(logits, torch.cat([torch.arange(n) + n, torch.arange(n)]))

    return _steps(model, simclr, batches)  # type: ignore[arg-type]


def _assert_steps(got: Steps, want: Steps, what: str, values: bool = True) -> None:
    for s, ((value, grads), (ref_value, ref_grads)) in enumerate(zip(got, want, strict=True)):
        if values:
            assert value == pytest.approx(ref_value, rel=1e-12), f"{what}, step {s} value"
        for name in ref_grads:
            torch.testing.assert_close(
                grads[name], ref_grads[name], **F64,
                msg=lambda m, s=s, name=name: f"{what}, step {s}, grad of {name}: {m}",
            )  # fmt: skip


SIMCLR = {"temperature": 0.3}
MOCO = {"temperature": 0.2, "memory_bank_size": BANK}


# ---------------------------------------------------------------------------
# Where lightly is exact: ours equals it
# ---------------------------------------------------------------------------


@needs_peer
@pytest.mark.parametrize("kwargs", [SIMCLR, MOCO], ids=["simclr", "bank"])
@pytest.mark.parametrize("sizes", [[5], [2, 2], [2, 2, 2]])
def test_equals_lightly_where_it_is_exact(kwargs: dict[str, Any], sizes: list[int]) -> None:
    kwargs = {**kwargs, "gather_distributed": True}
    peer = run_ranks(len(sizes), _rank_steps, "peer", kwargs, sizes)
    mine = run_ranks(len(sizes), _rank_steps, "ours", {**kwargs, "tile_size": 2}, sizes)
    ref = _reference(kwargs, sizes)
    # lightly returns this rank's mean; the mean over equal ranks is the whole batch's.
    peer_means = [(sum(p[s][0] for p in peer) / len(peer), peer[0][s][1]) for s in range(STEPS)]
    _assert_steps(peer_means, ref, "lightly")
    for r in range(len(sizes)):
        _assert_steps(mine[r], peer[r], f"rank {r} vs lightly", values=False)
        _assert_steps(mine[r], ref, f"rank {r} vs reference")


# ---------------------------------------------------------------------------
# Where lightly is wrong or crashes: ours equals the reference
# ---------------------------------------------------------------------------


# the bank's reference is lightly's own loss (needs the peer)
@pytest.mark.parametrize(
    "kwargs", [SIMCLR, pytest.param(MOCO, marks=needs_peer)], ids=["simclr", "bank"]
)
@pytest.mark.parametrize("sizes", [[4, 1], [2, 0, 3]])
def test_uneven_rows_and_an_empty_rank(kwargs: dict[str, Any], sizes: list[int]) -> None:
    # lightly aborts gloo on uneven rows and raises on an empty rank.
    ref = _reference(kwargs, sizes)
    for r, got in enumerate(run_ranks(len(sizes), _rank_steps, "ours", kwargs, sizes)):
        _assert_steps(got, ref, f"rank {r}")


@needs_peer
@pytest.mark.parametrize("kwargs", [SIMCLR, MOCO], ids=["simclr", "bank"])
def test_lightly_default_flags_fail_the_same_assertion(kwargs: dict[str, Any]) -> None:
    # MUTATION: gather_distributed=False, lightly's default, under DDP.
    sizes = [3, 3]
    ref = _reference(kwargs, sizes)
    peer = run_ranks(2, _rank_steps, "peer", {**kwargs, "gather_distributed": False}, sizes)
    with pytest.raises(AssertionError, match="grad of enc"):
        _assert_steps(peer[0], ref, "lightly", values=False)
    for r, got in enumerate(run_ranks(2, _rank_steps, "ours", kwargs, sizes)):
        _assert_steps(got, ref, f"rank {r}")


# ---------------------------------------------------------------------------
# Arguments and the bank's bookkeeping
# ---------------------------------------------------------------------------


def test_bad_arguments_single_process() -> None:
    with pytest.raises(WholebatchError, match=r"temperature=0.0; \|temperature\| must be >= 1e-08"):
        NTXentLoss(temperature=0.0)
    with pytest.raises(WholebatchError, match="does not give the feature dimension"):
        NTXentLoss(memory_bank_size=4096)
    with pytest.raises(WholebatchError, match="expected \\(num_features, dim\\)"):
        NTXentLoss(memory_bank_size=(1, 2, 3))
    loss = NTXentLoss(memory_bank_size=(8, 3))
    with pytest.raises(
        WholebatchError, match="the embeddings have dim 4 but the memory bank has 3"
    ):
        loss(torch.randn(2, 4), torch.randn(2, 4))


def test_eval_mode_leaves_the_bank_alone() -> None:
    loss = NTXentLoss(memory_bank_size=(8, 3))
    before = loss.bank.clone()
    loss(torch.randn(2, 3), torch.randn(2, 3))  # no grad: not training
    assert torch.equal(loss.bank, before) and int(loss.bank_ptr) == 0
    loss(torch.randn(2, 3, requires_grad=True), torch.randn(2, 3))
    assert not torch.equal(loss.bank, before) and int(loss.bank_ptr) == 2


def _rank_mixed_modes() -> None:
    r = get_rank()
    loss = NTXentLoss(memory_bank_size=(8, 3))
    loss(torch.randn(2, 3, requires_grad=r == 0), torch.randn(2, 3))


def test_mixed_train_and_eval_same_error_on_every_rank() -> None:
    outcomes = run_ranks_outcomes(2, _rank_mixed_modes)
    msgs = {getattr(o, "message", None) for o in outcomes}
    assert len(msgs) == 1, msgs
    assert "requires grad on some ranks and not on others" in str(msgs.pop())


def _rank_bank() -> Tensor:
    torch.manual_seed(get_rank())  # a different draw on every rank
    loss = NTXentLoss(memory_bank_size=(4, 3))
    loss(torch.randn(1, 3), torch.randn(1, 3))
    return loss.bank


def test_bank_is_rank_zeros_on_every_rank() -> None:
    banks = run_ranks(3, _rank_bank)
    torch.manual_seed(0)
    want = NTXentLoss(memory_bank_size=(4, 3)).bank
    for bank in banks:
        torch.testing.assert_close(bank, want, rtol=0, atol=0)
