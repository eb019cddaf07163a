"""One descriptor per whole-batch loss: what the losses' exchange, the planner and the docs ask of it.

Torch-free (the planner imports it without torch). A loss's function reads
its replicated scalars, the options its ranks must agree on and the
strategies it offers from here; `wholebatch plan` reads the same entry for
the tile kernel it runs, the blocks it moves, the buffers it keeps and the
elementwise passes it pays. Adding a loss: its function (and module form) in
`contrastive.py` or a file of its own, and its `LossSpec` in `SPECS` below.

Legend: N global rows, B a rank's rows, D embedding dim, k hard negatives per
query, J = 1 + k key rows per query (its document and its hard negatives).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

__all__ = [
    "COLUMN_PASSES",
    "GATHER",
    "RING",
    "SPECS",
    "STRATEGIES",
    "Kernel",
    "LossSpec",
    "Strategy",
    "spec",
    "strategy_code",
    "strategy_problem",
]

Strategy = Literal["gather", "ring", "auto"]
"""How a loss reaches the other ranks' rows: all-gather them, pass them around a ring, or choose."""
STRATEGIES: tuple[str, ...] = ("gather", "ring", "auto")
GATHER, RING = "gather", "ring"

Kernel = Literal["positive", "symmetric", "sigmoid"]
"""The tile kernel family (losses/tiles.py): `PositiveLSE` / `PositiveRing` (softmax rows with a
known positive), `SymmetricLSE` (NT-Xent's self-similarity), `SigmoidRing` (SigLIP's pairs)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossSpec:
    """Everything the rest of the library asks of one whole-batch loss."""

    name: str
    """The planner's name (`wholebatch plan --loss`)."""
    function: str
    """The public function (`wholebatch.<function>`), also the op name in its errors."""
    module: str
    """Its `nn.Module` form."""
    summary: str
    """One line for the docs' table."""
    kernel: Kernel
    """The tile kernel family it runs."""
    keys: str
    """What its key blocks hold, as the planner names their collectives."""
    scalars: tuple[str, ...]
    """Replicated scalars, always passed, in the exchange's and the agreement's order."""
    optional_scalars: tuple[str, ...] = ()
    """Replicated scalars a caller may add (clip's `logit_bias`), after `scalars`."""
    options: tuple[tuple[str, str], ...] = ()
    """(name, fix) of each option every rank must pass alike: one exchange column each."""
    strategies: tuple[str, ...] = (GATHER,)
    """The strategies it offers ("gather", "ring"); with both, "auto" too."""
    default_strategy: str = GATHER
    """What it does when the caller does not say."""
    views: int = 1
    """Key rows per sample in its self-similarity (NT-Xent: 2, the two views)."""
    negatives: bool = False
    """It takes k hard negatives per query."""
    directions: tuple[str, ...] = ()
    """The directions it offers (InfoNCE), the first always included."""
    columns: Literal["always", "never", "doc_to_query"] = "never"
    """When its sweep also keeps column statistics (the symmetric CE's second direction)."""
    passes: int = 0
    """Reads + writes of one logits element per forward + backward, counted from the PyTorch
    tile loops (a GPU pays them in memory bandwidth), without column statistics: a sweep
    with them pays `COLUMN_PASSES` more per column element."""
    tile_buffers: float = 2.0
    """float32 T x T buffers alive at the tile loop's peak (measured at T = 512 and 2,048)."""

    def key_rows(self, k: int = 0) -> int:
        """Key rows each sample contributes to the blocks moved (D elements each)."""
        return self.views * (1 + (k if self.negatives else 0))

    def embeddings_per_row(self, k: int = 0) -> int:
        """Embedding rows the loss receives per sample (two towers, + k hard negatives)."""
        return 2 + (k if self.negatives else 0)

    def has_columns(self, directions: Sequence[str] = ()) -> bool:
        """Whether the sweep keeps column statistics for these directions."""
        if self.columns == "doc_to_query":
            return "doc_to_query" in directions
        return self.columns == "always"

    def exchange_options(self) -> int:
        """Columns its options take in the exchange row (losses/sizing.py)."""
        return len(self.options)

    def replicable(self, strategy: object) -> bool:
        """Whether the small path (losses/replicated.py) may replace `strategy` on a small batch:
        any but an explicit "ring" where the loss gathers by default (that asks for O(B·D) memory)."""
        return strategy != RING or self.default_strategy == RING

    def offers(self, strategy: str) -> bool:
        """Whether `strategy` ("gather", "ring", "auto") is one of its own."""
        return strategy in self.strategies or (strategy == "auto" and len(self.strategies) > 1)


# Element passes counted from the kernels' tile loops (losses/tiles.py); a sweep
# with column statistics (CLIP, InfoNCE's doc_to_query) pays about this many more.
COLUMN_PASSES = 14

_SAME = "pass the same on every rank"
_STRATEGY = ("strategy", "pass the same strategy= on every rank")

_SPECS = (
    LossSpec(
        name="clip",
        function="clip_loss",
        module="ClipLoss",
        summary="symmetric InfoNCE over image-text pairs (open_clip's ClipLoss)",
        kernel="positive",
        keys="text embeddings",
        scalars=("logit_scale",),
        optional_scalars=("logit_bias",),
        options=(_STRATEGY,),
        strategies=(GATHER, RING),
        columns="always",
        passes=16,
        tile_buffers=2.5,
    ),
    LossSpec(
        name="siglip",
        function="siglip_loss",
        module="SigLipLoss",
        summary="sigmoid loss over every image-text pair (SigLIP)",
        kernel="sigmoid",
        keys="text blocks",
        scalars=("logit_scale", "logit_bias"),
        strategies=(RING,),
        default_strategy=RING,
        passes=22,
    ),
    LossSpec(
        name="nt_xent",
        function="nt_xent_loss",
        module="NTXentLoss",
        summary="SimCLR's NT-Xent over the 2N views of N samples",
        kernel="symmetric",
        keys="[z1 | z2]",
        scalars=("temperature",),
        views=2,
        passes=29,
    ),
    LossSpec(
        name="info_nce",
        function="info_nce_loss",
        module="InfoNCELoss",
        summary="InfoNCE with hard negatives (sentence-transformers' MultipleNegativesRankingLoss)",
        kernel="positive",
        keys="[document | negatives]",
        scalars=("logit_scale",),
        options=(
            ("hard negatives per query (k)", _SAME + " (pad, or drop rows to a common k)"),
            ("directions", _SAME),
            ("partition_mode", _SAME),
            _STRATEGY,
        ),
        strategies=(GATHER, RING),
        negatives=True,
        directions=("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"),
        columns="doc_to_query",
        passes=16,
        tile_buffers=2.5,
    ),
)
SPECS: dict[str, LossSpec] = {s.name: s for s in _SPECS}
"""Every whole-batch loss, by its planner name."""


def spec(name: str) -> LossSpec:
    """The descriptor of loss `name` ("clip", "siglip", "nt_xent", "info_nce")."""
    try:
        return SPECS[name]
    except KeyError:
        raise KeyError(f"no whole-batch loss {name!r}; the losses are {tuple(SPECS)}") from None


def strategy_problem(loss: LossSpec, strategy: object) -> str | None:
    """Why `strategy` is not one `loss` offers, or None."""
    if isinstance(strategy, str) and loss.offers(strategy):
        return None
    offered = [*loss.strategies, *(["auto"] if len(loss.strategies) > 1 else [])]
    return f"strategy={strategy!r} must be one of {offered}"


def strategy_code(strategy: object) -> int:
    """`strategy` as the number its exchange column carries (0 when it is not a strategy)."""
    return STRATEGIES.index(strategy) if strategy in STRATEGIES else 0
