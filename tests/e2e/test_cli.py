"""The `wholebatch` command as a user runs it: usage errors give a message and exit code 2, never a traceback.

Every subprocess here has a hard timeout and runs in its own session, so a
hung run is killed with everything it started (`run_cli`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from wholebatch.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def run_cli(
    *args: str, timeout: float = 120.0, cwd: Path = ROOT, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`python -m wholebatch ARGS` with a hard timeout; on timeout the whole process group is killed."""
    return run_command(
        [sys.executable, "-m", "wholebatch", *args], timeout=timeout, cwd=cwd, env=env
    )


def run_command(
    cmd: list[str], *, timeout: float, cwd: Path = ROOT, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(
            f"{' '.join(cmd)} did not finish in {timeout:.0f} s\n--- stdout\n{out}\n--- stderr\n{err}"
        ) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _assert_usage_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr + result.stdout
    for needle in needles:
        assert needle in result.stderr, result.stderr


# -- end to end (subprocess): a few, each costs a Python + torch start -------------


def test_bad_flag_value_and_missing_target_as_a_user_sees_them() -> None:
    _assert_usage_error(run_cli("demo", "--nproc", "0"), "--nproc", ">= 1", "got 0")
    _assert_usage_error(run_cli("verify", "examples/no_such_file.py:step"), "does not exist")


def test_bench_runs_a_quick_benchmark_and_prints_its_table() -> None:
    result = run_cli("bench", "--only", "lint", timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "== bench_lint --quick" in result.stdout and "files/s" in result.stdout


# -- in process: the remaining argument checks ---------------------------------------


@pytest.mark.parametrize(
    "argv,needles",
    [
        (["demo", "--batch-size", "4"], ["--batch-size", "between", "got 4"]),
        (["demo", "--epochs", "0"], ["--epochs", "got 0"]),
        (["demo", "--lr", "-1"], ["--lr", "positive"]),
        (["verify", "examples/verify_clip.py"], ["module:function"]),
        (["verify", "examples/verify_clip.py:nothing"], ["has no 'nothing'", "correct"]),
        (["verify", "examples/verify_clip.py:correct", "--nproc", "0"], ["--nproc"]),
        (["verify", "examples/verify_clip.py:correct", "--nproc", "20"], ["24 rows", "fewer than"]),
        (["selftest", "--backend", "mpi"], ["--backend", "'mpi'"]),
        (["selftest", "--timeout", "0"], ["--timeout"]),
        (["bench", "--only", "nope"], ["no such benchmark", "bench_comm"]),
        (["frobnicate"], ["invalid choice"]),
        (["verify", "x:y", "--micro-batches", "two"], ["--micro-batches", "'two'"]),
        (["verify", "no_such_module_xyz:step"], ["no module named 'no_such_module_xyz'"]),
        ([], ["COMMAND"]),
    ],
)
def test_usage_errors_exit_2(
    argv: list[str],
    needles: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(ROOT)
    assert main(argv) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("demo", "verify", "selftest", "bench", "lint"):
        assert command in out


def test_verify_json_and_flags_come_from_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--nproc", "--micro-batches", "--timeout", "--json"):
        assert flag in out
    assert "K: micro-batches per rank" in out  # the field's docstring is the help


def test_bench_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--list"]) == 0
    listed = capsys.readouterr().out.split()
    on_disk = sorted(p.stem for p in (ROOT / "benchmarks").glob("bench_*.py"))
    assert sorted(listed) == on_disk  # every benchmark file is reachable from the command
    assert listed[:3] == ["bench_comm", "bench_accumulate", "bench_losses"]


def test_lint_still_dispatches_to_the_linter(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["lint", str(ROOT / "examples" / "verify_tokens.py")])
    assert code in (0, 1)
