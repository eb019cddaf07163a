"""Whole-batch contrastive losses: CLIP, SigLIP and NT-Xent over every rank's rows, memory-linear.

Each loss returns the loss of the WHOLE batch (every rank's rows, in rank order),
the same value on every rank, and is built so that, after DDP's mean over ranks
(or, with ``grad_reduction="sum"``, a sum), every parameter's gradient equals the
gradient one process would get on the concatenated batch: encoders, and the
replicated scalars (`logit_scale`, `logit_bias`, `temperature`) that every rank
holds a copy of. See docs/contrastive.md.

How: rank r computes only its own rows against the global batch, a share l_r
with sum_r l_r = L, and returns L = all_reduce(l_r) (sum). That all-reduce's
backward hands every l_r the sum of every rank's upstream gradient, W when each
rank back-propagates its L: each rank's gradients are W·dl_r, and DDP's 1/W
turns their sum into exactly dL. Gradient to remote rows flows back through the
collectives' adjoints (all-gather -> reduce-scatter, ring_shift(1) -> ring_shift(-1)).

Logits are never materialised: see `wholebatch.losses.tiles` (tiles of T x T,
recomputed in backward from the inputs and the per-row log-sum-exp).

Legend: W ranks, B this rank's rows, N global rows (sum of B), D embedding dim,
T tile size.

    .venv/bin/python -m benchmarks.bench_losses --quick     # memory and time vs naive
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal, NoReturn

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from wholebatch.comm.checks import exchange_text, per_rank
from wholebatch.comm.collectives import all_gather, all_reduce
from wholebatch.comm.groups import comm_device, get_rank, get_world_size, is_distributed
from wholebatch.errors import WholebatchError, WholebatchTypeError
from wholebatch.losses.tiles import SigmoidRing, SymmetricLSE, TiledLSE, compute_dtype

__all__ = ["GradReduction", "clip_loss", "nt_xent_loss", "siglip_loss"]

GradReduction = Literal["mean", "sum"]
_REDUCTIONS: tuple[str, ...] = ("mean", "sum")
_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_MSG_BYTES = 480
DEFAULT_TILE = 512


# ---------------------------------------------------------------------------
# Validation, agreed across ranks
# ---------------------------------------------------------------------------


def _check_embeddings(tensors: Mapping[str, object]) -> tuple[int, int, str | None]:
    """(B, D, why the embeddings are unusable or None) for same-shaped 2-D float tensors."""
    first: Tensor | None = None
    first_name = ""
    for name, x in tensors.items():
        if not isinstance(x, Tensor):
            return 0, 0, f"T{name} must be a torch.Tensor, got {type(x).__name__}"
        if x.dim() != 2:
            return 0, 0, f"V{name} must be 2-D (rows, dim), got shape {tuple(x.shape)}"
        if x.dtype not in _DTYPES:
            return 0, 0, f"T{name} must be float32/float64/float16/bfloat16, got {x.dtype}"
        if first is None:
            first, first_name = x, name
            continue
        if x.shape != first.shape:
            return (
                0,
                0,
                (
                    f"V{name} has shape {tuple(x.shape)} but {first_name} has {tuple(first.shape)}; "
                    "row i of each is the same sample, so they must match on every rank"
                ),
            )
        if x.dtype != first.dtype or x.device != first.device:
            return (
                0,
                0,
                (
                    f"T{name} is {x.dtype} on {x.device} but {first_name} is {first.dtype} on "
                    f"{first.device}; pass both with one dtype and device"
                ),
            )
    assert first is not None
    return first.shape[0], first.shape[1], None


def _check_scalar(name: str, value: object) -> str | None:
    if isinstance(value, Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            return (
                f"T{name} must be a float scalar (a 1-element tensor or a number), "
                f"got a {value.dtype} tensor of shape {tuple(value.shape)}"
            )
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"T{name} must be a float scalar tensor or a number, got {type(value).__name__}"
    return None


def _scalar_value(value: object) -> float:
    return float(value.detach().reshape(()).item()) if isinstance(value, Tensor) else float(value)  # type: ignore[arg-type]


def _scalar_tensor(value: Tensor | float, like: Tensor) -> Tensor:
    """`value` as a 0-d tensor of the compute dtype on `like`'s device (gradient flows)."""
    acc = compute_dtype(like.dtype)
    if isinstance(value, Tensor):
        return value.reshape(()).to(device=like.device, dtype=acc)
    return torch.tensor(float(value), dtype=acc, device=like.device)


def _raise(op: str, msg: str) -> NoReturn:
    kind, text = msg[0], msg[1:]
    raise (WholebatchTypeError if kind == "T" else WholebatchError)(f"{op}: {text}")


def _prepare(
    op: str,
    embeddings: Mapping[str, object],
    scalars: Mapping[str, object],
    grad_reduction: object,
    tile_size: object,
    group: ProcessGroup | None,
) -> list[int]:
    """Validate on every rank and agree on it; return every rank's row count B.

    One small all-gather (a few float64 per rank) carries each rank's rows, dim,
    dtype, device, options and scalar values; every rank runs the same checks
    on the same table, so a bad input raises the same error on every rank.
    """
    b, d, err = _check_embeddings(embeddings)
    for name, value in scalars.items():
        err = err or _check_scalar(name, value)
    if err is None and grad_reduction not in _REDUCTIONS:
        err = f"Vgrad_reduction={grad_reduction!r} must be 'mean' (DDP averages) or 'sum'"
    if err is None and (
        isinstance(tile_size, bool) or not isinstance(tile_size, int) or tile_size < 1
    ):
        err = f"Vtile_size={tile_size!r} must be a positive int"
    if not is_distributed(group):
        if err is not None:
            _raise(op, err)
        if b == 0:
            raise WholebatchError(f"{op}: the whole batch has 0 rows; pass at least one row")
        return [b]
    values = [_scalar_value(v) for v in scalars.values()] if err is None else [0.0] * len(scalars)
    first = next(iter(embeddings.values()))
    dtype_code = _DTYPES.index(first.dtype) if isinstance(first, Tensor) and err is None else -1
    device_code = (
        float(first.device.type != "cpu") if isinstance(first, Tensor) and err is None else -1
    )
    row = [float(err is not None), b, d, dtype_code, device_code]
    row += [float(_REDUCTIONS.index(str(grad_reduction))) if err is None else -1, *values]
    mine = torch.tensor(row, dtype=torch.float64, device=comm_device(group))
    w = get_world_size(group)
    table = all_gather(mine, sizes=[len(row)] * w, group=group, check=False).view(w, -1).tolist()
    if any(t[0] for t in table):
        msgs = exchange_text(err or "", group, max_bytes=_MSG_BYTES)
        bad = {r: m for r, m in enumerate(msgs) if table[r][0]}
        if len(set(bad.values())) == 1:
            m = next(iter(bad.values()))
            _raise(op, f"{m} (on ranks {sorted(bad)})")
        kind = "T" if all(m[0] == "T" for m in bad.values()) else "V"
        _raise(op, kind + "; ".join(f"rank {r}: {m[1:]}" for r, m in bad.items()))
    names = list(embeddings)
    columns: list[tuple[int, str, str]] = [
        (2, "embedding dim", f"every rank's {'/'.join(names)} must have the same dim"),
        (3, "dtype", "cast every rank's embeddings to one dtype"),
        (4, "device type", "put every rank's embeddings on the same kind of device"),
        (5, "grad_reduction", "pass the same grad_reduction on every rank"),
    ]
    for i, name in enumerate(scalars):
        columns.append(
            (
                6 + i,
                name,
                "it is a replicated parameter: every rank must hold the same value "
                "(keep it in the DDP module, or broadcast it)",
            )
        )
    for col, what, fix in columns:
        vals = [t[col] for t in table]
        same = all(v == vals[0] or (math.isnan(v) and math.isnan(vals[0])) for v in vals)
        if not same:
            shown: list[Any] = vals
            if col == 3:
                shown = [str(_DTYPES[int(v)]).replace("torch.", "") for v in vals]
            elif col == 5:
                shown = [_REDUCTIONS[int(v)] for v in vals]
            elif col == 4:
                shown = ["cpu" if v == 0 else "accelerator" for v in vals]
            elif col == 2:
                shown = [int(v) for v in vals]
            exc = WholebatchTypeError if col in (3, 4) else WholebatchError
            raise exc(f"{op}: {what} differs across ranks {per_rank(shown)}; {fix}")
    sizes = [int(t[1]) for t in table]
    if sum(sizes) == 0:
        raise WholebatchError(
            f"{op}: the whole batch has 0 rows (rows per rank {per_rank(sizes)}); "
            "at least one rank must pass rows"
        )
    return sizes


# ---------------------------------------------------------------------------
# The whole-batch scalar and its gradient convention
# ---------------------------------------------------------------------------


class _ScaleGrad(torch.autograd.Function):
    """Identity in the forward; the backward multiplies the gradient by `factor`."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, factor: float) -> Tensor:  # type: ignore[override]
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return grad * ctx.factor, None


def _whole(local: Tensor, grad_reduction: str, group: ProcessGroup | None) -> Tensor:
    """L = sum over ranks of each rank's share, the same on every rank.

    Backward: all-reduce (sum) of every rank's upstream gradient, so with each
    rank back-propagating L every share gets W: after DDP's mean, exactly dL.
    With ``grad_reduction="sum"`` the gradient is divided by W instead, so a sum
    over ranks gives exactly dL.
    """
    w = get_world_size(group)
    if w == 1:
        return local
    total = all_reduce(local, "sum", group=group, check=False)
    return _ScaleGrad.apply(total, 1.0 / w) if grad_reduction == "sum" else total  # type: ignore[no-untyped-call]


# ---------------------------------------------------------------------------
# Public losses
# ---------------------------------------------------------------------------


def clip_loss(
    image_BD: Tensor,
    text_BD: Tensor,
    logit_scale: Tensor | float,
    *,
    group: ProcessGroup | None = None,
    grad_reduction: GradReduction = "mean",
    tile_size: int = DEFAULT_TILE,
) -> Tensor:
    """Symmetric InfoNCE (CLIP) over the whole batch: every rank's rows, in rank order.

    With I, T the whole-batch embeddings (N x D) and s = `logit_scale` (the
    multiplier itself, already exponentiated):
    L = ( CE(s·I·Tᵀ, arange N) + CE(s·T·Iᵀ, arange N) ) / 2, CE a mean over rows.

    Every rank of `group` must call it; each gets L. Rank r computes its rows'
    log-sum-exps against all N texts (row direction) and its partial
    log-sum-exps for every text column (combined across ranks: 2 all-reduces of
    N floats): O(B·N·D) work, one B x N sweep in the forward, one in the backward.

    Backward (gradient contract): with the default ``grad_reduction="mean"``,
    after DDP averages over W ranks, the gradients of the encoders and of
    `logit_scale` (a replicated parameter) equal those of one process computing
    L on the concatenated batch; with ``"sum"``, after a sum over ranks. Text
    gradients reach their owners through the all-gather's reduce-scatter.

    Memory: O(N·D + T²) peak (the gathered texts, their gradient, one tile);
    never O(N²) or O(B·N).

    Args:
        image_BD: this rank's image embeddings (B x D), normalised by the caller.
        text_BD: this rank's text embeddings (B x D); row i pairs with image row i.
        logit_scale: the logit multiplier, a 1-element tensor (may require grad) or a number;
            the same value on every rank.
        group: the process group (default: the world).
        grad_reduction: "mean" if parameter gradients are averaged over ranks (DDP),
            "sum" if they are summed.
        tile_size: rows and columns of one logits tile (memory T² per buffer).
    """
    op = "clip_loss"
    sizes = _prepare(
        op, {"image_BD": image_BD, "text_BD": text_BD}, {"logit_scale": logit_scale},
        grad_reduction, tile_size, group,
    )  # fmt: skip
    rank, n = get_rank(group), sum(sizes)
    offset, b = sum(sizes[:rank]), sizes[rank]
    acc = compute_dtype(image_BD.dtype)
    s = _scalar_tensor(logit_scale, image_BD)
    all_text_ND = all_gather(text_BD, sizes=sizes, group=group, check=False)
    row_B, col_N = TiledLSE.apply(image_BD, all_text_ND, s, True, tile_size, group)  # type: ignore[no-untyped-call]
    pos = s * (image_BD.to(acc) * text_BD.to(acc)).sum()  # sum over local i of s·Iᵢ·Tᵢ
    local = (row_B.sum() + col_N[offset : offset + b].sum()) / (2 * n) - pos / n
    return _whole(local, grad_reduction, group)


def siglip_loss(
    image_BD: Tensor,
    text_BD: Tensor,
    logit_scale: Tensor | float,
    logit_bias: Tensor | float,
    *,
    group: ProcessGroup | None = None,
    grad_reduction: GradReduction = "mean",
    tile_size: int = DEFAULT_TILE,
) -> Tensor:
    """Sigmoid loss (SigLIP) over the whole batch: −Σᵢⱼ log σ(yᵢⱼ·(s·IᵢTⱼ + b)) / N.

    yᵢᵢ = 1 and yᵢⱼ = −1 otherwise; I, T are every rank's rows in rank order;
    s = `logit_scale` (the multiplier itself), b = `logit_bias` (added).

    Every rank of `group` must call it; each gets the same value. Remote text
    blocks arrive one at a time by `ring_shift` (W − 1 shifts), never a full
    all-gather; the backward re-exchanges them rather than keeping them, and
    sends each block's gradient home along the same ring.

    Backward (gradient contract): with the default ``grad_reduction="mean"``,
    after DDP averages over W ranks, the gradients of the encoders and of
    `logit_scale` and `logit_bias` equal one process's on the concatenated
    batch; with ``"sum"``, after a sum over ranks.

    Memory: O(B·D + T²) peak, independent of W and of N beyond this rank's rows
    and the one block in flight.

    Args:
        image_BD: this rank's image embeddings (B x D), normalised by the caller.
        text_BD: this rank's text embeddings (B x D); row i pairs with image row i.
        logit_scale: the logit multiplier (a 1-element tensor or a number), the same on every rank.
        logit_bias: the logit bias (a 1-element tensor or a number), the same on every rank.
        group: the process group (default: the world).
        grad_reduction: "mean" if parameter gradients are averaged over ranks (DDP), "sum" if summed.
        tile_size: rows and columns of one logits tile.
    """
    op = "siglip_loss"
    sizes = _prepare(
        op, {"image_BD": image_BD, "text_BD": text_BD},
        {"logit_scale": logit_scale, "logit_bias": logit_bias}, grad_reduction, tile_size, group,
    )  # fmt: skip
    n, b_rows = sum(sizes), sizes[get_rank(group)]
    acc = compute_dtype(image_BD.dtype)
    s, b = _scalar_tensor(logit_scale, image_BD), _scalar_tensor(logit_bias, image_BD)
    # softplus(-z) = softplus(z) - z: all pairs as negatives, then the positives' correction.
    negatives = SigmoidRing.apply(image_BD, text_BD, s, b, tuple(sizes), tile_size, group)  # type: ignore[no-untyped-call]
    positives = s * (image_BD.to(acc) * text_BD.to(acc)).sum() + b * b_rows
    return _whole((negatives - positives) / n, grad_reduction, group)


def nt_xent_loss(
    z1_BD: Tensor,
    z2_BD: Tensor,
    temperature: Tensor | float,
    *,
    group: ProcessGroup | None = None,
    grad_reduction: GradReduction = "mean",
    tile_size: int = DEFAULT_TILE,
) -> Tensor:
    """SimCLR's NT-Xent over the whole batch of 2N views.

    Z = [Z1; Z2] (2N x D: every rank's first views in rank order, then every
    rank's second views), logits Z·Zᵀ / τ with the diagonal excluded, the
    positive of row i its other view (i ± N); cross-entropy averaged over all
    2N rows. τ = `temperature` divides.

    Every rank of `group` must call it; each gets the same value. One
    all-gather of [z1 | z2]; the logits Z·Zᵀ are symmetric, so only the tiles
    on and above the diagonal are computed (each serves its rows and, mirrored,
    its columns), dealt round-robin to the ranks: O(N²·D / W) work per rank,
    half that of every rank sweeping its 2B rows against all 2N. The partial
    log-sum-exps are combined across ranks (2 all-reduces of 2N floats).

    Backward (gradient contract): with the default ``grad_reduction="mean"``,
    after DDP averages over W ranks, the gradients of the encoder and of
    `temperature` equal one process's on the concatenated batch; with
    ``"sum"``, after a sum over ranks. Gathered rows' gradients return to their
    owners through the all-gather's reduce-scatter.

    Memory: O(N·D + T²) peak; never O(N²) or O(B·N).

    Args:
        z1_BD: this rank's first-view embeddings (B x D), normalised by the caller.
        z2_BD: this rank's second-view embeddings (B x D); row i is the same sample.
        temperature: τ (a 1-element tensor or a number), the same on every rank.
        group: the process group (default: the world).
        grad_reduction: "mean" if parameter gradients are averaged over ranks (DDP), "sum" if summed.
        tile_size: rows and columns of one logits tile.
    """
    op = "nt_xent_loss"
    sizes = _prepare(
        op, {"z1_BD": z1_BD, "z2_BD": z2_BD}, {"temperature": temperature},
        grad_reduction, tile_size, group,
    )  # fmt: skip
    rank, n = get_rank(group), sum(sizes)
    offset, b = sum(sizes[:rank]), sizes[rank]
    d = z1_BD.shape[1]
    acc = compute_dtype(z1_BD.dtype)
    inv_tau = 1.0 / _scalar_tensor(temperature, z1_BD)
    all_N2D = all_gather(torch.cat([z1_BD, z2_BD], 1), sizes=sizes, group=group, check=False)
    all_z_2ND = torch.cat([all_N2D[:, :d], all_N2D[:, d:]], 0)
    # Z·Zᵀ is symmetric: the kernel computes each tile pair once, the W ranks
    # sharing the upper triangle, and returns every row's log-sum-exp.
    lse_2N = SymmetricLSE.apply(all_z_2ND, inv_tau, tile_size, group)  # type: ignore[no-untyped-call]
    mine = lse_2N[offset : offset + b].sum() + lse_2N[n + offset : n + offset + b].sum()
    pos = 2 * inv_tau * (z1_BD.to(acc) * z2_BD.to(acc)).sum()  # rows i and i + N share z1ᵢ·z2ᵢ
    return _whole((mine - pos) / (2 * n), grad_reduction, group)
