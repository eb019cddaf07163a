"""Differentiable collectives: exact adjoints of the distributed program, for any sizes.

Gradient convention (DESIGN.md): if each rank r calls backward on its own scalar
l_r, the gradient arriving at every input is d(sum over r of l_r)/d(input).
Every rank of `group` must call each op, in the same order, and every rank must
back-propagate through it (its backward is a collective too).

With torch.distributed not initialised (or a group of one), each op is the
identity of a world of one and moves nothing.

Legend: W ranks in the group, B this rank's rows along `dim`, N = sum of B over
ranks, R the remaining dims.

    wholebatch demo --gather      # see it work on 2 local processes
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from wholebatch.comm import checks
from wholebatch.comm._c10d import eager, global_rank
from wholebatch.comm.debug import arrive
from wholebatch.comm.groups import get_rank, get_world_size
from wholebatch.comm.moves import (
    all_to_all_rows,
    back,
    cast,
    front,
    gather_rows,
    reduce_scatter_rows,
    ring_pass,
    ring_peers,
    shift_rows,
)
from wholebatch.comm.sizes import shift_splits
from wholebatch.errors import WholebatchError

__all__ = [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "apply",
    "broadcast",
    "gather_rows",
    "reduce_scatter",
    "ring_pass",
    "ring_peers",
    "ring_shift",
]

ReduceOp = Literal["sum", "mean", "max", "min"]


@eager
def apply(fn: Any, *args: Any) -> Any:
    """`fn.apply(*args)` for an autograd Function `fn`: torch leaves `Function.apply` untyped,
    so every call site would need a suppression; here none does."""
    return fn.apply(*args)


_REDUCE_OPS: tuple[str, ...] = ("sum", "mean", "max", "min")


# ---------------------------------------------------------------------------
# autograd Functions
# ---------------------------------------------------------------------------


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]  # torch declares forward(ctx, *args)
        ctx: Any, x: Tensor, dim: int, sizes: tuple[int, ...], wire: torch.dtype | None, group: Any
    ) -> Tensor:
        ctx.dim, ctx.sizes, ctx.wire, ctx.group = dim, sizes, wire, group
        ctx.rank = get_rank(group)
        out_NR = gather_rows(cast(front(x, dim), wire), sizes, group)
        return back(out_NR.to(x.dtype), dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        # backward: reduce-scatter (sum), each rank receiving the rows it contributed.
        arrive("all_gather backward", grad, ctx.group)
        g_NR = cast(front(grad, ctx.dim), ctx.wire)
        g_BR = reduce_scatter_rows(g_NR, ctx.sizes, ctx.rank, grad.dtype, ctx.group)
        return back(g_BR, ctx.dim), None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]  # torch declares forward(ctx, *args)
        ctx: Any, x: Tensor, dim: int, sizes: tuple[int, ...], wire: torch.dtype | None, group: Any
    ) -> Tensor:
        ctx.dim, ctx.sizes, ctx.wire, ctx.group = dim, sizes, wire, group
        rank = get_rank(group)
        out_BR = reduce_scatter_rows(cast(front(x, dim), wire), sizes, rank, x.dtype, group)
        return back(out_BR, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        # backward: all-gather of every rank's output gradient, with the same split.
        arrive("reduce_scatter backward", grad, ctx.group)
        g_NR = gather_rows(cast(front(grad, ctx.dim), ctx.wire), ctx.sizes, ctx.group)
        return back(g_NR.to(grad.dtype), ctx.dim), None, None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]  # torch declares forward(ctx, *args)
        ctx: Any,
        x: Tensor,
        dim: int,
        send: tuple[int, ...],
        recv: tuple[int, ...],
        wire: torch.dtype | None,
        group: Any,
    ) -> Tensor:
        ctx.dim, ctx.send, ctx.recv, ctx.wire, ctx.group = dim, send, recv, wire, group
        out = all_to_all_rows(cast(front(x, dim), wire), send, recv, group)
        return back(out.to(x.dtype), dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        # backward: all-to-all with send and receive sizes swapped.
        arrive("all_to_all backward", grad, ctx.group)
        g = all_to_all_rows(cast(front(grad, ctx.dim), ctx.wire), ctx.recv, ctx.send, ctx.group)
        return back(g.to(grad.dtype), ctx.dim), None, None, None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, op: str, group: Any) -> Tensor:  # type: ignore[override]  # torch declares forward(ctx, *args)
        ctx.op, ctx.group = op, group
        ctx.world_size = get_world_size(group)
        out = x.contiguous().clone()
        c10d_op = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}.get(op, dist.ReduceOp.SUM)
        dist.all_reduce(out, op=c10d_op, group=group)
        if op == "mean":
            out = out / ctx.world_size if out.is_floating_point() else out // ctx.world_size
        if op in ("max", "min"):
            ctx.save_for_backward(x == out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        # backward: all-reduce (sum) of the output gradient (every rank's output
        # is the reduction of every input); "mean" then divides by W; "max"/"min"
        # route it to the rank(s) holding the extreme, split evenly among ties.
        arrive("all_reduce backward", grad, ctx.group)
        if ctx.op in ("sum", "mean"):
            total = grad.contiguous().clone()
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.group)
            return (total / ctx.world_size if ctx.op == "mean" else total), None, None
        (holds,) = ctx.saved_tensors
        # One all-reduce carries both the summed gradient and the number of ranks
        # holding each extreme.
        both = torch.stack([grad.contiguous(), holds.to(grad.dtype)])
        dist.all_reduce(both, op=dist.ReduceOp.SUM, group=ctx.group)
        total, ties = both[0], both[1]
        return torch.where(holds, total / ties.clamp_min(1), torch.zeros_like(total)), None, None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, src: int, group: Any) -> Tensor:  # type: ignore[override]  # torch declares forward(ctx, *args)
        ctx.src, ctx.group = src, group
        ctx.is_src = get_rank(group) == src
        out = x.contiguous().clone()
        dist.broadcast(out, src=global_rank(group, src), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        # backward: reduce (sum) to src; every other rank's input gets zeros.
        arrive("broadcast backward", grad, ctx.group)
        total = grad.contiguous().clone()
        dist.reduce(
            total, dst=global_rank(ctx.group, ctx.src), op=dist.ReduceOp.SUM, group=ctx.group
        )
        return (total if ctx.is_src else torch.zeros_like(total)), None, None


class _RingShift(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]  # torch declares forward(ctx, *args)
        ctx: Any,
        x: Tensor,
        shift: int,
        dim: int,
        sizes: tuple[int, ...],
        wire: torch.dtype | None,
        group: Any,
    ) -> Tensor:
        world_size, rank = len(sizes), get_rank(group)
        ctx.shift, ctx.dim, ctx.sizes, ctx.wire, ctx.group = shift, dim, sizes, wire, group
        ctx.rank = rank
        _, recv_rows = shift_splits(sizes, rank, shift)
        out = shift_rows(cast(front(x, dim), wire), shift, recv_rows, rank, world_size, group)
        return back(out.to(x.dtype), dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        # backward: ring_shift(-shift): each gradient goes back to the rank it came from.
        arrive("ring_shift backward", grad, ctx.group)
        world_size = len(ctx.sizes)
        g = cast(front(grad, ctx.dim), ctx.wire)
        sent_rows, _ = shift_splits(ctx.sizes, ctx.rank, ctx.shift)  # they come back
        home = shift_rows(g, -ctx.shift, sent_rows, ctx.rank, world_size, ctx.group)
        return back(home.to(grad.dtype), ctx.dim), None, None, None, None, None


# ---------------------------------------------------------------------------
# Public ops
# ---------------------------------------------------------------------------


@eager
def all_gather(
    x: Tensor,
    dim: int = 0,
    *,
    group: ProcessGroup | None = None,
    sizes: Sequence[int] | None = None,
    wire_dtype: torch.dtype | None = None,
    check: bool | None = None,
) -> Tensor:
    """Concatenate `x` from every rank along `dim`, in rank order; sizes along `dim` may differ.

    Every rank of `group` must call it; every rank gets the same tensor, of size
    N = sum of all ranks' sizes along `dim`. A rank may contribute 0 rows. Shapes
    other than `dim`, dtypes and device types must match across ranks; a
    mismatch raises the same `WholebatchError` on every rank before data moves.

    Backward: reduce-scatter (sum) of the output gradient, each rank receiving the
    slice it contributed: the gradient of the sum of every rank's loss. Under DDP,
    which averages parameter gradients over W, see docs/semantics.md.

    Args:
        x: this rank's tensor (B along `dim`).
        dim: the dimension to concatenate along.
        group: the process group (default: the world).
        sizes: every rank's size along `dim`, if the caller knows them: skips the
            size exchange (one small all-gather) when checks are off.
        wire_dtype: send in this dtype (e.g. torch.bfloat16), return `x.dtype`;
            the backward travels in it too. Each element is rounded once
            (relative error up to 2**-8 for bfloat16, 2**-11 for float16), every
            rank's own slice included, so every rank holds the same tensor.
        check: run the cross-rank checks even when `sizes` is given (default: the
            `wholebatch.set_checks` / ``WHOLEBATCH_CHECKS`` setting, on).
    """
    op = "all_gather"
    x = checks.require_tensor(op, x)
    world_size, rank = get_world_size(group), get_rank(group)
    d, err = checks.norm_dim(x, dim)
    err = err or checks.wire_problem(x, wire_dtype)
    err = err or checks.sizes_problem("sizes", sizes, world_size, None)
    if err is None and sizes is not None and int(sizes[rank]) != x.shape[d]:
        err = (
            f"sizes[{rank}]={int(sizes[rank])} but this rank's input has {x.shape[d]} along dim={d}"
        )
    if checks.alone(op, world_size, err):
        return x
    fps = checks.agree_call(
        op,
        x,
        need_sizes=sizes is None,
        check=check,
        local_error=err,
        dim=d,
        wire_dtype=wire_dtype,
        vec_a=sizes,
        group=group,
    )
    if fps is not None:
        checks.check_shapes_except(op, fps, d)
        if sizes is not None:
            checks.check_arg(
                op, "sizes", [tuple(v or ()) for v in fps.vec_a], "pass the same list on every rank"
            )
        sizes = fps.sizes()
    assert sizes is not None
    out: Tensor = apply(_AllGather, x, d, tuple(int(s) for s in sizes), wire_dtype, group)
    return out


@eager
def reduce_scatter(
    x: Tensor,
    dim: int = 0,
    *,
    group: ProcessGroup | None = None,
    sizes: Sequence[int] | None = None,
    wire_dtype: torch.dtype | None = None,
    check: bool | None = None,
) -> Tensor:
    """Sum `x` over ranks and give each rank its slice along `dim`.

    Every rank of `group` must call it with the same shape. Rank r receives rows
    `sizes[r]` (default: an equal split, which needs the size along `dim` to be
    divisible by W) of the element-wise sum over ranks.

    Backward: all-gather of every rank's output gradient (same split): each rank's
    input gradient is the concatenation of all ranks' output gradients.

    Args:
        x: this rank's full-size tensor (N along `dim`).
        dim: the dimension to split along.
        group: the process group (default: the world).
        sizes: rows per rank along `dim`, summing to N; the same list on every rank.
        wire_dtype: send in this dtype and sum in `x.dtype`: each contribution is
            rounded once; the sum adds no wire rounding.
        check: run the cross-rank checks (default: the process setting, on).
    """
    op = "reduce_scatter"
    x = checks.require_tensor(op, x)
    world_size, _rank = get_world_size(group), get_rank(group)
    d, err = checks.norm_dim(x, dim)
    err = err or checks.wire_problem(x, wire_dtype)
    n = x.shape[d] if err is None else 0
    err = err or checks.sizes_problem("sizes", sizes, world_size, n)
    if err is None and sizes is None and n % world_size:
        err = f"x.shape[{d}]={n} does not split evenly over {world_size} ranks; pass sizes= for an uneven split"
    split = (
        [int(s) for s in sizes]
        if sizes is not None and err is None
        else [n // world_size] * world_size
    )
    if checks.alone(op, world_size, err):
        return x
    fps = checks.agree_call(
        op,
        x,
        need_sizes=False,
        check=check,
        local_error=err,
        dim=d,
        wire_dtype=wire_dtype,
        vec_a=split,
        group=group,
    )
    if fps is not None:
        checks.check_shapes_except(op, fps, None)
        checks.check_arg(
            op, "sizes", [tuple(v or ()) for v in fps.vec_a], "pass the same list on every rank"
        )
    out: Tensor = apply(_ReduceScatter, x, d, tuple(split), wire_dtype, group)
    return out


@eager
def all_to_all(
    x: Tensor,
    send_sizes: Sequence[int],
    recv_sizes: Sequence[int] | None = None,
    dim: int = 0,
    *,
    group: ProcessGroup | None = None,
    wire_dtype: torch.dtype | None = None,
    check: bool | None = None,
) -> Tensor:
    """Send `send_sizes[j]` consecutive rows (along `dim`) to rank j; receive from every rank in order.

    Every rank of `group` must call it. The result is the concatenation, in rank
    order, of the rows each rank sent to this one. `recv_sizes` (what each rank
    sends here) is learnt by a small exchange when not given.

    Backward: all-to-all with send and receive sizes swapped: each row's
    gradient goes back to the rank that sent the row.

    Args:
        x: this rank's rows to send (sum of `send_sizes` along `dim`).
        send_sizes: rows for each rank, one entry per rank.
        recv_sizes: rows from each rank, if known (must match the senders').
        dim: the dimension to split and concatenate along.
        group: the process group (default: the world).
        wire_dtype: send in this dtype, return `x.dtype`; each element rounded once.
        check: run the cross-rank checks when `recv_sizes` is given (default: on).
    """
    op = "all_to_all"
    x = checks.require_tensor(op, x)
    world_size, rank = get_world_size(group), get_rank(group)
    d, err = checks.norm_dim(x, dim)
    err = err or checks.wire_problem(x, wire_dtype)
    err = err or checks.sizes_problem(
        "send_sizes", send_sizes, world_size, x.shape[d] if err is None else None
    )
    err = err or checks.sizes_problem("recv_sizes", recv_sizes, world_size, None)
    if checks.alone(op, world_size, err):
        return x
    send = [int(s) for s in send_sizes] if err is None else [0] * world_size
    recv = [int(s) for s in recv_sizes] if recv_sizes is not None and err is None else None
    fps = checks.agree_call(
        op,
        x,
        need_sizes=recv is None,
        check=check,
        local_error=err,
        dim=d,
        wire_dtype=wire_dtype,
        vec_a=send,
        vec_b=recv,
        group=group,
    )
    if fps is not None:
        checks.check_shapes_except(op, fps, d)
        sent = [v or [0] * world_size for v in fps.vec_a]
        for r, claimed in enumerate(fps.vec_b):
            expected = [sent[j][r] for j in range(world_size)]
            if claimed is not None and list(claimed) != expected:
                raise WholebatchError(
                    f"{op}: rank {r} expects recv_sizes={list(claimed)} but the ranks send it "
                    f"{expected} (send_sizes per rank {checks.per_rank(sent)}); "
                    "recv_sizes[j] must equal rank j's send_sizes[r], or pass recv_sizes=None"
                )
        recv = [sent[j][rank] for j in range(world_size)]
    assert recv is not None
    out: Tensor = apply(_AllToAll, x, d, tuple(send), tuple(recv), wire_dtype, group)
    return out


@eager
def all_reduce(
    x: Tensor,
    op: ReduceOp = "sum",
    *,
    group: ProcessGroup | None = None,
    check: bool | None = None,
) -> Tensor:
    """Reduce `x` element-wise over ranks ("sum", "mean", "max" or "min"); every rank gets the result.

    Every rank of `group` must call it with the same shape. Returns a new tensor.

    Backward: all-reduce (sum) of the output gradient, since every rank's output
    depends on every rank's input. "mean" then divides by W. "max"/"min" send the
    summed gradient to the rank(s) holding the extreme of each element; ranks
    that tie split it evenly (as `torch.amax` does among tied elements).

    Args:
        x: this rank's tensor.
        op: "sum", "mean", "max" or "min".
        group: the process group (default: the world).
        check: run the cross-rank checks (default: the process setting, on).
    """
    name = "all_reduce"
    x = checks.require_tensor(name, x)
    err = None if op in _REDUCE_OPS else f"op={op!r} is not one of {list(_REDUCE_OPS)}"
    if checks.alone(name, get_world_size(group), err):
        return x
    arg = _REDUCE_OPS.index(op) + 1 if err is None else 99
    fps = checks.agree_call(
        name, x, need_sizes=False, check=check, local_error=err, arg=arg, group=group
    )
    if fps is not None:
        checks.check_shapes_except(name, fps, None)
    out: Tensor = apply(_AllReduce, x, op, group)
    return out


@eager
def broadcast(
    x: Tensor,
    src: int = 0,
    *,
    group: ProcessGroup | None = None,
    check: bool | None = None,
) -> Tensor:
    """Every rank gets rank `src`'s `x` (a new tensor); other ranks' `x` only give the shape.

    Every rank of `group` must call it with the same shape and `src` (a rank
    within `group`).

    Backward: reduce (sum) of every rank's output gradient to `src`; the other
    ranks' inputs get zeros, since their values were never used.

    Args:
        x: the tensor to send (on `src`) or a same-shaped placeholder (elsewhere).
        src: the sending rank, within `group`.
        group: the process group (default: the world).
        check: run the cross-rank checks (default: the process setting, on).
    """
    op = "broadcast"
    x = checks.require_tensor(op, x)
    world_size = get_world_size(group)
    err = (
        None
        if 0 <= src < world_size
        else f"src={src} is not a rank of this {world_size}-rank group"
    )
    if checks.alone(op, world_size, err):
        return x
    fps = checks.agree_call(
        op, x, need_sizes=False, check=check, local_error=err, arg=src, group=group
    )
    if fps is not None:
        checks.check_shapes_except(op, fps, None)
    out: Tensor = apply(_Broadcast, x, src, group)
    return out


@eager
def ring_shift(
    x: Tensor,
    shift: int = 1,
    *,
    dim: int = 0,
    group: ProcessGroup | None = None,
    sizes: Sequence[int] | None = None,
    wire_dtype: torch.dtype | None = None,
    check: bool | None = None,
) -> Tensor:
    """Receive `x` from rank (r - shift) mod W while sending yours to rank (r + shift) mod W.

    Every rank of `group` must call it with the same `shift`. Sizes along `dim`
    may differ per rank: the result has the sender's size. Only two tensors move
    per rank (one send, one receive): the building block of ring algorithms that
    keep one remote block in memory at a time.

    Backward: ring_shift(-shift) of the output gradient: each gradient returns to
    the rank whose rows it belongs to.

    Args:
        x: this rank's block (B along `dim`).
        shift: how many ranks along the ring to move; any int (taken mod W).
        dim: the dimension whose size may differ per rank.
        group: the process group (default: the world).
        sizes: every rank's size along `dim`, if known: skips the size exchange
            when checks are off (ring algorithms learn them once, shift W-1 times).
        wire_dtype: send in this dtype, return `x.dtype`; each element rounded once.
        check: run the cross-rank checks when `sizes` is given (default: on).
    """
    op = "ring_shift"
    x = checks.require_tensor(op, x)
    world_size, rank = get_world_size(group), get_rank(group)
    d, err = checks.norm_dim(x, dim)
    err = err or checks.wire_problem(x, wire_dtype)
    err = err or checks.sizes_problem("sizes", sizes, world_size, None)
    if err is None and sizes is not None and int(sizes[rank]) != x.shape[d]:
        err = (
            f"sizes[{rank}]={int(sizes[rank])} but this rank's input has {x.shape[d]} along dim={d}"
        )
    if not isinstance(shift, int):
        err = err or f"shift={shift!r} must be an int"
        shift = 0
    s = shift % world_size
    if checks.alone(op, world_size, err):
        return x
    fps = checks.agree_call(
        op,
        x,
        need_sizes=sizes is None,
        check=check,
        local_error=err,
        dim=d,
        arg=s,
        wire_dtype=wire_dtype,
        vec_a=sizes,
        group=group,
    )
    if fps is not None:
        checks.check_shapes_except(op, fps, d)
        if sizes is not None:
            checks.check_arg(
                op, "sizes", [tuple(v or ()) for v in fps.vec_a], "pass the same list on every rank"
            )
        sizes = fps.sizes()
    if s == 0:
        return x
    assert sizes is not None
    out: Tensor = apply(_RingShift, x, s, d, tuple(int(v) for v in sizes), wire_dtype, group)
    return out
