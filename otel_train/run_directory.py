"""The run directory: its default name, creating it, and claiming this rank's files in it."""

from __future__ import annotations

import datetime
import json
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from otel_train.bridges.rundir import RunFiles, write_json
from otel_train.config import Config, ConfigError

_T = TypeVar("_T")


def make_run_dir(config: Config, run_name: str) -> Path | None:
    """`output_dir/run_name`, created and probed for writing; None with run_dir_enabled=False."""
    if not config.run_dir_enabled:
        return None
    path = Path(config.output_dir) / run_name
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise run_dir_config_error(path, exc) from None
    return path


def claim_run_dir(run_dir: Path, rank: int, run_id: str, run_name: str, role: str = "") -> bool:
    """Decide whether this process may write rank `rank`'s files in `run_dir`. Returns True for a
    resume (the same run_id restarted: torchrun elastic restart, SLURM requeue: append), False for
    a fresh start; raises ConfigError when an EARLIER run with another run_id wrote this rank's
    files (appending would interleave two runs). Other ranks of the same job share the directory,
    so only this rank's own files count, never the directory's existence."""
    files = RunFiles(run_dir, rank, role)
    owner, metrics = files.owner, files.metrics
    previous: str | None
    if owner.exists():
        try:
            previous = str(json.loads(owner.read_text(encoding="utf-8")).get("run_id"))
        except (OSError, ValueError, AttributeError):
            previous = None
    elif metrics.exists() and metrics.stat().st_size > 0:
        previous = None  # written by a version without owner files: cannot tell, so not ours
    else:  # nothing of this rank yet: a fresh start
        write_json(owner, {"run_id": run_id, "pid": os.getpid(), "started": time.time()})
        return False
    if previous == run_id:
        return True
    raise ConfigError(
        f"run_name {run_name!r}: {run_dir} already holds {role + ' ' if role else ''}rank {rank}'s files from another run "
        f"(run_id {previous or 'unknown'}; this one is {run_id}); appending would mix the two. Choose "
        "a new name (init(run_name=...) / OTEL_TRAIN_RUN_NAME, or leave it unset for a unique one), "
        "move the old directory away, or set the same run_id (OTEL_TRAIN_RUN_ID) to resume that run."
    )


def run_dir_config_error(path: Path, exc: OSError) -> ConfigError:
    where = exc.filename or path
    return ConfigError(
        f"output_dir: cannot write {str(where)!r} ({exc.strerror or exc}). Free space there or point "
        "OTEL_TRAIN_OUTPUT_DIR / init(output_dir=...) at a writable directory, or set run_dir_enabled=False."
    )


def run_dir_errors_as_config_errors(make: Callable[[], _T]) -> _T:
    """Run-dir files created at init(): a full or read-only disk is a ConfigError naming the file."""
    try:
        return make()
    except OSError as exc:
        raise run_dir_config_error(Path(exc.filename or "?"), exc) from None


def default_run_name() -> str:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{secrets.token_hex(2)}"
