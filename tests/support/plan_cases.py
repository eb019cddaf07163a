"""One loss call on one rank, as the planner's checks run it: inputs, the call, and its plan.

A `Case` names a loss and everything the planner takes about it (rows per rank,
dim, dtype, InfoNCE's k hard negatives and directions, whether the caller
passes `sizes=` with `check=False`). `inputs` builds this rank's tensors
(different on every rank), `call` runs the REAL public loss on them, and
`planned` asks the planner for the same call's bytes per phase and primitive.
Used by tests/distributed/test_plan_dist.py, tests/support/plan_memprobe.py and benchmarks/bench_plan.py.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import torch
import torch.nn.functional as F

from wholebatch.losses import clip_loss, examples, info_nce_loss, nt_xent_loss, siglip_loss
from wholebatch.losses.sizing import using_small_rows
from wholebatch.losses.specs import SPECS

__all__ = ["DTYPES", "Case", "by_primitive", "call", "inputs", "planned"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
# Replicated scalars, learnable (so the agreement's backward runs, as in training).
SCALARS = {"clip": (10.0,), "siglip": (10.0, -10.0), "nt_xent": (0.1,), "info_nce": (10.0,),
           "dcl": (10.0,), "supcon": (10.0,), "maxsim": (2.0,)}  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One loss call over a world of `len(sizes)` ranks."""

    loss: str
    sizes: tuple[int, ...]
    dtype: str = "fp32"
    dim: int = 24
    k: int = 0
    """info_nce: hard negatives per query."""
    directions: tuple[str, ...] = ("query_to_doc",)
    """info_nce: directions (partition mode "joint")."""
    known_sizes: bool = False
    """Pass `sizes=` and `check=False`: no metadata exchange."""
    tile: int | None = None
    strategy: str = "gather"
    """clip, info_nce: "gather" or "ring"."""
    small: int | None = None
    """The small-batch row limit (`sizing.set_small_rows`; 0: never; None: the default, 512)."""
    tokens: tuple[int, int] = (3, 5)
    """maxsim: (query, document) tokens per row, on every rank."""

    @property
    def world(self) -> int:
        return len(self.sizes)

    def label(self) -> str:
        parts = [self.loss, "-".join(map(str, self.sizes)), self.dtype]
        if self.loss == "info_nce":
            parts += [f"k{self.k}", "+".join(d.replace("_to_", "2") for d in self.directions)]
        parts += ["ring"] if self.strategy == "ring" else []
        parts += [] if self.small is None else [f"small<={self.small}"]
        return " ".join(parts + (["known-sizes"] if self.known_sizes else []))


def inputs(case: Case, rank: int, rows: int | None = None) -> tuple[torch.Tensor, ...]:
    """This rank's inputs (two embeddings, plus (B, k, D) negatives for info_nce with k > 0;
    supcon's features and labels; maxsim's token sets and masks) and scalars."""
    b = case.sizes[rank] if rows is None else rows
    g = torch.Generator().manual_seed(100 + rank)
    dt = DTYPES[case.dtype]

    def emb(*shape: int) -> torch.Tensor:
        return F.normalize(torch.randn(*shape, generator=g), dim=-1).to(dt).requires_grad_()

    if case.loss == "supcon":
        out = [emb(b, case.dim), labels(case, rank)]
    elif case.loss == "maxsim":
        q, t = case.tokens
        masks = [torch.rand(b, n, generator=g) > 0.3 for n in (q, t)]
        for m in masks:
            m[:, 0] = True
        out = [emb(b, q, case.dim), masks[0], emb(b, t, case.dim), masks[1]]
    else:
        out = [emb(b, case.dim), emb(b, case.dim)]
    if case.loss == "info_nce" and case.k:
        out.append(emb(b, case.k, case.dim))
    return (*out, *(torch.tensor(v, requires_grad=True) for v in SCALARS[case.loss]))


def labels(case: Case, rank: int) -> torch.Tensor:
    """supcon's labels on `rank`: 5 labels, repeating across ranks."""
    return (torch.arange(case.sizes[rank]) * 3 + rank) % 5


def classes(case: Case) -> int:
    """supcon: the labels with a positive in the whole batch (what the planner takes)."""
    y = torch.cat([labels(case, r) for r in range(case.world)])
    return int((torch.bincount(y) > 1).sum())


def call(case: Case, args: tuple[torch.Tensor, ...], group: Any = None) -> torch.Tensor:
    """The public loss of `case` on `args` (from `inputs`), over `group` (None: the world),
    under its small-batch row limit."""
    with using_small_rows(case.small):
        return _call(case, args, group)


def _call(case: Case, args: tuple[torch.Tensor, ...], group: Any = None) -> torch.Tensor:
    kw: dict[str, Any] = {"tile_size": case.tile}
    if group is not None:
        kw.update(group=group)
    if case.known_sizes:
        kw.update(sizes=list(case.sizes), check=False)
    if case.strategy != "gather":
        kw.update(strategy=case.strategy)
    if case.loss == "clip":
        return clip_loss(*args, **kw)
    if case.loss == "siglip":
        return siglip_loss(*args, **kw)
    if case.loss == "nt_xent":
        return nt_xent_loss(*args, **kw)
    if case.loss in ("dcl", "supcon", "maxsim"):
        spec = SPECS[case.loss]
        names = [*spec.inputs, *spec.scalars]
        parts = dict(zip(names, args, strict=True))
        values = {n: parts.pop(n) for n in spec.scalars}
        return examples.call(spec, parts, values, **kw)
    q, d, *rest = args
    negatives = rest.pop(0) if case.k else None
    return info_nce_loss(
        q,
        d,
        *rest,
        negatives_BKD=negatives,
        directions=case.directions,
        **kw,  # type: ignore[arg-type]
    )


def planned(case: Case, rank: int) -> dict[str, tuple[dict[str, int], dict[str, int]]]:
    """The planner's bytes of `case` on `rank`: phase -> (sent, received) per c10d primitive.

    The planner names a reduce-scatter `all_to_all` (how wholebatch moves it on
    gloo and for uneven sizes) and an even gather `all_gather`: the c10d calls.
    """
    from wholebatch.planner.traffic import loss_traffic

    elem = DTYPES[case.dtype].itemsize
    rows = loss_traffic(
        case.loss, list(case.sizes), rank, case.dim, elem, max(4, elem), negatives=case.k,
        directions=case.directions, exchange=not case.known_sizes,
        strategy="ring" if case.loss == "siglip" else case.strategy, small=case.small,
        classes=classes(case) if case.loss == "supcon" else 0, tokens=case.tokens,
    )  # fmt: skip
    return by_primitive(rows)


def by_primitive(rows: Any) -> dict[str, tuple[dict[str, int], dict[str, int]]]:
    """Planned collectives (`Collective` rows) summed per phase into (sent, received) bytes by
    primitive, the zeros left out: the shape `Counter` counts in."""
    out = {}
    for phase in ("forward", "backward"):
        sent: dict[str, int] = defaultdict(int)
        recv: dict[str, int] = defaultdict(int)
        for c in rows:
            if c.phase == phase:
                sent[c.primitive] += c.sent
                recv[c.primitive] += c.received
        out[phase] = ({p: v for p, v in sent.items() if v}, {p: v for p, v in recv.items() if v})
    return out
