"""The demo's refusals of bad flags, as `make demo` runs it (`python -m examples.demo`): exit 2,
one line naming the flag, no traceback, no run directory left behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from examples.demo.train import main

ROOT = Path(__file__).resolve().parents[2]
PROG = "python -m examples.demo"
TINY = ["--steps", "1", "--layers", "1", "--d-model", "16", "--heads", "2", "--context", "8",
        "--batch-size", "2", "--quiet", "--prometheus-port", "0"]  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--heads", "3"], "--d-model 16 must be a multiple of --heads 3"),
        (["--lr", "-1"], "--lr must be > 0"),
        (["--max-chars", "0"], "--max-chars must be >= 1 (0, no cap, only with --data)"),
        (["--trace-every", "0"], "--trace-every must be >= 1"),
        (["--data", "no-such-file"], "--data no-such-file: no such file"),
    ],
)
def test_the_demo_refuses_bad_flags_in_one_line_before_making_a_run_directory(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*TINY, "--output-dir", str(tmp_path / "runs"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{PROG}: error: {message}") and "Traceback" not in err, err
    assert f"({PROG} --help lists the flags)" in err, err
    assert not (tmp_path / "runs").exists()


def test_the_demo_names_a_short_corpus_and_a_refused_setting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    short = tmp_path / "short.txt"
    short.write_text("def f(): pass\n")
    assert main([*TINY, "--output-dir", str(tmp_path / "runs"), "--data", str(short)]) == 2
    err = capsys.readouterr().err
    assert "characters of text leave" in err and "smaller --context" in err, err
    assert not (tmp_path / "runs").exists()
    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x * 2\n" * 40)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert main([*TINY, "--output-dir", str(blocker / "runs"), "--data", str(text)]) == 2
    err = capsys.readouterr().err
    assert f"{PROG}: error: output_dir" in err and "--output-dir set otel_train's" in err, err
    assert main([*TINY, "--output-dir", str(tmp_path / "runs"), "--data", str(text),
                 "--run-name", "fixed", "--no-wandb", "--no-mlflow", "--no-tensorboard"]) == 0  # fmt: skip
    assert (tmp_path / "runs" / "fixed").is_dir()
    assert main([*TINY, "--output-dir", str(tmp_path / "runs"), "--data", str(text),
                 "--run-name", "fixed", "--no-wandb", "--no-mlflow", "--no-tensorboard"]) == 2  # fmt: skip
    assert "--run-name and --output-dir" in capsys.readouterr().err


def test_make_demos_command_runs_the_demo_from_the_repository_root(tmp_path: Path) -> None:
    """`make demo` runs `python -m examples.demo $(ARGS)` in the repository root: the module runs
    there and passes the flags through (a bad one is refused under the demo's own name)."""
    proc = subprocess.run(
        [sys.executable, "-m", "examples.demo", *TINY, "--output-dir", str(tmp_path / "runs"), "--lr", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"{PROG}: error: --lr must be > 0") and "Traceback" not in proc.stderr
    usage = subprocess.run(
        [sys.executable, "-m", "examples.demo", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert usage.returncode == 0 and usage.stdout.startswith(f"usage: {PROG}"), usage.stderr
    assert "--uninstrumented" in usage.stdout
