"""The settings table: a `Config` field declared once with `setting(...)` is checked by `validate`,
read from `OTEL_TRAIN_<FIELD>` (and its standard variables), changed (or refused) by the control
file within its declared range, and listed on the docs' configuration page."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from otel_train import config
from otel_train.config import Config, ConfigError, setting
from otel_train.config_loading import load_config
from otel_train.control import ControlFile, changed_config

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Extended(Config):
    """Config with two settings more, each declared in this one place."""

    warmup_steps: int = setting(10, ge=0, le=1000, runtime=True, doc="steps before the first flush")
    site_label: str = setting("lab", pattern=r"[a-z]+", env=("SITE_LABEL",), doc="where the job runs")


class _Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def emit(
        self, event: str, message: str, attributes: Mapping[str, Any] | None = None, severity: str = "WARNING"
    ) -> None:
        self.seen.append((event, message))


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("otel_train_docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_validation_refuses_a_value_outside_the_declared_range() -> None:
    assert load_config({"warmup_steps": 1000}, environ={}, config_cls=Extended).warmup_steps == 1000
    with pytest.raises(ConfigError) as info:
        load_config({"warmup_steps": 1001}, environ={}, config_cls=Extended)
    message = str(info.value)
    for fragment in ("warmup_steps", "1001", "an integer in [0, 1000]", "OTEL_TRAIN_WARMUP_STEPS"):
        assert fragment in message, message
    with pytest.raises(ConfigError, match=r"site_label = 'Lab 1'.*init\(site_label=\.\.\.\)"):
        load_config({"site_label": "Lab 1"}, environ={}, config_cls=Extended)


def test_the_environment_sets_it_by_its_declared_type() -> None:
    loaded = load_config(
        {}, environ={"OTEL_TRAIN_WARMUP_STEPS": " 25 ", "SITE_LABEL": "mars"}, config_cls=Extended
    )
    assert loaded.warmup_steps == 25 and loaded.site_label == "mars"
    with pytest.raises(ConfigError, match=r"warmup_steps = 'many'.*an integer.*from OTEL_TRAIN_WARMUP_STEPS"):
        load_config({}, environ={"OTEL_TRAIN_WARMUP_STEPS": "many"}, config_cls=Extended)
    with pytest.raises(ConfigError, match="unknown setting 'warmup_steps'"):
        load_config({"warmup_steps": 3}, environ={})  # the plain Config does not have it


def test_the_control_file_changes_a_runtime_setting_within_its_range(tmp_path: Path) -> None:
    events = _Events()
    control = ControlFile(tmp_path, rank=0, events=events, config_cls=Extended)
    for step, document in enumerate(({"warmup_steps": 1001}, {"site_label": "moon"}, {"warmup_steps": 40})):
        control.path.write_text(json.dumps(document))
        control.schedule(last_step=100 * step, seconds_per_step=0.01)
    rejected = [message for event, message in events.seen if event == "control_rejected"]
    assert len(rejected) == 2, events.seen
    assert "warmup_steps=1001: use an integer in [0, 1000]" in rejected[0]
    assert "site_label cannot change in a running job" in rejected[1] and "'warmup_steps'" in rejected[1]
    [change] = control.take_due(10**6)
    assert dict(change.settings) == {"warmup_steps": 40}
    assert changed_config(Extended(), change.settings).warmup_steps == 40


def test_a_runtime_change_goes_through_the_same_validation() -> None:
    """A change that skipped the control file's check (a stamped file from another version, a
    caller) is still refused when applied."""
    with pytest.raises(ConfigError, match=r"warmup_steps = -1 is invalid.*from the control file"):
        changed_config(Extended(), {"warmup_steps": -1})
    with pytest.raises(ConfigError, match=r"straggler_threshold = 1\.5"):
        changed_config(Config(), {"straggler_threshold": 1.5})


def test_the_docs_page_lists_it_with_its_rules() -> None:
    table = _hooks().settings_table(config_cls=Extended)
    rows = {line.split(" | ")[0]: line for line in table.splitlines() if line.startswith("| `")}
    warmup = rows["| `warmup_steps`"]
    assert warmup.startswith(
        "| `warmup_steps` | `OTEL_TRAIN_WARMUP_STEPS` | `10` | steps before the first flush"
    )
    assert "Allowed: an integer in [0, 1000]" in warmup and "`control.json` may change it" in warmup
    label = rows["| `site_label`"]
    assert label.startswith(
        "| `site_label` | `OTEL_TRAIN_SITE_LABEL`, `SITE_LABEL` | `'lab'` | where the job runs"
    )
    assert "control.json" not in label


def test_every_declared_range_is_enforced_on_the_real_config() -> None:
    """Each bounded setting of Config: its bound itself is allowed or refused as declared, and a
    value past it is refused naming the setting."""
    checked = 0
    for name, entry in config.declared().items():
        spec = entry.setting
        bounds = ((spec.ge, True, -1), (spec.gt, False, -1), (spec.le, True, 1), (spec.lt, False, 1))
        for bound, inclusive, step in bounds:
            if bound is None:
                continue
            value = entry.type(bound)
            assert (config.problem(name, value) is None) is inclusive, (name, value)
            past = entry.type(bound + step)
            with pytest.raises(ConfigError, match=name):
                load_config({name: past}, environ={})
            checked += 1
    assert checked >= 25


def test_the_control_file_may_change_only_runtime_settings(tmp_path: Path) -> None:
    assert config.runtime_settings() == [
        "timing_log_level",
        "trace_first",
        "trace_every",
        "verbosity",
        "total_steps",
        "straggler_threshold",
    ]
    events = _Events()
    control = ControlFile(tmp_path, rank=0, events=events)
    control.path.write_text(json.dumps({"otlp_endpoint": "http://elsewhere:4318"}))
    control.schedule(last_step=0, seconds_per_step=0.01)
    assert control.take_due(10**6) == []
    assert [event for event, _ in events.seen] == ["control_rejected"]
    assert "otlp_endpoint cannot change in a running job" in events.seen[0][1]
