"""The batch groups of a mesh are cached weakly: a destroyed world leaves no mesh or group alive.

Three rounds, in fresh processes (2 ranks, gloo): `init_process_group`, a 2 x 1
mesh, `clip_loss(mesh=, batch_dims=)` twice (the second call reuses the cached
group: no group created), `destroy_process_group`, then the round's last
references dropped. After each round the mesh object and its batch group must be
freed (weak references dead) and the cache empty. The mutation, the strong cache
keyed by `id(mesh)` that held every mesh alive, fails the same check.
"""

from __future__ import annotations

import gc
import os
import socket
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rounds(rank: int, ports: list[int], out: dict[int, list[tuple[bool, ...]]]) -> None:
    """Three rounds with the real cache, then three with the mutation, in one process."""
    out[rank] = _three(rank, ports[:3], strong=False) + _three(rank, ports[3:], strong=True)


def _three(rank: int, ports: list[int], strong: bool) -> list[tuple[bool, ...]]:
    os.environ["WHOLEBATCH_SMALL_ROWS"] = "0"
    from torch.distributed.device_mesh import init_device_mesh

    import wholebatch.comm.meshgroup as meshgroup
    from wholebatch.losses import clip_loss

    held: list[object] = []
    if strong:  # MUTATION: a strong cache keyed by id(mesh), as before
        real = meshgroup._GROUPS.put

        def put(mesh: object, dims: tuple[str, ...], pg: object) -> None:
            held.append((mesh, pg))
            real(mesh, dims, pg)  # type: ignore[arg-type]

        meshgroup._GROUPS.put = put  # type: ignore[method-assign]
    seen = []
    for port in ports:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2)  # fmt: skip
        # torch 2.8 keeps slices in a registry of its own, keyed by the slice (which compares
        # by value: the first key of each shape stays, holding its root) with the root of the
        # last such slice as its value: slice another mesh the same way before and after the
        # loss, so that registry holds that one, not the loss's (torch 2.13 holds neither)
        other = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
        other["dp"].get_group()
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
        x = torch.randn(3, 4, dtype=torch.float64)
        clip_loss(x, x, 2.0, mesh=mesh, batch_dims=("dp",))
        pg = meshgroup._GROUPS.get(mesh, ("dp",))
        clip_loss(x, x, 2.0, mesh=mesh, batch_dims=("dp",))
        cached = meshgroup._GROUPS.get(mesh, ("dp",)) is pg and pg is not None
        other["dp"].get_group()  # after the loss's slice too: the registry's value is other's
        mesh_ref, pg_ref = weakref.ref(mesh), weakref.ref(pg)  # type: ignore[arg-type]
        del mesh, pg, other
        dist.destroy_process_group()
        gc.collect()
        seen.append((cached, mesh_ref() is None, pg_ref() is None, len(meshgroup._GROUPS) == 0))
    return seen


def test_three_rounds_leave_no_mesh_or_group_alive() -> None:
    ports = [_port() for _ in range(6)]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rounds, args=(ports, out), nprocs=2, join=True)
        per_rank = [list(out[r]) for r in range(2)]
    for rounds in per_rank:
        assert rounds[:3] == [(True, True, True, True)] * 3, rounds
        assert [r[1] for r in rounds[3:]] == [False] * 3, rounds  # the mutation is caught
