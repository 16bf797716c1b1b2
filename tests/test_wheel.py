"""The package as users get it: the sdist and wheel built with `python -m build`, the wheel
installed in a fresh virtual environment beside `torch==2.13.0` (and the core dependencies only,
no extras), and the README's quickstart and the CLI run from there, outside the source tree.

Slow by nature (a build in an isolated environment, a venv, torch installed into it): about two
minutes on a 2-core machine. pip resolves torch from the local wheels the machine's pip
configuration points at, and the other dependencies from the package index."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from test_docs import run_quickstart

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"

pytestmark = pytest.mark.timeout(1200)


def _run(args: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{args}\n{result.stdout}\n{result.stderr}"
    return result


def _clean_env(tmp_path: Path) -> dict[str, str]:
    """The environment without the test venv's traces, so nothing from the source tree leaks in."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["OTEL_TRAIN_OUTPUT_DIR"] = str(tmp_path / "runs")
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def test_wheel_installs_in_a_fresh_venv_and_runs_the_quickstart_and_cli(tmp_path) -> None:
    pytest.importorskip("build")
    env = _clean_env(tmp_path)
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)], ROOT, env, 600)
    version = importlib.metadata.version("otel-train")  # this tree's, installed editable
    (wheel,) = dist.glob(f"otel_train-{version}-py3-none-any.whl")
    (sdist,) = dist.glob(f"otel_train-{version}.tar.gz")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert "otel_train/py.typed" in names and "otel_train/__init__.py" in names
    assert not [n for n in names if n.startswith(("tests/", "docs/", "bench/", "examples/"))], (
        "the wheel ships only the package"
    )
    assert not [n for n in names if "demo" in n], "the demo is an example in the checkout, not in the wheel"
    # Apache-2.0 asks that a redistribution carries the license text: both archives hold it
    license_text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read(f"otel_train-{version}.dist-info/licenses/LICENSE").decode() == license_text
        assert "License-File: LICENSE" in archive.read(f"otel_train-{version}.dist-info/METADATA").decode()
    with tarfile.open(sdist) as archive:
        member = archive.extractfile(f"otel_train-{version}/LICENSE")
        assert member is not None and member.read().decode() == license_text

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, env, 120)
    python, bin_dir = str(venv / "bin" / "python"), venv / "bin"
    _run([python, "-m", "pip", "install", "-q", TORCH, str(wheel)], tmp_path, env, 900)

    work = tmp_path / "work"
    work.mkdir()
    where = _run(
        [python, "-c", "import importlib.metadata, otel_train; print(otel_train.__file__); "
         "print(importlib.metadata.version('otel-train'))"],
        work, env, 120,
    ).stdout.split()  # fmt: skip
    assert Path(where[0]).is_relative_to(venv), "otel_train came from the source tree, not the wheel"
    assert where[1] == version
    extras = _run([python, "-m", "pip", "list", "--format=freeze"], work, env, 120).stdout
    assert "tensorboard" not in extras and "wandb" not in extras, "no extra is installed by default"

    run_dir = run_quickstart(python, work, env)
    assert run_dir.is_relative_to(tmp_path / "runs")

    help_text = _run([str(bin_dir / "otel-train"), "--help"], work, env, 120).stdout
    assert "{doctor,diagnose}" in help_text, help_text
    demo = subprocess.run(
        [str(bin_dir / "otel-train"), "demo"], cwd=work, env=env, capture_output=True, text=True, timeout=120
    )
    assert demo.returncode == 2 and "make demo" in demo.stderr and "Traceback" not in demo.stderr, demo.stderr
    doctor_env = {**env, "OTEL_TRAIN_PROMETHEUS_PORT": "0"}
    doctor = _run([str(bin_dir / "otel-train"), "doctor"], work, doctor_env, 120).stdout
    assert "config: ok" in doctor
    # Core only: the doctor says how to add a bridge, and that alone is no failure (exit 0).
    assert 'extra [tensorboard]: missing: pip install "otel-train[tensorboard]"' in doctor


def test_the_package_version_is_spelled_once() -> None:
    """pyproject.toml's version is the one the package reports (the wheel's name and
    `otel_train.__version__`, read by the resource attributes, cannot disagree)."""
    import tomllib

    from otel_train.version import __version__

    with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as file:
        assert tomllib.load(file)["project"]["version"] == __version__
