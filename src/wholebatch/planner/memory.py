"""Peak memory of one rank: the whole-batch loss, the model's activations at K, gradient caching's extra.

Loss memory (forward + backward of the loss with respect to both embeddings,
gradients included, beyond the embeddings the caller already holds) is

    bytes = alpha * N * D + beta * B * D + 2 * T^2 * a + 4 * N * a

with N the global rows, B this rank's rows, D the dim, T the tile, a the
compute element size (4, or 8 for float64 inputs). alpha and beta count the
(N x D) and (B x D) buffers alive at the peak, per element, by kernel and by
whether the inputs are narrower than the compute dtype (bf16/fp16: their
float32 copies). They were read off peak-RSS measurements of the kernels on CPU
(glibc's mmap threshold fixed, so RSS follows live memory; benchmarks/bench_plan.py)
and explained by the buffers below; the tests check the formula at other N, D,
W and tiles. The 2·T² term is one tile and its gradient; 4·N·a the log-sum-exp
vectors.

- clip / info_nce, gather + tiled (`TiledLSE` over the all-gathered texts): at
  W > 1 the gathered texts (N·D·e), their float32 gradient and the
  reduce-scatter's receive buffer (alpha: 2 float32 buffers, +2 bytes for
  16-bit inputs' cast copy); the queries scaled once, their gradient, the
  positives' gradients and the .grad accumulations (beta: 5). At W = 1 nothing
  is gathered: 6 buffers of N·D.
- siglip, ring + tiled (`SigmoidRing`): only B x D blocks: the image gradient,
  the [block | gradient] pair being sent and the one arriving (8 at W = 2; 9
  from W = 3, when the previous pair is still alive during the shift); 4 at W = 1.
- nt_xent, gather + tiled (`SymmetricLSE` over the 2N x D views): 8 float32
  buffers of N·D (two views each: the gathered pair, its float32 copy,
  the gradient accumulator and the reduce-scatter buffer) and 2 of B·D.

Strategies the library does not use, for comparison (their published
measurements are in docs/plan.md): the full N x N logits on every rank ("naive",
4 logits-sized float32 buffers, measured by benchmarks/bench_losses.py: 266,
1,040, 4,120 MiB at N = 4,096 / 8,192 / 16,384) and open_clip's local loss
(B x N logits: the same 4 buffers, B x N each); both add the gathered
features of both towers and their gradients (4·N·D·e).
"""

from __future__ import annotations

__all__ = ["LOSS_STRATEGY", "loss_memory"]

# The strategy each wholebatch loss uses.
LOSS_STRATEGY = {
    "clip": "gather + tiled",
    "info_nce": "gather + tiled",
    "nt_xent": "gather + tiled",
    "siglip": "ring + tiled",
}


def _coefficients(loss: str, strategy: str, w: int, elem: int, acc: int) -> tuple[float, float]:
    """(alpha, beta): bytes per element of N x D and of B x D alive at the loss's peak."""
    narrow = elem < acc
    if strategy == "ring + tiled":
        if w == 1:
            return 0.0, 4 * acc + (2 * elem if narrow else 0)
        return 0.0, (8 + (1 if w >= 3 else 0)) * acc
    if loss == "nt_xent":
        # measured: float32 alpha 32, beta 8; bfloat16 alpha 36, beta 4 (any W)
        return (8 * acc + 4, 4.0) if narrow else (8 * acc, 2 * acc)
    if w == 1:  # clip / info_nce: the keys are the caller's own tensor
        return 0.0, 6 * acc + (2 * elem if narrow else 0)
    # measured: float32 alpha 8, beta 20; bfloat16 alpha 12, beta 18
    return (2 * acc + 2 * elem, 4 * acc + elem) if narrow else (2 * acc, 5 * acc)


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
) -> int:
    """Peak bytes of the loss's forward + backward on a rank with `b` of the `n` rows.

    Args:
        loss: "clip", "siglip", "nt_xent" or "info_nce".
        strategy: "gather + tiled" or "ring + tiled" (wholebatch's kernels), or
            "naive" (N x N logits on every rank) or "local" (B x N logits), for comparison.
        n: N, global rows (pairs; nt_xent has 2N views).
        b: B, this rank's rows.
        dim: D.
        elem: bytes per embedding element.
        acc: bytes per compute element.
        tile: T.
        w: W.
    """
    views = 2 if loss == "nt_xent" else 1
    # both towers' gathered features and their gradients (gather_with_grad)
    gathered = 4 * n * dim * elem if w > 1 else 0
    if strategy == "naive":  # every rank holds the whole (views·N)^2 logits
        return 4 * (views * n) ** 2 * acc + gathered
    if strategy == "local":  # B x N logits per direction (open_clip's local_loss, DisCo-CLIP)
        return 4 * (views * b) * (views * n) * acc + gathered
    alpha, beta = _coefficients(loss, strategy, w, elem, acc)
    lse = 4 * views * n * acc if strategy == "gather + tiled" else 0
    return int(alpha * n * dim + beta * b * dim + 2 * tile * tile * acc + lse)
