"""The corpus's independent check: each target's real step or trainer, without verify's runner.

    PYTHONPATH=src:. python -m tests.support.verify_corpus_check tests/support/verify_corpus_own.py:attn_f64_global

For a target (a function returning a VerifySpec, TrainerSpec or ReplaySpec; only
its fields are read), `measure` starts W fresh interpreters (multiprocessing
"spawn"), joins them in a gloo group of their own (TCP on loopback, torchrun's
environment variables set), and on each rank:

- builds the model after `torch.manual_seed(spec.seed)`, with every
  `nn.Dropout`'s p set to 0 for a trainer (verify's rule for trainers);
- hands it an optimizer of this module (`StepSpy`) that copies every
  parameter's `.grad` (float64) when `step()` is called, and counts the calls;
- runs the step as the spec says: a VerifySpec's step with DDP (or its mesh's
  `parallelize`) on this rank's K of W·K contiguous chunks, a trainer's
  `train(run)` with a `TrainerRun` filled as the spec's documentation says;
- records what the model's forward received (for the micro-batch weights) and,
  for a ReplaySpec, the micro-batches the trainer recorded.

One more fresh interpreter computes the reference: the model built the same
way, cast to float64 with its batch, `reference_loss` on the whole batch (a
ReplaySpec: every rank's recorded micro-batches, padded and concatenated here),
backward. The `Truth` compares them: the relative error of the whole model's
gradient (L2 over every entry), its ratio to the reference, how far it is from
that multiple, how far ranks differ, and (given a hypothesis: each micro-batch's
own mean loss) the weight of every recorded micro-batch, fitted by least squares.

Legend: W ranks, K micro-batches per rank, J = W·K micro-batches, P parameter entries.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import math
import multiprocessing as mp
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["StepSpy", "Truth", "measure"]


@dataclasses.dataclass
class Truth:
    """What the independent check measured for one target."""

    target: str
    rel_err: float = math.nan
    """max over ranks of ||g_r - g_ref|| / ||g_ref|| (every parameter entry)."""
    ratio: float = math.nan
    """<g_0, g_ref> / <g_ref, g_ref>."""
    multiple_err: float = math.nan
    """||g_0 - ratio g_ref|| / ||g_ref||: small when the step is a multiple of the reference."""
    rank_spread: float = math.nan
    """max over ranks of ||g_r - g_0|| / ||g_ref||."""
    steps: list[int] = dataclasses.field(default_factory=list)
    """optimizer.step() calls per rank."""
    missing: list[str] = dataclasses.field(default_factory=list)
    """Parameters with a reference gradient (over 1e-6 of the largest) whose step gradient is zero."""
    weights: list[float] = dataclasses.field(default_factory=list)
    weights_residual: float = math.nan
    error: str = ""
    seconds: float = 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def load(target: str) -> Any:
    """The spec a 'path/to/file.py:function' target returns (imported by its dotted name under the
    repository root, so its sibling modules import as they do in the tests)."""
    where, _, fn = target.rpartition(":")
    root = Path(__file__).resolve().parents[2]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    path = Path(where).resolve().relative_to(root)
    module = importlib.import_module(".".join(path.with_suffix("").parts))
    return getattr(module, fn)()


class StepSpy(torch.optim.Optimizer):
    """Copies every parameter's gradient (float64, DTensors gathered) at each `step()`; changes nothing."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(list(model.parameters()), {"lr": 1.0})
        self.model = model
        self.calls = 0
        self.grads: dict[str, Tensor] = {}

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            with torch.enable_grad():
                closure()
        self.calls += 1
        for name, p in self.model.named_parameters():
            g = p.grad
            if g is None:
                continue
            g = g.full_tensor() if hasattr(g, "full_tensor") else g
            g = g.detach().double().cpu().clone()
            self.grads[name] = self.grads[name] + g if name in self.grads else g


def _tensors(x: Any) -> Any:
    """Tensors of a forward's arguments (dicts and sequences kept), detached copies on the CPU."""
    if isinstance(x, Tensor):
        return x.detach().cpu().clone()
    if isinstance(x, Mapping):
        return {k: _tensors(v) for k, v in x.items() if isinstance(v, Tensor | Mapping)}
    if isinstance(x, list | tuple):
        return [_tensors(v) for v in x]
    return None


def _rank(target: str, rank: int, world: int, k: int, mesh: str, port: int, conn: Any) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )  # fmt: skip
    torch.set_num_threads(1)
    try:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=timedelta(seconds=300),
        )  # fmt: skip
        conn.send_bytes(pickle.dumps(("ok", _run(load(target), rank, world, k, mesh))))
    except BaseException:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))


def _run(spec: Any, rank: int, world: int, k: int, mesh_shape: str) -> dict[str, Any]:
    kind = type(spec).__name__
    trainer = kind in ("TrainerSpec", "ReplaySpec")
    torch.manual_seed(spec.seed)
    model = spec.build_model()
    if trainer:
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
    forwards: list[Any] = []

    def hook(_m: nn.Module, args: Any, kwargs: Any) -> None:
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            forwards.append({"args": _tensors(args), "kwargs": _tensors(kwargs)})

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    recorded: list[dict[str, Tensor]] = []
    module: nn.Module = model
    mesh = None
    if mesh_shape:
        from torch.distributed.device_mesh import init_device_mesh

        from wholebatch.verify import mesh as verify_mesh

        dims = dict(p.split("=") for p in mesh_shape.split(","))
        mesh = init_device_mesh(
            "cpu", tuple(int(v) for v in dims.values()), mesh_dim_names=tuple(dims)
        )
        verify_mesh._CURRENT.append(mesh)  # what the spec's step reads through current_mesh()
        module = spec.parallelize(model, mesh) or model
    elif kind == "VerifySpec" and spec.wrap == "ddp":
        module = nn.parallel.DistributedDataParallel(model)
    spy = StepSpy(model)
    with tempfile.TemporaryDirectory() as out:
        if kind == "VerifySpec":
            shards = world if mesh is None else mesh["dp"].size()
            shard = rank if mesh is None else mesh["dp"].get_local_rank()
            parts = _chunks(spec.batch, shards * k)[shard * k : (shard + 1) * k]
            torch.manual_seed(spec.seed + 1 + shard)
            spec.step(module, spy, parts)
        else:
            from wholebatch.verify import TrainerRun

            batch = getattr(spec, "batch", None)
            rows = list(spec.data) if kind == "ReplaySpec" else _rows(batch)
            run = TrainerRun(
                model=model, optimizer=spy, batch=batch, dataset=rows, world_size=world,
                rank=rank, micro_batches=k, per_device_rows=len(rows) // (world * k),
                output_dir=out, seed=spec.seed, data_shards=world, data_rank=rank,
                shard=rows[rank * len(rows) // world : (rank + 1) * len(rows) // world],
                record=lambda mb: recorded.append({n: v.detach().cpu().clone() for n, v in mb.items()}),
            )  # fmt: skip
            torch.manual_seed(spec.seed + 1 + rank)
            spec.train(run)
    handle.remove()
    grads = spy.grads
    if not spy.calls:  # never stepped: the gradient it left
        grads = {
            n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
            .detach()
            .double()
            .cpu()
            for n, p in model.named_parameters()
            if p.grad is not None
        }
    return {"grads": grads, "calls": spy.calls, "forwards": forwards, "recorded": recorded}


def _chunks(batch: Any, parts: int) -> list[Any]:
    if isinstance(batch, Tensor):
        return list(torch.tensor_split(batch, parts))
    if isinstance(batch, Mapping):
        cols = {key: _chunks(v, parts) for key, v in batch.items()}
        return [{key: v[i] for key, v in cols.items()} for i in range(parts)]
    pieces = [_chunks(b, parts) for b in batch]
    return [type(batch)(p[i] for p in pieces) for i in range(parts)]


def _rows(batch: Any) -> list[Any]:
    if isinstance(batch, Tensor):
        return list(batch.unbind(0))
    if isinstance(batch, Mapping):
        n = len(next(iter(batch.values())))
        return [{key: v[i] for key, v in batch.items()} for i in range(n)]
    n = len(batch[0])
    return [type(batch)(b[i] for b in batch) for i in range(n)]


def _double(x: Any) -> Any:
    if isinstance(x, Tensor):
        return x.double() if x.is_floating_point() else x
    if isinstance(x, Mapping):
        return {key: _double(v) for key, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_double(v) for v in x)
    return x


def collate(recorded: list[dict[str, Tensor]], left: tuple[str, ...]) -> dict[str, Tensor]:
    """Micro-batches as one batch: every column padded with zeros to the widest (on the left
    for `left`), concatenated, and a `row` column numbering the rows."""
    out: dict[str, Tensor] = {}
    for key in recorded[0]:
        parts = [mb[key] for mb in recorded]
        shape = [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())]
        padded = []
        for p in parts:
            pad: list[int] = []
            for d in reversed(range(1, p.dim())):
                extra = shape[d - 1] - p.shape[d]
                pad += [extra, 0] if key in left else [0, extra]
            padded.append(torch.nn.functional.pad(p, pad))
        out[key] = torch.cat(padded)
    out["row"] = torch.arange(sum(len(next(iter(mb.values()))) for mb in recorded))
    return out


def _reference(target: str, ranks: list[dict[str, Any]], hypothesis: str, conn: Any) -> None:
    torch.set_num_threads(1)
    try:
        spec = load(target)
        kind = type(spec).__name__

        def fresh() -> nn.Module:
            torch.manual_seed(spec.seed)
            model = spec.build_model()
            for m in model.modules():
                if isinstance(m, nn.Dropout):
                    m.p = 0.0
            return model.double()

        if kind == "ReplaySpec":
            batch = collate([mb for r in ranks for mb in r["recorded"]], spec.left_padded)
        else:
            batch = spec.batch
        model = fresh()
        model.train()
        spec.reference_loss(model, _double(batch)).backward()
        ref = {
            n: p.grad.detach().double().clone()
            for n, p in model.named_parameters()
            if p.grad is not None
        }
        cols: list[dict[str, Tensor]] = []
        if hypothesis:
            where, _, fn = hypothesis.rpartition(":")
            loss_fn = getattr(importlib.import_module("tests.support." + Path(where).stem), fn)
            for r in ranks:
                for f in r["forwards"]:
                    model = fresh()
                    model.train()
                    loss_fn(model, _double(f["args"]), _double(f["kwargs"])).backward()
                    cols.append(
                        {
                            n: p.grad.detach().clone()
                            for n, p in model.named_parameters()
                            if p.grad is not None
                        }
                    )
        conn.send_bytes(pickle.dumps(("ok", {"ref": ref, "cols": cols})))
    except BaseException:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))


def _spawn(fn: Any, args_per: list[tuple[Any, ...]], timeout: float) -> list[Any]:
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    for args in args_per:
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=fn, args=(*args, child))
        proc.start()
        child.close()
        procs.append(proc)
        conns.append(parent)
    out = []
    end = time.monotonic() + timeout
    for conn in conns:
        if not conn.poll(max(0.0, end - time.monotonic())):
            out.append(("error", "timed out"))
            continue
        try:
            out.append(pickle.loads(conn.recv_bytes()))
        except EOFError:
            out.append(("error", "died"))
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
    return out


def _flat(grads: Mapping[str, Tensor], names: list[str], shapes: Mapping[str, Any]) -> Tensor:
    return torch.cat(
        [
            grads[n].reshape(-1)
            if n in grads
            else torch.zeros(shapes[n].numel(), dtype=torch.float64)
            for n in names
        ]
    )


def measure(
    target: str,
    *,
    world: int = 2,
    micro_batches: int = 3,
    mesh: str = "",
    hypothesis: str = "",
    timeout: float = 900.0,
) -> Truth:
    """Run `target` on `world` fresh gloo ranks and against one process's float64 reference."""
    start = time.monotonic()
    truth = Truth(target=target)
    if mesh:
        world = math.prod(int(p.split("=")[1]) for p in mesh.split(","))
    port = _free_port()
    outs = _spawn(
        _rank, [(target, r, world, micro_batches, mesh, port) for r in range(world)], timeout
    )
    bad = [o[1] for o in outs if o[0] != "ok"]
    if bad:
        truth.error = bad[0]
        return truth
    ranks = [o[1] for o in outs]
    (ref_out,) = _spawn(_reference, [(target, ranks, hypothesis)], timeout)
    if ref_out[0] != "ok":
        truth.error = ref_out[1]
        return truth
    ref, cols = ref_out[1]["ref"], ref_out[1]["cols"]
    names = sorted(ref)
    shapes = {n: ref[n] for n in names}
    r = _flat(ref, names, shapes)
    gs = [_flat(o["grads"], names, shapes) for o in ranks]
    norm = float(r.norm())
    truth.rel_err = max(float((g - r).norm()) / norm for g in gs)
    truth.ratio = float(gs[0] @ r) / float(r @ r)
    truth.multiple_err = float((gs[0] - truth.ratio * r).norm()) / norm
    truth.rank_spread = max(float((g - gs[0]).norm()) / norm for g in gs)
    truth.steps = [int(o["calls"]) for o in ranks]
    largest = max(float(ref[n].abs().max()) for n in names)
    truth.missing = [
        n for n in names
        if float(ref[n].abs().max()) > 1e-6 * largest
        and all(n not in o["grads"] or float(o["grads"][n].abs().max()) == 0.0 for o in ranks)
    ]  # fmt: skip
    if cols:
        m = torch.stack([_flat(c, names, shapes) for c in cols], 1)
        w = torch.linalg.lstsq(m, gs[0][:, None]).solution[:, 0]
        truth.weights = [float(x) for x in w]
        truth.weights_residual = float((m @ w - gs[0]).norm()) / float(gs[0].norm())
    truth.seconds = time.monotonic() - start
    return truth


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("targets", nargs="+")
    parser.add_argument("--mesh", default="")
    parser.add_argument("--micro-batches", type=int, default=3)
    parser.add_argument("--hypothesis", default="")
    a = parser.parse_args()
    for t in a.targets:
        truth = measure(t, micro_batches=a.micro_batches, mesh=a.mesh, hypothesis=a.hypothesis)
        print(json.dumps(dataclasses.asdict(truth)))


if __name__ == "__main__":
    main()
