"""All-gathers of raw bytes by direct sends where gloo moves them: one step, not a ring.

gloo runs a collective on its worker thread and its all-gather as a ring of
W − 1 steps, one after another; a send or a receive is posted from the
caller's thread at once. For the moves whose cost is latency (every loss
call's exchange, `agree_rows`, the small path's rows, `all_gather`'s rows) each
rank here posts its bytes to every peer and a receive from every peer, all at
once: one step whatever W, and the same bytes as the ring ((W − 1) x its own
bytes sent by every rank, N − B received). Where the bytes go through another
backend (NCCL), c10d's all-gather (equal sizes) or all-to-all (uneven) moves them.

`expect_flat` posts the receives before this rank's bytes exist (`Expected.send`
then sends them): a loss call posts its exchange's receives before its checks,
so a peer's row moves the moment the peer sends it.

Measured after a barrier (benchmarks/exchange_direct.py, medians, the slower
rank; RESULTS.md, "The exchange by direct sends"): 0.77-0.90x c10d's all-gather
on 2 CPU ranks at 1 KiB to 264 KiB, 0.5-0.6x on 3; two moves in a row 0.85-0.90x
and 0.25-0.53x. `gather_flat` sends first: with each receive posted just before
its send, two moves of 264 KiB in a row once took 1.6 ms against c10d's 0.63.
A loss call's exchange posts its receives early all the same (`expect_flat`),
~0.1 ms before its send: there it measured faster (`benchmarks/losses_small.py`).

The sends use their own tag (`TAG`), so they never pair with a caller's own
point-to-point messages on the same group; every rank posts them in the same
order, as every collective requires.

Legend: W ranks of `group`, B this rank's elements, N every rank's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from wholebatch.comm._c10d import all_gather_single, global_rank
from wholebatch.comm.groups import backend_of, get_rank
from wholebatch.comm.sizes import gather_splits

__all__ = ["TAG", "DirectWork", "Expected", "expect_flat", "gather_flat", "is_gloo"]

TAG = 0x7762
"""The point-to-point tag of every direct all-gather (not c10d's default 0)."""


def is_gloo(group: ProcessGroup | None, device: torch.device) -> bool:
    """Whether c10d routes tensors on `device` through gloo in `group` ("gloo" or
    "cpu:gloo,cuda:nccl")."""
    backend = backend_of(group)
    if ":" not in backend:
        return backend == "gloo"
    routes = dict(part.split(":", 1) for part in backend.split(",") if ":" in part)
    return routes.get(device.type) == "gloo"


class DirectWork:
    """The sends and receives of one direct all-gather: `wait()` returns once all are done."""

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        self._works = []
        return True


def gather_flat(
    out_N: Tensor,
    x_B: Tensor,
    sizes: Sequence[int],
    group: ProcessGroup | None,
    *,
    async_op: bool = False,
) -> DirectWork | Any | None:
    """Every rank's 1-D `x_B` into `out_N`, in rank order (`sizes`: every rank's B).

    Every rank of `group` must call it with the same `sizes` (agreed already) and,
    with `async_op`, wait on the result before its next collective on `group` and
    before reading `out_N`. No checks, no autograd: the raw move under the
    exchange and the small path. Returns the work to wait on (`async_op`), else None.
    `expect_flat` then `Expected.send` is the same move with the receives posted early.
    """
    r = get_rank(group)
    if not is_gloo(group, x_B.device):
        return _c10d_gather(out_N, x_B, list(sizes), r, group, async_op)
    # Sends first, then receives: with each receive posted just before its send, two
    # moves of 256 KiB in a row took ~2 ms on 2 CPU ranks against ~0.5 ms this way
    # (benchmarks/exchange_direct.py, "two in a row"; RESULTS.md).
    works = _sends(x_B, sizes, r, group) + _receives(out_N, sizes, r, group)
    return _own(out_N, x_B, sizes, r, works, async_op)


class Expected:
    """The receives of a direct all-gather, posted before this rank's bytes exist
    (`expect_flat`): `send` completes the move. On gloo a peer's bytes then go out the
    moment the peer sends them; each rank must `send` once, before its next collective."""

    def __init__(
        self,
        out_N: Tensor,
        sizes: Sequence[int],
        group: ProcessGroup | None,
        works: list[Any] | None,
    ) -> None:
        self.out_N, self.sizes, self.group = out_N, list(sizes), group
        self._works = works  # None: not gloo, the whole move happens in `send`

    def send(self, x_B: Tensor, *, async_op: bool = False) -> DirectWork | Any | None:
        """Send this rank's `x_B` (`sizes[rank]` elements) to every peer: see `gather_flat`."""
        sizes, group, out_N = self.sizes, self.group, self.out_N
        r = get_rank(group)
        if x_B.numel() != sizes[r]:
            raise ValueError(f"gather_flat: {x_B.numel()} elements sent, {sizes[r]} expected")
        if self._works is None:
            return _c10d_gather(out_N, x_B, sizes, r, group, async_op)
        works, self._works = self._works + _sends(x_B, sizes, r, group), []
        return _own(out_N, x_B, sizes, r, works, async_op)


def expect_flat(
    out_N: Tensor, sizes: Sequence[int], group: ProcessGroup | None, device: torch.device
) -> Expected:
    """Post the receives of a `gather_flat` into `out_N` of bytes on `device` (gloo only;
    elsewhere nothing happens until `Expected.send`). Every rank of `group` must then
    `send`, in the same order as every rank's other collectives."""
    if not is_gloo(group, device):
        return Expected(out_N, sizes, group, None)
    return Expected(out_N, sizes, group, _receives(out_N, sizes, get_rank(group), group))


def _sends(x_B: Tensor, sizes: Sequence[int], r: int, group: ProcessGroup | None) -> list[Any]:
    """This rank's bytes posted to every peer (none when it has none)."""
    w = len(sizes)
    if not sizes[r]:
        return []
    return [dist.isend(x_B, global_rank(group, (r + k) % w), group=group, tag=TAG)
            for k in range(1, w)]  # fmt: skip


def _own(
    out_N: Tensor, x_B: Tensor, sizes: Sequence[int], r: int, works: list[Any], async_op: bool
) -> DirectWork | None:
    """This rank's bytes into their own place in `out_N`; then the move's work, or its end."""
    if sizes[r]:
        start = sum(sizes[:r])
        out_N[start : start + sizes[r]].copy_(x_B)
    work = DirectWork(works)
    if async_op:
        return work
    work.wait()
    return None


def _receives(out_N: Tensor, sizes: Sequence[int], r: int, group: ProcessGroup | None) -> list[Any]:
    """Every peer's bytes posted to arrive in their place in `out_N`."""
    w = len(sizes)
    starts = [sum(sizes[:q]) for q in range(w)]
    works = []
    for k in range(1, w):
        src = (r - k) % w
        if sizes[src]:
            part = out_N[starts[src] : starts[src] + sizes[src]]
            works.append(dist.irecv(part, global_rank(group, src), group=group, tag=TAG))
    return works


def _c10d_gather(
    out_N: Tensor, x_B: Tensor, sizes: list[int], r: int, group: ProcessGroup | None, async_op: bool
) -> Any:
    """c10d's all-gather (equal sizes) or all-to-all (uneven) of the same bytes."""
    if len(set(sizes)) == 1:
        return all_gather_single(out_N, x_B, group=group, async_op=async_op)
    splits = gather_splits(sizes, sizes[r])
    return dist.all_to_all_single(
        out_N, x_B.repeat(len(sizes)), output_split_sizes=list(splits.recv),
        input_split_sizes=list(splits.send), group=group, async_op=async_op,
    )  # fmt: skip
