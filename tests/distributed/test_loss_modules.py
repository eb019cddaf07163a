"""The `nn.Module` forms against the function forms, and against the peers' own loss modules.

A module must compute exactly its function (normalising first only when the
constructor says so), own its learnable scalars with the whole-batch gradient,
and refuse ambiguity (a scalar both owned and passed) with a clear error.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.support.features import requires_peer
from tests.support.harness import run_ranks
from wholebatch import ClipLoss, InfoNCELoss, NTXentLoss, SigLipLoss, WholebatchError
from wholebatch.comm.groups import get_rank
from wholebatch.losses import clip_loss, info_nce_loss, nt_xent_loss, siglip_loss

F64: dict[str, float] = dict(rtol=1e-12, atol=1e-12)  # the same float64 operations: round-off


def _xy(n: int = 6, d: int = 4, seed: int = 0) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64) * 2
    y = torch.randn(n, d, generator=gen, dtype=torch.float64) * 2
    return x.requires_grad_(), y.requires_grad_()


CASES: dict[str, tuple[Any, Any, dict[str, Any], tuple[float, ...]]] = {
    # name: (module class, function, module kwargs, the scalars the function gets)
    "clip": (ClipLoss, clip_loss, dict(logit_scale=7.0), (7.0,)),
    "siglip": (SigLipLoss, siglip_loss, dict(logit_scale=5.0, logit_bias=-2.0), (5.0, -2.0)),
    "nt_xent": (NTXentLoss, nt_xent_loss, dict(temperature=0.3), (0.3,)),
    "info_nce": (InfoNCELoss, info_nce_loss, dict(logit_scale=20.0), (20.0,)),
}


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("name", list(CASES))
def test_module_equals_function(name: str, normalize: bool) -> None:
    cls, fn, kw, scalars = CASES[name]
    x, y = _xy()
    got = cls(normalize=normalize, tile_size=4, **kw)(x, y)
    xs, ys = (F.normalize(x, dim=1), F.normalize(y, dim=1)) if normalize else (x, y)
    want = fn(xs, ys, *scalars, tile_size=3)
    torch.testing.assert_close(got, want, **F64)
    for a, b in zip(
        torch.autograd.grad(got, [x, y]), torch.autograd.grad(want, [x, y]), strict=True
    ):
        torch.testing.assert_close(a, b, **F64)
    # and normalising matters here, so the two settings are told apart
    other = cls(normalize=not normalize, tile_size=4, **kw)(x, y)
    assert not torch.allclose(other, got)


@pytest.mark.parametrize("name", list(CASES))
def test_learnable_scalars_get_the_function_gradient(name: str) -> None:
    cls, fn, kw, scalars = CASES[name]
    learn = {"nt_xent": dict(learn_temperature=True)}.get(name, dict(learn_scale=True))
    if name == "siglip":
        learn["learn_bias"] = True
    module = cls(normalize=False, **kw, **learn).double()
    x, y = _xy()
    module(x, y).backward()
    params = dict(module.named_parameters())
    log_name = "temperature.param" if name == "nt_xent" else "scale.param"
    # the values the module holds (created in float32, then .double())
    held = [params[log_name].detach().exp()]
    torch.testing.assert_close(
        held[0], torch.tensor(scalars[0], dtype=torch.float64), rtol=1e-6, atol=0
    )
    if name == "siglip":
        held.append(params["bias.param"].detach())
    sc = [v.clone().requires_grad_() for v in held]
    g = torch.autograd.grad(fn(x, y, *sc), sc)
    # stored as a log: d/d(log v) = v · d/dv
    torch.testing.assert_close(params[log_name].grad, g[0] * held[0], **F64)
    if name == "siglip":
        torch.testing.assert_close(params["bias.param"].grad, g[1], **F64)


def test_per_call_scalars_and_ambiguity() -> None:
    x, y = _xy()
    per_call = ClipLoss(normalize=False)
    torch.testing.assert_close(per_call(x, y, 3.0), clip_loss(x, y, 3.0), **F64)
    with pytest.raises(WholebatchError, match="no logit_scale: pass one"):
        per_call(x, y)
    with pytest.raises(
        WholebatchError, match="logit_scale was passed to the call, but the module owns"
    ):
        ClipLoss(normalize=False, logit_scale=2.0)(x, y, 3.0)
    with pytest.raises(WholebatchError, match="normalize=None must be True"):
        ClipLoss(normalize=None, logit_scale=2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ClipLoss(logit_scale=2.0)  # type: ignore[call-arg]  # normalize must be stated
    with pytest.raises(WholebatchError, match="learning temperature needs its initial value"):
        NTXentLoss(normalize=True, learn_temperature=True)


def test_clip_accepts_logit_bias_with_zero_gradient() -> None:
    # open_clip's ClipLoss takes a logit_bias; a shift of every logit changes no softmax.
    x, y = _xy()
    b = torch.tensor(-3.0, dtype=torch.float64, requires_grad=True)
    loss = ClipLoss(normalize=True, logit_scale=4.0)(x, y, logit_bias=b)
    torch.testing.assert_close(
        loss, clip_loss(F.normalize(x, dim=1), F.normalize(y, dim=1), 4.0), **F64
    )
    loss.backward()
    assert b.grad is not None and b.grad.item() == 0.0


@requires_peer("sentence_transformers")
def test_info_nce_module_is_sentence_transformers_mnrl() -> None:
    # InfoNCELoss(normalize=True) on raw embeddings = the peer's MNRL (cos_sim, scale 20),
    # hard negatives given as its columns (a list of B x D tensors).
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    gen = torch.Generator().manual_seed(3)
    q, d, h1, h2 = (torch.randn(7, 5, generator=gen, dtype=torch.float64) for _ in range(4))
    for directions, mode in (
        (("query_to_doc",), "joint"),
        (("query_to_doc", "doc_to_query"), "per_direction"),
        (("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"), "joint"),
    ):
        peer = MultipleNegativesRankingLoss(
            nn.Module(), directions=directions, partition_mode=mode,  # type: ignore[arg-type]
        )  # fmt: skip
        theirs = peer.compute_loss_from_embeddings([q, d, h1, h2], torch.empty(0))
        ours = InfoNCELoss(normalize=True, directions=directions, partition_mode=mode)(  # type: ignore[arg-type]
            q, d, [h1, h2]
        )
        torch.testing.assert_close(ours, theirs, **F64)


def _open_clip_loss_module() -> Any:
    """open_clip 3.3.0's loss module, loaded from its file (the package needs torchvision)."""
    import importlib.util

    spec = importlib.util.find_spec("open_clip")
    assert spec is not None and spec.submodule_search_locations
    path = f"{next(iter(spec.submodule_search_locations))}/loss.py"
    file_spec = importlib.util.spec_from_file_location("_open_clip_loss", path)
    assert file_spec is not None and file_spec.loader is not None
    module = importlib.util.module_from_spec(file_spec)
    file_spec.loader.exec_module(module)
    return module


@requires_peer("open_clip", "open-clip-torch")
def test_modules_match_open_clip() -> None:
    # One process: open_clip's ClipLoss (with a logit_bias) and SigLipLoss on the same features.
    oc = _open_clip_loss_module()
    x, y = _xy(8, 5, seed=4)
    xn, yn = F.normalize(x, dim=1), F.normalize(y, dim=1)
    s, b = torch.tensor(6.0, dtype=torch.float64), torch.tensor(-1.5, dtype=torch.float64)
    theirs = oc.ClipLoss()(xn, yn, s, logit_bias=b)
    torch.testing.assert_close(ClipLoss(normalize=True)(x, y, s, logit_bias=b), theirs, **F64)
    theirs = oc.SigLipLoss()(xn, yn, s, b)
    torch.testing.assert_close(SigLipLoss(normalize=True)(x, y, s, b), theirs, **F64)


def _rank_module(kind: str) -> tuple[Tensor, Tensor]:
    r = get_rank()
    gen = torch.Generator().manual_seed(10 + r)
    x = torch.randn(2 + r, 4, generator=gen, dtype=torch.float64).requires_grad_()
    y = torch.randn(2 + r, 4, generator=gen, dtype=torch.float64).requires_grad_()
    torch.manual_seed(0)
    module = InfoNCELoss(normalize=True, learn_scale=True, tile_size=2).double()
    loss = module(x, y)
    loss.backward()
    return loss.detach(), module.scale.param.grad  # type: ignore[union-attr]


def test_module_learnable_scale_distributed() -> None:
    # Every rank's copy of the learnable scale gets the same, whole-batch gradient.
    got = run_ranks(2, _rank_module, "info_nce")
    xs, ys = [], []
    for r in range(2):
        gen = torch.Generator().manual_seed(10 + r)
        xs.append(torch.randn(2 + r, 4, generator=gen, dtype=torch.float64))
        ys.append(torch.randn(2 + r, 4, generator=gen, dtype=torch.float64))
    module = InfoNCELoss(normalize=True, learn_scale=True).double()
    loss = module(torch.cat(xs), torch.cat(ys))
    loss.backward()
    for value, grad in got:
        torch.testing.assert_close(value, loss.detach(), **F64)
        torch.testing.assert_close(grad, module.scale.param.grad, **F64)  # type: ignore[union-attr]
