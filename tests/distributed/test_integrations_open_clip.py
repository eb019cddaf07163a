"""`wholebatch.integrations.open_clip` against the real open_clip 3.3.0 `loss.py`, on gloo ranks.

A tiny two-tower model (float64) with `logit_scale` (and `logit_bias`) as
parameters, wrapped in DDP, runs one backward on every rank; its parameter
gradients after DDP's mean are compared with

- the REFERENCE: the same model in one process on the whole batch (rows in
  rank order), the loss written from its formula with the N x N logits;
- the PEER: open_clip's own `ClipLoss` / `SigLipLoss` on the same ranks, where
  open_clip is exact (equal rows, `gather_with_grad=True`).

Where open_clip is wrong (its default flags under DDP) or crashes (uneven rows,
which abort gloo; an empty rank) only the reference is compared with. The
peer's default flags are the mutation: the same assertion must reject them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.support.harness import run_ranks, run_ranks_outcomes
from tests.support.peers import SKIP_REASON, load_open_clip_loss
from wholebatch.comm import get_rank, get_world_size
from wholebatch.errors import WholebatchError, WholebatchTypeError
from wholebatch.integrations import open_clip as ours

# float64; each value sums a few hundred terms of size <= ~20: round-off ~1e-13.
# 1e-10 leaves room and rejects the peer's default flags (off by a factor W).
F64: dict[str, float] = dict(rtol=1e-10, atol=1e-10)
D_IMG, D_TXT, D = 5, 6, 4

needs_peer = pytest.mark.skipif(
    load_open_clip_loss() is None, reason=SKIP_REASON.format("open_clip")
)


class Towers(nn.Module):
    """Image and text projections, normalised, with the learnable scale (and bias) open_clip keeps."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.img = nn.Linear(D_IMG, D)
        self.txt = nn.Linear(D_TXT, D)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0)))
        self.logit_bias = nn.Parameter(torch.tensor(-2.0)) if bias else None

    def forward(self, x_img: Tensor, x_txt: Tensor) -> tuple[Tensor, ...]:
        out = (
            F.normalize(self.img(x_img), dim=-1),
            F.normalize(self.txt(x_txt), dim=-1),
            self.logit_scale.exp(),
        )
        return out if self.logit_bias is None else (*out, self.logit_bias)


def _model(bias: bool) -> Towers:
    torch.manual_seed(0)
    return Towers(bias).double()


def _inputs(sizes: Sequence[int]) -> list[tuple[Tensor, Tensor]]:
    """Rank r's rows, seeded per rank: every rank's data differs."""
    out = []
    for r, n in enumerate(sizes):
        gen = torch.Generator().manual_seed(100 + r)
        out.append(
            (
                torch.randn(n, D_IMG, generator=gen, dtype=torch.float64),
                torch.randn(n, D_TXT, generator=gen, dtype=torch.float64),
            )
        )
    return out


def _loss_class(impl: str, kind: str) -> type[nn.Module]:
    module: Any = ours if impl == "ours" else load_open_clip_loss()
    return module.ClipLoss if kind == "clip" else module.SigLipLoss  # type: ignore[no-any-return]


def _rank_step(
    impl: str, kind: str, kwargs: dict[str, Any], sizes: list[int], bias: bool
) -> tuple[float, dict[str, Tensor]]:
    """One forward + backward on this rank; (loss value, parameter gradients after DDP)."""
    r, w = get_rank(), get_world_size()
    model = _model(bias)
    wrapped: nn.Module = DDP(model) if w > 1 else model
    loss_fn = _loss_class(impl, kind)(rank=r, world_size=w, **kwargs)
    out = loss_fn(*wrapped(*_inputs(sizes)[r]), output_dict=True)
    loss = out["contrastive_loss"]
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]


def _reference(kind: str, sizes: list[int], bias: bool) -> tuple[float, dict[str, Tensor]]:
    """One process, the whole batch, the loss written from its formula (N x N logits)."""
    model = _model(bias)
    xs = _inputs(sizes)
    outs = model(torch.cat([x for x, _ in xs]), torch.cat([t for _, t in xs]))
    i_ND, t_ND, s = outs[:3]
    b = outs[3] if bias else 0.0
    n = i_ND.shape[0]
    logits_NN = s * i_ND @ t_ND.T + b
    if kind == "clip":
        labels = torch.arange(n)
        loss = (F.cross_entropy(logits_NN, labels) + F.cross_entropy(logits_NN.T, labels)) / 2
    else:
        y_NN = 2 * torch.eye(n, dtype=torch.float64) - 1
        loss = -F.logsigmoid(y_NN * logits_NN).sum() / n
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]


def _assert_grads(got: dict[str, Tensor], want: dict[str, Tensor], what: str) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], **F64, msg=lambda m, name=name: f"{what}, grad of {name}: {m}"
        )


def _run(
    impl: str, kind: str, sizes: list[int], kwargs: dict[str, Any] | None = None, bias: bool = False
) -> list[tuple[float, dict[str, Tensor]]]:
    return run_ranks(len(sizes), _rank_step, impl, kind, kwargs or {}, sizes, bias)


# ---------------------------------------------------------------------------
# Where open_clip is exact: ours equals it (and the reference)
# ---------------------------------------------------------------------------


@needs_peer
@pytest.mark.parametrize(
    ("kind", "sizes", "kwargs"),
    [
        ("clip", [3], {}),
        ("clip", [3, 3], {"gather_with_grad": True}),
        ("clip", [2, 2, 2], {"gather_with_grad": True, "local_loss": True}),
        ("siglip", [4], {}),
        ("siglip", [2, 2, 2], {}),  # dist_impl "bidir" (open_clip's default)
        ("siglip", [3, 3], {"dist_impl": "gather"}),
    ],
)
def test_equals_open_clip_where_it_is_exact(
    kind: str, sizes: list[int], kwargs: dict[str, Any]
) -> None:
    bias = kind == "siglip" or len(sizes) == 2  # SigLIP's bias; ClipLoss's optional one once
    peer = _run("peer", kind, sizes, kwargs, bias)
    mine = _run("ours", kind, sizes, {**kwargs, "tile_size": 2}, bias)
    ref_value, ref_grads = _reference(kind, sizes, bias)
    # open_clip's value is the rank's share when local_loss=True or for SigLIP; its mean is L.
    peer_mean = sum(v for v, _ in peer) / len(peer)
    assert peer_mean == pytest.approx(ref_value, rel=1e-12)
    for r, ((value, grads), (_, peer_grads)) in enumerate(zip(mine, peer, strict=True)):
        assert value == pytest.approx(ref_value, rel=1e-12), f"rank {r}"
        _assert_grads(grads, peer_grads, f"rank {r} vs open_clip")
        _assert_grads(grads, ref_grads, f"rank {r} vs reference")


# ---------------------------------------------------------------------------
# Where open_clip is wrong or crashes: ours equals the reference
# ---------------------------------------------------------------------------


@needs_peer
@pytest.mark.parametrize("kwargs", [{}, {"local_loss": True}])
def test_open_clip_default_flags_fail_the_same_assertion(kwargs: dict[str, Any]) -> None:
    # MUTATION: open_clip's training-script defaults (no gradient through the gather).
    sizes = [3, 3]
    _, ref_grads = _reference("clip", sizes, False)
    peer = _run("peer", "clip", sizes, kwargs)
    with pytest.raises(AssertionError, match="grad of img"):
        _assert_grads(peer[0][1], ref_grads, "open_clip defaults")
    for r, (_, grads) in enumerate(_run("ours", "clip", sizes, kwargs)):
        _assert_grads(grads, ref_grads, f"rank {r}")


@pytest.mark.parametrize("kind", ["clip", "siglip"])
@pytest.mark.parametrize("sizes", [[4, 1], [2, 0, 3]])
def test_uneven_rows_and_an_empty_rank(kind: str, sizes: list[int]) -> None:
    # open_clip aborts gloo on uneven rows and returns NaN on a 0-row rank.
    bias = kind == "siglip"
    ref_value, ref_grads = _reference(kind, sizes, bias)
    for r, (value, grads) in enumerate(_run("ours", kind, sizes, {"tile_size": 2}, bias)):
        assert value == pytest.approx(ref_value, rel=1e-12), f"rank {r}"
        _assert_grads(grads, ref_grads, f"rank {r}")


# ---------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------


def test_output_dict_and_plain_value() -> None:
    x = F.normalize(torch.randn(4, 3, dtype=torch.float64), dim=-1)
    y = F.normalize(torch.randn(4, 3, dtype=torch.float64), dim=-1)
    plain = ours.ClipLoss()(x, y, 5.0)
    assert isinstance(plain, Tensor) and plain.dim() == 0
    out = ours.SigLipLoss(dist_impl="shift")(x, y, 5.0, -1.0, output_dict=True)
    assert isinstance(out, dict) and set(out) == {"contrastive_loss"}


def test_bad_arguments_single_process() -> None:
    with pytest.raises(WholebatchError, match="use_horovod=True is not supported"):
        ours.ClipLoss(use_horovod=True)
    with pytest.raises(WholebatchError, match="dist_impl='ring'"):
        ours.SigLipLoss(dist_impl="ring")
    x = torch.randn(4, 3)
    with pytest.raises(WholebatchError, match=r"world_size=2, but this process runs alone"):
        ours.ClipLoss(rank=0, world_size=2)(x, x, 1.0)
    with pytest.raises(WholebatchTypeError, match="logit_bias must be a float scalar"):
        ours.ClipLoss()(x, x, 1.0, torch.zeros(4, 4))


def _rank_wrong_world() -> None:
    r = get_rank()
    x = torch.randn(2, 3)
    # rank 1 was built with a stale world size; rank 0 with the group's values
    ours.ClipLoss(rank=r, world_size=2 if r == 0 else 3)(x, x, 1.0)


def test_rank_arguments_disagreeing_with_the_group_same_error_everywhere() -> None:
    outcomes = run_ranks_outcomes(2, _rank_wrong_world)
    msgs = {getattr(o, "message", None) for o in outcomes}
    assert len(msgs) == 1, msgs
    msg = msgs.pop()
    assert msg is not None and "rank 1: rank=1, world_size=3" in msg, msg
