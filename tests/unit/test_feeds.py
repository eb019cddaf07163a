"""The replicas' input fingerprint (`wholebatch.train.feeds`), in one process.

The distributed tier checks the refusal itself (tests/distributed/test_mesh_dist.py);
here: which tensors are fingerprinted and under which names, and that the kinds of
difference a misfed replica shows move the fingerprint.
"""

from __future__ import annotations

import dataclasses

import torch

from wholebatch.train import feeds


@dataclasses.dataclass
class _Batch:
    ids: torch.Tensor
    note: str


def _row(inputs: object) -> list[float]:
    leaves = feeds._step_leaves({"micro_batches": inputs})
    return [float(v) for v in feeds._step_stats(list(enumerate(x for _, x in leaves)))]


def test_leaves_are_named_by_their_path_in_a_fixed_order() -> None:
    mbs = [
        {"ids": torch.ones(2, 3, dtype=torch.long), "mask": [torch.zeros(2)]},
        _Batch(torch.ones(1), "x"),
    ]
    got = [(p, tuple(t.shape)) for p, t in feeds._step_leaves({"micro_batches": mbs})]
    assert got == [
        ("micro_batches[0]['ids']", (2, 3)),
        ("micro_batches[0]['mask'][0]", (2,)),
        ("micro_batches[1].ids", (1,)),
    ]
    assert feeds._structure(feeds._step_leaves({"m": [torch.ones(2, dtype=torch.long)]})) == [
        "m[0]|int64|(2,)"
    ]


def test_the_fingerprint_moves_for_every_kind_of_misfeed() -> None:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 50, (3, 8), generator=gen)
    labels = torch.randint(1, 50, (3, 8), generator=gen)
    base = _row([(ids, labels), (ids.flip(1), labels)])
    variants = {
        "shifted ids": [((ids + 1) % 50, labels), (ids.flip(1), labels)],
        "rows reordered": [(ids.flip(0), labels), (ids.flip(1), labels)],
        "tokens shifted in place": [(ids.roll(1, 1), labels), (ids.flip(1), labels)],
        "micro-batches swapped": [(ids.flip(1), labels), (ids, labels)],
    }
    for name, mbs in variants.items():
        assert _row(mbs) != base, name
    assert _row([(ids.clone(), labels.clone()), (ids.flip(1), labels)]) == base


def test_no_check_without_replicas() -> None:
    # One process (torch.distributed not initialised): nothing to compare, nothing added.
    assert feeds.feed_fields(None, {"micro_batches": [torch.ones(2)]}) == {}
    assert not feeds.needs_check(None)
