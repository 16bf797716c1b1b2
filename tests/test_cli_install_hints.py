"""`otel-train --version`, and the doctor's install hints as a shell can run them (quoted, as the
README quotes them: zsh reads an unquoted `otel-train[wandb]` as a glob and fails)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from otel_train.cli import main
from otel_train.version import __version__

ROOT = Path(__file__).resolve().parents[1]


def test_version_prints_the_version_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        main(["--version"])
    assert raised.value.code == 0
    assert capsys.readouterr().out.strip() == f"otel-train {__version__}"
    proc = subprocess.run([sys.executable, "-m", "otel_train", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == f"otel-train {__version__}", proc.stderr


def test_doctor_quotes_a_missing_extra_as_the_readme_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from otel_train.bridges.table import BRIDGES

    extras = {b.import_names[0] for b in BRIDGES} | {"pynvml"}
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in extras else real(name, *a)
    )
    monkeypatch.setenv("OTEL_TRAIN_OUTPUT_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("OTEL_TRAIN_PROMETHEUS_PORT", "0")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_TRAIN_OTLP_ENDPOINT", raising=False)
    main(["doctor"])
    out = capsys.readouterr().out
    assert 'extra [tensorboard]: missing: pip install "otel-train[tensorboard]"' in out, out
    assert 'pip install "otel-train[tensorboard]"' in (ROOT / "README.md").read_text(encoding="utf-8")


def test_doctor_and_the_bridge_name_pytorch_for_tensorboard_when_only_torch_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The TensorBoard bridge writes with torch.utils.tensorboard: with the extra installed and no
    torch, both said to install the extra, which was installed."""
    from otel_train.bridges.errors import BridgeImportError
    from otel_train.bridges.tensorboard import TensorBoardSink

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a)
    )
    monkeypatch.setenv("OTEL_TRAIN_OUTPUT_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("OTEL_TRAIN_PROMETHEUS_PORT", "0")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_TRAIN_OTLP_ENDPOINT", raising=False)
    main(["doctor"])
    assert "extra [tensorboard]: missing: PyTorch" in capsys.readouterr().out
    with pytest.raises(BridgeImportError, match="needs PyTorch"):
        TensorBoardSink(tmp_path / "tb")
