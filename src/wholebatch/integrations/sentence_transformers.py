"""sentence-transformers drop-ins: (Cached)MultipleNegativesRankingLoss over the whole batch of every rank.

Change two lines of a `SentenceTransformerTrainer` script (docs/integrations/sentence_transformers.md):

    from wholebatch.integrations.sentence_transformers import CachedMultipleNegativesRankingLoss
    loss = CachedMultipleNegativesRankingLoss(model, mini_batch_size=32)   # no gather_across_devices

sentence-transformers 6.2.0's losses score each rank's anchors against that
rank's own rows only under DDP, unless `gather_across_devices=True`: by default
the step's gradient is off the whole batch's by an amount that depends on the
data (5-7% on random embeddings, 30% on a BERT encoder), and with
`gather_across_devices=True` they abort in the all-gather when ranks hold
different numbers of rows. These drop-ins take the same constructor and
call, and always compute the loss of the whole batch of every rank:

- `MultipleNegativesRankingLoss`: the model's forward as the peer runs it, then
  `wholebatch.info_nce_loss` (tiled: memory O(N·(1 + k)·D + T²), never the
  B x N·(1 + k) similarity matrix);
- `CachedMultipleNegativesRankingLoss`: the same loss through
  `wholebatch.GradCache`: each column split into mini-batches of
  `mini_batch_size` sequences exactly as the peer splits them, pass 1 under
  `no_grad`, pass 2 inside the Trainer's own `loss.backward()`.

Gradient contract: after the Trainer's backward and DDP's mean over W ranks,
every parameter's gradient is the one ONE process would compute for the loss
over the concatenated batch of all ranks (uneven rows per rank included),
with the forwards' dropout as drawn (the cached loss replays the RNG).

The peer package is imported only where it is needed: `compute_loss_from_embeddings`
works without it; embedding the features (`forward`) and the cached loss's
constructor import it, or raise an ImportError naming it.

Legend: W ranks, B this rank's rows (queries), N global rows, k hard-negative
columns, R = (2 + k)·B sequences of this rank, D embedding dim.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from wholebatch.comm.agree import agree_rows, exchange_text
from wholebatch.comm.groups import is_distributed
from wholebatch.conventions import GradReduction, check_grad_reduction
from wholebatch.errors import WholebatchError, WholebatchTypeError
from wholebatch.losses.info_nce import DIRECTIONS, Direction, PartitionMode, info_nce_loss
from wholebatch.train.gradcache import GradCache

__all__ = ["CachedMultipleNegativesRankingLoss", "MultipleNegativesRankingLoss"]

_PEER = "sentence-transformers"
_COS = ("cos_sim", "pytorch_cos_sim", "cosine", "cos")
_DOT = ("dot_score", "dot", "dot_product")
_HARDNESS = (None, "in_batch_negatives", "hard_negatives", "all_negatives")
Features = dict[str, Any]
MicroBatch = tuple[Features, int, int, bool]  # (column's features, begin, end, drop the output)


def _peer(module: str) -> Any:
    """Import `module` of sentence-transformers, or raise an ImportError naming the package."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"wholebatch.integrations.sentence_transformers: this needs the `{_PEER}` package "
            f"({module} could not be imported: {exc}); install it with `pip install "
            f'"{_PEER}[train]"` (tested with 6.2.0)'
        ) from exc


def similarity_kind(similarity_fct: object, op: str) -> str:
    """'cos' or 'dot' for a similarity the tiled loss computes exactly; a `WholebatchError` otherwise.

    Accepted: sentence-transformers' `cos_sim` (and `pytorch_cos_sim`) and
    `dot_score`, a model's bound `model.similarity` whose `similarity_fn_name`
    is "cosine" or "dot", or the names "cosine" / "dot". None means cos_sim.
    """
    if similarity_fct is None:
        return "cos"
    name: object = similarity_fct
    if not isinstance(similarity_fct, str):
        name = getattr(similarity_fct, "__name__", None)
        owner = getattr(similarity_fct, "__self__", None)
        module = str(getattr(similarity_fct, "__module__", "") or "")
        if name == "similarity" and hasattr(owner, "similarity_fn_name"):
            name = str(getattr(owner, "similarity_fn_name", None) or "cosine")
        elif not module.startswith("sentence_transformers"):
            name = None
    if name in _COS:
        return "cos"
    if name in _DOT:
        return "dot"
    shown = getattr(similarity_fct, "__name__", None) or repr(similarity_fct)
    raise WholebatchError(
        f"{op}: similarity_fct={shown} is not supported; the whole-batch loss computes "
        "sentence_transformers.util.cos_sim (the default) or dot_score exactly, tiled. For "
        "another similarity keep sentence-transformers' own loss with "
        "gather_across_devices=True (equal rows per rank; it holds the B x N similarity matrix)"
    )


def _agree_count(op: str, error: str | None, count: int, group: ProcessGroup | None) -> int:
    """The largest `count` over ranks; a rank's `error` becomes the same error on every rank."""
    if not is_distributed(group):
        if error is not None:
            raise WholebatchError(f"{op}: {error}")
        return count
    rows = agree_rows({"error": error is not None, "count": count}, group=group)
    if rows.ranks_where("error"):
        texts = exchange_text(error or "", group)
        raise WholebatchError(
            f"{op}: " + "; ".join(f"rank {r}: {t}" for r, t in enumerate(texts) if t)
        )
    return max(rows.ints("count"))


class _WholeBatchMNRL(nn.Module):
    """What both drop-ins share: the peer's arguments, validated, and the whole-batch loss."""

    _op = "MultipleNegativesRankingLoss"

    def __init__(
        self,
        model: nn.Module,
        scale: float,
        similarity_fct: Callable[[Tensor, Tensor], Tensor] | str | None,
        gather_across_devices: bool,
        directions: Sequence[Direction],
        partition_mode: PartitionMode,
        hardness_mode: str | None,
        hardness_strength: float,
        group: ProcessGroup | None,
        grad_reduction: GradReduction,
        tile_size: int | None,
    ) -> None:
        super().__init__()
        op = self._op
        if not isinstance(model, nn.Module):
            raise WholebatchTypeError(
                f"{op}: model must be a SentenceTransformer (an nn.Module), got {type(model).__name__}"
            )
        if not isinstance(scale, (int, float)) or not scale > 0:
            raise WholebatchError(
                f"{op}: scale={scale!r} must be a positive number (1 / temperature)"
            )
        if isinstance(directions, str) or not directions or not set(directions) <= set(DIRECTIONS):
            raise WholebatchError(
                f"{op}: directions={directions!r} must be a non-empty tuple of {DIRECTIONS}"
            )
        if "query_to_doc" not in directions:
            raise WholebatchError(f"{op}: directions must hold 'query_to_doc' (the positive pair)")
        if partition_mode not in ("joint", "per_direction"):
            raise WholebatchError(
                f"{op}: partition_mode={partition_mode!r} must be 'joint' or 'per_direction'"
            )
        if partition_mode == "per_direction" and set(directions) & {"query_to_query", "doc_to_doc"}:
            raise WholebatchError(
                f"{op}: partition_mode='per_direction' takes only 'query_to_doc' and "
                "'doc_to_query' (the others hold no positive pair); use partition_mode='joint'"
            )
        if hardness_mode not in _HARDNESS:
            raise WholebatchError(
                f"{op}: hardness_mode={hardness_mode!r} must be one of {_HARDNESS}"
            )
        if not hardness_strength >= 0:
            raise WholebatchError(f"{op}: hardness_strength={hardness_strength!r} must be >= 0")
        if hardness_mode is not None and hardness_strength > 0:
            raise WholebatchError(
                f"{op}: hardness_mode={hardness_mode!r} with hardness_strength > 0 is not offered "
                "by the whole-batch loss; pass hardness_mode=None, or keep sentence-transformers' "
                "own loss for hardness weighting"
            )
        check_grad_reduction(op, grad_reduction)
        self.model = model
        self.scale = float(scale)
        self._kind = similarity_kind(similarity_fct, op)
        self.similarity_fct = similarity_fct
        # Accepted for the peer's signature; the loss always spans every rank's rows.
        self.gather_across_devices = bool(gather_across_devices)
        self.directions: tuple[Direction, ...] = tuple(directions)
        self.partition_mode: PartitionMode = partition_mode
        self.hardness_mode, self.hardness_strength = hardness_mode, float(hardness_strength)
        self.group, self.grad_reduction, self.tile_size = group, grad_reduction, tile_size

    @property
    def temperature(self) -> float:
        return 1.0 / self.scale

    def compute_loss_from_embeddings(
        self, embeddings: Sequence[Tensor], labels: Tensor | None = None
    ) -> Tensor:
        """The whole batch's loss from this rank's column embeddings [anchor, positive, negative_1..k].

        Each is B x D (B may differ across ranks, 0 included); `labels` is unused
        (the positive is the row's own positive, as in the peer). Returns L, the
        mean over the whole batch's N anchors, the same on every rank; backward
        as `wholebatch.info_nce_loss` (exact after DDP's mean). Every rank must call it.
        """
        if len(embeddings) < 2:
            raise WholebatchError(
                f"{self._op}: expected at least 2 embedding columns (anchor, positive), got "
                f"{len(embeddings)}"
            )
        query_BD, doc_BD, *negs = embeddings
        negs_BKD = torch.stack(list(negs), 1) if negs else None
        if self._kind == "cos":
            query_BD, doc_BD = F.normalize(query_BD, dim=-1), F.normalize(doc_BD, dim=-1)
            negs_BKD = None if negs_BKD is None else F.normalize(negs_BKD, dim=-1)
        return self._info_nce(query_BD, doc_BD, negs_BKD)

    def _info_nce(self, query_BD: Tensor, doc_BD: Tensor, negs_BKD: Tensor | None) -> Tensor:
        return info_nce_loss(
            query_BD,
            doc_BD,
            self.scale,
            negatives_BKD=negs_BKD,
            directions=self.directions,
            partition_mode=self.partition_mode,
            group=self.group,
            grad_reduction=self.grad_reduction,
            tile_size=self.tile_size,
        )

    def get_config_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "similarity_fct": "cos_sim" if self._kind == "cos" else "dot_score",
            "gather_across_devices": self.gather_across_devices,
            "directions": self.directions,
            "partition_mode": self.partition_mode,
            "hardness_mode": self.hardness_mode,
            "hardness_strength": self.hardness_strength,
        }


class MultipleNegativesRankingLoss(_WholeBatchMNRL):
    """sentence-transformers' `MultipleNegativesRankingLoss` over the whole batch of every rank.

    Same constructor and call as sentence-transformers 6.2.0's (`loss(features,
    labels)` inside `SentenceTransformerTrainer`, which swaps the DDP-wrapped
    model into `loss.model`). The columns are embedded as the peer embeds them
    (its `embed_columns`: the anchors in one forward, the candidate columns
    merged into another), then `wholebatch.info_nce_loss` scores each anchor
    against every positive and hard negative of every rank.

    Args:
        model: the SentenceTransformer.
        scale: the logit multiplier (1 / temperature), default 20.
        similarity_fct: `cos_sim` (default) or `dot_score` (see `similarity_kind`).
        gather_across_devices: accepted and ignored: every rank's rows are always in the loss.
        directions, partition_mode: as the peer's (and `wholebatch.info_nce_loss`).
        hardness_mode, hardness_strength: only None / 0 (hardness weighting is not offered).
        group: the process group of the loss and of the reduction (default: the world).
        grad_reduction: "mean" (DDP, the Trainer) or "sum".
        tile_size: logits tile size (None: chosen for the device).
    """

    def __init__(
        self,
        model: nn.Module,
        scale: float = 20.0,
        similarity_fct: Callable[[Tensor, Tensor], Tensor] | str | None = None,
        gather_across_devices: bool = False,
        directions: Sequence[Direction] = ("query_to_doc",),
        partition_mode: PartitionMode = "joint",
        hardness_mode: str | None = None,
        hardness_strength: float = 0.0,
        *,
        group: ProcessGroup | None = None,
        grad_reduction: GradReduction = "mean",
        tile_size: int | None = None,
    ) -> None:
        super().__init__(
            model,
            scale,
            similarity_fct,
            gather_across_devices,
            directions,
            partition_mode,
            hardness_mode,
            hardness_strength,
            group,
            grad_reduction,
            tile_size,
        )

    def forward(
        self, sentence_features: Iterable[Features], labels: Tensor | None = None
    ) -> Tensor:
        """Embed each column with `self.model` and return the whole batch's loss (every rank must call)."""
        merged = _peer("sentence_transformers.base.losses.merged_forward")
        embeddings = merged.embed_columns(self.model, list(sentence_features))
        return self.compute_loss_from_embeddings(embeddings, labels)


class CachedMultipleNegativesRankingLoss(_WholeBatchMNRL):
    """sentence-transformers' `CachedMultipleNegativesRankingLoss` over the whole batch of every rank.

    The same loss as `MultipleNegativesRankingLoss`, at the activation memory
    of one mini-batch: every column is cut into mini-batches of
    `mini_batch_size` sequences (or packed to `mini_batch_num_tokens`), exactly
    as the peer cuts them, and `wholebatch.GradCache` embeds them without graph,
    computes the whole-batch loss on the cached embeddings and re-embeds each
    mini-batch inside the Trainer's `loss.backward()` (RNG and autocast
    replayed; DDP reduces once, on the last). Every mini-batch runs twice, as
    in the peer (peak memory: the larger of one mini-batch's activations and
    the loss stage, as the peer's). A rank with fewer mini-batches
    than another (uneven rows) runs one-row forwards whose output is dropped,
    so every rank runs as many forwards (DDP broadcasts buffers in each).

    Not supported: wrapping it in `MatryoshkaLoss` or `AdaptiveLayerLoss`
    (they patch the peer's `calculate_loss` protocol; an error says so).

    Args:
        model: the SentenceTransformer (not a StaticEmbedding one, as for the peer).
        scale, similarity_fct, gather_across_devices, directions, partition_mode,
        hardness_mode, hardness_strength: as for `MultipleNegativesRankingLoss`.
        mini_batch_size: sequences per forward (the peer's meaning), default 32.
        mini_batch_num_tokens: pack mini-batches by non-padding tokens instead (the peer's).
        show_progress_bar: a progress bar over pass 1's mini-batches.
        group, grad_reduction, tile_size: as for `MultipleNegativesRankingLoss`.
    """

    _op = "CachedMultipleNegativesRankingLoss"
    uses_gradient_cache = True  # what MatryoshkaLoss and AdaptiveLayerLoss look for

    def __init__(
        self,
        model: nn.Module,
        scale: float = 20.0,
        similarity_fct: Callable[[Tensor, Tensor], Tensor] | str | None = None,
        mini_batch_size: int = 32,
        mini_batch_num_tokens: int | None = None,
        gather_across_devices: bool = False,
        directions: Sequence[Direction] = ("query_to_doc",),
        partition_mode: PartitionMode = "joint",
        show_progress_bar: bool = False,
        hardness_mode: str | None = None,
        hardness_strength: float = 0.0,
        *,
        group: ProcessGroup | None = None,
        grad_reduction: GradReduction = "mean",
        tile_size: int | None = None,
    ) -> None:
        super().__init__(
            model,
            scale,
            similarity_fct,
            gather_across_devices,
            directions,
            partition_mode,
            hardness_mode,
            hardness_strength,
            group,
            grad_reduction,
            tile_size,
        )
        op = self._op
        if isinstance(mini_batch_size, bool) or not isinstance(mini_batch_size, int):
            raise WholebatchTypeError(f"{op}: mini_batch_size={mini_batch_size!r} must be an int")
        if mini_batch_size < 1:
            raise WholebatchError(f"{op}: mini_batch_size={mini_batch_size} must be >= 1")
        if mini_batch_num_tokens is not None and not mini_batch_num_tokens > 0:
            raise WholebatchError(
                f"{op}: mini_batch_num_tokens={mini_batch_num_tokens!r} must be a positive int or None"
            )
        gc = _peer("sentence_transformers.base.losses.gradcache")
        if gc.has_static_embedding_input(model):
            raise WholebatchError(
                f"{op}: a StaticEmbedding model's inputs cannot be cut into mini-batches; use "
                "MultipleNegativesRankingLoss"
            )
        self.mini_batch_size = mini_batch_size
        self.mini_batch_num_tokens = mini_batch_num_tokens
        self.show_progress_bar = bool(show_progress_bar)

    def calculate_loss(self, *args: Any, **kwargs: Any) -> Tensor:
        """The peer's per-mini-batch loss protocol (used by MatryoshkaLoss): not offered."""
        raise WholebatchError(
            f"{self._op}: calculate_loss (the peer's protocol for MatryoshkaLoss and "
            "AdaptiveLayerLoss) is not offered; use sentence-transformers' own cached loss "
            "under those wrappers"
        )

    def forward(
        self, sentence_features: Iterable[Features], labels: Tensor | None = None
    ) -> Tensor:
        """The whole batch's loss; its backward re-embeds every mini-batch (every rank must call)."""
        op = self._op
        if "calculate_loss" in self.__dict__:  # MatryoshkaLoss replaced it: its dims would be lost
            raise WholebatchError(
                f"{op}: it is wrapped by a loss that decorates calculate_loss (MatryoshkaLoss); "
                "that combination is not offered: use sentence-transformers' own cached loss"
            )
        gc = _peer("sentence_transformers.base.losses.gradcache")
        columns = list(sentence_features)
        rows = [int(gc._get_batch_size(f)) for f in columns]
        error = None
        if len(columns) < 2:
            error = f"expected at least 2 input columns (anchor, positive), got {len(columns)}"
        elif len(set(rows)) > 1:
            error = f"the input columns hold different numbers of rows {rows}"
        mbs: list[MicroBatch] = [
            (f, begin, end, False)
            for f in columns
            for begin, end in gc._minibatch_ranges(
                f, self.mini_batch_size, self.mini_batch_num_tokens
            )
        ]
        k_all = _agree_count(op, error, len(mbs), self.group)
        # A rank with fewer mini-batches than another runs one-row forwards (output
        # dropped): every rank must run as many forwards (DDP broadcasts buffers in each).
        mbs += [(columns[0], 0, min(1, rows[0]), True)] * (k_all - len(mbs))
        b = rows[0]
        embed = self._embedder(gc, len(mbs))

        def loss_fn(all_RD: Tensor) -> Tensor:
            # R = (2 + k)·B rows, column-major: anchors, positives, negatives_1..k.
            if self._kind == "cos":
                all_RD = F.normalize(all_RD, dim=-1)
            k = len(columns) - 2
            negs_BKD = all_RD[2 * b :].view(k, b, all_RD.shape[1]).transpose(0, 1) if k else None
            return self._info_nce(all_RD[:b], all_RD[b : 2 * b], negs_BKD)

        if not torch.is_grad_enabled():
            return loss_fn(torch.cat([embed(self.model, mb) for mb in mbs]))
        # keep_last=False: every mini-batch is re-run in pass 2, as the peer does, so the
        # peak is the larger of one mini-batch and the loss, never their sum (at N = 8,192
        # keeping the last graph cost 1.34x the peer's memory for one forward in 64).
        cache = GradCache(
            self.model, embed, grad_reduction=self.grad_reduction, group=self.group, keep_last=False
        )
        return cache(mbs, loss_fn)

    def _embedder(self, gc: Any, total: int) -> Callable[[nn.Module, MicroBatch], Tensor]:
        """`embed_fn` for GradCache: one mini-batch's sentence embeddings (R_mb x D)."""
        bar = (
            _peer("tqdm").tqdm(total=total, desc="Embed mini-batches")
            if self.show_progress_bar
            else None
        )

        def embed(model: nn.Module, mb: MicroBatch) -> Tensor:
            nonlocal bar
            features, begin, end, drop = mb
            out: Tensor = model(gc._create_minibatch(features, begin, end))["sentence_embedding"]
            if bar is not None:  # pass 1 only: closed after its last mini-batch
                bar.update(1)
                if bar.n >= total:
                    bar.close()
                    bar = None
            return out[:0] if drop else out

        return embed

    def get_config_dict(self) -> dict[str, Any]:
        return {
            **super().get_config_dict(),
            "mini_batch_size": self.mini_batch_size,
            "mini_batch_num_tokens": self.mini_batch_num_tokens,
        }
