"""A two-process demonstration of the gradient through all_gather.

    wholebatch demo --gather

A whole batch of 5 rows is split over 2 processes (2 rows and 3 rows). Each
process embeds its rows with a shared matrix P, gathers every embedding, and
scores its rows against the whole batch (a log-sum-exp, as contrastive losses
do). The sum of the processes' losses is the whole-batch loss, so the summed
gradient of P should equal one process's gradient on the whole batch:

- gathering with `torch.distributed.all_gather` gives tensors with no gradient:
  every term where a row is a *key* for another process's row is lost;
- `wholebatch.all_gather` sends those terms back (backward: reduce-scatter),
  and the gradient matches to round-off.

Processes start through torchrun's own launcher (torch.distributed.launcher).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["run_demo"]

# The whole batch: row i is [i, 1 - i / 4], in float64 so errors are round-off.
_ROWS = 5
_SPLIT = (2, 3)


def _whole_batch() -> tuple[Tensor, Tensor]:
    x_ND = torch.stack([torch.arange(_ROWS, dtype=torch.float64), 1 - torch.arange(_ROWS) / 4], 1)
    p_DD = torch.tensor([[0.3, -0.2], [0.1, 0.5]], dtype=torch.float64)
    return x_ND, p_DD


def _loss(queries_BD: Tensor, keys_ND: Tensor) -> Tensor:
    """Sum over query rows of log-sum-exp of their scores against every key row."""
    return torch.logsumexp(queries_BD @ keys_ND.T, dim=1).sum()


def _one_process() -> Tensor:
    x_ND, p_DD = _whole_batch()
    p_DD.requires_grad_()
    e_ND = x_ND @ p_DD
    torch.autograd.backward(_loss(e_ND, e_ND))  # typed, unlike Tensor.backward
    assert p_DD.grad is not None
    return p_DD.grad


def _rank_main(method: str) -> list[float]:
    """One rank: embed its rows, gather, back-propagate; return its gradient of P, flattened."""
    import wholebatch

    rank = dist.get_rank()
    x_ND, p_DD = _whole_batch()
    start = sum(_SPLIT[:rank])
    x_BD = x_ND[start : start + _SPLIT[rank]]
    p_DD.requires_grad_()
    e_BD = x_BD @ p_DD
    if method == "c10d":
        # c10d needs equal sizes on gloo: gather padded rows, then trim.
        padded = torch.zeros(max(_SPLIT), 2, dtype=torch.float64)
        padded[: e_BD.shape[0]] = e_BD.detach()
        gathered = [torch.empty_like(padded) for _ in _SPLIT]
        # The demonstration's wrong side, on purpose: what a user's plain gather does.
        dist.all_gather(gathered, padded)  # noqa: WB101
        parts = [g[:n] for g, n in zip(gathered, _SPLIT, strict=True)]
        keys_ND = torch.cat(
            parts
        )  # no gradient: torch.distributed.all_gather is not differentiable
    else:
        keys_ND = wholebatch.all_gather(e_BD)
    torch.autograd.backward(_loss(e_BD, keys_ND))
    assert p_DD.grad is not None
    total = p_DD.grad.clone()
    dist.all_reduce(total)  # what DDP's reduction adds up (DDP then divides by W)
    return total.flatten().tolist()


def _launch(method: str, nproc: int) -> list[float]:
    from wholebatch.comm.launch import LaunchSpec, launch

    results = launch(_rank_main, (method,), spec=LaunchSpec(nproc=nproc, backend="gloo"))
    return list(results[0])


def _fmt(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:+.6f}" for v in values) + "]"


def run_demo(nproc: int = 2) -> int:
    """Run the demonstration on `nproc` (must be 2) local processes; print the table; return 0."""
    if nproc != len(_SPLIT):
        print(
            f"wholebatch demo: --nproc must be {len(_SPLIT)} for this demo, got {nproc}",
            file=sys.stderr,
        )
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    reference = _one_process().flatten().tolist()
    rows = {"one process, whole batch": reference}
    rows["2 processes, torch.distributed.all_gather"] = _launch("c10d", nproc)
    rows["2 processes, wholebatch.all_gather"] = _launch("wholebatch", nproc)
    ref_t = torch.tensor(reference)
    print(f"A whole batch of {_ROWS} rows split {_SPLIT[0]} + {_SPLIT[1]} over {nproc} processes.")
    print(
        "Gradient of the shared matrix P (summed over processes, as DDP's reduction adds them):\n"
    )
    width = max(len(k) for k in rows)
    print(f"  {'':{width}}  {'dL/dP':^42}  max rel error")
    for name, vals in rows.items():
        err = (torch.tensor(vals) - ref_t).abs().max() / ref_t.abs().max()
        shown = "(reference)" if vals is reference else f"{float(err):.1e}"
        print(f"  {name:{width}}  {_fmt(vals)}  {shown}")
    print(
        "\ntorch.distributed.all_gather returns tensors without gradient: the terms where a row"
        "\nis another process's key are lost, and training silently follows the wrong gradient."
        "\nwholebatch.all_gather's backward (a reduce-scatter) returns them: the whole-batch gradient."
    )
    return 0
