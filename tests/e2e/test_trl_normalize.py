"""trl 1.16's GRPO loss types against the whole-batch normalisation modes (tests/support/trl_grpo_cases.py).

W = 2 ranks x gradient accumulation 3 (simulated in one process, as DDP averages),
ragged completions, float64, trl's own `_compute_loss` on fixed rollouts. The
table in docs/accumulation.md and benchmarks/RESULTS.md is this measurement. The
last test moves the same step onto `Accumulator(normalize=...)`: each mode's
definition to round-off.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.peers import SKIP_REASON

trl = pytest.importorskip("trl", reason=SKIP_REASON.format("trl"))

from tests.support import trl_grpo_cases as cases  # noqa: E402
from wholebatch import Accumulator, Normalize  # noqa: E402

# Llama's RMSNorm and rotary embedding run in float32 even in a float64 model, so a
# different loss scale through the backward (the token mode rescales after it) rounds
# differently at ~1e-7 relative; the mismatches measured are all > 1e-2.
EXACT = 1e-6


def test_trl_version_is_the_pinned_one() -> None:
    assert trl.__version__ == "1.16.0"


@pytest.fixture(scope="module")
def rows() -> dict[str, cases.Row]:
    return {r.loss_type: r for r in cases.measure()}


@pytest.mark.parametrize(
    ("loss_type", "matches"),
    [
        ("grpo", "sequence"),  # every micro-batch holds B completions: the mean of means is exact
        ("sapo", "sequence"),
        ("bnpo", "token per micro-batch"),  # the local batch's token mean, not the step's
        ("dr_grpo", "constant"),
        ("dapo", "token"),
        ("cispo", "token"),
        ("vespo", "token"),
        ("luspo", "sequence_sum"),
    ],
)
def test_each_loss_type_matches_the_mode_measured(
    rows: dict[str, cases.Row], loss_type: str, matches: str
) -> None:
    row = rows[loss_type]
    assert row.matches == matches, row.errors
    assert row.errors[matches] < EXACT


def test_bnpo_is_not_the_whole_batch_token_mean(rows: dict[str, cases.Row]) -> None:
    assert rows["bnpo"].errors["token"] > 1e-2


def test_dapo_with_more_steps_per_generation_is_not_the_token_mean() -> None:
    # trl #5619 / PR #6024: the generation batch's token count rescaled by GA / steps_per_generation
    # is the window's count only when both windows hold as many tokens.
    (row,) = cases.measure(("dapo",), steps_per_generation=2 * cases.K)
    assert row.matches is None and row.errors["token"] > 1e-3, row.errors


@pytest.mark.parametrize("mode", ["token", "sequence", "constant"])
def test_the_same_rollouts_on_the_accumulator_give_each_definition(mode: str) -> None:
    want = cases.definition_gradient(mode, logps=cases.plain_logps)
    model = cases.tiny_model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=1.0))
    mbs = [mb for rank in cases.rollouts() for mb in rank]  # W x K micro-batches on one process
    for i, mb in enumerate(mbs):  # completion b of micro-batch i is sequence i * B + b
        seq = torch.arange(cases.B)[:, None] + i * cases.B
        mb["sequence"] = seq.expand_as(mb["completion_mask"]).contiguous()
    constant = float(cases.T_MAX * len(mbs) * cases.B) if mode == "constant" else None

    def items(mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        m = mb["completion_mask"].bool()
        return {"mask": m, "sequence": mb["sequence"]}

    def loss_fn(net: torch.nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        out: torch.Tensor = -mb["advantages"][:, None] * cases.plain_logps(net, mb)
        return out

    before = [p.detach().clone() for p in model.parameters()]
    acc.step(mbs, loss_fn, normalize=Normalize(mode, items=items, constant=constant))  # type: ignore[arg-type]
    got = torch.cat(
        [(b - p.detach()).reshape(-1) for b, p in zip(before, model.parameters(), strict=True)]
    )
    assert float((got - want).norm() / want.norm()) < EXACT
