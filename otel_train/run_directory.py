"""The run directory: its default name, creating it, and claiming this rank's files in it."""

from __future__ import annotations

import datetime
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from otel_train.bridges.rundir import RunFiles, write_json
from otel_train.config import Config, ConfigError

_T = TypeVar("_T")
log = logging.getLogger("otel_train")


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
        write_json(owner, _owner_record(run_id))
        return False
    if previous == run_id:
        holder = live_owner(run_dir, rank, role)
        if holder is not None:  # only when rank 0 did not see its own owner alive (see avoid_live_owner)
            log.warning(
                "otel_train: %s: rank %d's files are still held by live process %s on %s; both append.",
                run_dir,
                rank,
                holder.get("pid"),
                holder.get("host"),
            )
        write_json(owner, _owner_record(run_id))  # this process holds the files now
        return True
    raise ConfigError(
        f"run_name {run_name!r}: {run_dir} already holds {role + ' ' if role else ''}rank {rank}'s files from another run "
        f"(run_id {previous or 'unknown'}; this one is {run_id}); appending would mix the two. Choose "
        "a new name (init(run_name=...) / OTEL_TRAIN_RUN_NAME, or leave it unset for a unique one), "
        "move the old directory away, or set the same run_id (OTEL_TRAIN_RUN_ID) to resume that run."
    )


def _owner_record(run_id: str) -> dict[str, object]:
    pid = os.getpid()
    return {
        "run_id": run_id,
        "pid": pid,
        "host": socket.gethostname(),
        "process_start": _process_start(pid),
        "started": time.time(),
    }


def _process_start(pid: int) -> str | None:
    """When process `pid` started (Linux: clock ticks since boot, telling a reused pid apart), or
    None where that cannot be read; "" for a process that has exited (a zombie) or does not exist."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return ""
    except (OSError, IndexError):
        return None
    return "" if fields[0] in ("Z", "X") else fields[19]


def live_owner(run_dir: Path, rank: int, role: str = "") -> dict[str, object] | None:
    """The owner record of rank `rank`'s files when another live process on this host holds them
    (same pid and the same process start time). Owners on other hosts cannot be checked: None."""
    try:
        record = json.loads(RunFiles(run_dir, rank, role).owner.read_text(encoding="utf-8"))
        pid = int(record["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if record.get("host") != socket.gethostname() or pid == os.getpid() or pid <= 0:
        return None
    started = _process_start(pid)
    if started is None:  # no /proc: whether the pid exists at all
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return record
    return record if started and started == record.get("process_start") else None


def avoid_live_owner(output_dir: Path, run_name: str, run_id: str, role: str = "") -> str:
    """Rank 0, before the run name is agreed: a run name whose files another live process of the
    SAME run id still writes (a requeued job racing its zombie) becomes `<run_name>-<pid>`, so the
    two never interleave rows in one file. Warns naming the directory and the setting."""
    holder = live_owner(output_dir / run_name, 0, role)
    if holder is None or str(holder.get("run_id")) != run_id:
        return run_name  # nobody alive there (resume), or another run (claim_run_dir refuses it)
    diverted = f"{run_name}-{os.getpid()}"
    log.warning(
        "otel_train: %s is still written by live process %s (run_id %s) on this host; this process "
        "writes to %s instead. Stop the old process first to resume the run in place, or set a "
        "distinct run_name / OTEL_TRAIN_RUN_NAME.",
        output_dir / run_name,
        holder.get("pid"),
        run_id,
        output_dir / diverted,
    )
    return diverted


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
