"""The small path's agreement without the exchange (losses/small.py `_agreed`), no process group needed.

With `sizes=` and `check=False` every rank's (scalars, reduction code) row rides
after its rows, and every rank takes the same maxima, shares and factor from the
table. Checked against the rule written out in plain Python (the maximum of each
column; a scalar's gradient to the ranks holding it, W-fold, split among ties;
"sum" on any rank makes every rank sum), ties, a "sum" anywhere and NaN included.
"""

from __future__ import annotations

import math

import pytest
import torch

from wholebatch.losses import small

TABLES = {
    "agree": [[2.5, -1.0, 0.0], [2.5, -1.0, 0.0], [2.5, -1.0, 0.0]],
    "one differs": [[2.5, -1.0, 0.0], [2.5, -1.0, 0.0], [3.0, -2.0, 0.0]],
    "tie of two": [[3.0, -1.0, 0.0], [2.5, -1.0, 0.0], [3.0, -1.0, 0.0]],
    "sum on one rank": [[2.5, -1.0, 0.0], [2.5, -1.0, 1.0], [2.5, -1.0, 0.0]],
    "nan": [[2.5, math.nan, 0.0], [2.5, -1.0, 0.0], [2.5, -1.0, 0.0]],
}


def _rule(table: list[list[float]], r: int) -> tuple[list[float], list[float], float]:
    w = len(table)
    cols = list(zip(*table, strict=True))
    top = [math.nan if any(map(math.isnan, c)) else max(c) for c in cols]
    factor = 1.0 / w if top[-1] > 0.5 else 1.0
    shares = []
    for k, m in enumerate(top[:-1]):
        ties = sum(row[k] == m for row in table)
        shares.append(factor * w * (table[r][k] == m) / ties if ties else math.nan)
    return top[:-1], shares, factor


@pytest.mark.parametrize("name", list(TABLES))
@pytest.mark.parametrize("rank", [0, 1, 2])
def test_the_agreement_is_the_rule(name: str, rank: int) -> None:
    table = TABLES[name]
    values, shares, factor = small._agreed(torch.tensor(table, dtype=torch.float64), rank, 3,
                                           torch.float64)  # fmt: skip
    want_values, want_shares, want_factor = _rule(table, rank)
    torch.testing.assert_close(values, torch.tensor(want_values, dtype=torch.float64),
                               equal_nan=True, rtol=0, atol=0)  # fmt: skip
    torch.testing.assert_close(shares, torch.tensor(want_shares, dtype=torch.float64),
                               equal_nan=True, rtol=0, atol=0)  # fmt: skip
    assert float(factor) == want_factor


def test_mutation_a_share_without_the_ties_is_caught() -> None:
    table = torch.tensor(TABLES["tie of two"], dtype=torch.float64)
    _, shares, _ = small._agreed(table, 0, 3, torch.float64)
    _, want, _ = _rule(TABLES["tie of two"], 0)
    assert float(shares[0]) == want[0] == 1.5  # split between ranks 0 and 2
    assert float(shares[0]) != 3.0  # the whole W-fold share to one of two tied ranks: caught
