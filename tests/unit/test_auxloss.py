"""Whole-batch auxiliary terms in one process: the formula, the memory, the errors.

The distributed tier checks exactness over ranks and meshes
(tests/distributed/test_accumulate_moe.py).
"""

from __future__ import annotations

import re
import weakref

import pytest
import torch

from tests.support.models import PAD, make_sequences, micro_batch
from tests.support.moe_cases import MoEBlock, TinyMoE, aux_value, ce_sum, router_sums
from wholebatch import Accumulator
from wholebatch.errors import WholebatchError
from wholebatch.train.auxloss import LoadBalancingLoss


def _mbs(k: int, same: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    lengths = [(5, 8, 3), (2, 7, 8), (8, 1, 6)]
    return [
        micro_batch(make_sequences(lengths[0 if same else i % 3], seed=0 if same else i), width=8)
        for i in range(k)
    ]


@pytest.mark.parametrize("top_k", [1, 2])
def test_a_term_outside_a_step_holds_its_calls_own_loss(top_k: int) -> None:
    model = TinyMoE(top_k)
    tokens, _ = _mbs(1)[0]
    model(tokens)
    want = aux_value(router_sums(model, (tokens != PAD).reshape(-1)), top_k)
    block = model.layers[0]
    got = block.balance.loss + block.z.loss  # type: ignore[operator]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    assert got.requires_grad


def test_one_process_step_equals_the_whole_batch_objective() -> None:
    mbs = _mbs(3)
    ref = TinyMoE(2, checkpointed=False)
    tokens = torch.cat([t for t, _ in mbs])
    targets = torch.cat([y for _, y in mbs])
    main, n = ce_sum(ref, (tokens, targets))
    (main / n + aux_value(router_sums(ref, (tokens != PAD).reshape(-1)), 2)).backward()
    model = TinyMoE(2)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0))
    grads: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: grads.__setitem__(name, p.grad.clone())
        )
    stats = acc.step(mbs, ce_sum)
    assert set(stats.aux) == {"layers.0.balance", "layers.0.z"}
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-10, atol=1e-12, msg=name)


def _peak_saved_bytes(fn: object) -> int:
    """The most bytes that autograd's saved tensors held at once while `fn()` ran."""
    live, peak = [0], [0]

    class Box:
        __slots__ = ("__weakref__", "t")

    def release(n: int) -> None:
        live[0] -= n

    def pack(t: torch.Tensor) -> Box:
        n = t.numel() * t.element_size()
        live[0] += n
        peak[0] = max(peak[0], live[0])
        box = Box()
        box.t = t
        weakref.finalize(box, release, n)
        return box

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.t):
        fn()  # type: ignore[operator]
    return peak[0]


def test_the_counting_pass_holds_one_micro_batchs_graph() -> None:
    def step(k: int) -> None:
        model = TinyMoE(2, checkpointed=False)
        Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1)).step(_mbs(k, True), ce_sum)

    def all_graphs() -> None:  # the naive exact step: every micro-batch's graph alive at once
        model = TinyMoE(2, checkpointed=False)
        torch.stack([ce_sum(model, mb)[0] for mb in _mbs(3, True)]).sum().backward()

    one, three = _peak_saved_bytes(lambda: step(1)), _peak_saved_bytes(lambda: step(3))
    assert three == one  # K = 3 at the memory of K = 1
    assert _peak_saved_bytes(all_graphs) > 2.5 * one


class _TwiceBlock(MoEBlock):
    def forward(self, h_TD: torch.Tensor, mask_T: torch.Tensor) -> torch.Tensor:
        out = super().forward(h_TD, mask_T)
        return self.balance(out, self.block_out["probs"], self.block_out["top"], mask_T)


class _DriftingBlock(MoEBlock):
    """Routes differently every time it runs (a router nudged by a forward counter)."""

    calls = 0

    def forward(self, h_TD: torch.Tensor, mask_T: torch.Tensor) -> torch.Tensor:
        _DriftingBlock.calls += 1
        with torch.no_grad():
            self.router.bias[0] += 3.0 * (-1) ** _DriftingBlock.calls  # expert 0 in and out
        return super().forward(h_TD, mask_T)


def _with_block(cls: type) -> TinyMoE:
    model = TinyMoE(2)
    old = model.layers[0]
    new = cls(old.dim, len(old.experts), 2, False)
    new.load_state_dict(old.state_dict())
    model.layers[0] = new.double()
    return model


def test_a_term_called_twice_and_a_replay_that_routes_differently_are_errors() -> None:
    for cls, needle in [
        (_TwiceBlock, "called twice in one forward"),
        (_DriftingBlock, "routed differently"),
    ]:
        model = _with_block(cls)
        acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(WholebatchError, match=needle):
            acc.step(_mbs(3), ce_sum)
        assert all(p.grad is None for p in model.parameters())


def test_bad_arguments_name_the_argument() -> None:
    with pytest.raises(
        WholebatchError, match=re.escape("top_k=5 must be an int in 1..num_experts=4")
    ):
        LoadBalancingLoss(4, top_k=5)
    model = TinyMoE(1)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    import wholebatch

    with pytest.raises(WholebatchError, match="normalize= with whole-batch auxiliary terms"):
        acc.step(_mbs(1), ce_sum, normalize=wholebatch.Normalize("token", items=lambda mb: {}))


def test_engines_that_do_not_run_the_terms_refuse_a_model_with_them() -> None:
    from wholebatch import CachedStep, GradCache

    model = TinyMoE(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for build, op in [
        (lambda: GradCache(model), "GradCache"),
        (lambda: CachedStep(model, opt, lambda m, b: m(b), lambda e: e.sum()), "CachedStep"),
    ]:
        with pytest.raises(WholebatchError, match=f"{op}: the model holds whole-batch"):
            build()
