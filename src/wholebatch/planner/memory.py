"""Peak memory of one rank: the whole-batch loss, the model's activations at K, gradient caching's extra.

Loss memory (forward + backward of the loss with respect to every embedding,
gradients included, beyond the embeddings the caller already holds) is a sum
of buffers, each a multiple of one of

    G·D  the gathered key rows (G = N for clip, N·(1 + k) for info_nce's
         [documents; hard negatives]; at W = 1 nothing is gathered),
    B·D  this rank's query rows, Bk·D its key rows (Bk = B·(1 + k)),
    T²   one logits tile (float32; T the tile),

with e the embeddings' element size and a the kernels' compute element size
(4, or 8 for float64 inputs). The coefficients were read off peak-RSS
measurements of the kernels on CPU (glibc's mmap threshold fixed, so RSS
follows live memory; benchmarks/bench_plan.py, tests/support/plan_memprobe.py) at
N = 8,192 (W = 1) and 16,384 (W = 2, 4), D = 256, tiles 512 and 2,048, and are
explained by the buffers below; the tests and the benchmark check them at
other N, W (3), k and dtypes (docs/plan.md).

- clip, info_nce without hard negatives (`PositiveLSE` over the all-gathered
  keys), W > 1: float32 inputs 2a·G (the gathered keys, their gradient, then
  the reduce-scatter's receive buffer) + 2.3a·B (the queries' gradient, one
  product for d scale; the scaled queries are freed with the tile loop);
  16-bit inputs 10.2·G + 19.6·B bytes per element (the float32 copies of keys
  and queries the CPU kernels make, and the gradients cast back). At W = 1
  the same less the gathered copy (e·B). (Re-read at W = 2 and 4, N = 8,192
  and 16,384, after the backward's tile loop became a function whose float32
  copies are freed before the gradients are cast back: 3a·B and 11·G + 26·B
  before.)
- info_nce with k > 0 hard negatives: the candidates are a copy of the
  gathered [document | negatives] rows, so the larger of the forward (float32:
  2e·G + e·Bk + 2a·B: gathered rows, their candidate-ordered copy, the local
  [document | negatives] row) and the backward (float32 (e + a)·G + 2.3a·B;
  16-bit (e + 2a)·G + 5a·B: the float32 copy of the candidates is freed
  before their gradient is cast back; (2e + 2a)·G before); at W = 1 no Bk term (the local row is the gathered one).
  Extra directions (measured together at W = 2, k = 1): query_to_query keeps
  the gathered queries (e·N·D); doc_to_doc sweeps the candidates once more,
  its key gradient accumulating beside the first (a·G).
- nt_xent (`SymmetricLSE` over the 2N x D views): 10a per N·D (the gathered
  [z1 | z2], the stacked views, the scaled copy, the gradient, one product),
  + 6e for 16-bit inputs; independent of B.
- siglip (`SigmoidRing`): only B x D blocks: float32 4a at W = 1, 6a at
  W = 2 (the image gradient, the block and its gradient sent and the pair
  arriving), 7a from W = 3 (the previous block still alive during the shift);
  16-bit 4a + 4e at W = 1, 5a + 3e at W = 2, 5a + 4e from W = 3 (the blocks
  travel in their own dtype, their gradients in float32).
- clip and info_nce with `strategy="ring"` (`PositiveRing`): only B·D and
  B·J·D buffers (J = 1 + k) and chunks of about a tile's candidates (the
  blocks travel in chunks), independent of N: see `_positive_ring`; 2.8 T²·a
  of tiles.
- Tiles: 2.5 T²·a for clip and info_nce (the tile and one buffer that holds
  the rows' exponentials, then the columns', then the gradient tile), 2 for
  nt_xent and siglip; plus 4 vectors of the columns' statistics (N floats)
  where the kernel keeps them.

Strategies the library does not use, for comparison (their published
measurements are in docs/plan.md): the full N x N logits on every rank ("naive",
4 logits-sized float32 buffers, measured by benchmarks/bench_losses.py: 266,
1,040, 4,120 MiB at N = 4,096 / 8,192 / 16,384) and open_clip's local loss
(B x N logits: the same 4 buffers, B x N each); both add the gathered
features of both towers and their gradients (4·N·D·e).
"""

from __future__ import annotations

from collections.abc import Sequence

from wholebatch.losses.sizing import ring_chunk_rows
from wholebatch.losses.specs import RING, SPECS

__all__ = ["LOSS_STRATEGY", "STRATEGY_NAMES", "loss_memory"]

# How the planner names the losses' strategies.
STRATEGY_NAMES = {"gather": "gather + tiled", "ring": "ring + tiled"}
# The strategy each wholebatch loss uses by default (its descriptor's).
LOSS_STRATEGY = {name: STRATEGY_NAMES[s.default_strategy] for name, s in SPECS.items()}


def _ring_per_bd(w: int, elem: int, acc: int) -> float:
    """`SigmoidRing`'s bytes per B·D element."""
    if elem < acc:
        return 4 * acc + 4 * elem if w == 1 else 5 * acc + (3 if w == 2 else 4) * elem
    return 4 * acc if w == 1 else (6 if w == 2 else 7) * acc


def _positive_ring(
    b: int,
    dim: int,
    elem: int,
    acc: int,
    w: int,
    k: int,
    directions: Sequence[str],
    chunk_rows: int,
) -> float:
    """`PositiveRing` (clip, info_nce with strategy="ring"): B·D, B·J·D and chunk buffers only.

    The blocks travel in chunks of about one tile of candidates (`chunk_rows`:
    `sizing.ring_chunk_rows`, the device's tile / J rows, at most the block), so a rank holds about ONE block of each travelling tensor (the held
    chunks not yet sent and the arriving ones), not two. Read off peak RSS at W = 2
    and 4 (B = 2,048, D = 256, J = 1..3, tiles 256 and 1,024;
    tests/support/plan_memprobe.py, docs/plan.md): float32 a per B·D (the queries'
    gradient) + 2a per B·J·D (the travelling block and its travelling gradient; at
    the end the gradient's chunks and their join), + 1.23a per B·J·D with hard
    negatives (the caller's [document | negatives] rows and their gradients' copies);
    16-bit inputs 2a per B·D (the queries' gradient and their float32 copy) + 1.38a
    per B·J·D, (0.83 + k)a with k hard negatives (fitted at k = 1 and 2: the
    caller's rows and copies grow faster than the ring's own buffers; not broken
    down); chunks in flight 1.4a per chunk element at W = 2, 2a from W = 3 (the
    sent chunk alive until the next is computed, the arriving one, the tile's two
    T x D products; measured 0.2a-3.5a from W = 3: a receive buffer is resident
    only once its chunk has arrived, so the peak depends on how far the arriving
    chunks lag behind the computed ones, and 2a is the middle); each extra direction's ring (query_to_query, doc_to_doc)
    1.05a per B·J·D more. W = 1 (nothing in flight, not measured): as W = 2.
    """
    bd, bjd = b * dim, b * (1 + k) * dim
    chunk = min(chunk_rows, max(b, 1)) * (1 + k) * dim
    if elem < acc:
        out = 2.0 * acc * bd + (0.83 + k if k else 1.38) * acc * bjd
    else:
        out = acc * (bd + 2.0 * bjd) + (1.23 * acc * bjd if k else 0.0)
    out += (1.4 if w <= 2 else 2.0) * acc * chunk
    extra = sum(d in directions for d in ("query_to_query", "doc_to_doc"))
    return out + 1.05 * acc * bjd * extra


def _gather_keys(
    n: int, b: int, dim: int, elem: int, acc: int, w: int, k: int, directions: Sequence[str]
) -> float:
    """`PositiveLSE` over gathered keys (clip; info_nce with k hard negatives and its directions)."""
    e, a, narrow = elem, acc, elem < acc
    g, bk = n * (1 + k) * dim, b * (1 + k) * dim
    bd = b * dim
    if k == 0:
        alpha, beta = (10.2, 19.6) if narrow else (2.0 * a, 2.3 * a)
        out = alpha * g + beta * bd if w > 1 else (alpha + beta - e) * bd
    else:
        local = e * bk if w > 1 else 0.0
        fwd: float
        bwd: float
        if narrow:
            fwd = (2 * e + a) * g + local + 3 * a * bd
            bwd = (e + 2 * a) * g + 5 * a * bd
        else:
            fwd = 2 * e * g + local + 2 * a * bd
            bwd = (e + a) * g + 2.3 * a * bd
        out = max(fwd, bwd)
    if "query_to_query" in directions:
        out += e * n * dim
    if "doc_to_doc" in directions:
        out += a * g
    return out


def loss_memory(
    loss: str,
    *,
    strategy: str,
    n: int,
    b: int,
    dim: int,
    elem: int,
    acc: int,
    tile: int,
    w: int,
    negatives: int = 0,
    directions: Sequence[str] = ("query_to_doc",),
    tokens: tuple[int, int] = (32, 180),
    device: str = "cuda",
) -> int:
    """Peak bytes of the loss's forward + backward on a rank with `b` of the `n` rows.

    Args:
        loss: a key of `SPECS`.
        strategy: "gather + tiled" or "ring + tiled" (wholebatch's kernels), or
            "naive" (N x N logits on every rank) or "local" (B x N logits), for comparison.
        n: N, global rows (pairs; nt_xent has 2N views; info_nce's queries).
        b: B, this rank's rows.
        dim: D.
        elem: bytes per embedding element.
        acc: bytes per compute element.
        tile: T.
        w: W.
        negatives: info_nce's k hard negatives per query.
        directions: info_nce's directions.
        tokens: maxsim's (query, document) tokens per row.
        device: the device type the rings cut their chunks for (`sizing.ring_chunk_rows`).
    """
    spec = SPECS[loss]
    views = spec.views
    k = negatives if spec.negatives else 0
    if spec.kernel == "tokens":
        return _token_memory(strategy, n, b, dim, elem, acc, tile, w, tokens)
    # both towers' gathered features and their gradients (gather_with_grad)
    gathered = (2 + 2 * (1 + k)) * n * dim * elem if w > 1 else 0
    if strategy == "naive":  # every rank holds the whole (views·N)^2 logits
        return 4 * (views * n) * (views * n * (1 + k)) * acc + gathered
    if strategy == "local":  # B x N logits per direction (open_clip's local_loss, DisCo-CLIP)
        return 4 * (views * b) * (views * n * (1 + k)) * acc + gathered
    tiles = tile * tile * acc
    if (
        strategy == "ring + tiled"
        and spec.kernel in ("positive", "symmetric")
        and RING in spec.strategies
    ):
        j = spec.key_rows(k)
        rows = ring_chunk_rows(device, b, j)
        ring = _positive_ring(b, dim, elem, acc, w, j - 1, directions, rows)
        # two views (dcl): the second view's sweep runs while the first's gradients (its rows',
        # its key block's) are held: 3a per B·D more, read off peak RSS at W = 3 (docs/plan.md)
        extra = 3 * (views - 1) * acc * b * dim
        labels = 8 * n + acc * b * dim if spec.name == "supcon" else 0  # labels, label sums
        return int(ring + extra + labels + 2.8 * tiles)
    if strategy == "ring + tiled":  # SigmoidRing's schedule (the comparison for other losses)
        width = spec.key_rows(k)  # key blocks of `width` x D per row
        buffers = 2.0 if spec.kernel != "sigmoid" else spec.tile_buffers
        return int(_ring_per_bd(w, elem, acc) * width * b * dim + buffers * tiles)
    if spec.kernel == "symmetric":
        per_nd = 10 * acc + (6 * elem if elem < acc else 0)
        return int(per_nd * n * dim + spec.tile_buffers * tiles + 4 * 2 * n * acc)
    if spec.kernel == "sigmoid":  # siglip with a gather (for comparison): clip's kernel, no columns
        return int(_gather_keys(n, b, dim, elem, acc, w, 0, ()) + 2.5 * tiles)
    labels = 8 * n + acc * b * dim if spec.name == "supcon" else 0
    return int(
        _gather_keys(n, b, dim, elem, acc, w, k, directions)
        + spec.tile_buffers * tiles
        + (4 * n * acc if spec.has_columns(directions) else 0)
        + labels
    )


def _token_memory(
    strategy: str,
    n: int,
    b: int,
    dim: int,
    elem: int,
    acc: int,
    tile: int,
    w: int,
    tokens: tuple[int, int],
) -> int:
    """maxsim (`late.MaxSimLSE`, `late.MaxSimRing`): the documents' token blocks, never N x Q x T.

    Gather: the gathered documents N·T·D (the embeddings' dtype) and their gradient
    (compute dtype; e + 1.2a per N·T·D), the queries' gradient B·Q·D (2a with its
    float32 copy), and the tiles: one tile of T² token similarities and autograd's
    copies of it in the recomputing backward (about 4). Ring: 3a per B·T·D from W = 3,
    2a at W = 2 (the block held, the block and its gradient in flight), the queries' gradient, the tiles. The
    own pairs' scores B·Q·T are kept for their gradient. Read off peak RSS at W = 3
    (D = 128, Q = 3, T = 5, tile 256), checked at W = 2 (docs/plan.md).
    """
    q, t = tokens
    bqd, btd = b * q * dim, b * t * dim
    tiles = 4 * tile * tile * acc + b * q * t * acc
    if strategy == "naive":
        return 4 * n * n * q * t * acc
    if strategy == "ring + tiled":
        return int((2 if w <= 2 else 3) * acc * btd + 2 * acc * bqd + tiles)
    gathered = (elem + 1.2 * acc) * n * t * dim if w > 1 else (elem + acc) * btd
    return int(gathered + 2 * acc * bqd + tiles)
