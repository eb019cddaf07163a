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

import math
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from wholebatch.comm import checks, direct
from wholebatch.comm._c10d import global_rank, reduce_scatter_single
from wholebatch.comm.debug import arrive
from wholebatch.comm.groups import checks_enabled, get_rank, get_world_size
from wholebatch.comm.sizes import reduce_scatter_splits, shift_splits
from wholebatch.errors import WholebatchError, WholebatchTypeError

__all__ = [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "gather_rows",
    "reduce_scatter",
    "ring_shift",
]

ReduceOp = Literal["sum", "mean", "max", "min"]
_REDUCE_OPS: tuple[str, ...] = ("sum", "mean", "max", "min")


# ---------------------------------------------------------------------------
# Local helpers: layout, argument validation
# ---------------------------------------------------------------------------


def _front(x: Tensor, dim: int) -> Tensor:
    """`x` with `dim` moved to the front, contiguous: the layout c10d splits along."""
    return (x if dim == 0 else x.movedim(dim, 0)).contiguous()


def _back(y: Tensor, dim: int) -> Tensor:
    """Undo `_front` on a result: `dim` back in place, contiguous like `torch.cat`'s output."""
    return y if dim == 0 else y.movedim(0, dim).contiguous()


def _require_tensor(op: str, x: object) -> Tensor:
    if not isinstance(x, Tensor):
        raise WholebatchTypeError(f"{op}: expected a torch.Tensor, got {type(x).__name__}")
    return x


def _norm_dim(x: Tensor, dim: int) -> tuple[int, str | None]:
    """`dim` made non-negative, or the reason it cannot be (reported on every rank)."""
    nd = x.dim()
    if nd == 0:
        return 0, "a 0-d tensor has no dim to split along; unsqueeze it first"
    if nd > checks.MAX_DIMS:
        return 0, f"tensors of more than {checks.MAX_DIMS} dims are not supported (got {nd})"
    if not -nd <= dim < nd:
        return 0, f"dim={dim} is out of range for a {nd}-d tensor of shape {tuple(x.shape)}"
    return dim % nd, None


def _check_wire(x: Tensor, wire_dtype: torch.dtype | None) -> str | None:
    if wire_dtype is None:
        return None
    if not isinstance(wire_dtype, torch.dtype) or not wire_dtype.is_floating_point:
        return f"wire_dtype={wire_dtype!r} must be a floating torch.dtype such as torch.bfloat16"
    if not x.is_floating_point():
        return f"wire_dtype needs a floating input, got {x.dtype}"
    return None


def _check_sizes(
    name: str, sizes: Sequence[int] | None, world_size: int, total: int | None
) -> str | None:
    """Why `sizes` (one entry per rank) is unusable, or None; `total` is its required sum."""
    if sizes is None:
        return None
    try:
        vals = [int(s) for s in sizes]
    except (TypeError, ValueError):
        return f"{name} must be a sequence of {world_size} ints, got {sizes!r}"
    if len(vals) != world_size:
        return (
            f"{name} has {len(vals)} entries for a group of {world_size} ranks; give one per rank"
        )
    if any(v < 0 for v in vals):
        return f"{name}={vals} has a negative entry"
    if total is not None and sum(vals) != total:
        return f"{name}={vals} sums to {sum(vals)} but the input has {total} along dim"
    return None


def _agree(
    op: str,
    x: Tensor,
    *,
    need_sizes: bool,
    check: bool | None,
    local_error: str | None,
    dim: int = 0,
    arg: int = 0,
    wire_dtype: torch.dtype | None = None,
    vec_a: Sequence[int] | None = None,
    vec_b: Sequence[int] | None = None,
    group: ProcessGroup | None,
) -> checks.Fingerprints | None:
    """Exchange fingerprints when sizes must be learnt or checks are on; else raise local errors here.

    In debug mode (`wholebatch.set_debug`) every rank first checks in, so a rank
    that never arrives is named instead of leaving the others waiting.
    """
    arrive(op, x, group)
    if need_sizes or checks_enabled(check):
        return checks.exchange(
            op, x, dim=dim, arg=arg, wire_dtype=wire_dtype, vec_a=vec_a, vec_b=vec_b,
            local_error=local_error, group=group,
        )  # fmt: skip
    if local_error is not None:
        raise WholebatchError(f"{op}: {local_error}")
    return None


def _alone(op: str, world_size: int, err: str | None) -> bool:
    """True in a world of one, where every op is the identity (after raising `err`, if any)."""
    if world_size > 1:
        return False
    if err:
        raise WholebatchError(f"{op}: {err}")
    return True


def _cast(x: Tensor, dtype: torch.dtype | None) -> Tensor:
    return x if dtype is None or x.dtype == dtype else x.to(dtype)


# ---------------------------------------------------------------------------
# Data movement along dim 0 of contiguous tensors (no autograd)
# ---------------------------------------------------------------------------


def gather_rows(x_BR: Tensor, sizes: Sequence[int], group: ProcessGroup | None) -> Tensor:
    """Concatenate every rank's rows (`comm.direct.gather_flat`: on gloo by direct sends, else
    the native all-gather for equal sizes, an all-to-all for uneven).

    The raw move under `all_gather`: no checks, no autograd. Every rank of `group` must
    call it with the same `sizes` (every rank's rows, agreed already). Each rank sends
    its B rows to every peer: (W-1)·B sent, N-B received, the ring minimum, where
    padding to the largest B would move W·max.
    """
    out_NR = x_BR.new_empty((sum(sizes), *x_BR.shape[1:]))
    if out_NR.numel() == 0:
        return out_NR
    row = math.prod(x_BR.shape[1:])
    direct.gather_flat(out_NR.view(-1), x_BR.contiguous().view(-1), [q * row for q in sizes], group)
    return out_NR


def _reduce_scatter_rows(
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
    if len(set(sizes)) == 1 and x_NR.dtype == out_dtype and not direct.is_gloo(group, x_NR.device):
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
        recv, x_NR, output_split_sizes=list(splits.recv), input_split_sizes=list(splits.send),
        group=group,
    )  # fmt: skip
    return recv.view(world_size, b, *rest).to(out_dtype).sum(0)


def _all_to_all_rows(
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


def _shift_rows(
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


# ---------------------------------------------------------------------------
# autograd Functions
# ---------------------------------------------------------------------------


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, dim: int, sizes: tuple[int, ...], wire: torch.dtype | None, group: Any
    ) -> Tensor:
        ctx.dim, ctx.sizes, ctx.wire, ctx.group = dim, sizes, wire, group
        ctx.rank = get_rank(group)
        out_NR = gather_rows(_cast(_front(x, dim), wire), sizes, group)
        return _back(out_NR.to(x.dtype), dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        # backward: reduce-scatter (sum), each rank receiving the rows it contributed.
        arrive("all_gather backward", grad, ctx.group)
        g_NR = _cast(_front(grad, ctx.dim), ctx.wire)
        g_BR = _reduce_scatter_rows(g_NR, ctx.sizes, ctx.rank, grad.dtype, ctx.group)
        return _back(g_BR, ctx.dim), None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, dim: int, sizes: tuple[int, ...], wire: torch.dtype | None, group: Any
    ) -> Tensor:
        ctx.dim, ctx.sizes, ctx.wire, ctx.group = dim, sizes, wire, group
        rank = get_rank(group)
        out_BR = _reduce_scatter_rows(_cast(_front(x, dim), wire), sizes, rank, x.dtype, group)
        return _back(out_BR, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        # backward: all-gather of every rank's output gradient, with the same split.
        arrive("reduce_scatter backward", grad, ctx.group)
        g_NR = gather_rows(_cast(_front(grad, ctx.dim), ctx.wire), ctx.sizes, ctx.group)
        return _back(g_NR.to(grad.dtype), ctx.dim), None, None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        dim: int,
        send: tuple[int, ...],
        recv: tuple[int, ...],
        wire: torch.dtype | None,
        group: Any,
    ) -> Tensor:
        ctx.dim, ctx.send, ctx.recv, ctx.wire, ctx.group = dim, send, recv, wire, group
        out = _all_to_all_rows(_cast(_front(x, dim), wire), send, recv, group)
        return _back(out.to(x.dtype), dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        # backward: all-to-all with send and receive sizes swapped.
        arrive("all_to_all backward", grad, ctx.group)
        g = _all_to_all_rows(_cast(_front(grad, ctx.dim), ctx.wire), ctx.recv, ctx.send, ctx.group)
        return _back(g.to(grad.dtype), ctx.dim), None, None, None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, op: str, group: Any) -> Tensor:  # type: ignore[override]
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
    def forward(ctx: Any, x: Tensor, src: int, group: Any) -> Tensor:  # type: ignore[override]
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
    def forward(  # type: ignore[override]
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
        out = _shift_rows(_cast(_front(x, dim), wire), shift, recv_rows, rank, world_size, group)
        return _back(out.to(x.dtype), dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        # backward: ring_shift(-shift): each gradient goes back to the rank it came from.
        arrive("ring_shift backward", grad, ctx.group)
        world_size = len(ctx.sizes)
        g = _cast(_front(grad, ctx.dim), ctx.wire)
        sent_rows, _ = shift_splits(ctx.sizes, ctx.rank, ctx.shift)  # they come back
        back = _shift_rows(g, -ctx.shift, sent_rows, ctx.rank, world_size, ctx.group)
        return _back(back.to(grad.dtype), ctx.dim), None, None, None, None, None


# ---------------------------------------------------------------------------
# Public ops
# ---------------------------------------------------------------------------


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
    x = _require_tensor(op, x)
    world_size, rank = get_world_size(group), get_rank(group)
    d, err = _norm_dim(x, dim)
    err = err or _check_wire(x, wire_dtype)
    err = err or _check_sizes("sizes", sizes, world_size, None)
    if err is None and sizes is not None and int(sizes[rank]) != x.shape[d]:
        err = (
            f"sizes[{rank}]={int(sizes[rank])} but this rank's input has {x.shape[d]} along dim={d}"
        )
    if _alone(op, world_size, err):
        return x
    fps = _agree(
        op, x, need_sizes=sizes is None, check=check, local_error=err, dim=d,
        wire_dtype=wire_dtype, vec_a=sizes, group=group,
    )  # fmt: skip
    if fps is not None:
        checks.check_shapes_except(op, fps, d)
        if sizes is not None:
            checks.check_arg(
                op, "sizes", [tuple(v or ()) for v in fps.vec_a], "pass the same list on every rank"
            )
        sizes = fps.sizes()
    assert sizes is not None
    out: Tensor = _AllGather.apply(x, d, tuple(int(s) for s in sizes), wire_dtype, group)  # type: ignore[no-untyped-call]
    return out


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
    x = _require_tensor(op, x)
    world_size, _rank = get_world_size(group), get_rank(group)
    d, err = _norm_dim(x, dim)
    err = err or _check_wire(x, wire_dtype)
    n = x.shape[d] if err is None else 0
    err = err or _check_sizes("sizes", sizes, world_size, n)
    if err is None and sizes is None and n % world_size:
        err = f"x.shape[{d}]={n} does not split evenly over {world_size} ranks; pass sizes= for an uneven split"
    split = (
        [int(s) for s in sizes]
        if sizes is not None and err is None
        else [n // world_size] * world_size
    )
    if _alone(op, world_size, err):
        return x
    fps = _agree(
        op, x, need_sizes=False, check=check, local_error=err, dim=d,
        wire_dtype=wire_dtype, vec_a=split, group=group,
    )  # fmt: skip
    if fps is not None:
        checks.check_shapes_except(op, fps, None)
        checks.check_arg(
            op, "sizes", [tuple(v or ()) for v in fps.vec_a], "pass the same list on every rank"
        )
    out: Tensor = _ReduceScatter.apply(x, d, tuple(split), wire_dtype, group)  # type: ignore[no-untyped-call]
    return out


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
    x = _require_tensor(op, x)
    world_size, rank = get_world_size(group), get_rank(group)
    d, err = _norm_dim(x, dim)
    err = err or _check_wire(x, wire_dtype)
    err = err or _check_sizes(
        "send_sizes", send_sizes, world_size, x.shape[d] if err is None else None
    )
    err = err or _check_sizes("recv_sizes", recv_sizes, world_size, None)
    if _alone(op, world_size, err):
        return x
    send = [int(s) for s in send_sizes] if err is None else [0] * world_size
    recv = [int(s) for s in recv_sizes] if recv_sizes is not None and err is None else None
    fps = _agree(
        op, x, need_sizes=recv is None, check=check, local_error=err, dim=d,
        wire_dtype=wire_dtype, vec_a=send, vec_b=recv, group=group,
    )  # fmt: skip
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
    out: Tensor = _AllToAll.apply(x, d, tuple(send), tuple(recv), wire_dtype, group)  # type: ignore[no-untyped-call]
    return out


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
    x = _require_tensor(name, x)
    err = None if op in _REDUCE_OPS else f"op={op!r} is not one of {list(_REDUCE_OPS)}"
    if _alone(name, get_world_size(group), err):
        return x
    arg = _REDUCE_OPS.index(op) + 1 if err is None else 99
    fps = _agree(name, x, need_sizes=False, check=check, local_error=err, arg=arg, group=group)
    if fps is not None:
        checks.check_shapes_except(name, fps, None)
    out: Tensor = _AllReduce.apply(x, op, group)  # type: ignore[no-untyped-call]
    return out


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
    x = _require_tensor(op, x)
    world_size = get_world_size(group)
    err = (
        None
        if 0 <= src < world_size
        else f"src={src} is not a rank of this {world_size}-rank group"
    )
    if _alone(op, world_size, err):
        return x
    fps = _agree(op, x, need_sizes=False, check=check, local_error=err, arg=src, group=group)
    if fps is not None:
        checks.check_shapes_except(op, fps, None)
    out: Tensor = _Broadcast.apply(x, src, group)  # type: ignore[no-untyped-call]
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
    sends = [_front(x, 0) for x in xs]
    outs = [x.new_empty((recv_rows, *x.shape[1:])) for x in sends]
    # Sizes are agreed: a side that moves nothing skips its half, and so does its peer.
    ops = [dist.P2POp(dist.isend, x, dst, group=group) for x in sends if x.numel() > 0]
    ops += [dist.P2POp(dist.irecv, o, src, group=group) for o in outs if o.numel() > 0]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return outs


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
    x = _require_tensor(op, x)
    world_size, rank = get_world_size(group), get_rank(group)
    d, err = _norm_dim(x, dim)
    err = err or _check_wire(x, wire_dtype)
    err = err or _check_sizes("sizes", sizes, world_size, None)
    if err is None and sizes is not None and int(sizes[rank]) != x.shape[d]:
        err = (
            f"sizes[{rank}]={int(sizes[rank])} but this rank's input has {x.shape[d]} along dim={d}"
        )
    if not isinstance(shift, int):
        err = err or f"shift={shift!r} must be an int"
        shift = 0
    s = shift % world_size
    if _alone(op, world_size, err):
        return x
    fps = _agree(
        op, x, need_sizes=sizes is None, check=check, local_error=err, dim=d, arg=s,
        wire_dtype=wire_dtype, vec_a=sizes, group=group,
    )  # fmt: skip
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
    out: Tensor = _RingShift.apply(x, s, d, tuple(int(v) for v in sizes), wire_dtype, group)  # type: ignore[no-untyped-call]
    return out
