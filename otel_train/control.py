"""Runtime control: change settings of a running job by writing `<run dir>/control.json`.

    echo '{"timing_log_level": 2, "trace_every": 10}' > runs/<run>/control.json
    echo '{"profile": {"active": 3, "ranks": [0]}}'     > runs/<run>/control.json

Settings: `timing_log_level` (0-2), `verbosity` (0-2), `trace_every` (>= 1), `trace_first` (>= 0),
`straggler_threshold` (0-1) and `profile` (`ot.profile` arguments). The watchdog thread of every
rank polls the file about once a second. Rank 0 decides WHEN: it stamps the file with
`apply_at_step` (a few seconds' worth of steps ahead) and a `version`, and every rank applies the
change on its training thread when that step begins, so all ranks switch at the same step. Ranks
that see a stamp only after its step has passed apply at once and say so. Each accepted change is
one `control` health event; a file that does not parse or names an unknown setting is one
`control_rejected` event naming the problem, and changes nothing. All ranks must share the run
directory (one node, or a shared file system for `output_dir`).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from otel_train.bridges.rundir import RunFiles
from otel_train.config import Config
from otel_train.health import EventChannel

if TYPE_CHECKING:
    from otel_train.profiling import ProfileWindow

log = logging.getLogger("otel_train")

LEAD_TIME_S = 3.0  # how far ahead rank 0 schedules a change: > the other ranks' poll period
_LIMITS: dict[str, tuple[float, float]] = {
    "timing_log_level": (0, 2),
    "verbosity": (0, 2),
    "trace_every": (1, math.inf),
    "trace_first": (0, math.inf),
    "straggler_threshold": (0.0, 1.0),
}
_INTEGERS = {"timing_log_level", "verbosity", "trace_every", "trace_first"}
_PROFILE_KEYS = {"wait", "warmup", "active", "repeat", "skip_first", "ranks"}


@dataclass(frozen=True)
class ControlChange:
    version: int
    apply_at_step: int
    settings: Mapping[str, Any]


def validate(settings: Mapping[str, Any]) -> str | None:
    """None when every setting is known and in range, else what is wrong (for the event)."""
    for key, value in settings.items():
        if key == "profile":
            if not isinstance(value, Mapping) or not set(value) <= _PROFILE_KEYS:
                return f"profile: use an object with keys from {sorted(_PROFILE_KEYS)}"
            continue
        if key not in _LIMITS:
            return f"unknown setting {key!r}: use one of {sorted([*_LIMITS, 'profile'])}"
        low, high = _LIMITS[key]
        number_ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number_ok or not low <= value <= high or (key in _INTEGERS and value != int(value)):
            return f"{key}={value!r}: use a number in [{low}, {high}]" + (
                " (an integer)" * (key in _INTEGERS)
            )
    return None


class ControlFile:
    """Polled by the watchdog thread. `poll` returns a change to schedule, at most once each."""

    def __init__(self, run_dir: Path, rank: int, events: EventChannel, role: str = "") -> None:
        self.path = RunFiles(run_dir, rank, role).control
        self.rank = rank
        self._events = events
        self._seen_mtime: float | None = None
        self._version = 0  # the last version handed out

    def poll(self, last_step: int, seconds_per_step: float | None) -> ControlChange | None:
        try:
            mtime = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.debug("otel_train: cannot stat %s: %s", self.path, exc)
            return None
        if mtime == self._seen_mtime:
            return None
        self._seen_mtime = mtime
        try:
            document = json.loads(self.path.read_text(encoding="utf-8"))
            if not isinstance(document, dict):
                raise ValueError("the file must hold one JSON object")
        except (OSError, ValueError) as exc:
            self._reject(f"does not parse: {exc}")
            return None
        stamped = "apply_at_step" in document and "version" in document
        settings = {k: v for k, v in document.items() if k not in ("apply_at_step", "version")}
        problem = validate(settings)
        if problem is not None:
            self._reject(problem)
            return None
        if not stamped:
            if self.rank != 0:
                return None  # rank 0 stamps it; this rank reads the stamped file at a later poll
            lead_steps = 1 if not seconds_per_step else math.ceil(LEAD_TIME_S / max(seconds_per_step, 1e-6))
            document = {
                **settings,
                "version": self._version + 1,
                "apply_at_step": last_step + 1 + max(1, lead_steps),
            }
            self._write(document)
        version = int(document["version"])
        if version <= self._version:
            return None
        self._version = version
        return ControlChange(version, int(document["apply_at_step"]), settings)

    def announce(self, change: ControlChange) -> None:
        """One `control` health event for a change this rank scheduled."""
        self._events.emit(
            "control",
            f"runtime control v{change.version}: {dict(change.settings)} from step {change.apply_at_step}",
            {"step": change.apply_at_step, "version": change.version},
            severity="INFO",
        )

    def _reject(self, problem: str) -> None:
        self._events.emit("control_rejected", f"{self.path} ignored: {problem}", {"file": str(self.path)})

    def _write(self, document: Mapping[str, Any]) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
        tmp.replace(self.path)
        self._seen_mtime = self.path.stat().st_mtime_ns


def changed_config(config: Config, settings: Mapping[str, Any]) -> Config:
    """`config` with a change's settings (all but `profile`, which starts a window instead)."""
    return replace(config, **{k: settings[k] for k in settings if k != "profile"})


def profile_request(options: Mapping[str, Any]) -> tuple[ProfileWindow, list[int] | None]:
    """A change's `profile` setting as the arguments of `Session.start_profile`."""
    from otel_train.profiling import ProfileWindow

    window = dict(options)
    ranks = window.pop("ranks", None)
    return ProfileWindow(**window), ranks


def warn_if_late(change: ControlChange, index: int) -> None:
    if index > change.apply_at_step:
        log.warning(
            "otel_train: runtime control v%d applied at step %d, after its step %d (this rank "
            "read the control file late)",
            change.version,
            index,
            change.apply_at_step,
        )
