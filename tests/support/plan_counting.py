"""Count what the library's collectives hand to c10d, per rank, while the real calls run.

Pass-through wrappers around the c10d entry points wholebatch uses (every call
still moves its data through gloo); each records the bytes it sends to and
receives from OTHER ranks, by primitive:

- all-to-all: the input/output split sizes, less this rank's own chunk;
- point-to-point (`batch_isend_irecv`, the ring shifts): each isend / irecv;
- all-gather (c10d's, equal sizes; `wholebatch.comm._c10d.all_gather_single`, through
  which every wholebatch all-gather goes): (W - 1) x the input sent, N - B received;
- all-reduce: 2 (W - 1) / W of the tensor, the ring algorithm's volume.

`wchar()` reads the bytes this process wrote to sockets (gloo's TCP transport):
the wire, headers included, to check the counts against.

Also used by benchmarks/bench_plan.py.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

import wholebatch.comm._c10d as c10d

__all__ = ["Counter", "count_collectives", "wchar"]


def wchar() -> int:
    """Bytes this process has written through write-like system calls (sockets included)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar"):
                return int(line.split()[1])
    return 0


class Counter:
    """Bytes sent / received per primitive, and the number of c10d calls."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = defaultdict(int)
        self.received: dict[str, int] = defaultdict(int)
        self.calls = 0

    def add(self, primitive: str, sent: int, received: int) -> None:
        self.sent[primitive] += sent
        self.received[primitive] += received
        self.calls += 1

    def totals(self) -> tuple[int, int]:
        return sum(self.sent.values()), sum(self.received.values())


def _row_bytes(t: torch.Tensor) -> int:
    return (t.numel() // max(t.shape[0], 1)) * t.element_size() if t.dim() else t.element_size()


@contextlib.contextmanager
def count_collectives(counter: Counter, group: Any = None) -> Iterator[Counter]:
    """Within the block, every c10d call of wholebatch's collectives and kernels adds to `counter`.

    `group`: the process group the counted calls run on (a mesh's batch group), for
    this rank's index and the group's size; None: the world.
    """
    rank, w = dist.get_rank(group), dist.get_world_size(group)
    real_a2a, real_p2p = dist.all_to_all_single, dist.batch_isend_irecv
    real_ar, real_ag = dist.all_reduce, c10d.all_gather_single

    def a2a(out: torch.Tensor, inp: torch.Tensor, output_split_sizes: Any = None,
            input_split_sizes: Any = None, **kw: Any) -> Any:  # fmt: skip
        send = list(input_split_sizes or [inp.shape[0] // w] * w)
        recv = list(output_split_sizes or [out.shape[0] // w] * w)
        counter.add(
            "all_to_all",
            (sum(send) - send[rank]) * _row_bytes(inp),
            (sum(recv) - recv[rank]) * _row_bytes(out),
        )
        return real_a2a(out, inp, output_split_sizes, input_split_sizes, **kw)

    def p2p(ops: list[Any]) -> Any:
        for op in ops:
            nbytes = op.tensor.numel() * op.tensor.element_size()
            if op.op is dist.isend:
                counter.add("p2p", nbytes, 0)
            else:
                counter.add("p2p", 0, nbytes)
        return real_p2p(ops)

    def all_reduce(t: torch.Tensor, *args: Any, **kw: Any) -> Any:
        moved = round(2 * (w - 1) / w * t.numel() * t.element_size())
        counter.add("all_reduce", moved, moved)
        return real_ar(t, *args, **kw)

    def all_gather(out: torch.Tensor, inp: torch.Tensor, group: Any = None, **kw: Any) -> Any:
        peers = dist.get_world_size(group) - 1  # the call's own group
        nbytes = inp.numel() * inp.element_size()
        counter.add("all_gather", peers * nbytes, peers * nbytes)
        return real_ag(out, inp, group=group, **kw)

    dist.all_to_all_single, dist.batch_isend_irecv = a2a, p2p  # type: ignore[assignment]
    dist.all_reduce = all_reduce  # type: ignore[assignment]
    c10d.all_gather_single = all_gather
    try:
        yield counter
    finally:
        dist.all_to_all_single, dist.batch_isend_irecv = real_a2a, real_p2p
        dist.all_reduce = real_ar
        c10d.all_gather_single = real_ag
