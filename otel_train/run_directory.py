"""The run directory: every file in it is named here (`RunFiles`), with the primitives that write
them whole (`LineFile`, `append_line`, `write_json`, `replace_whole`), its default name, creating
it, and claiming this rank's files in it (`claim_run_dir`, `live_owner`).

The files: docs/design/core.md#run-directory.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from otel_train.config import Config, ConfigError
from otel_train.config import default_run_name as default_run_name  # its default name (assemble)
from otel_train.redaction import plain_value

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
    """May this process write rank `rank`'s files in `run_dir`? True for a resume (the same
    run_id restarted: append), False for a fresh start; ConfigError when an earlier run with another
    run_id wrote them. Only this rank's own files count: other ranks share the directory."""
    files = RunFiles(run_dir, rank, role)
    wrote = files.metrics.exists() and files.metrics.stat().st_size > 0
    if os.path.lexists(files.owner):
        # A damaged owner file (a node died before it reached the disk) is not a verdict: taken over.
        previous = _run_id_in(files.owner) or _set_aside_owner(files, run_id)
        taken_over = previous is None
    else:  # a fresh start, unless a version without owner files wrote here: cannot tell, not ours
        previous, taken_over = None, not wrote
    if taken_over:
        write_json(files.owner, _owner_record(run_id), fsync=True)
        return wrote
    if previous == run_id:
        holder = live_owner(run_dir, rank, role)
        if holder is not None:  # only when rank 0 did not see its own owner alive (see avoid_live_owner)
            log.warning(
                "otel_train: %s: rank %d's files are still held by live process %s on %s; both append.",
                run_dir, rank, holder.get("pid"), holder.get("host"),
            )  # fmt: skip
        write_json(files.owner, _owner_record(run_id), fsync=True)  # this process holds the files now
        return True
    raise ConfigError(
        f"run_name {run_name!r}: {run_dir} already holds {role + ' ' if role else ''}rank {rank}'s files from another run "
        f"(run_id {previous or 'unknown'}; this one is {run_id}); appending would mix the two. Choose "
        "a new name (init(run_name=...) / OTEL_TRAIN_RUN_NAME, or leave it unset for a unique one), "
        "move the old directory away, or set the same run_id (OTEL_TRAIN_RUN_ID) to resume that run."
    )


MAX_OWNER_BYTES = 64 * 1024  # an owner record is ~150 bytes; anything larger is not one


def _read_record(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; empty when it cannot be trusted (empty, cut short, not JSON, not
    an object, not a regular file, too large)."""
    try:
        record = json.loads(read_regular_file(path, MAX_OWNER_BYTES))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _run_id_in(path: Path) -> str | None:
    """The run id recorded in `path` (an owner or goodput file), or None when there is none."""
    run_id = _read_record(path).get("run_id")
    return run_id if isinstance(run_id, str) and run_id else None


def _set_aside_owner(files: RunFiles, run_id: str) -> str | None:
    """A damaged owner file never stops a restart: kept aside as `<name>.corrupt` (warned), None
    returned; unless this rank's goodput file names another run id, which is returned instead."""
    owner = files.owner
    recorded = _run_id_in(files.goodput)
    if recorded is not None and recorded != run_id:
        return recorded
    aside = owner.with_name(owner.name + ".corrupt")
    try:
        owner.replace(aside)
    except OSError:
        aside = owner  # overwritten by this process's record
    log.warning(
        "otel_train: %s is damaged (empty, cut short or not an owner record); kept as %s. Nothing "
        "names another run, so run_id %s takes rank %d's files over and appends to them.",
        owner, aside, run_id, files.rank,
    )  # fmt: skip
    return None


def _owner_record(run_id: str) -> dict[str, object]:
    pid = os.getpid()
    return {
        "run_id": run_id,
        "pid": pid,
        "host": socket.gethostname(),
        "process_start": process_start(pid),
        "started": time.time(),
    }


def process_start(pid: int) -> str | None:
    """When process `pid` started (Linux: ticks since boot, telling a reused pid apart); None where
    unreadable; "" for an exited (zombie) or absent process."""
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
    record = _read_record(RunFiles(run_dir, rank, role).owner)
    try:
        pid = int(record["pid"])
    except (ValueError, KeyError, TypeError):
        return None
    if record.get("host") != socket.gethostname() or pid == os.getpid() or pid <= 0:
        return None
    started = process_start(pid)
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
    """Rank 0, before the run name is agreed: a run name whose files a live process of the SAME run
    id still writes (a requeued job racing its zombie) becomes `<run_name>-<pid>` (warned)."""
    holder = live_owner(output_dir / run_name, 0, role)
    if holder is None or str(holder.get("run_id")) != run_id:
        return run_name  # nobody alive there (resume), or another run (claim_run_dir refuses it)
    diverted = f"{run_name}-{os.getpid()}"
    log.warning(
        "otel_train: %s is still written by live process %s (run_id %s) on this host; this process "
        "writes to %s instead. Stop the old process first to resume the run in place. A second "
        "process of its own (an evaluation or a tool started by the job, which inherits its run id "
        "from SLURM_JOB_ID / TORCHELASTIC_RUN_ID) also shares that process's OTLP and Prometheus "
        "series: give it init(role=...) or its own OTEL_TRAIN_RUN_ID.",
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


# --- the layout and the whole-line writers ---------------------------------------------------------
class _RunFile:
    """A `RunFiles` path: `<stem>.<role>.rank<k><suffix>` for a file per rank, or
    `<stem>[.<role>]<suffix>` for one per run (whichever rank writes it) or per role."""

    def __init__(self, stem: str, suffix: str, per_rank: bool = True) -> None:
        self.stem, self.suffix, self.per_rank = stem, suffix, per_rank

    def __get__(self, files: RunFiles, owner: object = None) -> Path:
        if self.per_rank:
            return files.run_dir / f"{self.stem}.{files._who}{self.suffix}"
        role = f".{files.role}" if files.role else ""
        return files.run_dir / f"{self.stem}{role}{self.suffix}"


@dataclass(frozen=True)
class RunFiles:
    """Where each file goes in `run_dir`, as rank `rank` of role `role` sees it
    (docs/design/core.md#run-directory). With a role every name carries it, so two roles of one run
    (each with its own rank 0) never share a file."""

    run_dir: Path
    rank: int = 0
    role: str = ""

    metrics = _RunFile("metrics", ".jsonl")
    owner = _RunFile(".owner", ".json")
    events = _RunFile("events", ".jsonl")
    goodput = _RunFile("goodput", ".json")
    raw_stacks = _RunFile("faulthandler", ".txt")
    # Where this rank's collectives stood at its last stall (hang attribution reads them all).
    collectives = _RunFile("collectives", ".json")
    # A stalled rank's question to the ranks that left no summary: are you alive? (hang attribution)
    hang_request = _RunFile("hang_request", ".json", per_rank=False)
    progress = _RunFile("progress", ".txt", per_rank=False)
    text = _RunFile("text", ".jsonl", per_rank=False)
    samples = _RunFile("samples", ".jsonl", per_rank=False)
    histograms = _RunFile("histograms", ".jsonl", per_rank=False)
    hparams = _RunFile("hparams", ".json", per_rank=False)
    config = _RunFile("config", ".json", per_rank=False)
    env = _RunFile("env", ".json", per_rank=False)
    control = _RunFile("control", ".json", per_rank=False)
    wandb_run_info = _RunFile("wandb_run", ".json", per_rank=False)

    @property
    def _who(self) -> str:
        return f"{self.role}.rank{self.rank}" if self.role else f"rank{self.rank}"

    def stacks(self, dump: int) -> Path:
        return self.run_dir / f"stacks.{self._who}.{dump}.txt"

    def flight_recorder(self, dump: int) -> Path:
        return self.run_dir / f"flight_recorder.{self._who}.{dump}"

    def memory_summary(self, dump: int) -> Path:
        return self.run_dir / f"memory_summary.{self._who}.{dump}.txt"

    def memory_snapshot(self, dump: int) -> Path:
        """torch.cuda.memory._snapshot(), pickled: open it at https://pytorch.org/memory_viz."""
        return self.run_dir / f"memory_snapshot.{self._who}.{dump}.pickle"

    @property
    def metrics_glob(self) -> str:
        """Every rank's `metrics` file of this role."""
        return f"metrics.{self.role}.rank*.jsonl" if self.role else "metrics.rank*.jsonl"

    @property
    def collectives_glob(self) -> str:
        """Every rank's `collectives` file of this role."""
        return f"collectives.{self.role}.rank*.json" if self.role else "collectives.rank*.json"

    @property
    def profiles(self) -> Path:
        return self.run_dir / "profiles" / self._who

    @property
    def tensorboard(self) -> Path:
        return self.run_dir / "tensorboard" / self.role if self.role else self.run_dir / "tensorboard"

    @property
    def wandb(self) -> Path:
        return self.run_dir / "wandb"

    @property
    def mlflow(self) -> Path:
        return self.run_dir / "mlflow"


def dumps_line(row: Mapping[str, Any]) -> bytes:
    return (json.dumps(row, default=plain_value) + "\n").encode("utf-8")


CLOSE_WAIT_S = 1.0  # how long a close waits for a line in flight on another thread


class LineFile:
    """An append-only file written a whole line at a time (unbuffered, one os.write per line).

    A close waits for a line another thread is writing: closed under it, the descriptor number could
    go to the next file opened, and the line into that file. `single_writer` (a per-rank file): a torn
    last line can only be its previous writer's, and is cut off."""

    def __init__(self, path: Path, single_writer: bool = False) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
        self._size = _cut_torn_tail(self._fd, path) if single_writer else os.fstat(self._fd).st_size
        self._lock = threading.Lock()

    def write_line(self, data: bytes) -> None:
        """Append `data` (one line); on any error the file is cut back to its previous end and an
        OSError naming the file is raised (also after `close`)."""
        with self._lock:
            fd = self._fd
            try:
                if fd < 0:
                    raise OSError(errno.EBADF, "closed")
                view = memoryview(data)
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
            except OSError as exc:
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, self._size)  # no torn last line
                raise OSError(exc.errno, f"{exc.strerror or exc}; line not written", str(self.path)) from None
            self._size += len(data)

    def close(self, fsync: bool = True) -> None:
        if not self._lock.acquire(timeout=CLOSE_WAIT_S):
            # A write is stuck (a hung file system): its descriptor stays open, so no other file
            # can take its number, and no later line is written.
            self._fd = -1
            return
        try:
            if self._fd < 0:
                return
            if fsync:
                with contextlib.suppress(OSError):
                    os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
        finally:
            self._lock.release()


TAIL_CHUNK_BYTES = 64 * 1024


def _cut_torn_tail(fd: int, path: Path) -> int:
    """The size of the file open as `fd` once a torn last line (writer killed mid-write, disk full)
    is cut off, back to its last newline; warned once."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size == 0:
        return info.st_size
    size = end = info.st_size
    try:
        with open(path, "rb") as reader:  # `fd` is write-only
            if os.pread(reader.fileno(), 1, size - 1) == b"\n":
                return size
            while end > 0:  # back to the last newline, a chunk at a time
                start = max(0, end - TAIL_CHUNK_BYTES)
                newline = os.pread(reader.fileno(), end - start, start).rfind(b"\n")
                if newline >= 0:
                    end = start + newline + 1
                    break
                end = start
        os.ftruncate(fd, end)
    except OSError as exc:  # a write-only file: appended to as it is
        log.debug("otel_train: cannot check %s for a torn last line: %s", path, exc)
        return size
    log.warning(
        "otel_train: %s ended in a torn line (%d bytes without a newline, left by a process that "
        "stopped mid-write); cut off before appending.",
        path, size - end,
    )  # fmt: skip
    return end


def append_line(path: Path, row: Mapping[str, Any], single_writer: bool = False) -> None:
    """Open, append one whole JSON line, close (for the rarely written files; `LineFile`)."""
    line = LineFile(path, single_writer)
    try:
        line.write_line(dumps_line(row))
    finally:
        line.close(fsync=False)


def _finite(data: Any) -> Any:
    """`data` with NaN/Inf floats as null: json.dumps writes them as `NaN`, which is not JSON."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {key: _finite(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite(value) for value in data]
    return data


def read_regular_file(path: Path, max_bytes: int, tail: bool = False) -> bytes:
    """The bytes of `path` if it is a regular file of at most `max_bytes`, else OSError naming it;
    `tail`: its last `max_bytes` whatever its size. For files anyone who can write the run dir may
    plant: FIFOs (opened O_NONBLOCK), devices and directories are refused, and a file too large
    before it is read."""
    with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY), "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        if tail:
            return os.pread(f.fileno(), max_bytes, max(0, info.st_size - max_bytes))
        if info.st_size > max_bytes:
            raise OSError(errno.EFBIG, f"{info.st_size} bytes, more than the {max_bytes} read", str(path))
        data = f.read(max_bytes + 1)  # one byte more tells a file that grew past the limit while read
    if len(data) > max_bytes:
        raise OSError(errno.EFBIG, f"more than the {max_bytes} bytes read", str(path))
    return data


def write_json(path: Path, data: Any, fsync: bool = False) -> None:
    """`data` as indented JSON at `path`, whole (`replace_whole`)."""
    replace_whole(
        path, json.dumps(_finite(data), indent=2, sort_keys=True, default=plain_value) + "\n", fsync
    )


def replace_whole(path: Path, text: str, fsync: bool = False) -> None:
    """Write `text` to a writer-own temporary file and rename it to `path`: readers see the old file
    or the new one whole, the old one stays whole on a full disk, and concurrent writers' last
    rename wins whole. The temporary file is made new (O_EXCL | O_NOFOLLOW), so a link planted under
    its name in the run dir is never written through. `fsync`: data and rename on disk first."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        tmp.unlink(missing_ok=True)  # a crashed writer's with this pid, or a planted link (not followed)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)  # the umask decides
        with open(fd, "w", encoding="utf-8") as f:
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        tmp.replace(path)
        if fsync:
            _fsync_dir(path.parent)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from None


def _fsync_dir(directory: Path) -> None:
    """The directory entry of a rename on disk (best effort: not every file system allows it)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
