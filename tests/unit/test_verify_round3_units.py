"""verify round 3 (issue 25), one process: the instruments and `diagnose` on synthetic runs.

- autocast is read from its state, where the outputs' dtypes miss it (a reentrant
  checkpoint runs its forward without gradient);
- collectives inside a custom autograd Function are named per Function and phase;
- the dropout tape tells a recomputation that replays its masks from one that does not;
- rows padded to another length are matched by content;
- `diagnose`: every cause per group of parameters, the local-slice GatherLayer, RNG
  redraws before mean-of-means, no round-off above 5%. Each with a mutation that
  the same assertion rejects.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from wholebatch.verify.diagnose import diagnose
from wholebatch.verify.precision import PrecisionMeter
from wholebatch.verify.recording import (
    collectives_in_functions,
    collectives_seen,
    install_tape_dropout,
    is_watched,
    unwatch_collectives,
    watch_collectives,
)
from wholebatch.verify.report import Evidence, Fit, Floor, compare
from wholebatch.verify.rows import RowRecorder

# -- instruments -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_is_seen_where_output_dtypes_miss_it(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    scale = nn.Parameter(torch.ones(6))
    x = torch.randn(5, 6)
    with PrecisionMeter() as meter:
        with torch.autocast("cpu", dtype=dtype):
            out = checkpoint(net, x * scale, use_reentrant=True)
            loss = (out.float() ** 2).mean()
        loss.backward()
    # the outputs say float32 only; the matmuls (recomputed in backward) ran in half precision
    assert dtype in meter.dtypes and "addmm" in meter.ops[dtype]
    assert meter.autocast == {f"cpu:{str(dtype).removeprefix('torch.')}"}
    # MUTATION: the same without autocast records none, and no half precision
    with PrecisionMeter() as plain:
        checkpoint(net, x * scale, use_reentrant=True).sum().backward()
    assert plain.autocast == set() and plain.dtypes == {torch.float32}


class _LocalSlice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        out = [torch.empty_like(x)]
        dist.all_gather(out, x)
        return out[0]

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, g: torch.Tensor) -> torch.Tensor:
        return g


class _Summed(_LocalSlice):
    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        dist.all_reduce(g)
        return g


def test_collectives_inside_autograd_functions_are_named() -> None:
    watch_collectives()
    if not dist.is_initialized():
        with tempfile.NamedTemporaryFile() as f:
            dist.init_process_group("gloo", store=dist.FileStore(f.name, 1), rank=0, world_size=1)
    try:
        collectives_seen(reset=True)
        collectives_in_functions(reset=True)
        x = torch.ones(3, requires_grad=True)
        _LocalSlice.apply(x).sum().backward()
        _Summed.apply(x).sum().backward()
        seen = collectives_in_functions(reset=True)
        assert seen == {
            "_LocalSlice.forward: torch.distributed.all_gather": 1,
            "_Summed.forward: torch.distributed.all_gather": 1,
            "_Summed.backward: torch.distributed.all_reduce": 1,
        }
        assert collectives_seen(reset=True) == {}  # nothing outside a Function
    finally:
        dist.destroy_process_group()
        unwatch_collectives()
    from torch.autograd.function import BackwardCFunction, Function

    assert not is_watched(Function.__dict__["apply"].__func__)
    assert not is_watched(BackwardCFunction.apply)


class _Drop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.tanh(self.lin(x)))


@pytest.mark.parametrize("preserve", [True, False])
def test_the_tape_tells_replayed_from_redrawn_masks(preserve: bool) -> None:
    torch.manual_seed(0)
    model = _Drop()
    tape = install_tape_dropout(model, "record")["drop"]
    for rows in (3, 2):
        x = torch.randn(rows, 4)
        checkpoint(model, x, use_reentrant=False, preserve_rng_state=preserve).sum().backward()
    assert tape.redrawn(5) == (0 if preserve else 2)
    # a second forward of the same rows (open_clip's accum_freq) without restoring the RNG
    torch.manual_seed(1)
    again = _Drop()
    tape = install_tape_dropout(again, "record")["drop"]
    x = torch.randn(3, 4)
    state = torch.get_rng_state()
    with torch.no_grad():
        again(x)
    torch.set_rng_state(state)
    again(x).sum().backward()  # RNG restored: the same mask
    assert tape.redrawn(3) == 0
    again(x).sum().backward()  # not restored: a new one
    assert tape.redrawn(3) == 1


class _Lm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 2)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        idx: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.emb(input_ids)


def test_rows_padded_per_micro_batch_are_matched_by_content() -> None:
    ids = torch.tensor([[5, 6, 7, 0], [3, 0, 0, 0], [5, 6, 0, 0], [3, 4, 0, 0]])
    batch = {"input_ids": ids, "attention_mask": (ids != 0).long()}
    model = _Lm()
    recorder = RowRecorder(model, batch)
    # micro-batches padded to their own longest rows, as a collator does
    model(input_ids=torch.tensor([[3, 4], [3, 0]]), attention_mask=torch.tensor([[1, 1], [1, 0]]))
    model(input_ids=torch.tensor([[5, 6, 7], [5, 6, 0]]))  # no mask: the batch's pad value
    recorder.remove()
    assert recorder.calls == [[3, 1], [0, 2]] and recorder.forwards == 2
    # MUTATION: rows the batch does not hold are not matched, and counted as missed
    recorder = RowRecorder(model, batch)
    model(input_ids=torch.tensor([[1, 2]]))
    recorder.remove()
    assert recorder.calls == [] and recorder.missed == 1
    # an id column names the rows when given
    keyed = {"idx": torch.tensor([10, 11, 12, 13]), **batch}
    recorder = RowRecorder(model, keyed, key="idx")
    model(input_ids=torch.tensor([[3, 4]]), idx=torch.tensor([13]))
    recorder.remove()
    assert recorder.calls == [[3]]


# -- diagnose on synthetic runs -----------------------------------------------------------

REF = {
    "image.weight": torch.tensor([[1.0, -2.0], [0.5, 3.0]], dtype=torch.float64),
    "text.weight": torch.tensor([[0.3, 1.0], [-1.5, 0.25]], dtype=torch.float64),
    "logit_scale": torch.tensor(0.7, dtype=torch.float64),
}


def _report(  # type: ignore[no-untyped-def]
    grads,
    *,
    w: int = 2,
    k: int = 3,
    extra=None,
    collectives=None,
    in_functions=None,
    redrawn=(),
    dropout: bool = False,
    floor: Floor | None = None,
    fit: Fit | None = None,
):
    comps = [
        compare("as given", REF, [grads, grads], rtol=1e-6, step_calls=[1, 1], micro_batches=k,
                dropout=dropout)
    ]  # fmt: skip
    for (name, gw, gk), g in (extra or {}).items():
        comps.append(
            compare(name, REF, [g] * gw, rtol=1e-6, step_calls=[1] * gw, world_size=gw,
                    micro_batches=gk, dropout=name.startswith("re-run") and dropout,
                    equal=name.startswith("equal"))
        )  # fmt: skip
    evidence = Evidence(
        kind="step", step_calls=(1, 1), changed=((), ()),
        collectives=(collectives or {}, collectives or {}), reference_zero=False,
        reference_spread=0.0, in_functions=(in_functions or {}, in_functions or {}),
        redrawn=(tuple(redrawn), tuple(redrawn)),
    )  # fmt: skip
    return diagnose(
        target="t", world_size=w, micro_batches=k, rows=12, wrap="ddp", comparisons=comps,
        evidence=evidence, floor=floor, fit=fit,
    )  # fmt: skip


def _codes(report) -> list[str]:  # type: ignore[no-untyped-def]
    return [d.code for d in report.diagnoses]


def _scaled(towers: float, scale: float) -> dict[str, torch.Tensor]:
    return {n: g * (scale if n == "logit_scale" else towers) for n, g in REF.items()}


GATHER = {"torch.distributed.all_gather": 6}


def test_towers_at_one_over_w_and_logit_scale_at_k_are_one_report() -> None:
    report = _report(_scaled(0.5, 3.0), collectives=GATHER)
    assert _codes(report) == ["replicated-K", "gather-no-grad"]
    by_code = {d.code: d for d in report.diagnoses}
    assert by_code["replicated-K"].params == ("logit_scale",)
    assert by_code["gather-no-grad"].params == ("image.weight", "text.weight")
    text = by_code["gather-no-grad"].message
    assert "exactly 1/W = 1/2" in text and "not a fixed multiple" not in text
    assert "local_loss" not in text  # the step's flags: no local loss here
    # MUTATION: logit_scale right too -> only the gather; towers right -> only replicated-K
    assert _codes(_report(_scaled(0.5, 1.0), collectives=GATHER)) == ["gather-no-grad"]
    assert _codes(_report(_scaled(1.0, 3.0), collectives=GATHER)) == ["replicated-K"]


def test_with_dropout_the_redraw_and_both_groups_are_named() -> None:
    noisy = {n: g * 1.37 + 0.01 for n, g in REF.items()}
    report = _report(
        noisy, dropout=True, redrawn=("visual.2",), collectives=GATHER,
        extra={("dropout off", 2, 3): _scaled(0.5, 3.0)},
    )  # fmt: skip
    assert _codes(report) == ["no-rng-replay", "replicated-K", "gather-no-grad"]
    assert "visual.2" in report.diagnoses[0].message
    assert "still differs" in report.diagnoses[0].message  # dropout off is not exact here


def test_a_local_slice_gather_layer_is_its_own_cause() -> None:
    fns = {"GatherLayer.forward: torch.distributed.all_gather": 2}
    report = _report(_scaled(0.5, 0.5), in_functions=fns)
    assert _codes(report) == ["local-slice-backward"]
    assert "GatherLayer" in report.diagnoses[0].message
    # MUTATION: a GatherLayer whose backward reduces is not blamed (and 1/W stays uncompensated)
    both = fns | {"GatherLayer.backward: torch.distributed.all_reduce": 2}
    assert _codes(_report(_scaled(0.5, 0.5), in_functions=both)) == ["uncompensated-mean"]


def test_a_dropout_only_failure_is_never_a_mean_of_means() -> None:
    wrong = {n: g * 1.1 + 0.01 for n, g in REF.items()}
    exact = {n: g.clone() for n, g in REF.items()}
    only_dropout = _report(
        wrong, dropout=True, redrawn=("mix.2",),
        extra={("dropout off", 2, 3): exact, ("equal items, dropout off", 2, 3): exact},
    )  # fmt: skip
    assert _codes(only_dropout) == ["no-rng-replay"]
    # the fit says "equal weights" (as a recomputed dropout can make it look): still not
    fit = Fit(
        ranks=(0, 0, 0, 1, 1, 1), split=(1 / 6,) * 6, reference=(0.1, 0.2, 0.1, 0.2, 0.2, 0.2),
        split_residual=0.0, reference_residual=0.0, counts={},
    )  # fmt: skip
    no_off = _report(wrong, dropout=True, redrawn=("mix.2",), fit=fit)
    assert _codes(no_off)[0] == "no-rng-replay"
    # MUTATION: ragged normalisation with dropout off too -> both are named
    both = _report(
        wrong, dropout=True, redrawn=("mix.2",),
        extra={("dropout off", 2, 3): wrong, ("equal items, dropout off", 2, 3): exact},
    )  # fmt: skip
    assert _codes(both) == ["no-rng-replay", "mean-of-means"]


def test_round_off_is_never_named_above_five_percent() -> None:
    bf16 = Floor(
        dtypes=("bfloat16", "float32"), unit_roundoff=2**-7, measured=None, rtol=1e-6,
        rtol_from="x",
    )  # fmt: skip
    near = {n: g * (1 + 0.02 * i) for i, (n, g) in enumerate(REF.items())}
    assert _codes(_report(near, floor=bf16)) == ["round-off"]
    far = {n: g * (1 + 0.3 * i) for i, (n, g) in enumerate(REF.items())}
    assert "round-off" not in _codes(_report(far, floor=bf16))  # 100 x eps would be 78%


def test_a_row_key_that_is_not_a_batch_column_is_refused() -> None:
    from wholebatch.verify.spec import TrainerSpec

    batch = {"input_ids": torch.zeros(4, 3, dtype=torch.long), "idx": torch.arange(4)}
    spec = TrainerSpec(
        build_model=_Lm, batch=batch, train=print, reference_loss=print, row_key="idx"
    )  # type: ignore[arg-type]
    assert spec.row_key == "idx"
    with pytest.raises(ValueError, match=r"row_key='id' is not a tensor column.*'idx'"):
        TrainerSpec(build_model=_Lm, batch=batch, train=print, reference_loss=print, row_key="id")  # type: ignore[arg-type]
