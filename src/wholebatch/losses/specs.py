"""One descriptor per whole-batch loss: everything the call path, the planner and the docs ask of it.

Torch-free (the planner and the docs' test import it without torch). A loss is
its `LossSpec` here, and a module of its own (`home`) holding its function, its
row terms and its one reference formula. What reads the spec:

- the call path (`wholebatch.losses.call`): the exchange's row is
  `exchange_fields(spec)` (the row built from this list, nothing kept in step by
  hand), the options every rank must pass alike and how their values are shown,
  the strategies it offers, whether the small path may replace the one asked for;
- `wholebatch.losses` exports `function` from `home` (no export list to edit);
- `wholebatch plan` (the kernel family, the key blocks it moves, the buffers and
  passes it pays), `wholebatch selftest` and the loss tests (they iterate `SPECS`);
- docs/contrastive.md's loss table (`docs_table`, checked by the tests).

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
    "KERNELS",
    "RING",
    "SPECS",
    "STRATEGIES",
    "Kernel",
    "LossSpec",
    "Option",
    "Strategy",
    "docs_table",
    "exchange_fields",
]

Strategy = Literal["gather", "ring", "auto"]
"""How a loss reaches the other ranks' rows: all-gather them, pass them around a ring, or choose."""
STRATEGIES: tuple[str, ...] = ("gather", "ring", "auto")
GATHER, RING = "gather", "ring"

Kernel = Literal["positive", "symmetric", "sigmoid", "tokens"]
"""The kernel family: softmax rows with a known positive (`lse.PositiveLSE`, `ring.PositiveRing`),
NT-Xent's self-similarity (`symmetric.SymmetricLSE`), sigmoid pairs (`sigmoid.SigmoidRing`),
max over token pairs (`late.MaxSimLSE`)."""
KERNELS: dict[str, str] = {
    "positive": "softmax rows",
    "symmetric": "symmetric self-similarity",
    "sigmoid": "sigmoid pairs",
    "tokens": "max over token pairs, softmax rows",
}
"""How the docs name each kernel family."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Option:
    """An argument every rank must pass alike: one exchange column, shown by name in errors."""

    name: str
    """What the errors call it (the keyword, or what it counts)."""
    fix: str
    """How to make the ranks agree."""
    choices: tuple[str, ...] = ()
    """The names of its codes 0, 1, ... (a bit mask over them with `flags`); (): a count."""
    flags: bool = False
    """The code is a bit mask over `choices` (InfoNCE's directions)."""

    def shown(self, code: float) -> object:
        """The value a code stands for, as errors print it."""
        c = int(code)
        if not self.choices or code != c or c < 0:
            return c if code == c else code
        if self.flags:
            return tuple(x for i, x in enumerate(self.choices) if c >> i & 1)
        return self.choices[c] if c < len(self.choices) else c


_SAME = "pass the same on every rank"
STRATEGY = Option(name="strategy", fix="pass the same strategy= on every rank", choices=STRATEGIES)
"""Every loss's `strategy=`, always in the exchange."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossSpec:
    """Everything the rest of the library asks of one whole-batch loss."""

    name: str
    """The planner's name (`wholebatch plan --loss`) and the docs row's key."""
    function: str
    """The public function (`wholebatch.losses.<function>`), also the op name in its errors."""
    home: str
    """The module that defines `function` (and the loss's reference formula)."""
    formula: str
    """The name, in `home`, of its one reference formula (rows, scalars) -> L: what the small
    path evaluates, and what `wholebatch selftest` compares the distributed call with."""
    inputs: tuple[str, ...]
    """Its positional tensor arguments, in order, before the scalars; each name says its shape
    (`_BD` rows x dim, `_BQD`/`_BTD` token sets, `_BQ`/`_BT` their masks, `_B` an integer per
    row: `wholebatch.losses.examples` builds inputs from them)."""
    extras: tuple[str, ...] = ()
    """Its optional keyword tensors (hard negatives, ids), named the same way."""
    module: str = ""
    """Its `nn.Module` form in `wholebatch.losses.modules` ("": none)."""
    summary: str
    """One line for the docs' table."""
    kernel: Kernel
    """The kernel family it runs (`KERNELS`)."""
    keys: str
    """What its key blocks hold, as the planner names their collectives."""
    scalars: tuple[str, ...]
    """Replicated scalars, always passed, in the exchange's and the agreement's order."""
    optional_scalars: tuple[str, ...] = ()
    """Replicated scalars a caller may add (clip's `logit_bias`): always a column (NaN: not
    passed), so the row has one length whatever each rank passes."""
    options: tuple[Option, ...] = ()
    """Its own options every rank must pass alike, after `strategy` (always there)."""
    per_rank: tuple[str, ...] = ()
    """Numbers each rank has its own of and every rank must learn (maxsim's token counts)."""
    towers: int = 2
    """Embedding tensors of B x D per row (SupCon: 1, one view), hard negatives aside."""
    strategies: tuple[str, ...] = (GATHER,)
    """The strategies it offers ("gather", "ring"); with both, "auto" too."""
    default_strategy: str = GATHER
    """What it does when the caller does not say."""
    views: int = 1
    """Key rows per sample in its self-similarity (NT-Xent, DCL: 2, the two views)."""
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
        """Embedding rows the loss receives per sample (its towers, + k hard negatives)."""
        return self.towers + (k if self.negatives else 0)

    def has_columns(self, directions: Sequence[str] = ()) -> bool:
        """Whether the sweep keeps column statistics for these directions."""
        if self.columns == "doc_to_query":
            return "doc_to_query" in directions
        return self.columns == "always"

    def replicable(self, strategy: object) -> bool:
        """Whether the small path may replace `strategy` on a small batch: any but an explicit
        "ring" where the loss gathers by default (that asks for O(B·D) memory)."""
        return strategy != RING or self.default_strategy == RING

    def offered(self) -> tuple[str, ...]:
        """The `strategy=` values it takes: its strategies, and "auto" where it has two."""
        return (*self.strategies, *(("auto",) if len(self.strategies) > 1 else ()))

    def strategy_problem(self, strategy: object) -> str | None:
        """Why `strategy` is not one it offers, or None."""
        if isinstance(strategy, str) and strategy in self.offered():
            return None
        return f"strategy={strategy!r} must be one of {list(self.offered())}"

    def all_options(self) -> tuple[Option, ...]:
        """`strategy` and its own options, in the exchange's order."""
        return (STRATEGY, *self.options)


# Element passes counted from the kernels' tile loops (losses/lse.py); a sweep
# with column statistics (CLIP, InfoNCE's doc_to_query) pays about this many more.
COLUMN_PASSES = 14

# The exchange row's fields every loss has, in order (`exchange_fields`).
_HEAD = ("error", "rows", "dim", "dtype", "device", "grad_reduction", "small rows")
_SIZES = ("sizes given", "sizes fingerprint")


def exchange_fields(loss: LossSpec) -> tuple[str, ...]:
    """The names of the float64 fields of `loss`'s exchange row, in order: its length.

    `wholebatch.losses.call` builds the row from this list (and the test of the
    exchange checks the row it sends has these names and no others); `wholebatch
    plan` counts 8 bytes per field. The row does not grow with W.
    """
    options = tuple(f"option {o.name}" for o in loss.all_options())
    scalars = tuple(f"scalar {s}" for s in (*loss.scalars, *loss.optional_scalars))
    return (*_HEAD, *loss.per_rank, *options, *_SIZES, *scalars)


_K = Option(name="hard negatives per query (k)", fix=_SAME + " (pad, or drop rows to a common k)")
_DIRECTIONS = Option(
    name="directions",
    fix=_SAME,
    flags=True,
    choices=("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"),
)
_PARTITION = Option(name="partition_mode", fix=_SAME, choices=("joint", "per_direction"))
_IDS = Option(name="ids_B", fix="pass ids_B on every rank, or on none", choices=("none", "given"))
_ID_TEXT = "; `ids_B=`: equal ids are never each other's negatives"

_SPECS = (
    LossSpec(
        name="clip",
        function="clip_loss",
        home="wholebatch.losses.contrastive",
        formula="clip_formula",
        inputs=("image_BD", "text_BD"),
        extras=("ids_B",),
        module="ClipLoss",
        summary="symmetric InfoNCE over image-text pairs (open_clip's ClipLoss)" + _ID_TEXT,
        kernel="positive",
        keys="text embeddings",
        scalars=("logit_scale",),
        optional_scalars=("logit_bias",),
        options=(_IDS,),
        strategies=(GATHER, RING),
        columns="always",
        passes=16,
        tile_buffers=2.5,
    ),
    LossSpec(
        name="siglip",
        function="siglip_loss",
        home="wholebatch.losses.contrastive",
        formula="siglip_formula",
        inputs=("image_BD", "text_BD"),
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
        home="wholebatch.losses.contrastive",
        formula="nt_xent_formula",
        inputs=("z1_BD", "z2_BD"),
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
        home="wholebatch.losses.info_nce",
        formula="info_nce_formula",
        inputs=("query_BD", "document_BD"),
        extras=("negatives_BKD", "ids_B"),
        module="InfoNCELoss",
        summary="InfoNCE with hard negatives (sentence-transformers' "
        "MultipleNegativesRankingLoss)" + _ID_TEXT,
        kernel="positive",
        keys="[document | negatives]",
        scalars=("logit_scale",),
        options=(_K, _DIRECTIONS, _PARTITION, _IDS),
        strategies=(GATHER, RING),
        negatives=True,
        directions=_DIRECTIONS.choices,
        columns="doc_to_query",
        passes=16,
        tile_buffers=2.5,
    ),
    LossSpec(
        name="dcl",
        function="dcl_loss",
        home="wholebatch.losses.dcl",
        formula="dcl_formula",
        inputs=("a_BD", "b_BD"),
        summary="decoupled contrastive loss: NT-Xent without the positive in the denominator",
        kernel="symmetric",
        keys="[a | b]",
        scalars=("logit_scale",),
        strategies=(GATHER, RING),
        views=2,
        passes=29,
    ),
    LossSpec(
        name="supcon",
        function="supcon_loss",
        home="wholebatch.losses.supcon",
        formula="supcon_formula",
        inputs=("features_BD", "labels_B"),
        summary="supervised contrastive loss: every row of the same label is a positive",
        kernel="positive",
        keys="features",
        scalars=("logit_scale",),
        towers=1,
        strategies=(GATHER, RING),
        passes=16,
        tile_buffers=2.5,
    ),
    LossSpec(
        name="maxsim",
        function="maxsim_loss",
        home="wholebatch.losses.maxsim",
        formula="maxsim_formula",
        inputs=("queries_BQD", "query_mask_BQ", "docs_BTD", "doc_mask_BT"),
        summary="late interaction (ColBERT's MaxSim): InfoNCE of queries over the batch's "
        "documents, token sets ragged",
        kernel="tokens",
        keys="document token blocks",
        scalars=("logit_scale",),
        per_rank=("query tokens", "doc tokens"),
        strategies=(GATHER, RING),
        passes=16,
    ),
)
SPECS: dict[str, LossSpec] = {s.name: s for s in _SPECS}
"""Every whole-batch loss, by its planner name."""


def docs_table() -> str:
    """docs/contrastive.md's table of the losses, one row per spec (a test keeps the page equal)."""
    rows = [
        "| loss | function | module | kernel | scalars | strategies | what |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in SPECS.values():
        scalars = ", ".join(f"`{x}`" for x in s.scalars)
        scalars += "".join(f" (+ `{x}`)" for x in s.optional_scalars)
        strategies = ", ".join(
            f"{x} (default)" if x == s.default_strategy and len(s.offered()) > 1 else x
            for x in s.offered()
        )
        kernel = KERNELS[s.kernel] + {"always": " + columns", "doc_to_query": " (+ columns)"}.get(
            s.columns, ""
        )
        module = f"`{s.module}`" if s.module else "-"
        rows.append(
            f"| {s.name} | `{s.function}` | {module} | {kernel} | {scalars} | {strategies} "
            f"| {s.summary} |"
        )
    return "\n".join(rows)
