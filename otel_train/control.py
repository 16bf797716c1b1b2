"""Runtime control: change settings of a running job by writing `<run dir>/control.json`; rank 0
stamps each change with the step to apply it at, so all ranks switch at the same step. Settings,
limits, an example and the design: docs/design/core.md#control.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import math
import os
import stat
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otel_train import config as settings_table
from otel_train.config import Config
from otel_train.health import EventChannel
from otel_train.run_directory import RunFiles, replace_whole

log = logging.getLogger("otel_train")

# How far ahead rank 0 schedules a change: more than two poll periods, because a change overwritten
# right after rank 0 stamped it reaches the other ranks only with rank 0's next stamp (`earlier`).
LEAD_TIME_S = 5.0
POLL_S = 1.0
MAX_FILE_BYTES = 64 * 1024  # a larger control file is refused unread
_HISTORY = 8  # earlier changes rank 0 keeps in the stamped file, for ranks that missed one
_PROFILE_KEYS = {"wait", "warmup", "active", "repeat", "skip_first", "ranks"}
_STAMP_KEYS = ("version", "apply_at_step", "earlier", "by", "digest")


@dataclass(frozen=True)
class ControlChange:
    version: int
    apply_at_step: int
    settings: Mapping[str, Any]


def validate(
    settings: Mapping[str, Any], world_size: int = 1, config_cls: type[Config] = Config
) -> str | None:
    """None when every setting may change at runtime and its value is allowed, else the fix."""
    runtime = settings_table.runtime_settings(config_cls)
    if not settings:
        return f"no setting: use one or more of {sorted([*runtime, 'profile'])}"
    for key, value in settings.items():
        if key == "profile":
            problem = _profile_problem(value, world_size)
        elif key not in runtime:
            known = key in settings_table.declared(config_cls)
            what = f"{key} cannot change in a running job" if known else f"unknown setting {key!r}"
            problem = f"{what}: use one of {sorted([*runtime, 'profile'])}"
        else:
            fix = settings_table.problem(key, value, config_cls)
            problem = f"{key}={value!r}: {fix}" if fix is not None else None
        if problem is not None:
            return problem
    return None


def _profile_problem(value: Any, world_size: int) -> str | None:
    from otel_train.profiling import window_problem

    if not isinstance(value, Mapping) or not set(value) <= _PROFILE_KEYS:
        return f"profile: use an object with keys from {sorted(_PROFILE_KEYS)}"
    ranks = value.get("ranks")
    valid_ranks = (
        isinstance(ranks, list) and ranks and all(r.__class__ is int and 0 <= r < world_size for r in ranks)
    )
    if ranks is not None and not valid_ranks:
        return f"profile ranks={ranks!r}: use a non-empty list of ranks in [0, {world_size - 1}]"
    problem = window_problem({k: v for k, v in value.items() if k != "ranks"})
    return f"profile: {problem}" if problem is not None else None


def read_bounded(path: Path) -> bytes | None:
    """The file's bytes, None when it does not exist; ValueError naming the problem when it is not
    a regular file or is larger than MAX_FILE_BYTES. Never blocks on a FIFO or reads a device."""
    try:
        mode = os.lstat(path).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(_not_regular(mode))
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: it became a symlink since the lstat
        raise ValueError(f"cannot open it ({exc.strerror or exc})") from None
    with os.fdopen(fd, "rb") as fh:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # swapped between lstat and open
            raise ValueError(_not_regular(mode))
        data = fh.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"larger than {MAX_FILE_BYTES} bytes: a control file holds a few settings")
    return data


def _not_regular(mode: int) -> str:
    kinds = {stat.S_ISLNK: "a symlink", stat.S_ISFIFO: "a FIFO", stat.S_ISDIR: "a directory"}
    kind = next((name for test, name in kinds.items() if test(mode)), "a device or socket")
    return f"{kind}, not a regular file: write the JSON into a plain file of that name"


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not standard JSON: use a finite number")


def parse(data: bytes) -> dict[str, Any]:
    """One JSON object (ValueError naming the problem otherwise)."""
    try:
        document = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if not isinstance(document, dict):
        raise ValueError("the file must hold one JSON object")
    return document


def _digest(body: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:32]


def _change(entry: Any, world_size: int, config_cls: type[Config]) -> ControlChange | None:
    """A stamped change ({version, apply_at_step, settings}) if well formed and valid."""
    if not isinstance(entry, Mapping):
        return None
    version, at, settings = entry.get("version"), entry.get("apply_at_step"), entry.get("settings")
    if version.__class__ is not int or at.__class__ is not int or not isinstance(settings, dict):
        return None
    if version < 1 or validate(settings, world_size, config_cls) is not None:
        return None
    return ControlChange(version, at, settings)


def _stamp_body(document: Mapping[str, Any]) -> dict[str, Any] | None:
    """The stamp of a file rank 0 stamped; None without one or when edited since (digest mismatch)."""
    body = {key: document.get(key) for key in ("version", "apply_at_step", "by")}
    body["settings"] = {k: v for k, v in document.items() if k not in _STAMP_KEYS}
    body["earlier"] = document.get("earlier", [])
    if document.get("digest") != _digest(body) or not isinstance(body["earlier"], list):
        return None
    return body


def stamped_changes(
    document: Mapping[str, Any], world_size: int, config_cls: type[Config] = Config
) -> list[ControlChange] | None:
    """The changes of a file rank 0 stamped (earlier ones first), None when it is not one."""
    body = _stamp_body(document)
    if body is None:
        return None
    changes = [_change(entry, world_size, config_cls) for entry in [*body["earlier"], body]]
    return None if None in changes else [change for change in changes if change is not None]


def _lasting_settings(body: Mapping[str, Any]) -> dict[str, Any]:
    """What a stamp's changes leave a run with: each setting's latest value, without `profile`."""
    settings: dict[str, Any] = {}
    for entry in [*body["earlier"], body]:
        if isinstance(entry, Mapping) and isinstance(entry.get("settings"), Mapping):
            settings.update(entry["settings"])
    settings.pop("profile", None)
    return settings


class ControlFile:
    """Read by a thread of its own (`start`); `poll` returns the changes to schedule, each once."""

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        events: EventChannel,
        world_size: int = 1,
        role: str = "",
        config_cls: type[Config] = Config,
    ) -> None:
        self.path = RunFiles(run_dir, rank, role).control
        self._owner = RunFiles(run_dir, 0, role).owner  # names rank 0's process (`_incarnation`)
        self.rank = rank
        self.world_size = world_size
        self.config_cls = config_cls  # whose settings declared `runtime=True` the file may change
        self._events = events
        self._seen: bytes | None = None  # the content last looked at (each content is judged once)
        self._version = 0  # the last version handed out
        self._history: list[ControlChange] = []  # rank 0: the recent stamped changes
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Scheduled changes in version order, for the training thread (`take_due`); the list is
        # replaced, never changed in place, so that thread reads it without the lock.
        self.pending: list[ControlChange] = []
        self._pending_lock = threading.Lock()

    def start(self, on_poll: Callable[[], None]) -> None:
        """Call `on_poll` every POLL_S on a thread of its own until `close`."""
        self._thread = threading.Thread(
            target=self._run, args=(on_poll,), name="otel_train-control", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)  # a read blocked on a dead file system is left behind

    def _run(self, on_poll: Callable[[], None]) -> None:
        while not self._stop.wait(POLL_S):
            try:
                on_poll()
            except Exception as exc:  # a bug here must not end runtime control for the run
                log.warning("otel_train: runtime control poll failed: %r", exc)

    def poll(self, last_step: int, seconds_per_step: float | None) -> list[ControlChange]:
        try:
            data = read_bounded(self.path)
        except ValueError as exc:
            marker = f"<{exc}>".encode()
            if marker != self._seen:
                self._seen = marker
                self._reject(str(exc))
            return []
        if data is None:
            self._seen = None  # written again later with the same content, it is a new change
            return []
        if data == self._seen:
            return []
        self._seen = data
        try:
            document = parse(data)
        except ValueError as exc:
            self._reject(f'does not parse ({exc}): write one JSON object, e.g. {{"log_interval": 50}}')
            return []
        changes = self._changes(document, last_step, seconds_per_step)
        new = [change for change in changes if change.version > self._version]
        if new:
            self._version = new[-1].version
            self._history = [*self._history, *new][-_HISTORY:]
        return new

    def _changes(
        self, document: dict[str, Any], last_step: int, seconds_per_step: float | None
    ) -> list[ControlChange]:
        """The changes a file asks for (only new ones count: see `poll`)."""
        body = _stamp_body(document)
        # No `by` (rank 0 could not read its owner record) or none to compare: this process's stamp.
        if body is not None and body["by"] is not None and self._incarnation() not in (None, body["by"]):
            # Stamped by an earlier rank-0 process of this run (a resume), which applied it: its
            # settings stay the run's, stamped again as a change of this process; its profile
            # window (an action, done then) does not run again.
            lasting = _lasting_settings(body)
            return self._asked(lasting, last_step, seconds_per_step) if lasting else []
        changes = stamped_changes(document, self.world_size, self.config_cls)
        if changes is not None and (self.rank != 0 or changes[-1].version >= self._version):
            return changes
        # Written by a person, edited since rank 0 stamped it, or an older stamp written back (an
        # editor's undo, a saved copy: rank 0 only ever writes newer ones, so a person asked for
        # those settings again).
        settings = {k: v for k, v in document.items() if k not in _STAMP_KEYS}
        return self._asked(settings, last_step, seconds_per_step)

    def _asked(
        self, settings: dict[str, Any], last_step: int, seconds_per_step: float | None
    ) -> list[ControlChange]:
        """Settings asked for anew, validated; rank 0 stamps them as the next change."""
        problem = validate(settings, self.world_size, self.config_cls)
        total = settings.get("total_steps")
        if problem is None and isinstance(total, int) and total <= last_step:
            problem = f"total_steps={total}: the run is at step {last_step} already; plan more steps"
        if problem is not None:
            self._reject(problem)
            return []
        if self.rank != 0:
            return []
        lead_steps = 1 if not seconds_per_step else math.ceil(LEAD_TIME_S / max(seconds_per_step, 1e-6))
        change = ControlChange(self._version + 1, last_step + 1 + max(1, lead_steps), settings)
        return [change] if self._stamp(change) else []

    def _incarnation(self) -> str | None:
        """Which process is rank 0 of this run now: a digest of its owner record, which it writes at
        init before any rank's first poll (None when unreadable: every stamp counts as this one's)."""
        try:
            record = read_bounded(self._owner)
        except ValueError:
            return None
        return hashlib.sha256(record).hexdigest()[:16] if record else None

    def schedule(self, last_step: int, seconds_per_step: float | None) -> None:
        """Control thread: schedule each new change for the training thread, as a `control` event."""
        for change in self.poll(last_step, seconds_per_step):
            with self._pending_lock:
                self.pending = [*self.pending, change]
            self._events.emit(
                "control",
                f"runtime control v{change.version}: {dict(change.settings)} from step {change.apply_at_step}",
                {"step": change.apply_at_step, "version": change.version},
                severity="INFO",
            )

    def take_due(self, index: int) -> list[ControlChange]:
        """Training thread, as step `index` begins: the scheduled changes due by now, in order."""
        with self._pending_lock:
            pending = self.pending
            due = list(itertools.takewhile(lambda change: index >= change.apply_at_step, pending))
            self.pending = pending[len(due) :]
        return due

    def reject_applied(self, change: ControlChange, index: int, problem: str) -> None:
        """A scheduled change that could not be applied at step `index` (training thread)."""
        self._reject(f"v{change.version} at step {index}: {problem}")

    def _reject(self, problem: str) -> None:
        self._events.emit("control_rejected", f"{self.path} ignored: {problem}", {"file": str(self.path)})

    def _stamp(self, change: ControlChange) -> bool:
        """Rank 0: write `change` (and the recent earlier ones) as the stamped file."""
        earlier = [dataclasses.asdict(c) for c in self._history]
        by = self._incarnation()
        while True:
            body = {**dataclasses.asdict(change), "earlier": earlier, "by": by}
            stamp = {k: body[k] for k in ("version", "apply_at_step", "earlier", "by")}
            text = json.dumps({**change.settings, **stamp, "digest": _digest(body)}, indent=1) + "\n"
            if len(text.encode()) <= MAX_FILE_BYTES:
                break
            if not earlier:
                self._reject(f"too large to stamp within {MAX_FILE_BYTES} bytes: write fewer settings")
                return False
            earlier = earlier[1:]  # the oldest first: ranks have had the longest to read it
        try:
            replace_whole(self.path, text)
        except OSError as exc:
            self._reject(f"cannot stamp it ({exc})")
            return False
        self._seen = text.encode()
        return True


def apply_due(session: Any, due: list[ControlChange], index: int) -> None:
    """Apply each change in turn; one that fails is a `control_rejected` event, never an exception
    in the user's step. `session`: a `Session` (not imported: session imports this module)."""
    for change in due:
        try:
            apply_change(session, change, index)
        except Exception as exc:  # torch.profiler (a `profile` change) and the sinks a setting reaches
            session.control.reject_applied(change, index, f"not applied (partly, perhaps): {exc!r}")


def apply_change(session: Any, change: ControlChange, index: int) -> None:
    """Training thread, as step `index` begins: apply one scheduled change to `session`."""
    settings = dict(change.settings)
    session.config = changed_config(session.config, settings)
    session.timing_level = session.config.timer_level
    session.worker.total_steps = session.config.total_steps
    if session.console is not None:
        session.console.verbosity = session.config.verbosity
    session.events.echo = session.config.verbosity > 0  # as init() sets it (assemble._health_events)
    if "straggler_threshold" in settings:
        session.reducer.set_threshold(session.config.straggler_threshold)
    window = dict(settings.get("profile") or {})
    ranks = window.pop("ranks", None)
    here = "profile" in settings and (ranks is None or session.identity.rank in ranks)  # for this rank
    if here and session.profiler is not None:
        session.control.reject_applied(
            change, index, "its profile was not applied: a window is still running; write it again later"
        )
    elif here:
        from otel_train.profiling import ProfileWindow

        session.start_profile(ProfileWindow(**window), ranks)
    if index > change.apply_at_step:
        log.warning(
            "otel_train: runtime control v%d applied at step %d, after its step %d (this rank "
            "read the control file late)",
            change.version, index, change.apply_at_step,
        )  # fmt: skip


def changed_config(config: Config, settings: Mapping[str, Any]) -> Config:
    """`config` with a change's settings but `profile`, checked as `init()` checks them."""
    changes = {k: v for k, v in settings.items() if k != "profile"}
    new = dataclasses.replace(config, **changes)
    settings_table.validate(new, dict.fromkeys(changes, "the control file"))
    return new
