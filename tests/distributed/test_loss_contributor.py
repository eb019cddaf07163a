"""A contributor's path, measured: a toy loss added as CONTRIBUTING.md says touches two source files.

In a copy of the source tree, a one-directional CLIP ("toy": each image's softmax
over every text of the whole batch) is written as CONTRIBUTING.md shows: its own
module (function, reference formula, row terms on the softmax-rows kernels) and
one `LossSpec` appended to `losses/specs.py`. Then, with that tree on the path:

- the only source files that differ from this tree's are those two;
- `wholebatch.losses.toy_loss` is exported (no export list edited), and the docs'
  table generated from the specs has its row;
- `wholebatch selftest` on 2 gloo processes runs it on every path its spec
  offers (the small path, gather, ring) against its reference formula, and
  passes; a toy with a wrong ring (no positive masked) fails there, so the check
  can fail.
"""

from __future__ import annotations

import filecmp
import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.e2e.test_cli import run_command

ROOT = Path(__file__).resolve().parents[2]

TOY = '''"""A toy loss: one-directional CLIP (image -> text) over the whole batch."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from wholebatch.comm.collectives import all_gather
from wholebatch.conventions import GradReduction
from wholebatch.losses.call import documented, validate
from wholebatch.losses.lse import PositiveLSE
from wholebatch.losses.ring import PositiveRing
from wholebatch.losses.small import evaluate, eye, lse_rows
from wholebatch.losses.specs import SPECS, Strategy
from wholebatch.losses.tiles import softplus

SPEC = SPECS["toy"]


@documented(SPEC)
def toy_loss(
    a_BD: Tensor,
    b_BD: Tensor,
    logit_scale: Tensor | float,
    *,
    group: ProcessGroup | None = None,
    mesh: DeviceMesh | None = None,
    batch_dims: Sequence[str] | None = None,
    grad_reduction: GradReduction = "mean",
    tile_size: int | None = None,
    sizes: Sequence[int] | None = None,
    check: bool | None = None,
    strategy: Strategy = "gather",
) -> Tensor:
    """Each image's cross-entropy over every text of the whole batch; the mean.

    Args:
        a_BD: images. b_BD: their texts. logit_scale: the multiplier.
        {common}
    """
    tensors = {"a_BD": a_BD, "b_BD": b_BD}
    call = validate(
        SPEC, tensors, {"logit_scale": logit_scale}, group=group, mesh=mesh,
        batch_dims=batch_dims, grad_reduction=grad_reduction, tile_size=tile_size,
        sizes=sizes, check=check, strategy=strategy,
    ).choose(key_elements=a_BD.shape[-1])
    if call.path == "small":
        return evaluate(call, tensors, toy_formula)
    s = call.scalars["logit_scale"]
    if call.path == "ring":
        row_B, _ = PositiveRing.apply(
            a_BD, b_BD, s, None, 1, @MASK@, False, call.sizes, call.tile(call.b, max(call.sizes)),
            call.group, None,
        )
    else:
        pos_B = s * (a_BD.to(call.acc) * b_BD.to(call.acc)).sum(1)
        keys = all_gather(b_BD, sizes=list(call.sizes), group=call.group, check=False)
        row_B, _ = PositiveLSE.apply(
            a_BD, keys, s, pos_B, call.offset, (0,), 0, call.sizes, call.tile(call.b, call.n),
            call.group, None,
        )
    return call.whole(softplus(row_B).sum() / call.n)


def toy_formula(rows: dict[str, Tensor], scalars: dict[str, Tensor]) -> Tensor:
    z = scalars["logit_scale"] * (rows["a_BD"] @ rows["b_BD"].T)
    return softplus(lse_rows(z, eye(z.shape[0], z.device)) - z.diagonal()).mean()
'''

SPEC_ENTRY = """    LossSpec(
        name="toy",
        function="toy_loss",
        home="wholebatch.losses.toy",
        formula="toy_formula",
        inputs=("a_BD", "b_BD"),
        summary="a toy: one-directional CLIP",
        kernel="positive",
        keys="texts",
        scalars=("logit_scale",),
        strategies=(GATHER, RING),
        passes=16,
    ),
"""


def _tree(tmp: Path, mask: str) -> Path:
    """A copy of src/ with the toy loss added as CONTRIBUTING.md says (`mask`: its ring's)."""
    src = tmp / "src"
    shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns("__pycache__"))
    (src / "wholebatch" / "losses" / "toy.py").write_text(TOY.replace("@MASK@", mask))
    specs = src / "wholebatch" / "losses" / "specs.py"
    text = specs.read_text()
    end = text.index(")\nSPECS: dict[str, LossSpec]")
    specs.write_text(text[:end] + SPEC_ENTRY + text[end:])
    return src


def _changed(src: Path) -> list[str]:
    """Source files of `src` that differ from this tree's (or are new)."""
    out = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src)
        mine = ROOT / "src" / rel
        if not mine.exists() or not filecmp.cmp(path, mine, shallow=False):
            out.append(str(rel))
    return out


def _selftest(src: Path) -> dict[str, dict[str, object]]:
    env = {"PYTHONPATH": f"{src}:{ROOT}"}
    done = run_command(
        [sys.executable, "-m", "wholebatch", "selftest", "--nproc", "2", "--json"],
        timeout=240, env=env,
    )  # fmt: skip
    checks = json.loads(done.stdout)["checks"]
    return {c["check"]: c for c in checks if c["check"].startswith("toy_loss")}


def test_a_toy_loss_takes_two_source_files_and_is_checked_everywhere(tmp_path: Path) -> None:
    src = _tree(tmp_path, "(0,)")
    assert _changed(src) == ["wholebatch/losses/specs.py", "wholebatch/losses/toy.py"]
    probe = (
        "import wholebatch.losses as L; from wholebatch.losses.specs import docs_table;"
        "assert L.toy_loss.__module__ == 'wholebatch.losses.toy' and 'toy_loss' in L.__all__;"
        "assert '| toy | `toy_loss` |' in docs_table(); print('ok')"
    )
    done = run_command([sys.executable, "-c", probe], timeout=120, env={"PYTHONPATH": str(src)})
    assert done.stdout.strip() == "ok", done.stdout + done.stderr
    toy = _selftest(src)
    assert set(toy) == {"toy_loss (small path)", "toy_loss (gather)", "toy_loss (ring)"}, toy
    assert all(c["passed"] for c in toy.values()), toy


@pytest.mark.parametrize("mask", ["()"])
def test_mutation_a_toy_whose_ring_keeps_its_positive_fails_the_selftest(
    tmp_path: Path, mask: str
) -> None:
    toy = _selftest(_tree(tmp_path, mask))
    assert toy["toy_loss (small path)"]["passed"] and toy["toy_loss (gather)"]["passed"]
    assert not toy["toy_loss (ring)"]["passed"], toy
