"""Full and read-only disks: never a torn JSONL line, warnings and errors name the file, every
lost write is counted, and init() on an unusable disk is a ConfigError naming the path and setting.

A small tmpfs is mounted when this runs as root; RLIMIT_FSIZE in a subprocess covers the rest."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import otel_train as ot
from otel_train.config import ConfigError
from otel_train.testing import Capture, current_session


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str = "64k", read_only: bool = False) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:  # fmt: skip
        pytest.skip("cannot mount a tmpfs here (not root); the RLIMIT_FSIZE test covers a full disk")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(disk: Path, leave: int) -> None:
    """Fill the filesystem to `leave` free bytes, appending to `filler` (a test that races a
    writer creates it first: creating a file on a disk that is already full fails)."""
    stats = os.statvfs(disk)
    free = stats.f_bavail * stats.f_frsize
    # unbuffered: a write the full disk refuses raises inside the suppress, none is left for close()
    with (disk / "filler").open("ab", buffering=0) as fh, contextlib.suppress(OSError):
        fh.write(b"x" * max(0, free - leave))


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]  # raises on a torn line


def test_disk_full_mid_run(tmp_path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="otel_train")
    with small_tmpfs(tmp_path / "disk") as disk:
        ot.init(output_dir=str(disk), run_name="r", prometheus_port=0, verbosity=0, log_interval=1,
                          hardware=False)  # fmt: skip
        session = current_session()
        capture = Capture()
        session.worker.add_sink(capture)
        _fill(disk, leave=16000)
        for step in range(40):
            with ot.step(step):
                for i in range(30):
                    ot.record(f"value_{i:02d}_with_a_long_name", float(step))
            time.sleep(0.005)
        ot.shutdown()
        metrics = disk / "r" / "metrics.rank0.jsonl"
        rows = _rows(metrics)  # every line whole
        assert 0 < len(rows) < 41
        assert metrics.read_bytes().endswith(b"\n")
        for line in (disk / "r" / "progress.txt").read_text().splitlines(keepends=True):
            assert line.endswith("\n")
    warnings = [r.getMessage() for r in caplog.records]
    assert any(str(metrics) in w and "No space left" in w for w in warnings), warnings
    assert any("sink rundir failed" in w and "time(s)" in w for w in warnings), warnings
    assert sum(v for _, v in capture.series("otel_train/dropped/sink_error")) > 0


def test_full_disk_at_init_is_a_config_error(tmp_path) -> None:
    with small_tmpfs(tmp_path / "disk", size="16k") as disk:
        _fill(disk, leave=0)
        with pytest.raises(ConfigError) as info:
            ot.init(output_dir=str(disk), run_name="r", prometheus_port=0, verbosity=0, hardware=False)
    message = str(info.value)
    assert str(disk / "r") in message and "output_dir" in message and "OTEL_TRAIN_OUTPUT_DIR" in message


def test_read_only_run_dir_at_init_is_a_config_error(tmp_path) -> None:
    with small_tmpfs(tmp_path / "ro", read_only=True) as disk, pytest.raises(ConfigError) as info:
        ot.init(output_dir=str(disk), run_name="r", prometheus_port=0, verbosity=0, hardware=False)
    assert str(disk / "r") in str(info.value) and "output_dir" in str(info.value)


FSIZE_SCRIPT = textwrap.dedent(
    """
    import resource, signal, sys, time
    import otel_train as ot
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))
    ot.init(output_dir=sys.argv[1], run_name="r", prometheus_port=0, verbosity=0, log_interval=1, hardware=False)
    for step in range(60):
        with ot.step(step):
            for i in range(10):
                ot.record(f"value_{i}_with_a_long_name", float(step))
        time.sleep(0.005)  # let the worker write each flush (~900 bytes a row)
    ot.shutdown()
    print("done", flush=True)
    """
)


def test_file_size_limit_mid_run(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-c", FSIZE_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-2000:]
    metrics = tmp_path / "r" / "metrics.rank0.jsonl"
    rows = _rows(metrics)
    assert 0 < len(rows) < 61 and metrics.stat().st_size <= 8192
    assert str(metrics) in proc.stderr and "File too large" in proc.stderr, proc.stderr[-2000:]


TB_TRAINER = textwrap.dedent(
    """
    import select, sys, time
    import otel_train as ot

    ot.init(output_dir=sys.argv[1], run_name="full", tensorboard=True, prometheus_port=0,
            verbosity=0, hardware=False, log_interval=1)
    step = 0
    while not select.select([sys.stdin], [], [], 0)[0]:  # steps until the test writes a line
        with ot.step(step):
            for i in range(3):
                ot.record(f"value_{i}", float(step))
            time.sleep(0.02)
        step += 1
    print("last", step - 1, flush=True)
    ot.shutdown()
    """
)


def _tb_steps(log_dir: Path) -> list[int]:
    from helpers.readback import read_tensorboard

    if not log_dir.is_dir() or not any(log_dir.iterdir()):
        return []
    return sorted({s for s, _ in read_tensorboard(log_dir).scalars.get("train/value_0", [])})


def _until(check: Callable[[], bool], guard_s: float) -> bool:
    """Poll `check`; the guard only ends a wait that would never end (no speed is asserted)."""
    deadline = time.monotonic() + guard_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)
    return True


def test_tensorboard_writes_again_once_a_full_disk_has_room(tmp_path: Path) -> None:
    """A small run directory (32 MiB: the JSONL alone must not fill it while the bridge process
    starts on a busy machine) fills mid-run and gets room again: TensorBoard (in the real bridge
    process) is disabled by the failures, retried with a fresh writer, and has the later steps.
    The filler holds a reserve from the start, so removing it gives room even when the run
    filled the disk on its own first."""
    pytest.importorskip("torch.utils.tensorboard")
    repo = Path(__file__).resolve().parents[2]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH")) if p)
    )
    with small_tmpfs(tmp_path / "disk", size="32m") as disk:
        (disk / "filler").write_bytes(b"x" * (4 << 20))  # the reserve (docstring)
        script = tmp_path / "trainer.py"
        script.write_text(TB_TRAINER)
        trainer = subprocess.Popen(
            [sys.executable, str(script), str(disk)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        errors: list[str] = []
        assert trainer.stderr is not None and trainer.stdin is not None
        reader = threading.Thread(
            target=lambda: errors.extend(iter(trainer.stderr.readline, "")), daemon=True
        )
        reader.start()
        log_dir = disk / "full" / "tensorboard"
        try:
            assert _until(lambda: len(_tb_steps(log_dir)) > 20, 120), errors[-20:]
            _fill(disk, leave=0)
            assert _until(lambda: any("tensorboard bridge failed 5 times" in e for e in errors), 120), [
                e for e in errors if e.startswith("otel_train")
            ]
            before = _tb_steps(log_dir)
            (disk / "filler").unlink()  # room again
            assert _until(lambda: _tb_steps(log_dir)[-1:] > [before[-1] + 50], 120), (
                before[-5:],
                errors[-20:],
            )
            trainer.stdin.write("stop\n")
            trainer.stdin.flush()
            out, _ = trainer.communicate(timeout=120)
        finally:
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait()
        reader.join(10)
        assert trainer.returncode == 0, "".join(errors)[-3000:]
        assert any("the tensorboard bridge works again" in e for e in errors), errors[-20:]
        assert _tb_steps(log_dir)[-1] == int(out.split()[-1])  # to the last step
