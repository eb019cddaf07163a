"""The shim's mesh and DTensor entries (wholebatch.comm._c10d), every branch, on 4 gloo ranks.

- `flat_group`: torch's `DeviceMesh._flatten` and the public fallback (one
  `new_subgroups_by_enumeration` per mesh) give each rank the same ranks, and a
  sum over either is the sum over exactly those ranks.
- `shard_offset`: torch's private `compute_local_shape_and_global_offset` and the
  public computation agree on uneven, nested and empty shards, and both are
  checked against the ground truth (the full tensor sliced at the offset is the
  rank's local shard), which a wrong offset fails.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.support.harness import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

W = 4
TIMEOUT = 60.0

# (a, b, c) = (2, 1, 2): flattening (b, c) pairs ranks {0, 1}, {2, 3}; (a, b) pairs {0, 2}, {1, 3}.
SHAPE = (("a", 2), ("b", 1), ("c", 2))
DIMS = (("b", "c"), ("a", "b"), ("a", "c"))


def _flat_groups() -> dict[str, list[tuple[list[int], float]]]:
    from tests.support.mesh_cases import get_mesh
    from wholebatch.comm._c10d import flat_group

    mesh = get_mesh(SHAPE)
    out: dict[str, list[tuple[list[int], float]]] = {}
    for dims in DIMS:
        for use_flatten in (True, False):
            group = flat_group(mesh, dims, use_flatten=use_flatten)
            ranks = sorted(dist.get_process_group_ranks(group))
            t = torch.tensor([10.0 ** dist.get_rank()], dtype=torch.float64)
            dist.all_reduce(t, group=group)
            out.setdefault("_".join(dims), []).append((ranks, float(t)))
        # made once per (mesh, dims): the second call returns the same group
        assert flat_group(mesh, dims, use_flatten=False) is flat_group(
            mesh, dims, use_flatten=False
        )
    return out


def test_flat_group_branches_agree() -> None:
    expected = {
        "b_c": [[0, 1], [0, 1], [2, 3], [2, 3]],
        "a_b": [[0, 2], [1, 3], [0, 2], [1, 3]],
        "a_c": [[0, 1, 2, 3]] * 4,
    }
    results = run_ranks(W, _flat_groups, timeout=TIMEOUT)
    for name, want in expected.items():
        for rank, got in enumerate(results):
            (ranks_flat, sum_flat), (ranks_pub, sum_pub) = got[name]
            assert ranks_flat == ranks_pub == want[rank], (name, rank)
            assert sum_flat == sum_pub == sum(10.0**r for r in want[rank]), (name, rank)


# (tensor shape, placements as (kind, dim)): uneven, nested on one dim, two dims, and a
# length-3 dim cut four ways (one rank's shard is empty).
LAYOUTS = [
    ((7, 3), (("shard", 0), ("shard", 0))),
    ((5, 3), (("shard", 0), ("shard", 1))),
    ((2, 5), (("replicate", 0), ("shard", 1))),
    ((3, 2), (("shard", 0), ("shard", 0))),
]


def _offsets() -> list[tuple[tuple[int, ...], tuple[int, ...], bool]]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from tests.support.mesh_cases import get_mesh
    from wholebatch.comm._c10d import shard_offset

    mesh = get_mesh((("dp", 2), ("tp", 2)))
    out = []
    for shape, spec in LAYOUTS:
        full = torch.arange(float(torch.Size(shape).numel()), dtype=torch.float64).reshape(shape)
        placements = [Shard(d) if kind == "shard" else Replicate() for kind, d in spec]
        dt = distribute_tensor(full, mesh, placements)
        private = shard_offset(dt, use_private=True)
        public = shard_offset(dt, use_private=False)
        local = dt.to_local()
        index = tuple(slice(o, o + n) for o, n in zip(public, local.shape, strict=True))
        out.append((private, public, bool(torch.equal(full[index], local))))
    return out


def test_shard_offset_branches_agree_with_the_full_tensor() -> None:
    results = run_ranks(W, _offsets, timeout=TIMEOUT)
    for rank, got in enumerate(results):
        for (shape, spec), (private, public, fits) in zip(LAYOUTS, got, strict=True):
            assert private == public, (rank, shape, spec)
            assert fits, f"rank {rank}: the full tensor at {public} is not its shard {shape} {spec}"
    # the layouts do cut unevenly: rank 3's piece of the (3, 2) tensor starts past the end
    assert results[3][3][1] == (3, 0)
