"""The causes of a step on a device mesh (`--mesh`): counts over the wrong dims, replicas fed apart.

A mesh's tensor- and context-parallel ranks (the replica dims) see the same rows:
counting their items again divides by R = tp too much (`counted-over-tp`),
compensating the data-parallel mean by them multiplies by R
(`compensated-over-tp`); both are exact in the re-run with those dims of size 1.
Context parallelism has its own two counts (`cp-counted-twice`,
`cp-items-missing`), a pipeline its stage that was not rescaled
(`stage-not-rescaled`), and replicas must be fed alike
(`replicas-fed-different-data`). A rank that divides by its own count shows in
the factors of its shard (`dp_count_factors`, named as `mean-of-means`).

Legend: R the replicas of a row shard (the product of the replica dims), B row
shards, C cp ranks.
"""

from __future__ import annotations

import math

from wholebatch.verify.case import Case, near
from wholebatch.verify.causes.base import Cause, at
from wholebatch.verify.report import Comparison

__all__ = ["MESH_CAUSES", "dp_count_factors", "dp_count_text", "mesh_factor"]


def _mesh_sizes(case: Case) -> tuple[int, int]:
    """(R, C): the tensor-parallel replicas (product of the replica dims), the cp size."""
    from wholebatch.verify.mesh import replica_dims

    shape = case.ev.mesh
    if not shape:
        return 1, 1
    r = math.prod(shape[d] for d in replica_dims(shape, case.ev.row_dims))
    return r, shape.get("cp", 1)


def _unreplicated(case: Case) -> Comparison | None:
    """The re-run with the tp and cp dims of size 1 ("dp=2,tp=1"), if verify made it."""
    from wholebatch.verify.mesh import REPLICAS_ONE

    return next((c for c in case.comparisons if c.variant.startswith(REPLICAS_ONE)), None)


def _mesh_at(case: Case, factor: float) -> bool:
    """The group is `factor` x the reference on a mesh, and exact (if re-run) without tp/cp."""
    if not case.ev.mesh or factor == 1.0 or not at(case, factor):
        return False
    again = _unreplicated(case)
    return again is None or again.ok


def _counted_replicas(case: Case) -> bool:
    r, _ = _mesh_sizes(case)
    return r > 1 and _mesh_at(case, 1.0 / r)


def _cp_twice(case: Case) -> bool:
    _, c = _mesh_sizes(case)
    return c > 1 and _mesh_at(case, 1.0 / c)


def _compensated_replicas(case: Case) -> bool:
    r, _ = _mesh_sizes(case)
    return r > 1 and _mesh_at(case, float(r))


def mesh_factor(case: Case) -> bool:
    """A constant factor one of the mesh causes explains (not also named `scaled`, `1/W`, `W`)."""
    if not case.ev.mesh or case.group is None:
        return False
    return _counted_replicas(case) or _cp_twice(case) or _compensated_replicas(case)


def _mesh_shown(case: Case) -> str:
    return ",".join(f"{d}={s}" for d, s in case.ev.mesh.items())


def _rerun_text(case: Case) -> str:
    again = _unreplicated(case)
    if again is None:
        return ""
    shape = again.variant.partition("(")[2].rstrip(")")
    return f", and exact on the same step at {shape}"


def _counted_replicas_message(case: Case) -> str:
    from wholebatch.verify.mesh import replica_dims

    r, _ = _mesh_sizes(case)
    dims = " x ".join(d for d in replica_dims(case.ev.mesh, case.ev.row_dims))
    return (
        f"{case.g.subject()} exactly 1/{r} of the whole-batch gradient on the mesh "
        f"{_mesh_shown(case)}{_rerun_text(case)}: {r} = the {dims} ranks that replicate each "
        f"row shard. The step counts items over them too (the count all-reduced over the "
        f"world, or over {' x '.join((*case.ev.row_dims, dims))}), so N is {r}x the batch's: "
        f"{dims} ranks see the same tokens and must be counted once."
    )


def _compensated_replicas_message(case: Case) -> str:
    from wholebatch.verify.mesh import replica_dims

    r, _ = _mesh_sizes(case)
    dims = " x ".join(d for d in replica_dims(case.ev.mesh, case.ev.row_dims))
    batch = " x ".join(case.ev.row_dims)
    return (
        f"{case.g.subject()} exactly {r} times the whole-batch gradient on the mesh "
        f"{_mesh_shown(case)}{_rerun_text(case)}: {r} = the {dims} ranks that replicate each "
        f"row shard. The step compensates the data-parallel mean (FSDP's or DDP's over "
        f"{batch}) by the size of {batch} x {dims}, the world, where the wrapper averaged over "
        f"{batch} only: the {dims} ranks hold the same tokens and no mean runs over them."
    )


def dp_count_factors(case: Case) -> dict[int, float]:
    """On a mesh: each data shard's factor, when every rank's shard of the gradient is one
    multiple f_s of the reference, the ranks of one data shard (its replicas) agree, the
    factors differ and sum over the shards of 1/f_s = 1: each data-parallel rank divided
    by its own item count N_s where the whole batch has N = sum N_s (f_s = N / N_s)."""
    ev = case.ev
    b = case.b
    if not ev.mesh or b < 2 or len(ev.rank_factors) != len(ev.shards) or not ev.rank_factors:
        return {}
    by_shard: dict[int, float] = {}
    for f, shard in zip(ev.rank_factors, ev.shards, strict=True):
        if f is None or f <= 0 or (shard in by_shard and not near(by_shard[shard], f)):
            return {}
        by_shard.setdefault(shard, f)
    first = next(iter(by_shard.values()))
    if len(by_shard) != b or all(near(f, first) for f in by_shard.values()):
        return {}  # one factor everywhere is a constant multiple: the factor causes read it
    return by_shard if abs(math.fsum(1.0 / f for f in by_shard.values()) - 1.0) <= 1e-6 else {}


def dp_count_text(case: Case, factors: dict[int, float]) -> str:
    """The words of a per-rank count read from the ranks' factors (for `mean-of-means`)."""
    shown = ", ".join(f"data shard {s}: {f:.4g}" for s, f in sorted(factors.items()))
    inverse = " + ".join(f"1/{f:.4g}" for _, f in sorted(factors.items()))
    return (
        f"on the mesh {_mesh_shown(case)} each rank's shard of the gradient is its own multiple "
        f"of the whole-batch gradient ({shown}), and {inverse} = 1: each data-parallel rank "
        f"normalises by its own item count N_s instead of the count agreed across "
        f"{' x '.join(case.ev.row_dims)} (N, the sum of them), so its shard is N/N_s times the "
        "whole batch's: per-rank counts, the mistake a flat world shows as a mean of the ranks' "
        "means"
    )


def _cp_twice_message(case: Case) -> str:
    _, c = _mesh_sizes(case)
    return (
        f"{case.g.subject()} exactly 1/cp = 1/{c} of the whole-batch gradient on the mesh "
        f"{_mesh_shown(case)}{_rerun_text(case)}: every context-parallel rank counts the "
        f"items of the whole rows it shares (not of its own tokens) and the counts are summed "
        f"over dp x cp, so each row's items are counted {c} times (prime-rl PR #2562)."
    )


def _replica_split(case: Case) -> list[tuple[int, int, int]]:
    """(rank, rank, forward) for the replicas whose model received different inputs."""
    from wholebatch.verify.mesh import replica_groups

    ev = case.ev
    if not ev.mesh or len(ev.inputs) != math.prod(ev.mesh.values()):
        return []
    out = []
    for group in replica_groups(ev.mesh, ev.row_dims):
        first = ev.inputs[group[0]]
        for r in group[1:]:
            mine = ev.inputs[r]
            if len(mine) != len(first):
                out.append((group[0], r, min(len(mine), len(first))))
                continue
            for i, (a, b) in enumerate(zip(first, mine, strict=True)):
                if abs(a - b) > 1e-9 * max(1.0, abs(a)):
                    out.append((group[0], r, i))
                    break
    return out


def _replica_data_message(case: Case) -> str:
    from wholebatch.verify.mesh import replica_dims

    dims = "/".join(replica_dims(case.ev.mesh, case.ev.row_dims))
    shown = "; ".join(
        f"ranks {a} and {b} at forward call {i + 1}" for a, b, i in _replica_split(case)[:4]
    )
    return (
        f"ranks that replicate a row shard on the mesh {_mesh_shown(case)} (the same "
        f"coordinates on the batch dims {case.ev.row_dims}, they differ only on {dims}) fed "
        f"their model different inputs ({shown}): verify gave them the same rows, so the step "
        "(or its data loader) picks rows by the global rank. Tensor-parallel ranks compute one "
        "loss together on the same tokens; fed different rows, their gradients mix rows of "
        "different batches."
    )


def _cp_factors(case: Case) -> dict[int, float]:
    """On a mesh with cp: each cp coordinate's factor, when every rank's shards are one
    multiple of the reference, the ranks of one cp coordinate agree, and sum(1/f) = 1."""
    from wholebatch.verify.mesh import coordinate

    ev, (_, c) = case.ev, _mesh_sizes(case)
    if c < 2 or not ev.rank_factors or any(f is None or f <= 0 for f in ev.rank_factors):
        return {}
    by_cp: dict[int, float] = {}
    for rank, f in enumerate(ev.rank_factors):
        assert f is not None
        at = coordinate(ev.mesh, rank)["cp"]
        if at in by_cp and not near(by_cp[at], f):
            return {}
        by_cp.setdefault(at, f)
    if len(by_cp) != c or all(near(f, 1.0) for f in by_cp.values()):
        return {}
    return by_cp if abs(math.fsum(1.0 / f for f in by_cp.values()) - 1.0) <= 1e-6 else {}


def _cp_missing_message(case: Case) -> str:
    factors = _cp_factors(case)
    shown = ", ".join(f"cp rank {r}: {f:.4g}" for r, f in sorted(factors.items()))
    inverse = " + ".join(f"1/{f:.4g}" for _, f in sorted(factors.items()))
    return (
        f"on the mesh {_mesh_shown(case)} each rank's shard of the gradient is its own "
        f"multiple of the whole-batch gradient ({shown}), and {inverse} = 1: each cp rank "
        "divides by the items of its own tokens (N_c, agreed over dp only) where the whole "
        "batch has N = the sum over cp of N_c, so the other context-parallel ranks' items are "
        "missing from its count (x cp when every cp rank holds as many; Megatron-LM PR #7513)."
    )


def _stages(case: Case) -> dict[int, set[str]]:
    """On a pipeline mesh: each pp stage's parameters (those its ranks gave a gradient)."""
    from wholebatch.verify.mesh import coordinate

    ev = case.ev
    if ev.mesh.get("pp", 1) < 2 or len(ev.owned) != math.prod(ev.mesh.values()):
        return {}
    out: dict[int, set[str]] = {}
    for rank, names_ in enumerate(ev.owned):
        out.setdefault(coordinate(ev.mesh, rank)["pp"], set()).update(names_)
    return out


def _unscaled_stage(case: Case) -> int | None:
    """The one stage whose parameters are this group, at one factor, the others exact."""
    stages, g = _stages(case), case.g
    if not stages or g.ratio is None or near(g.ratio, 1.0):
        return None
    group = set(g.names)
    hit = [s for s, owned in stages.items() if group <= owned]
    if len(hit) != 1:
        return None
    others = {n for s, owned in stages.items() if s != hit[0] for n in owned}
    exact = all(p.ok for p in case.main.params if p.name in others)
    return hit[0] if exact and others else None


def _stage_message(case: Case) -> str:
    stage = _unscaled_stage(case)
    return (
        f"{case.g.subject()} {case.g.ratio:.4g} x the whole-batch gradient, and they are the "
        f"parameters of pipeline stage {stage} on the mesh {_mesh_shown(case)}, while every "
        "other stage's gradient is exact: that stage's gradients were not rescaled by the "
        "step's factor (the agreed 1/N, times the wrapper's divisor). Only the last stage "
        "computes the loss, but every stage's gradient is part of the same step."
    )


MESH_CAUSES: tuple[Cause, ...] = (
    Cause(
        code="replicas-fed-different-data",
        summary="on a mesh, ranks that replicate a row shard (tp) fed the model different inputs",
        precedence=45,
        stage="evidence",
        located=False,
        test=lambda case: bool(_replica_split(case)),
        message=_replica_data_message,
        fix="Fix: shard the data by the batch dims only (DistributedSampler(num_replicas=<product "
        "of the batch dims' sizes>, rank=<the batch index>)); wholebatch.Accumulator(mesh=, "
        "batch_dims=) checks this at every step.",
    ),
    Cause(
        code="counted-over-tp",
        summary="on a mesh, exactly 1/tp: items counted over the tensor-parallel replicas too",
        precedence=142,
        stage="gradient",
        per_group=True,
        excluded_by=("replicated-K",),
        test=_counted_replicas,
        message=_counted_replicas_message,
        fix="Fix: all-reduce the item count over the batch dims' group only "
        "(MeshSplit(mesh=mesh, batch_dims=('dp',)).batch_group(), not the world), or "
        "wholebatch.Accumulator(model, opt, mesh=mesh, batch_dims=('dp',)).",
    ),
    Cause(
        code="compensated-over-tp",
        summary="on a mesh, exactly tp times: the data-parallel mean compensated by the "
        "tensor-parallel replicas too",
        precedence=143,
        stage="gradient",
        per_group=True,
        excluded_by=("replicated-K",),
        test=_compensated_replicas,
        message=_compensated_replicas_message,
        fix="Fix: multiply by the size of the dims the wrapper averaged over (the batch dims: "
        "mesh['dp'].size()), not the world's, or wholebatch.Accumulator(model, opt, mesh=mesh, "
        "batch_dims=('dp',)).",
    ),
    Cause(
        code="cp-counted-twice",
        summary="on a mesh, exactly 1/cp: each row's items counted on every context-parallel rank",
        precedence=144,
        stage="gradient",
        per_group=True,
        excluded_by=("replicated-K",),
        test=_cp_twice,
        message=_cp_twice_message,
        fix="Fix: each cp rank counts the items of its own tokens only, summed over dp x cp "
        "(Accumulator(mesh=mesh, batch_dims=('dp', 'cp')) with a loss_fn over the rank's "
        "slice).",
    ),
    Cause(
        code="cp-items-missing",
        summary="on a mesh with cp, each rank's shard at N / N_c: cp's items left out of the count",
        precedence=147,
        stage="gradient",
        test=lambda case: bool(_cp_factors(case)),
        message=_cp_missing_message,
        fix="Fix: count over dp x cp (Accumulator(mesh=mesh, batch_dims=('dp', 'cp'))), the "
        "count all-reduced over the flattened dp_cp group.",
    ),
    Cause(
        code="stage-not-rescaled",
        summary="on a pipeline mesh, one stage's parameters at a factor, the other stages exact",
        precedence=146,
        stage="gradient",
        per_group=True,
        excluded_by=("replicated-K",),
        test=lambda case: _unscaled_stage(case) is not None,
        message=_stage_message,
        fix="Fix: after the schedule, agree N over the mesh and rescale every stage by the "
        "same factor (wholebatch.train.pipeline.PipelineAccumulator does).",
    ),
)
"""The mesh causes (they hold only on a mesh)."""
