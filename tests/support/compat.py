"""`make test-compat`: the demo and the unit and distributed tiers on several torch releases.

    python3 -m tests.support.compat                          # the Makefile's versions
    python3 -m tests.support.compat --torch 2.8.0 --tiers unit demo
    python3 -m tests.support.compat --dir /big/disk/compat   # where the venvs live

For each torch version: a venv under `--dir` (made once; a stamp file records
what was installed), holding that torch from the package index (a CUDA build on
Linux: it runs on the CPU; 5.1-7.4 GB each), the triton it pins, and wholebatch's
runtime, `dev` and `demo` dependencies. The peer libraries (`peers` extra) are
not installed: tests that need them skip, saying so. Where the torch's triton
is older than 3.8, numpy < 2.4 goes beside it: triton <= 3.6's interpreter
cannot run a kernel beside a newer numpy (tests.support.features).

Then, in this checkout (PYTHONPATH=src:., so the tree's code runs, not the copy
installed for its entry points), each tier runs with `-ra` and the
demo with its defaults; a Markdown table comes out on stdout (and in `--out`),
one row per torch, with every distinct skip reason below it. The exit code is
non-zero if any tier failed anywhere.

Legend of the table: passed / failed / skipped as pytest counts them ("errors"
added to failed); the demo's column: its first-step gradient check (the split
step's largest relative error against one process on the whole batch, which
must be float32 round-off) and the held-out top-5 retrieval it trained to.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import tomllib

__all__ = ["Row", "main"]

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TORCH = ("2.8.0", "2.10.0", "2.11.0")
TIERS = ("unit", "distributed", "demo")
# Each tier's wall-clock limit (2 shared cores: the distributed tier is ~10 min idle).
LIMITS_S = {"unit": 1200, "distributed": 3600, "demo": 1200}


@dataclasses.dataclass
class Row:
    """One torch version's results."""

    torch: str
    triton: str = "-"
    numpy: str = "-"
    cells: dict[str, str] = dataclasses.field(default_factory=dict)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    skips: set[str] = dataclasses.field(default_factory=set)
    failed: bool = False


def _run(cmd: list[str], *, env: dict[str, str] | None = None, timeout: float) -> tuple[int, str]:
    """(exit code, stdout + stderr); 124 when it ran past `timeout`."""
    try:
        p = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout if isinstance(e.stdout, str) else (e.stdout or b"").decode()
        return 124, out + f"\n[timed out after {timeout:.0f} s]"
    return p.returncode, p.stdout + p.stderr


def _requirements() -> list[str]:
    """wholebatch's runtime, dev and demo requirements, read from pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    reqs = [r for r in project["dependencies"] if not r.startswith("torch")]
    return reqs + extras["dev"] + extras["demo"]


def _version_of(py: Path, module: str) -> str:
    """`module.__version__` in the venv of `py` ("-" when it does not import)."""
    p = subprocess.run(
        [str(py), "-c", f"import {module}; print({module}.__version__)"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = p.stdout.split()
    return lines[-1] if p.returncode == 0 and lines else "-"


def ensure_venv(base: Path, version: str, python: str) -> Path:
    """The venv for torch `version` under `base`, made and filled if its stamp is not current."""
    venv = base / f"torch-{version}"
    py = venv / "bin" / "python"
    spec = [f"torch=={version}", *_requirements()]
    stamp = venv / ".wholebatch-compat.json"
    if stamp.is_file() and json.loads(stamp.read_text()).get("spec") == spec and py.exists():
        return py
    print(f"==> {venv}: torch {version} from the package index (several GB)", flush=True)
    if not py.exists():
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, *spec], check=True)
    # wholebatch itself, without dependencies: its entry points (the flake8 plugin, the
    # `wholebatch` command); PYTHONPATH makes the checkout's code the one that runs.
    subprocess.run([*pip, "--no-deps", str(ROOT)], check=True)
    triton = _version_of(py, "triton")
    if triton != "-" and tuple(int(x) for x in re.findall(r"\d+", triton)[:2]) < (3, 8):
        subprocess.run([*pip, "numpy<2.4"], check=True)
    stamp.write_text(json.dumps({"spec": spec}))
    return py


def _pytest_cell(out: str) -> tuple[str, bool, set[str]]:
    """('N passed, M failed, K skipped', failed?, skip reasons) from pytest's output."""
    counts = dict.fromkeys(("passed", "failed", "errors", "skipped"), 0)
    tail = [ln for ln in out.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", ln)]
    if tail:
        for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", tail[-1]):
            counts["errors" if word.startswith("error") else word] += int(n)
    skips = {
        re.sub(r"^SKIPPED \[\d+\] [^:]+:\d+: ", "", ln).strip()
        for ln in out.splitlines()
        if ln.startswith("SKIPPED [")
    }
    bad = counts["failed"] + counts["errors"]
    cell = f"{counts['passed']} passed, {bad} failed, {counts['skipped']} skipped"
    return cell, bad > 0 or not tail, skips


# The demo's first-step check: float32 split step vs float64 whole batch, so float32
# round-off (tests/e2e/test_demo.py holds it to the same bound).
DEMO_REL_ERR = 1e-5


def _demo(py: Path, env: dict[str, str], out_dir: Path) -> tuple[str, bool, int, str]:
    """(cell, failed?, exit code, output) of `wholebatch demo` with its defaults.

    Judged on its summary: the gradient check's max relative error and the
    retrieval it reached (a run that exits 0 with a wrong gradient fails here).
    """
    shutil.rmtree(out_dir, ignore_errors=True)
    cmd = [str(py), "-m", "wholebatch", "demo", "--out", str(out_dir)]
    code, out = _run(cmd, env=env, timeout=LIMITS_S["demo"])
    summary = out_dir / "summary.json"
    if code != 0 or not summary.is_file():
        return f"FAIL (exit {code})", True, code, out
    s = json.loads(summary.read_text())
    err, top5 = s["gradient_check"]["max_rel_err"], s["retrieval_after"]["top5"]
    ok = err < DEMO_REL_ERR and top5 > s["retrieval_before"]["top5"]
    verdict = "pass" if ok else "FAIL"
    return f"{verdict}: grad rel. err {err:.1e}, top-5 {top5:.3f}", not ok, code, out


def run_version(base: Path, version: str, python: str, tiers: list[str], log: Path) -> Row:
    """Every tier on torch `version`; each tier's whole output is appended to `log`."""
    row = Row(torch=version)
    try:
        py = ensure_venv(base, version, python)
    except subprocess.CalledProcessError as e:
        row.cells = dict.fromkeys(tiers, f"install failed ({e.returncode})")
        row.failed = True
        return row
    row.torch = _version_of(py, "torch")
    row.triton, row.numpy = _version_of(py, "triton"), _version_of(py, "numpy")
    env = dict(os.environ)
    env.update(
        PYTHONPATH=f"{ROOT / 'src'}:{ROOT}",
        OMP_NUM_THREADS="1",
        TRITON_INTERPRET="1",
        PYTHONDONTWRITEBYTECODE="1",
    )
    for tier in tiers:
        t0 = time.perf_counter()
        if tier == "demo":
            cell, bad, code, out = _demo(py, env, base / f"demo-{version}")
            skips: set[str] = set()
        else:
            cmd = [str(py), "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider", f"tests/{tier}"]
            code, out = _run(cmd, env=env, timeout=LIMITS_S[tier])
            cell, bad, skips = _pytest_cell(out)
            if code == 124:
                cell, bad = f"timed out ({cell})", True
        row.seconds[tier] = time.perf_counter() - t0
        row.cells[tier] = cell
        row.skips |= skips
        row.failed |= bad
        with log.open("a") as f:
            f.write(f"\n\n===== torch {row.torch}: {tier} (exit {code}) =====\n{out}")
        print(f"    torch {row.torch} {tier}: {cell} ({row.seconds[tier]:.0f} s)", flush=True)
    return row


def table(rows: list[Row], tiers: list[str]) -> str:
    """The results as Markdown: one row per torch, then each skip reason once."""
    head = ["torch", "triton", "numpy", *tiers, "minutes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.torch, r.triton, r.numpy, *(r.cells.get(t, "-") for t in tiers)]
        cells.append(f"{sum(r.seconds.values()) / 60:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    for r in rows:
        if r.skips:
            lines.append(f"\nSkipped on torch {r.torch}:")
            lines.extend(f"- {s}" for s in sorted(r.skips))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.support.compat", description=__doc__)
    ap.add_argument("--torch", nargs="+", default=list(DEFAULT_TORCH), help="torch versions")
    ap.add_argument("--tiers", nargs="+", default=list(TIERS), choices=TIERS)
    ap.add_argument("--dir", type=Path, default=ROOT / ".venv-compat", help="where the venvs live")
    ap.add_argument("--python", default="python3.11", help="the interpreter each venv is made from")
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    a = ap.parse_args(argv)
    a.dir.mkdir(parents=True, exist_ok=True)
    log = a.dir / "test-compat.log"
    log.write_text("")
    t0 = time.perf_counter()
    rows = [run_version(a.dir, v, a.python, a.tiers, log) for v in a.torch]
    text = table(rows, a.tiers)
    text += f"\n\n({(time.perf_counter() - t0) / 60:.0f} min; full output in {log})"
    print("\n" + text)
    if a.out is not None:
        a.out.write_text(text + "\n")
    return 1 if any(r.failed for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
