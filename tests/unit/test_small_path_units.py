"""The small path's pieces that need no process group (losses/replicated.py).

- The agreement without the exchange (`sizes=` with `check=False`) is taken from
  every rank's (scalars, reduction code) row: on the device by `_agreed` (CUDA
  tables), on the host by `_agreed_here` (CPU tables, what the gloo tests run).
  Both must give the same maxima, shares and factor on every table, ties, a
  "sum" anywhere and NaN included; the multi-rank tests only reach the host one.
- The closed-form CLIP and SigLIP kernels against autograd through the same
  formula, float64, for every span of own rows (a mutation: a wrong sign in the
  positives' gradient is caught).
"""

from __future__ import annotations

import math

import pytest
import torch

from wholebatch.losses import replicated

TABLES = {
    "agree": [[2.5, -1.0, 0.0], [2.5, -1.0, 0.0], [2.5, -1.0, 0.0]],
    "one differs": [[2.5, -1.0, 0.0], [2.5, -1.0, 0.0], [3.0, -2.0, 0.0]],
    "tie of two": [[3.0, -1.0, 0.0], [2.5, -1.0, 0.0], [3.0, -1.0, 0.0]],
    "sum on one rank": [[2.5, -1.0, 0.0], [2.5, -1.0, 1.0], [2.5, -1.0, 0.0]],
    "nan": [[2.5, math.nan, 0.0], [2.5, -1.0, 0.0], [2.5, -1.0, 0.0]],
}


@pytest.mark.parametrize("name", list(TABLES))
@pytest.mark.parametrize("rank", [0, 1, 2])
def test_the_host_agreement_is_the_device_one(name: str, rank: int) -> None:
    table = TABLES[name]
    t = torch.tensor(table, dtype=torch.float64)
    values_S, shares_S, factor = replicated._agreed(t, rank, 3, torch.float32)
    values, shares, factor_here = replicated._agreed_here(table, rank, 3, torch.float32, t.device)
    torch.testing.assert_close(torch.stack(values), values_S, equal_nan=True, rtol=0, atol=0)
    got = torch.tensor([float(x) for x in shares], dtype=torch.float32)
    torch.testing.assert_close(got, shares_S, equal_nan=True, rtol=0, atol=0)
    # the device's factor is in the compute dtype (float32 here: 1/3 rounded), the host's exact
    assert math.isclose(float(factor), factor_here, rel_tol=1e-7)


def _rows(n: int, d: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, d, generator=g, dtype=torch.float64) * 0.7 for _ in range(2)]


def _by_autograd(kernel: str, rows: list[torch.Tensor], scalars: list[torch.Tensor]) -> object:
    """The same loss by autograd through the formula (the reference for the closed forms)."""
    i, t = rows
    n = i.shape[0]
    u = i @ t.T
    eye = torch.eye(n, dtype=torch.bool)
    if kernel == "siglip":
        z = scalars[0] * u + scalars[1]
        neg = torch.nn.functional.softplus(z, threshold=1e9).masked_fill(eye, 0.0).sum()
        return (neg + torch.nn.functional.softplus(-z.diagonal(), threshold=1e9).sum()) / n
    z = (scalars[0] * u).masked_fill(eye, -math.inf)
    pos = scalars[0] * u.diagonal()
    a, c = torch.logsumexp(z, 1) - pos, torch.logsumexp(z, 0) - pos
    sp = torch.nn.functional.softplus
    return (sp(a, threshold=1e9).sum() + sp(c, threshold=1e9).sum()) / (2 * n)


@pytest.mark.parametrize("kernel", ["clip", "siglip"])
@pytest.mark.parametrize("span", [(0, 3), (3, 7), (7, 7), (0, 7)])
def test_closed_form_gradients_are_autograds(kernel: str, span: tuple[int, int]) -> None:
    fwd, bwd = {
        "clip": (replicated._clip_forward, replicated._clip_backward),
        "siglip": (replicated._siglip_forward, replicated._siglip_backward),
    }[kernel]
    rows = _rows(7, 5, 3)
    scalars = [torch.tensor(2.5, dtype=torch.float64), torch.tensor(-1.5, dtype=torch.float64)]
    scalars = scalars if kernel == "siglip" else scalars[:1]
    loss, state = fwd(rows, scalars, True)
    grad = torch.tensor(0.75, dtype=torch.float64)  # an upstream gradient that is not 1
    own, dscalars = bwd(state, grad, span)
    leaves = [x.clone().requires_grad_() for x in rows + scalars]
    ref = _by_autograd(kernel, leaves[:2], leaves[2:])
    assert isinstance(ref, torch.Tensor)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12)
    want = torch.autograd.grad(ref, leaves, grad)
    lo, hi = span
    for got, full in zip(own, want[:2], strict=True):
        torch.testing.assert_close(got, full[lo:hi], rtol=1e-12, atol=1e-12)
    for got, full in zip(dscalars, want[2:], strict=True):
        torch.testing.assert_close(got, full, rtol=1e-12, atol=1e-12)


def test_mutation_a_wrong_positive_gradient_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # The positives' dL/dz with the wrong sign: the same comparison fails.
    real = replicated._siglip_backward

    def wrong(state: object, grad: torch.Tensor, span: tuple[int, int]) -> object:
        i, t, s, u, z = state  # type: ignore[misc]
        flipped = z.clone()
        flipped.diagonal().neg_()
        return real((i, t, s, u, flipped), grad, span)

    monkeypatch.setattr(replicated, "_siglip_backward", wrong)
    with pytest.raises(AssertionError):
        test_closed_form_gradients_are_autograds("siglip", (0, 7))
