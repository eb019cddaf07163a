"""The collectives' raw moves along dim 0 of contiguous tensors: no checks, no autograd.

`wholebatch.comm.collectives` wraps these in autograd Functions with their
cross-rank checks; the losses' kernels call `gather_rows`, `ring_pass` and
`ring_peers` directly once their sizes are agreed. Every rank of `group` must
call each, with the same (agreed) sizes. Split sizes come from
`wholebatch.comm.sizes`, the bookkeeping `wholebatch plan` counts with.

Legend: W ranks in the group, B this rank's rows, N = sum of B over ranks, R the
remaining dims.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from wholebatch.comm import _c10d
from wholebatch.comm._c10d import global_rank, reduce_scatter_single
from wholebatch.comm.debug import arrive
from wholebatch.comm.groups import get_rank, get_world_size, is_gloo
from wholebatch.comm.sizes import gather_splits, reduce_scatter_splits

__all__ = [
    "all_to_all_rows",
    "back",
    "cast",
    "front",
    "gather_rows",
    "reduce_scatter_rows",
    "ring_pass",
    "ring_peers",
    "shift_rows",
]


def front(x: Tensor, dim: int) -> Tensor:
    """`x` with `dim` moved to the front, contiguous: the layout c10d splits along."""
    return (x if dim == 0 else x.movedim(dim, 0)).contiguous()


def back(y: Tensor, dim: int) -> Tensor:
    """Undo `front` on a result: `dim` back in place, contiguous like `torch.cat`'s output."""
    return y if dim == 0 else y.movedim(0, dim).contiguous()


def cast(x: Tensor, dtype: torch.dtype | None) -> Tensor:
    return x if dtype is None or x.dtype == dtype else x.to(dtype)


def gather_rows(x_BR: Tensor, sizes: Sequence[int], group: ProcessGroup | None) -> Tensor:
    """Concatenate every rank's rows: c10d's all-gather for equal sizes, an all-to-all for uneven.

    The raw move under `all_gather`: no checks, no autograd. Every rank of `group` must
    call it with the same `sizes` (every rank's rows, agreed already). Each rank sends
    its B rows to every peer: (W-1)·B sent, N-B received, the ring minimum, where
    padding to the largest B would move W·max.
    """
    out_NR = x_BR.new_empty((sum(sizes), *x_BR.shape[1:]))
    if out_NR.numel() == 0:
        return out_NR
    x_BR = x_BR.contiguous()
    if len(set(sizes)) == 1:  # gloo takes the flat form; c10d's all-gather for equal sizes
        _c10d.all_gather_single(out_NR.view(-1), x_BR.view(-1), group=group)
        return out_NR
    splits = gather_splits(sizes, x_BR.shape[0])
    dist.all_to_all_single(
        out_NR,
        x_BR.repeat(len(sizes), *[1] * (x_BR.dim() - 1)),
        output_split_sizes=list(splits.recv),
        input_split_sizes=list(splits.send),
        group=group,
    )
    return out_NR


def reduce_scatter_rows(
    x_NR: Tensor,
    sizes: Sequence[int],
    rank: int,
    out_dtype: torch.dtype,
    group: ProcessGroup | None,
) -> Tensor:
    """Sum every rank's `x_NR` and keep this rank's rows `sizes[rank]`, in `out_dtype`."""
    world_size = len(sizes)
    b = sizes[rank]
    rest = x_NR.shape[1:]
    if x_NR.numel() == 0:
        return x_NR.new_zeros((b, *rest), dtype=out_dtype)
    if len(set(sizes)) == 1 and x_NR.dtype == out_dtype and not is_gloo(group, x_NR.device):
        out_BR = x_NR.new_empty((b, *rest))
        reduce_scatter_single(out_BR, x_NR, group=group)
        return out_BR
    # Every rank sends each peer that peer's rows ((W-1)/W of the tensor, the
    # ring minimum) and sums the W pieces it receives locally, in out_dtype.
    # Used for uneven sizes; for a narrower wire dtype (each contribution is
    # rounded once, the sum adds no wire rounding); and on gloo, whose
    # reduce-scatter sends twice the bytes and runs 1.5-2x slower
    # (benchmarks/RESULTS.md; torch.distributed.nn does the same on gloo).
    recv = x_NR.new_empty((world_size * b, *rest))
    splits = reduce_scatter_splits(sizes, rank)
    dist.all_to_all_single(
        recv,
        x_NR,
        output_split_sizes=list(splits.recv),
        input_split_sizes=list(splits.send),
        group=group,
    )
    return recv.view(world_size, b, *rest).to(out_dtype).sum(0)


def all_to_all_rows(
    x_NR: Tensor, send_sizes: Sequence[int], recv_sizes: Sequence[int], group: ProcessGroup | None
) -> Tensor:
    out = x_NR.new_empty((sum(recv_sizes), *x_NR.shape[1:]))
    if x_NR.numel() == 0 and out.numel() == 0 and sum(send_sizes) == 0 and sum(recv_sizes) == 0:
        return out
    dist.all_to_all_single(
        out,
        x_NR,
        output_split_sizes=list(recv_sizes),
        input_split_sizes=list(send_sizes),
        group=group,
    )
    return out


def shift_rows(
    x_BR: Tensor, shift: int, recv_rows: int, rank: int, world_size: int, group: ProcessGroup | None
) -> Tensor:
    """Send to rank + shift, receive `recv_rows` rows from rank - shift (mod W)."""
    dst = global_rank(group, (rank + shift) % world_size)
    src = global_rank(group, (rank - shift) % world_size)
    out = x_BR.new_empty((recv_rows, *x_BR.shape[1:]))
    ops = []
    # Sizes are agreed on every rank, so a side that moves nothing skips its half
    # and its peer skips the matching half: no zero-byte messages to pair up.
    if x_BR.numel() > 0:
        ops.append(dist.P2POp(dist.isend, x_BR, dst, group=group))
    if out.numel() > 0:
        ops.append(dist.P2POp(dist.irecv, out, src, group=group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return out


def ring_peers(group: ProcessGroup | None = None) -> tuple[int, int]:
    """(global rank of group rank - 1, of group rank + 1): `ring_pass`'s peers, found once per ring.

    For a sub-group, torch's rank lookup scans the group's members: O(W) per call.
    """
    rank, world_size = get_rank(group), get_world_size(group)
    return global_rank(group, (rank - 1) % world_size), global_rank(group, (rank + 1) % world_size)


def ring_pass(
    xs: Sequence[Tensor],
    recv_rows: int,
    *,
    group: ProcessGroup | None = None,
    peers: tuple[int, int] | None = None,
) -> list[Tensor]:
    """One step of a ring algorithm whose sizes are already agreed: send each of `xs` to rank + 1, receive `recv_rows` rows of each from rank - 1.

    For kernels that shift W - 1 times per call after one agreement (SigLIP's
    ring): no autograd, no cross-rank checks and O(1) host work per step, where
    `ring_shift` validates a W-long `sizes` list each call (O(W²) host work per
    ring at W ranks). The tensors travel in one batch of point-to-point ops,
    each in its own dtype (a 16-bit block beside its float32 gradient). The
    caller guarantees what `ring_shift` would check: every rank calls it with
    tensors of the same trailing shapes and dtypes, and `recv_rows` is the
    sender's row count. `peers`: `ring_peers(group)`, computed once by a caller
    that shifts W - 1 times. Debug mode's check-in still runs.
    """
    arrive("ring_pass", xs[0], group)
    src, dst = peers if peers is not None else ring_peers(group)
    sends = [front(x, 0) for x in xs]
    outs = [x.new_empty((recv_rows, *x.shape[1:])) for x in sends]
    # Sizes are agreed: a side that moves nothing skips its half, and so does its peer.
    ops = [dist.P2POp(dist.isend, x, dst, group=group) for x in sends if x.numel() > 0]
    ops += [dist.P2POp(dist.irecv, o, src, group=group) for o in outs if o.numel() > 0]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return outs
