"""The bridge table (`otel_train/bridges/table.py`): every reader of it agrees with it, and a bridge
added as one row (its sink living in tests/ only) runs end to end: built in the bridge process, fed
at each flush, closed with the final scalars, checked by `otel-train doctor`, recorded in env.json."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import tomllib

import otel_train as ot
from otel_train import config as config_module
from otel_train.bridges import table
from otel_train.cli import main as cli_main
from otel_train.config_loading import load_config
from otel_train.testing import current_session

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent


def test_every_row_matches_a_setting_an_extra_and_a_sink_class() -> None:
    fields = {f.name for f in config_module.Config.__dataclass_fields__.values()}
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for bridge in table.BRIDGES:
        switch = bridge.module.rsplit(".", 1)[1]
        assert switch in fields, f"{bridge.name}: no Config.{switch} to switch it on"
        assert bridge.enabled(load_config({switch: True}))
        assert not bridge.enabled(load_config({switch: False}))
        assert any(bridge.distribution in req for req in extras[bridge.extra]), bridge
        text = (REPO / (bridge.module.replace(".", "/") + ".py")).read_text()
        assert f"class {bridge.sink_class}(" in text, bridge


@pytest.fixture
def recording_bridge(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """One more row, its sink in tests/helpers/bridge_fixtures.py; the bridge process imports it
    (tests/ on its PYTHONPATH)."""
    path = tmp_path / "recorded.jsonl"
    row = table.Bridge(
        name="Recording",
        module="helpers.bridge_fixtures",
        sink_class="Recording",
        enabled=lambda config: True,
        settings=lambda config, place: {"path": str(path)},
        extra="recording",
        distribution="pytest",
        import_names=("helpers.bridge_fixtures",),
    )
    monkeypatch.setattr(table, "BRIDGES", (*table.BRIDGES, row))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    )
    return path


def test_a_bridge_added_as_one_row_runs_end_to_end(recording_bridge: Path, tmp_path: Path) -> None:
    ot.init(output_dir=str(tmp_path), run_name="row", prometheus_port=0, verbosity=0, hardware=False,
                      log_interval=2)  # fmt: skip
    session = current_session()
    assert session.bridges is not None, "the row did not start the bridge process"
    for step in range(4):
        with ot.step(step):
            ot.record("loss", 1.0 / (step + 1))
    ot.shutdown()
    calls = [json.loads(line) for line in recording_bridge.read_text().splitlines()]
    steps = [call[1] for call in calls if call[0] == "scalars" and "train/loss" in call[2]]
    assert steps[:2] == [1, 3], calls
    assert calls[-1][0] == "close" and calls[-1][1], "closed without the final scalars"
    env = json.loads((tmp_path / "row" / "env.json").read_text())
    assert "pytest" in env["packages"], "env.json does not record the row's distribution"


def test_doctor_checks_every_rows_package(recording_bridge: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sys.path.insert(0, str(TESTS))  # doctor runs in this process: find helpers.bridge_fixtures
    try:
        cli_main(["doctor"])
    finally:
        sys.path.remove(str(TESTS))
    out = capsys.readouterr().out
    for bridge in table.BRIDGES:
        assert f"extra [{bridge.extra}]: " in out, out
    assert "extra [recording]: installed" in out
