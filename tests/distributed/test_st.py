"""The sentence-transformers drop-ins against the REAL sentence-transformers 6.2.0.

Where the peer is right (one process; equal rows with gather_across_devices=True)
values and gradients equal the peer's to float64 round-off. Where it is wrong or
crashes (its default under DDP sees only local negatives; uneven rows per rank;
an empty rank) ours equals the whole-batch reference: the peer's own
`MultipleNegativesRankingLoss` on ONE process over the concatenated batch (where
the peer is right). The mutation in every distributed case is the peer's default
under DDP, which must fail the same assertion.

Two levels: the loss on embeddings (a replicated linear encoder, gradients
averaged over ranks as DDP does; W = 2 and 3, uneven rows, an empty rank), and a
tiny SentenceTransformer (a 1-layer BERT and a WordLevel tokenizer built here,
no download; float64, dropout on) under real DDP, both losses, uneven rows
(the cached loss then pads the shorter rank's forwards).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from importlib.util import find_spec
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from tests.support.harness import run_ranks
from wholebatch.comm.groups import get_rank, get_world_size
from wholebatch.errors import WholebatchError

needs_peer = pytest.mark.skipif(
    find_spec("sentence_transformers") is None,
    reason="sentence-transformers is not installed (make .venv/.peers installs the peers)",
)

# float64; the losses sum a few dozen terms of size <= ~20: round-off ~1e-14; 1e-10 leaves
# room and rejects the peer's local negatives (gradients off by tens of percent).
F64: dict[str, float] = dict(rtol=1e-10, atol=1e-10)
D_IN, D = 5, 4
VOCAB = [f"w{i}" for i in range(24)]
SETTINGS: dict[str, tuple[tuple[str, ...], str]] = {
    "q2d": (("query_to_doc",), "joint"),
    "symmetric": (("query_to_doc", "doc_to_query"), "per_direction"),
    "all four joint": (("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"), "joint"),
}


# ---------------------------------------------------------------------------
# The peer and a tiny SentenceTransformer built from a config
# ---------------------------------------------------------------------------


def peer_loss(kind: str, model: nn.Module, **kw: Any) -> nn.Module:
    """The REAL sentence-transformers loss (`kind`: "mnrl" or "cached")."""
    from sentence_transformers.sentence_transformer import losses

    cls = (
        losses.MultipleNegativesRankingLoss
        if kind == "mnrl"
        else losses.CachedMultipleNegativesRankingLoss
    )
    return cls(model, **kw)  # type: ignore[no-any-return]


def our_loss(kind: str, model: nn.Module, **kw: Any) -> nn.Module:
    from wholebatch.integrations import sentence_transformers as wst

    cls = (
        wst.MultipleNegativesRankingLoss
        if kind == "mnrl"
        else wst.CachedMultipleNegativesRankingLoss
    )
    return cls(model, **kw)


def build_model_dir(path: str) -> str:
    """Save a 1-layer BERT (hidden 8, dropout 0.1) and a WordLevel tokenizer to `path`."""
    import transformers
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {t: i for i, t in enumerate(specials + VOCAB)}
    tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # type: ignore[assignment]
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]", model_max_length=16,
    ).save_pretrained(path)  # fmt: skip
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(vocab), hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=16,
    )  # fmt: skip
    BertModel(config, add_pooling_layer=False).save_pretrained(path)
    return path


def load_model(path: str) -> nn.Module:
    """The SentenceTransformer (Transformer + mean Pooling) in float64, training mode (dropout on)."""
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    encoder = Transformer(path, model_kwargs={"add_pooling_layer": False})
    model = SentenceTransformer(modules=[encoder, Pooling(8, "mean")], device="cpu").double()
    model.train()
    return model


@pytest.fixture(scope="module")
def model_dir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="wb-st-") as path:
        yield build_model_dir(path)


def texts(rank: int, rows: int, columns: int) -> list[list[str]]:
    """Per-rank different sentences of 1-6 words, one list per column."""
    gen = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(columns):
        lens = torch.randint(1, 7, (rows,), generator=gen).tolist()
        out.append(
            [
                " ".join(VOCAB[int(i)] for i in torch.randint(len(VOCAB), (n,), generator=gen))
                for n in lens
            ]
        )
    return out


def embed_like(
    kind: str, model: nn.Module, features: list[dict[str, Any]], mbs: int
) -> list[Tensor]:
    """Embed with graph exactly as `kind` does (same forwards, same order, so the same dropout)."""
    if kind == "mnrl":
        from sentence_transformers.base.losses.merged_forward import embed_columns

        return list(embed_columns(model, features))
    from sentence_transformers.base.losses.gradcache import _create_minibatch, _minibatch_ranges

    return [
        torch.cat(
            [
                model(_create_minibatch(f, b, e))["sentence_embedding"]
                for b, e in _minibatch_ranges(f, mbs)
            ]
        )
        for f in features
    ]


# ---------------------------------------------------------------------------
# One process: the peer is right, ours must equal it
# ---------------------------------------------------------------------------


@needs_peer
@pytest.mark.parametrize("similarity", ["cos_sim", "dot_score"])
@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_loss_from_embeddings_equals_peer(similarity: str, k: int, setting: str) -> None:
    from sentence_transformers import util

    directions, mode = SETTINGS[setting]
    sim = getattr(util, similarity)
    kw = dict(scale=7.0, similarity_fct=sim, directions=directions, partition_mode=mode)
    torch.manual_seed(1)
    cols = [torch.randn(6, D, dtype=torch.float64) * 0.5 for _ in range(2 + k)]
    out = []
    for make in (peer_loss, our_loss):
        xs = [c.clone().requires_grad_() for c in cols]
        loss = make("mnrl", nn.Identity(), **kw).compute_loss_from_embeddings(xs, None)
        loss.backward()
        out.append((loss.detach(), [x.grad for x in xs]))
    (lp, gp), (lo, go) = out
    torch.testing.assert_close(lo, lp, **F64)
    for a, b in zip(go, gp, strict=True):
        torch.testing.assert_close(a, b, **F64)


@needs_peer
@pytest.mark.parametrize("kind", ["mnrl", "cached"])
def test_model_forward_equals_peer_with_dropout(kind: str, model_dir: str) -> None:
    """A real SentenceTransformer, dropout on, 7 rows, 1 hard negative, 3 sequences per forward."""
    cols = texts(0, 7, 3)
    results = []
    for make in (peer_loss, our_loss):
        model = load_model(model_dir)
        kw: dict[str, Any] = {"scale": 9.0} | ({"mini_batch_size": 3} if kind == "cached" else {})
        loss_fn = make(kind, model, **kw)
        forwards = [0]

        def count(*_: Any, forwards: list[int] = forwards) -> None:
            forwards[0] += 1

        model.register_forward_pre_hook(count)
        torch.manual_seed(5)
        loss = loss_fn([model.preprocess(c) for c in cols], None)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        results.append((loss.detach(), grads, forwards[0]))
    (lp, gp, fp), (lo, go, fo) = results
    # The same forwards as the peer: MNRL 2 (anchors; candidates merged); cached: every
    # mini-batch twice (3 columns x 3 mini-batches x 2 passes), so the same peak memory.
    assert fo == fp == (2 if kind == "mnrl" else 18)
    torch.testing.assert_close(lo, lp, **F64)
    for a, b in zip(go, gp, strict=True):
        torch.testing.assert_close(a, b, **F64)


# ---------------------------------------------------------------------------
# Distributed, on embeddings: a replicated linear encoder, gradients averaged like DDP
# ---------------------------------------------------------------------------


def _encoder() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(D_IN, D, dtype=torch.float64)


def _rank_inputs(rank: int, rows: int, k: int) -> Tensor:
    gen = torch.Generator().manual_seed(7 + rank)
    return torch.randn(rows, 2 + k, D_IN, dtype=torch.float64, generator=gen) + rank


def _embeddings_step(impl: str, sizes: list[int], k: int, setting: str) -> tuple[Tensor, Tensor]:
    """One rank: (its loss value, the encoder's weight gradient averaged over ranks as DDP does)."""
    directions, mode = SETTINGS[setting]
    kw = dict(scale=6.0, directions=directions, partition_mode=mode)
    enc = _encoder()
    x = _rank_inputs(get_rank(), sizes[get_rank()], k)
    cols = list(enc(x).unbind(1))
    if impl == "ours":
        loss_fn = our_loss("mnrl", enc, **kw)
    else:  # the peer: "peer_default" (local negatives) or "peer_gather"
        loss_fn = peer_loss("mnrl", enc, gather_across_devices=impl == "peer_gather", **kw)
    loss = loss_fn.compute_loss_from_embeddings(cols, None)  # type: ignore[operator]
    loss.backward()
    grad = enc.weight.grad
    assert grad is not None
    dist.all_reduce(grad)  # DDP's reduction: the mean over ranks
    return loss.detach(), grad / get_world_size()


def _embeddings_reference(sizes: list[int], k: int, setting: str) -> tuple[Tensor, Tensor]:
    directions, mode = SETTINGS[setting]
    enc = _encoder()
    x = torch.cat([_rank_inputs(r, n, k) for r, n in enumerate(sizes)])
    loss_fn = peer_loss("mnrl", enc, scale=6.0, directions=directions, partition_mode=mode)
    loss = loss_fn.compute_loss_from_embeddings(list(enc(x).unbind(1)), None)  # type: ignore[operator]
    loss.backward()
    assert enc.weight.grad is not None
    return loss.detach(), enc.weight.grad


def check_embeddings(impl: str, sizes: list[int], k: int, setting: str) -> None:
    got = run_ranks(len(sizes), _embeddings_step, impl, sizes, k, setting)
    ref_loss, ref_grad = _embeddings_reference(sizes, k, setting)
    for r, (_, grad) in enumerate(got):
        torch.testing.assert_close(grad, ref_grad, **F64, msg=lambda m, r=r: f"rank {r}: {m}")
    # The peer returns its rank's share (mean over local rows); over equal ranks their
    # mean is L. Ours returns L itself on every rank: the mean of equal values.
    torch.testing.assert_close(torch.stack([v for v, _ in got]).mean(), ref_loss, **F64)


@needs_peer
@pytest.mark.parametrize(
    "sizes,k,setting",
    [
        ([3, 5], 0, "q2d"),
        ([4, 1], 2, "all four joint"),
        ([2, 0, 3], 1, "q2d"),
        ([3, 0, 2], 0, "symmetric"),
    ],
)
def test_uneven_ranks_and_empty_rank_equal_whole_batch(
    sizes: list[int], k: int, setting: str
) -> None:
    check_embeddings("ours", sizes, k, setting)


@needs_peer
@pytest.mark.parametrize("setting", ["q2d", "all four joint"])
def test_equal_rows_equal_peer_with_gather(setting: str) -> None:
    """Where the peer is right (equal rows, gather_across_devices=True): both pass the same check."""
    check_embeddings("peer_gather", [3, 3], 1, setting)
    check_embeddings("ours", [3, 3], 1, setting)


@needs_peer
def test_mutation_peer_default_local_negatives_is_caught() -> None:
    with pytest.raises(AssertionError, match="rank 0"):
        check_embeddings("peer_default", [3, 3], 1, "q2d")


class LinearSentenceModel(nn.Module):
    """A sentence model that embeds 0 rows too: features["input_ids"] (B x D_IN floats) -> B x D."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = _encoder()

    def forward(self, features: dict[str, Tensor]) -> dict[str, Tensor]:
        return {**features, "sentence_embedding": self.lin(features["input_ids"])}


def _linear_ddp_step(kind: str, sizes: list[int], k: int) -> Tensor:
    """One rank: both losses on a DDP-wrapped linear sentence model; its gradient (DDP-averaged)."""
    from torch.nn.parallel import DistributedDataParallel

    model = nn.Sequential(LinearSentenceModel())  # indexable, as a SentenceTransformer
    kw: dict[str, Any] = {"scale": 6.0} | ({"mini_batch_size": 2} if kind == "cached" else {})
    loss_fn = our_loss(kind, model, **kw)
    loss_fn.model = DistributedDataParallel(model)
    x = _rank_inputs(get_rank(), sizes[get_rank()], k)
    loss_fn([{"input_ids": x[:, c]} for c in range(2 + k)], None).backward()
    grad = model[0].lin.weight.grad
    assert grad is not None
    return grad


@needs_peer
@pytest.mark.parametrize("kind", ["mnrl", "cached"])
def test_ddp_empty_rank_with_a_model_that_embeds_zero_rows(kind: str) -> None:
    """W = 3, rows 3, 0, 2: the empty rank's cached loss runs only 0-row forwards (padding)."""
    sizes, k = [3, 0, 2], 1
    got = run_ranks(3, _linear_ddp_step, kind, sizes, k)
    _, ref_grad = _embeddings_reference(sizes, k, "q2d")
    for r, grad in enumerate(got):
        torch.testing.assert_close(grad, ref_grad, **F64, msg=lambda m, r=r: f"rank {r}: {m}")


def _bad_columns_on_rank_0() -> str:
    from torch.nn.parallel import DistributedDataParallel

    model = nn.Sequential(LinearSentenceModel())
    loss_fn = our_loss("cached", model, mini_batch_size=2)
    loss_fn.model = DistributedDataParallel(model)
    x = _rank_inputs(get_rank(), 3, 0)
    cols = [{"input_ids": x[:, 0]}, {"input_ids": x[: 2 if get_rank() == 0 else 3, 1]}]
    try:
        loss_fn(cols, None)
    except WholebatchError as exc:
        return str(exc)
    return "no error"


@needs_peer
def test_bad_input_on_one_rank_is_the_same_error_on_every_rank() -> None:
    texts_ = run_ranks(2, _bad_columns_on_rank_0)
    assert texts_[0] == texts_[1]
    assert "rank 0: the input columns hold different numbers of rows [3, 2]" in texts_[0]


# ---------------------------------------------------------------------------
# Distributed, a real SentenceTransformer under DDP
# ---------------------------------------------------------------------------


def _ddp_step(
    impl: str, kind: str, model_dir: str, sizes: list[int], mbs: int
) -> tuple[Tensor, list[Tensor], Tensor, list[list[str]]]:
    """One rank: DDP-wrapped tiny model, the loss on this rank's rows, one backward."""
    from torch.nn.parallel import DistributedDataParallel

    rank = get_rank()
    model = load_model(model_dir)
    kw: dict[str, Any] = {"scale": 9.0} | ({"mini_batch_size": mbs} if kind == "cached" else {})
    if impl == "ours":
        loss_fn = our_loss(kind, model, **kw)
    else:
        loss_fn = peer_loss(kind, model, gather_across_devices=impl == "peer_gather", **kw)
    loss_fn.model = DistributedDataParallel(model)  # what the Trainer does (override_model_in_loss)
    cols = texts(rank, sizes[rank], 3)
    features = [model.preprocess(c) for c in cols]  # type: ignore[operator]
    torch.manual_seed(11 + rank)
    rng = torch.get_rng_state()
    loss = loss_fn(features, None)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], rng, cols  # type: ignore[union-attr]


def check_ddp(impl: str, kind: str, model_dir: str, sizes: list[int], mbs: int = 2) -> None:
    got = run_ranks(len(sizes), _ddp_step, impl, kind, model_dir, sizes, mbs, timeout=120)
    model = load_model(model_dir)
    per_rank: list[list[Tensor]] = []
    for _, _, rng, cols in got:  # each rank's forwards, replayed with its RNG, with graph
        torch.set_rng_state(rng)
        per_rank.append(embed_like(kind, model, [model.preprocess(c) for c in cols], mbs))  # type: ignore[operator]
    columns = [torch.cat([emb[c] for emb in per_rank]) for c in range(3)]
    ref = peer_loss("mnrl", model, scale=9.0).compute_loss_from_embeddings(columns, None)  # type: ignore[operator]
    ref.backward()
    ref_grads = [p.grad for p in model.parameters()]
    for r, (_, grads, *_) in enumerate(got):
        for i, (g, e) in enumerate(zip(grads, ref_grads, strict=True)):
            torch.testing.assert_close(
                g, e, **F64, msg=lambda m, i=i, r=r: f"rank {r} param {i}: {m}"
            )
    torch.testing.assert_close(torch.stack([v for v, *_ in got]).mean(), ref.detach(), **F64)


@needs_peer
@pytest.mark.parametrize("kind", ["mnrl", "cached"])
def test_ddp_uneven_rows_equal_whole_batch(kind: str, model_dir: str) -> None:
    """5 and 2 rows: the cached loss runs 3 vs 1 mini-batches per column, padded to 9 forwards each."""
    check_ddp("ours", kind, model_dir, [5, 2])


@needs_peer
@pytest.mark.parametrize("kind", ["mnrl", "cached"])
def test_ddp_equal_rows_peer_with_gather_equals_ours(kind: str, model_dir: str) -> None:
    check_ddp("peer_gather", kind, model_dir, [3, 3])
    check_ddp("ours", kind, model_dir, [3, 3])


@needs_peer
@pytest.mark.parametrize("kind", ["mnrl", "cached"])
def test_ddp_mutation_peer_default_is_caught(kind: str, model_dir: str) -> None:
    with pytest.raises(AssertionError, match="rank 0 param"):
        check_ddp("peer_default", kind, model_dir, [3, 3])


# ---------------------------------------------------------------------------
# Arguments, bad input, and the module without the peer
# ---------------------------------------------------------------------------


@needs_peer
def test_arguments_and_errors(model_dir: str) -> None:
    from sentence_transformers import util
    from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss

    from wholebatch.integrations import sentence_transformers as wst

    model = load_model(model_dir)
    loss = wst.CachedMultipleNegativesRankingLoss(
        model, 5.0, util.dot_score, 4, gather_across_devices=True, show_progress_bar=True
    )
    assert loss.get_config_dict()["similarity_fct"] == "dot_score"
    assert loss.get_config_dict()["mini_batch_size"] == 4 and loss.temperature == 0.2
    assert wst.similarity_kind(model.similarity, "op") == "cos"  # type: ignore[attr-defined]
    # hardness_mode with strength 0 has no effect in the peer either: accepted.
    wst.MultipleNegativesRankingLoss(model, hardness_mode="hard_negatives", hardness_strength=0.0)
    bad: list[tuple[Callable[[], object], str]] = [
        (lambda: wst.MultipleNegativesRankingLoss(model, similarity_fct=util.euclidean_sim), "euclidean_sim"),
        (lambda: wst.MultipleNegativesRankingLoss(model, similarity_fct=lambda a, b: a @ b.T), "not supported"),
        (lambda: wst.MultipleNegativesRankingLoss(model, scale=0.0), "scale"),
        (lambda: wst.MultipleNegativesRankingLoss(model, directions=("doc_to_query",)), "query_to_doc"),
        (lambda: wst.MultipleNegativesRankingLoss(model, hardness_mode="all_negatives", hardness_strength=5.0), "hardness"),
        (lambda: wst.CachedMultipleNegativesRankingLoss(model, mini_batch_size=0), "mini_batch_size"),
        (
            lambda: wst.MultipleNegativesRankingLoss(
                model, directions=("query_to_doc", "doc_to_doc"), partition_mode="per_direction"
            ),
            "per_direction",
        ),
    ]  # fmt: skip
    for make, text in bad:
        with pytest.raises(WholebatchError, match=text):
            make()
    cols = [model.preprocess(c) for c in texts(0, 3, 2)]  # type: ignore[operator]
    with pytest.raises(WholebatchError, match="at least 2"):
        loss(cols[:1], None)
    wrapped = MatryoshkaLoss(model, wst.CachedMultipleNegativesRankingLoss(model), [8, 4])
    with pytest.raises(WholebatchError, match="MatryoshkaLoss"):
        wrapped(cols, None)
    with torch.no_grad():  # evaluation: pass 1 and the loss only
        assert torch.isfinite(loss(cols, None))


def test_importable_without_the_peer() -> None:
    """The module and the loss on embeddings work without sentence-transformers; forward names it."""
    code = """
import sys
sys.modules["sentence_transformers"] = None  # as if not installed
import torch
from wholebatch.integrations.sentence_transformers import (
    CachedMultipleNegativesRankingLoss, MultipleNegativesRankingLoss)
loss = MultipleNegativesRankingLoss(torch.nn.Identity())
q, d = torch.randn(4, 3), torch.randn(4, 3)
assert torch.isfinite(loss.compute_loss_from_embeddings([q, d]))
for call in (lambda: loss([{}, {}], None),
             lambda: CachedMultipleNegativesRankingLoss(torch.nn.Identity())):
    try:
        call()
    except ImportError as exc:
        assert "pip install" in str(exc) and "sentence-transformers" in str(exc), exc
    else:
        raise AssertionError("no ImportError")
print("ok")
"""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
