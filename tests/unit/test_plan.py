"""`wholebatch plan` in one process: the bookkeeping at virtual W, the choices, the CLI, the helper.

The checks against measurement on real ranks are in tests/distributed/test_plan_dist.py.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import wholebatch
from wholebatch.cli.main import main
from wholebatch.comm.sizes import ring_block, ring_sizes, shift_splits
from wholebatch.errors import WholebatchError
from wholebatch.losses.sizing import tile_size_for
from wholebatch.losses.specs import SPECS, exchange_fields
from wholebatch.planner import PlanConfig, plan, split_rows
from wholebatch.planner.measure import measure_model
from wholebatch.planner.traffic import loss_traffic, representative_ranks

BIG = dict(batch=1_048_576 + 12_345, dim=768, world=65_536, act_mib=40.0, params=4.3e8)


def test_plan_is_the_function_and_the_names_are_lazy() -> None:
    assert wholebatch.plan is plan and callable(wholebatch.plan)
    assert wholebatch.PlanConfig is PlanConfig
    assert isinstance(wholebatch.plan(PlanConfig(world=2, batch=64)), wholebatch.Plan)


def test_ring_view_is_the_list() -> None:
    sizes = [3, 0, 7, 1, 5]
    for step in range(7):
        assert list(ring_sizes(sizes, step, lazy=True)) == ring_sizes(sizes, step)
        assert ring_sizes(sizes, step) == [sizes[(q - step) % 5] for q in range(5)]
    assert shift_splits(sizes, 2, 1) == (7, 0)
    assert ring_block(sizes, 0, 1) == 5


@pytest.mark.parametrize("loss", ["clip", "siglip", "nt_xent", "info_nce", "tokens"])
def test_any_w_up_to_65536_is_planned_quickly(loss: str) -> None:
    # A guard against O(W^2) bookkeeping (minutes at this W), not a timing claim:
    # benchmarks/bench_plan.py measures the time (target < 1 s).
    t0 = time.perf_counter()
    p = plan(PlanConfig(loss=loss, **BIG))  # type: ignore[arg-type]
    assert time.perf_counter() - t0 < 10
    assert p.rows_per_rank == (16, 17)
    if loss != "tokens":
        assert p.collectives and p.strategies


def test_walked_bytes_match_closed_forms_at_virtual_65536() -> None:
    """The walk over the library's bookkeeping agrees with the ring algebra, for every counted rank."""
    n, w, d = BIG["batch"], BIG["world"], BIG["dim"]
    sizes = split_rows(int(n), int(w))
    sizes[5], sizes[9] = 0, sizes[9] + sizes[5]  # an empty rank, a large one
    for rank in {*representative_ranks(sizes), 0, 5, 9}:
        b = sizes[rank]
        clip = {c.name: c for c in loss_traffic("clip", sizes, rank, d, 2, 4)}
        gather = clip["all_gather text embeddings"]
        assert (gather.sent, gather.received) == ((w - 1) * b * d * 2, (sum(sizes) - b) * d * 2)
        back = clip["reduce-scatter text embeddings gradient"]
        assert (back.sent, back.received) == ((sum(sizes) - b) * d * 2, (w - 1) * b * d * 2)
        ring = {c.name: c for c in loss_traffic("siglip", sizes, rank, d, 2, 4)}
        fwd = ring["ring_shift text blocks"]
        # W - 1 shifts send every block but that of the next rank; receive all but its own
        assert fwd.sent == (sum(sizes) - sizes[(rank + 1) % w]) * d * 2
        assert fwd.received == (sum(sizes) - b) * d * 2
        assert fwd.calls == w - 1


def test_representative_ranks_bound_every_rank() -> None:
    sizes = [4, 9, 1, 7, 7, 0, 3]
    ranks = representative_ranks(sizes)
    for loss in ("clip", "siglip", "nt_xent"):
        sent = [sum(c.sent for c in loss_traffic(loss, sizes, r, 8, 4, 4)) for r in range(7)]
        assert max(sent[r] for r in ranks) == max(sent), loss
    assert representative_ranks([5] * 9) == [0]


def test_k_is_the_smallest_that_fits_and_the_largest_batch_is_a_limit() -> None:
    c = PlanConfig(loss="clip", batch=262_144, dim=768, world=8, act_mib=60, params=4.3e8)
    p = plan(c)
    assert p.fits and p.micro_batches > 1
    smaller = plan(dataclasses.replace(c, micro_batches=p.micro_batches - 1))
    assert not smaller.fits
    assert p.max_batch is not None and p.max_batch_at_k is not None
    assert plan(dataclasses.replace(c, batch=p.max_batch, micro_batches=0)).fits
    assert not plan(dataclasses.replace(c, batch=int(p.max_batch * 1.01), micro_batches=0)).fits
    assert plan(dataclasses.replace(c, micro_batches=p.micro_batches, batch=p.max_batch_at_k)).fits


def test_tokens_accumulation_has_no_loss_collectives_and_no_batch_limit() -> None:
    p = plan(
        PlanConfig(loss="tokens", batch=4096, world=16, act_mib=200, params=7e9, memory_gib=80)
    )
    assert [c.name for c in p.collectives] == ["DDP gradient all-reduce (ring model)"]
    assert p.max_batch is None and p.memory.loss == 0
    # 7e9 params x 16 bytes do not fit in 80 GB: said plainly, not hidden
    assert not p.fits and "DOES NOT FIT" in p.format()


def test_ring_beats_gather_on_memory_and_loses_on_bytes_for_clip() -> None:
    p = plan(PlanConfig(loss="clip", batch=1_048_576, dim=768, world=64))
    by = {s.name: s for s in p.strategies}
    assert by["gather + tiled"].in_wholebatch and not by["ring + tiled"].in_wholebatch
    assert by["ring + tiled"].loss_memory < by["gather + tiled"].loss_memory
    assert by["ring + tiled"].sent > by["gather + tiled"].sent  # float32 [block | grad] backward
    assert by["naive"].loss_memory > by["local"].loss_memory > by["gather + tiled"].loss_memory


def test_tile_is_the_losses_own_choice_on_an_accelerator() -> None:
    """The recommended tile comes from `tile_size_for` (pure: the planner loads no torch)."""
    for loss, n, cols in (("clip", 1 << 20, 1 << 20), ("info_nce", 4096, 4096 * 4)):
        p = plan(PlanConfig(loss=loss, batch=n, world=8, negatives=3 if loss == "info_nce" else 0))
        assert p.tile == tile_size_for("cuda", n // 8, cols)
    assert plan(PlanConfig(loss="clip", batch=1 << 20, world=8)).tile == 9216
    assert plan(PlanConfig(loss="clip", batch=4096, world=8, tile=512)).tile == 512


def test_gradient_caching_reruns_k_minus_1_forwards_and_keeps_one_graph() -> None:
    """GradCache keeps the last micro-batch's pass-1 graph: K - 1 extra forwards, not K."""
    c = PlanConfig(loss="clip", batch=65536, dim=512, world=8, act_mib=1.0, params=1e8,
                   flops_per_sample=3e12, micro_batches=4)  # fmt: skip
    p, one = plan(c), plan(dataclasses.replace(c, micro_batches=1))
    # forward = 1/3 of forward + backward: 3 of the 4 micro-batches forward again
    assert p.times.model == pytest.approx(one.times.model * (1 + 3 / (3 * 4)))
    # the loss runs with the cached embeddings AND the kept graph's activations
    m = p.memory
    assert m.peak == m.static + m.activations + m.cache + m.loss and m.peak_phase == "loss"


def test_info_nce_hard_negatives_and_directions_cost_bytes_and_memory() -> None:
    base = PlanConfig(loss="info_nce", batch=65536, dim=768, world=16)
    p0, p3 = plan(base), plan(dataclasses.replace(base, negatives=3))
    g0 = next(x for x in p0.collectives if x.name.startswith("all_gather ["))
    g3 = next(x for x in p3.collectives if x.name.startswith("all_gather ["))
    assert g3.sent == 4 * g0.sent
    assert p3.memory.loss > p0.memory.loss + 3 * 65536 * 768 * 2  # at least the gathered negatives
    both = plan(dataclasses.replace(base, directions="query_to_doc,doc_to_query"))
    assert any("column" in x.name for x in both.collectives)
    assert not any("column" in x.name for x in p0.collectives)
    with pytest.raises(WholebatchError, match=r"^negatives="):
        PlanConfig(loss="clip", negatives=2)
    with pytest.raises(WholebatchError, match=r"^directions="):
        PlanConfig(loss="info_nce", directions="doc_to_query")


def test_the_exchange_row_is_fixed_and_known_sizes_skip_it() -> None:
    """The losses' metadata exchange all-gathers 13 float64 per rank (clip: its strategy and
    ids options, its scale and optional bias) at any W and nothing else: O(W) received."""
    assert len(exchange_fields(SPECS["clip"])) == 13
    for w in (8, 4096, 65_536):
        c = PlanConfig(loss="clip", batch=w * 16, world=w)
        row = next(x for x in plan(c).collectives if x.name.startswith("agree shapes"))
        assert row.received == (w - 1) * 13 * 8
    skipped = plan(dataclasses.replace(c, known_sizes=True))
    assert not any(x.name.startswith("agree shapes") for x in skipped.collectives)


def test_one_rank_moves_nothing() -> None:
    p = plan(PlanConfig(loss="siglip", batch=4096, world=1))
    assert p.collectives == () and p.bytes() == (0, 0)


@pytest.mark.parametrize(
    ("field", "value"),
    [("loss", "cosine"), ("dtype", "int8"), ("world", -1), ("world", 70_000), ("batch", 3),
     ("memory_gib", 0), ("reserve_gib", 90.0), ("tile", -1), ("micro_batches", True)],
)  # fmt: skip
def test_bad_config_names_the_field(field: str, value: object) -> None:
    with pytest.raises(WholebatchError, match=f"^{field}="):
        PlanConfig(**{field: value, **({"batch": 8} if field == "world" and value == -1 else {})})  # type: ignore[arg-type]


def test_uneven_sizes_must_add_up() -> None:
    with pytest.raises(WholebatchError, match="sizes must have world=2"):
        plan(PlanConfig(world=2, batch=10), sizes=[3, 3])
    p = plan(PlanConfig(world=2, batch=10), sizes=[10, 0])
    assert p.rows_per_rank == (0, 10)


def test_cli_table_json_and_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--loss", "siglip", "--world", "16", "--batch", "65536"]) == 0
    text = capsys.readouterr().out
    assert "ring_shift text blocks" in text and "assumptions:" in text
    assert main(["plan", "--loss", "clip", "--world", "4", "--batch", "4096", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["bytes_per_rank"]["forward_sent"] == sum(
        c["sent"] for c in doc["collectives"] if c["phase"] == "forward"
    )
    assert doc["config"]["world"] == 4 and doc["micro_batches"] >= 1
    assert main(["plan", "--world", "-3"]) == 2
    assert "--world=-3" in capsys.readouterr().err


def test_cli_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    args = ["plan", "--loss", "clip", "--world", "8", "--batch", "16384", "--plots", str(tmp_path)]
    assert main(args) == 0
    for name in ("vs_world.png", "vs_batch.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_measure_model_counts_saved_activations_per_sample() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    x = torch.randn(8, 32)
    act_mib, params = measure_model(model, lambda m: m(x), rows=8)
    assert params == 32 * 64 + 64 + 64 * 16 + 16
    # saved for backward: x (input of Linear 1), the ReLU output (input of
    # Linear 2 and ReLU's mask): 8 x (32 + 64) float32, per sample 96 x 4 bytes
    assert act_mib * 2**20 == pytest.approx(96 * 4, rel=0.35)
    with pytest.raises(WholebatchError, match="rows=0"):
        measure_model(model, lambda m: m(x), rows=0)


def test_docs_16_bit_gather_formula_is_the_planners() -> None:
    # docs/plan.md's CLIP 16-bit gather row, evaluated at N = 1,048,576 over dp = 32, D = 768
    # (issue 35: the page's 11·G·D + 26·B·D gave 9.65 GiB where the planner printed 8.92:
    # the page was stale; the planner's coefficients are the re-measured ones)
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "plan.md").read_text()
    alpha, beta = map(
        float, re.search(r"16-bit: ([\d.]+)·G·D \+ ([\d.]+)·B·D bytes", page).groups()
    )  # type: ignore[union-attr]
    c = PlanConfig(loss="clip", batch=1_048_576, world=32, dim=768, dtype="bf16")
    p = plan(c)
    n, b, d, t = c.batch, c.batch // 32, c.dim, p.tile
    from_page = alpha * n * d + beta * b * d + 2.5 * t * t * 4 + 4 * n * 4  # + tiles, columns
    assert p.memory.loss == int(from_page)
    assert abs(p.memory.loss / 2**30 - 8.92) < 0.01


def test_a_tokens_plan_speaks_of_items_not_tiles() -> None:
    c = PlanConfig(loss="tokens", batch=4096, mesh="dp=2,tp=2", params=1e9, act_mib=10)
    text = plan(c).format()
    assert "tile" not in text.lower() and "gathers over" not in text, text
    assert "the items are counted over them" in text
    assert "tile " in plan(PlanConfig(loss="clip", batch=4096)).format()  # a loss with tiles


def test_a_pipeline_plan_names_its_bubble() -> None:
    p = plan(PlanConfig(loss="tokens", batch=4096, mesh="dp=2,pp=8", params=1e9, act_mib=10,
                        micro_batches=2))  # fmt: skip
    assert p.bubble == pytest.approx(7 / 9)
    assert "pipeline bubble at pp = 8: (pp - 1) / (K + pp - 1) = 78%" in p.format()
    assert p.to_json()["pipeline_bubble"] == pytest.approx(7 / 9)
    assert plan(PlanConfig(loss="tokens", batch=4096, params=1e9)).bubble is None
