"""Every collective against a single-process simulation of all W ranks.

Each rank r gets a different input (`arange + 100 * r`, sizes that differ per
rank, some 0) and back-propagates its own loss l_r = (1 + r) * <out_r, w_r>
with a random w_r. DESIGN.md's convention says each input's gradient is
d(sum_r l_r)/d(input); the reference computes exactly that in one process.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import Tensor

import wholebatch as wb
from tests.support import reference
from tests.support.harness import run_ranks

# float64 inputs of magnitude <= ~1e3 combined by at most a handful of adds:
# round-off is below 1e3 * 4 * 2.2e-16 ~ 1e-12; 1e-10 leaves room and still
# rejects any real error (the mutations below are off by factors of 2 or more).
F64 = dict(rtol=1e-10, atol=1e-10)
# float32: same shapes, eps 1.2e-7.
F32 = dict(rtol=1e-5, atol=1e-3)


@dataclasses.dataclass(frozen=True)
class Case:
    """One collective call: the op, each rank's input and kwargs, the reference's kwargs."""

    op: Callable[..., Tensor]
    ref: Callable[..., list[Tensor]]
    xs: list[Tensor]
    kwargs: list[dict[str, Any]]
    ref_kwargs: dict[str, Any]


def _inputs(sizes: Sequence[int], dim: int, cols: int, dtype: torch.dtype) -> list[Tensor]:
    """Rank r's input: B_r rows along `dim` of `arange + 100 * r` (with a fraction, so no ties)."""
    xs = []
    for r, b in enumerate(sizes):
        x = torch.arange(b * cols, dtype=torch.float64).reshape(b, cols) * 1.25 + 100 * r + 0.5
        xs.append((x if dim == 0 else x.t().contiguous()).to(dtype))
    return xs


def _noncontig(x: Tensor) -> Tensor:
    """The same values as `x` in a non-contiguous view (gradient flows back to `x`)."""
    return x.unsqueeze(-1).expand(*x.shape, 2)[..., 0]


def _rank_step(
    op: Callable[..., Tensor],
    xs: list[Tensor],
    kwargs: list[dict[str, Any]],
    ws: list[Tensor],
    noncontig: bool,
) -> tuple[Tensor, Tensor]:
    r = dist.get_rank()
    x = xs[r].clone().requires_grad_()
    out = op(_noncontig(x) if noncontig else x, **kwargs[r])
    ((out.double() * ws[r]).sum() * (1 + r)).backward()
    assert x.grad is not None
    return out.detach(), x.grad


def _reference(case: Case, ws: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    xs = [x.clone().requires_grad_() for x in case.xs]
    outs = case.ref(xs, **case.ref_kwargs)
    total = sum(
        ((o.double() * w).sum() * (1 + r) for r, (o, w) in enumerate(zip(outs, ws, strict=True)))
    )
    assert isinstance(total, Tensor)
    total.backward()
    return [o.detach() for o in outs], [
        x.grad if x.grad is not None else torch.zeros_like(x) for x in xs
    ]


def _weights(case: Case, seed: int = 0) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        outs = case.ref(case.xs, **case.ref_kwargs)
    return [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outs]


def check_case(case: Case, *, noncontig: bool = False, tol: dict[str, float] = F64) -> None:
    """Run `case` on W real ranks and assert outputs and input gradients match the reference."""
    world = len(case.xs)
    ws = _weights(case)
    ref_outs, ref_grads = _reference(case, ws)
    got = run_ranks(world, _rank_step, case.op, case.xs, case.kwargs, ws, noncontig)
    for r, ((out, grad), ref_out, ref_grad) in enumerate(
        zip(got, ref_outs, ref_grads, strict=True)
    ):
        assert out.shape == ref_out.shape, f"rank {r}: output shape {out.shape} != {ref_out.shape}"
        assert out.dtype == ref_out.dtype, f"rank {r}: output dtype {out.dtype} != {ref_out.dtype}"
        where = f"rank {r}"
        torch.testing.assert_close(
            out.double(), ref_out.double(), **tol, msg=lambda m, where=where: f"{where} output: {m}"
        )
        torch.testing.assert_close(
            grad.double(), ref_grad.double(), **tol, msg=lambda m, where=where: f"{where} grad: {m}"
        )


# ---------------------------------------------------------------------------
# Case builders
# ---------------------------------------------------------------------------


def uneven_sizes(world: int) -> list[int]:
    """Sizes that differ per rank, with a 0 once W >= 3: [3], [3, 1], [3, 1, 0], [3, 1, 0, 2]."""
    return [3, 1, 0, 2][:world]


def gather_case(
    rows: Sequence[int], dim: int = 0, dtype: torch.dtype = torch.float64, **kw: Any
) -> Case:
    xs = _inputs(rows, dim, 3, dtype)
    return Case(
        wb.all_gather, reference.all_gather, xs, [dict(dim=dim, **kw)] * len(rows), dict(dim=dim)
    )


def reduce_scatter_case(
    sizes: Sequence[int], dim: int = 0, dtype: torch.dtype = torch.float64, **kw: Any
) -> Case:
    world, n = len(sizes), sum(sizes)
    xs = [x for x in _inputs([n] * world, dim, 3, dtype)]
    kwargs = dict(dim=dim, sizes=list(sizes), **kw)
    return Case(
        wb.reduce_scatter,
        reference.reduce_scatter,
        xs,
        [kwargs] * world,
        dict(dim=dim, sizes=list(sizes)),
    )


def all_to_all_case(
    world: int, dim: int = 0, dtype: torch.dtype = torch.float64, **kw: Any
) -> Case:
    # Rank r sends (r + j) % 3 rows to rank j: uneven both ways, zeros included.
    send = [[(r + j) % 3 for j in range(world)] for r in range(world)]
    xs = _inputs([sum(s) for s in send], dim, 2, dtype)
    kwargs = [dict(send_sizes=send[r], dim=dim, **kw) for r in range(world)]
    return Case(wb.all_to_all, reference.all_to_all, xs, kwargs, dict(send_sizes=send, dim=dim))


def all_reduce_case(world: int, op: str, dtype: torch.dtype = torch.float64) -> Case:
    xs = _inputs([2] * world, 0, 3, dtype)
    if op in ("max", "min"):  # per-element winners on different ranks
        xs = [x * (1 if (r % 2) else -1) for r, x in enumerate(xs)]
    return Case(wb.all_reduce, reference.all_reduce, xs, [dict(op=op)] * world, dict(op=op))


def broadcast_case(world: int, src: int) -> Case:
    xs = _inputs([2] * world, 0, 3, torch.float64)
    return Case(wb.broadcast, reference.broadcast, xs, [dict(src=src)] * world, dict(src=src))


def ring_shift_case(rows: Sequence[int], shift: int, dim: int = 0, **kw: Any) -> Case:
    xs = _inputs(rows, dim, 3, torch.float64)
    kwargs = [dict(shift=shift, dim=dim, **kw)] * len(rows)
    return Case(wb.ring_shift, reference.ring_shift, xs, kwargs, dict(shift=shift))


WORLDS = [1, 2, 3, 4]


# ---------------------------------------------------------------------------
# Exactness, float64, every op, W in {1, 2, 3, 4}
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dim", [0, 1])
def test_all_gather_uneven(world: int, dim: int) -> None:
    check_case(gather_case(uneven_sizes(world), dim))


@pytest.mark.parametrize("world", WORLDS)
def test_all_gather_equal_sizes_and_noncontiguous(world: int) -> None:
    check_case(gather_case([2] * world), noncontig=True)
    check_case(gather_case([2] * world, dim=1), noncontig=True)


@pytest.mark.parametrize("world", WORLDS)
def test_all_gather_with_known_sizes_and_checks_off(world: int) -> None:
    sizes = uneven_sizes(world)
    check_case(gather_case(sizes, sizes=sizes, check=False))
    check_case(gather_case(sizes, sizes=sizes, check=True))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dim", [0, 1])
def test_reduce_scatter(world: int, dim: int) -> None:
    check_case(reduce_scatter_case([2] * world, dim), noncontig=True)
    check_case(reduce_scatter_case(uneven_sizes(world), dim))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dim", [0, 1])
def test_all_to_all(world: int, dim: int) -> None:
    check_case(all_to_all_case(world, dim), noncontig=dim == 1)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_all_reduce(world: int, op: str) -> None:
    check_case(all_reduce_case(world, op))


def test_all_reduce_max_splits_the_gradient_among_tied_ranks() -> None:
    # Every rank holds the same value at element 0: each gets 1/W of the summed gradient.
    xs = [torch.tensor([5.0, float(r)], dtype=torch.float64) for r in range(3)]
    case = Case(wb.all_reduce, reference.all_reduce, xs, [dict(op="max")] * 3, dict(op="max"))
    check_case(case)


@pytest.mark.parametrize("world", WORLDS)
def test_broadcast(world: int) -> None:
    check_case(broadcast_case(world, src=world - 1))
    check_case(broadcast_case(world, src=0))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("shift", [1, -1, 2])
def test_ring_shift(world: int, shift: int) -> None:
    check_case(ring_shift_case(uneven_sizes(world), shift))


@pytest.mark.parametrize("world", [2, 3])
def test_ring_shift_dim1_with_known_sizes(world: int) -> None:
    sizes = uneven_sizes(world)
    check_case(ring_shift_case(sizes, 1, dim=1, sizes=sizes, check=False), noncontig=True)


def _ring_pass_rank(xs: list[Tensor], sizes: list[int]) -> list[Tensor]:
    from wholebatch.comm.collectives import ring_pass

    r, w = dist.get_rank(), len(sizes)
    # two tensors in one step, each in its own dtype (SigLIP: the block and its gradient)
    return ring_pass([_noncontig(xs[r]), xs[r].to(torch.bfloat16)], sizes[(r - 1) % w])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_pass_is_a_ring_shift_by_one(world: int) -> None:
    # SigLIP's ring step: told only the rows it receives (no W-long sizes), uneven, a 0-row rank.
    sizes = uneven_sizes(world)
    xs = _inputs(sizes, 0, 3, torch.float64)
    got = run_ranks(world, _ring_pass_rank, xs, sizes)
    for r, ((a, b), want) in enumerate(zip(got, reference.ring_shift(xs, 1), strict=True)):
        torch.testing.assert_close(a, want, rtol=0, atol=0, msg=f"rank {r}")
        torch.testing.assert_close(b, want.to(torch.bfloat16), rtol=0, atol=0, msg=f"rank {r}")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(0, 5), min_size=2, max_size=4),
    dim=st.sampled_from([0, 1]),
)
def test_random_uneven_sizes(sizes: list[int], dim: int) -> None:
    check_case(gather_case(sizes, dim))
    check_case(reduce_scatter_case(sizes, dim))
    check_case(ring_shift_case(sizes, 1, dim))


# ---------------------------------------------------------------------------
# Other dtypes, wire dtypes
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3])
def test_float32(world: int) -> None:
    check_case(gather_case(uneven_sizes(world), dtype=torch.float32), tol=F32)
    check_case(reduce_scatter_case(uneven_sizes(world), dtype=torch.float32), tol=F32)
    check_case(reduce_scatter_case([2] * world, dtype=torch.float32), tol=F32)
    check_case(all_to_all_case(world, dtype=torch.float32), tol=F32)


@pytest.mark.parametrize("world", [2, 3])
def test_bfloat16(world: int) -> None:
    # bfloat16 keeps 8 significant bits: a sum of W terms is off by up to
    # about W * 2**-8 relative to the float64 reference of the same inputs.
    tol = dict(rtol=world * 2.0**-8, atol=world * 2.0**-8 * 400)
    check_case(gather_case(uneven_sizes(world), dtype=torch.bfloat16), tol=tol)
    check_case(reduce_scatter_case([2] * world, dtype=torch.bfloat16), tol=tol)


def _rank_wire_gather(
    xs: list[Tensor], gs: list[Tensor], wire: torch.dtype
) -> tuple[Tensor, Tensor]:
    r = dist.get_rank()
    x = xs[r].clone().requires_grad_()
    out = wb.all_gather(x, wire_dtype=wire)
    out.backward(gs[r])
    assert x.grad is not None
    return out.detach(), x.grad


@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16])
def test_wire_dtype_rounds_each_element_once(wire: torch.dtype) -> None:
    # Forward: every element is rounded to the wire dtype once. Backward: each
    # rank's output gradient is rounded once and the sum is taken in float32.
    # Both are exact statements, so the comparison is exact up to float32 sums.
    sizes = [3, 0, 2]
    xs = [x.float() + 0.123 for x in _inputs(sizes, 0, 4, torch.float32)]
    gen = torch.Generator().manual_seed(1)
    gs = [torch.randn(sum(sizes), 4, generator=gen) for _ in sizes]
    got = run_ranks(3, _rank_wire_gather, xs, gs, wire)
    expected_out = torch.cat(xs).to(wire).float()
    summed = sum(g.to(wire).float() for g in gs)
    assert isinstance(summed, Tensor)
    expected_grads = summed.split(sizes)
    for (out, grad), eg in zip(got, expected_grads, strict=True):
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, expected_out, rtol=0, atol=0)
        torch.testing.assert_close(grad, eg, rtol=1e-6, atol=1e-6)
    # and it is not a no-op: the rounding is visible against the exact values
    assert not torch.equal(got[0][0], torch.cat(xs))


@pytest.mark.parametrize("world", [2, 3])
def test_wire_dtype_on_reduce_scatter_and_all_to_all(world: int) -> None:
    tol = dict(rtol=2.0**-7, atol=2.0**-7 * 400)  # one bf16 rounding per contribution
    check_case(
        reduce_scatter_case(uneven_sizes(world), dtype=torch.float32, wire_dtype=torch.bfloat16),
        tol=tol,
    )
    check_case(all_to_all_case(world, dtype=torch.float32, wire_dtype=torch.bfloat16), tol=tol)
    check_case(ring_shift_case([2] * world, 1, wire_dtype=torch.bfloat16), tol=tol)


# ---------------------------------------------------------------------------
# Mutations: known-wrong gathers that the same assertions must reject
# ---------------------------------------------------------------------------


class _LocalSliceGather(torch.autograd.Function):
    """The classic GatherLayer bug: backward returns only this rank's slice of its own gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        ctx.rank, ctx.b = dist.get_rank(), x.shape[0]
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
        dist.all_gather(sizes, torch.tensor([x.shape[0]]))
        ctx.start = int(sum(int(s) for s in sizes[: ctx.rank]))
        with torch.no_grad():
            return wb.all_gather(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad[ctx.start : ctx.start + ctx.b]


def local_slice_gather(x: Tensor, dim: int = 0) -> Tensor:
    out: Tensor = _LocalSliceGather.apply(x)
    return out


def no_grad_gather(x: Tensor, dim: int = 0) -> Tensor:
    """`torch.distributed.all_gather` with this rank's slice swapped back in: remote rows carry no gradient."""
    w, r = dist.get_world_size(), dist.get_rank()
    parts = [torch.empty_like(x) for _ in range(w)]
    dist.all_gather(parts, x.detach().contiguous())
    parts[r] = x
    return torch.cat(parts)


@pytest.mark.parametrize("mutant", [local_slice_gather, no_grad_gather])
def test_mutations_are_rejected(mutant: Callable[..., Tensor]) -> None:
    good = gather_case([2, 2, 2])
    check_case(good)
    bad = dataclasses.replace(good, op=mutant)
    with pytest.raises(AssertionError, match="grad"):
        check_case(bad)


# ---------------------------------------------------------------------------
# A distributed finite-difference gradcheck (float64), independent of reference.py
# ---------------------------------------------------------------------------


def _rank_gradcheck(
    op: Callable[..., Tensor], xs: list[Tensor], kwargs: list[dict[str, Any]]
) -> float:
    """Max |analytic - numerical| of d(sum_r l_r)/dx over all ranks' elements."""
    r, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(7 + r)
    x0 = xs[r].clone()
    w = None

    def local_loss(x: Tensor) -> Tensor:
        nonlocal w
        out = op(x, **kwargs[r])
        if w is None:
            w = torch.randn(out.shape, generator=gen, dtype=out.dtype)
        return (out * w).sum() * (1 + r)

    x = x0.clone().requires_grad_()
    local_loss(x).backward()
    assert x.grad is not None
    analytic = x.grad
    eps, worst = 1e-6, 0.0
    for q in range(world):
        for e in range(xs[q].numel()):
            totals = []
            for sign in (1.0, -1.0):
                xp = x0.clone()
                if q == r:
                    xp.view(-1)[e] += sign * eps
                with torch.no_grad():
                    total = local_loss(xp).reshape(1).clone()
                dist.all_reduce(total)
                totals.append(float(total))
            numeric = (totals[0] - totals[1]) / (2 * eps)
            if q == r:
                worst = max(worst, abs(numeric - float(analytic.view(-1)[e])))
    return worst


@pytest.mark.parametrize(
    "make",
    [
        lambda: gather_case([2, 0, 1]),
        lambda: reduce_scatter_case([1, 2, 0]),
        lambda: all_to_all_case(3),
        lambda: all_reduce_case(3, "mean"),
        lambda: all_reduce_case(3, "max"),
        lambda: broadcast_case(3, 1),
        lambda: ring_shift_case([2, 1, 0], 1),
    ],
)
def test_distributed_gradcheck(make: Callable[[], Case]) -> None:
    case = make()
    worst = run_ranks(3, _rank_gradcheck, case.op, case.xs, case.kwargs)
    # central differences in float64 with eps 1e-6 on a linear map: error ~1e-8
    assert max(worst) < 1e-6


# ---------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------


def _rank_compiled(backend: str) -> tuple[float, float, list[float], list[float]]:
    r = dist.get_rank()

    def step(x: Tensor) -> Tensor:
        y = wb.all_gather(x * 2)
        return (y * torch.arange(y.shape[0], dtype=y.dtype)).sum() * (1 + r)

    compiled = torch.compile(step, backend=backend)
    x = (torch.arange(r + 1, dtype=torch.float64) + 100 * r).requires_grad_()
    out = compiled(x)
    out.backward()
    x2 = x.detach().clone().requires_grad_()
    ref = step(x2)
    ref.backward()
    assert x.grad is not None and x2.grad is not None
    return float(out), float(ref), x.grad.tolist(), x2.grad.tolist()


def test_inside_torch_compile() -> None:
    got = run_ranks(2, _rank_compiled, "aot_eager", timeout=180)
    # whole batch [0, 100, 101] * 2 weighted by [0, 1, 2]: 604 per rank, times (1 + r)
    assert [g[0] for g in got] == [604.0, 1208.0]
    for out, ref, grad, ref_grad in got:
        assert out == ref and grad == ref_grad
    # d(sum_r (1+r) * <2 * gathered, arange>)/dx = 2 * position * (1 + 2)
    assert got[0][2] == [0.0] and got[1][2] == [6.0, 12.0]


def _rank_compiled_losses(backend: str) -> list[tuple[list[float], list[float]]]:
    """Each loss, compiled and eager, on this rank's rows [r + 1 rows]: its inputs' gradients."""
    r = dist.get_rank()
    gen = torch.Generator().manual_seed(10 + r)
    img = torch.randn(r + 1, 4, dtype=torch.float64, generator=gen)
    txt = torch.randn(r + 1, 4, dtype=torch.float64, generator=gen)
    out = []
    calls = (
        lambda a, b: wb.clip_loss(a, b, 2.0),
        lambda a, b: wb.siglip_loss(a, b, 2.0, -1.0),
    )
    for loss in calls:
        grads = []
        for fn in (torch.compile(loss, backend=backend), loss):
            a, b = img.clone().requires_grad_(), txt.clone().requires_grad_()
            fn(a, b).backward()
            assert a.grad is not None and b.grad is not None
            grads.append(torch.cat([a.grad, b.grad]).flatten().tolist())
        out.append((grads[0], grads[1]))
    return out


def test_losses_inside_torch_compile() -> None:
    # Every loss's autograd Function runs through collectives.apply, which runs eagerly
    # while compiling (comm._c10d.eager): the compiled loss's gradients are eager mode's.
    # A guard, not a mutation test: on torch 2.11 these two were right without `eager` too
    # (only the bare all_gather above was traced wrong there).
    for per_rank in run_ranks(2, _rank_compiled_losses, "aot_eager", timeout=240):
        for compiled, eager_ in per_rank:
            assert compiled == pytest.approx(eager_, rel=1e-12, abs=1e-15)
            assert any(compiled)


# ---------------------------------------------------------------------------
# A world of one, torch.distributed not initialised (this process)
# ---------------------------------------------------------------------------


def test_world_of_one_is_the_identity() -> None:
    assert not dist.is_initialized()
    x = torch.arange(6.0).reshape(2, 3).requires_grad_()
    for out in (
        wb.all_gather(x, dim=1),
        wb.reduce_scatter(x),
        wb.all_to_all(x, [2]),
        wb.all_reduce(x, "mean"),
        wb.broadcast(x),
        wb.ring_shift(x, 5),
    ):
        assert torch.equal(out, x)
        (out * 3).sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.full((2, 3), 18.0))
    assert wb.get_world_size() == 1 and wb.get_rank() == 0 and wb.all_ranks_agree(True)


def test_world_of_one_still_validates() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(wb.WholebatchError, match=r"all_gather: dim=2 is out of range"):
        wb.all_gather(x, dim=2)
    with pytest.raises(wb.WholebatchError, match=r"sizes\[0\]=3"):
        wb.all_gather(x, sizes=[3])
    with pytest.raises(wb.WholebatchError, match="op='prod'"):
        wb.all_reduce(x, "prod")  # type: ignore[arg-type]
    with pytest.raises(wb.WholebatchTypeError, match=r"expected a torch\.Tensor"):
        wb.all_gather([1, 2])  # type: ignore[arg-type]
    with pytest.raises(wb.WholebatchError, match="wire_dtype needs a floating input"):
        wb.all_gather(torch.zeros(2, dtype=torch.int64), wire_dtype=torch.bfloat16)


def test_agree_rows_names_fields_and_totals_in_one_process() -> None:
    from wholebatch.comm.agree import agree_rows

    rows = agree_rows({"loss": torch.tensor(2.5), "items": 3, "shape": [4, 5], "bad": False})
    assert rows["loss"] == (2.5,) and rows.ints("items") == (3,)
    assert rows.vectors("shape") == ((4.0, 5.0),) and rows.ranks_where("bad") == []
    assert rows.total("items") == 3 and rows.same("shape")
    rows.error("op", None, flag="bad")  # no flag set: nothing raised
    with pytest.raises(KeyError, match="no field 'nope'"):
        rows["nope"]
    # Totals of non-finite values do not raise (fsum refuses inf + -inf and overflow).
    inf = agree_rows({"x": [float("inf"), float("-inf")]})
    assert inf.vectors("x") == ((float("inf"), float("-inf")),)
    from wholebatch.comm.agree import Rows

    table = Rows(
        torch.tensor([[float("inf")], [float("-inf")]], dtype=torch.float64), {"x": (0, 1)}, None
    )
    assert math.isnan(table.total("x"))
    big = Rows(torch.tensor([[1e308], [1e308]], dtype=torch.float64), {"x": (0, 1)}, None)
    assert big.total("x") == float("inf")


def _flags(case: str) -> tuple[bool, bool]:
    """(all_ranks_agree, any_rank) of this rank's flag: `case` names who holds True."""
    r, w = dist.get_rank(), dist.get_world_size()
    flag = {"none": False, "all": True, "last": r == w - 1, "first": r == 0}[case]
    return wb.all_ranks_agree(flag), wb.any_rank(flag)


@pytest.mark.parametrize(
    ("case", "want"),
    [("none", (False, False)), ("all", (True, True)), ("last", (False, True)),
     ("first", (False, True))],
)  # fmt: skip
def test_all_ranks_agree_and_any_rank(case: str, want: tuple[bool, bool]) -> None:
    # every rank gets the same answer; one rank's True is enough for any_rank, not for
    # all_ranks_agree (a mutation returning the local flag fails "last" on ranks 0, 1)
    assert run_ranks(3, _flags, case) == [want] * 3
