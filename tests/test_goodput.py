"""Goodput: wall time split into productive steps and badput causes, continued across restarts."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers.fake_time import FakeTime
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

import otel_train as ot
from otel_train import adapters
from otel_train.core.buffer import Interval
from otel_train.goodput import CAUSES, GoodputListener, StepClock, span_cause
from otel_train.testing import current_session


def _account(run_dir: Path, rank: int = 0) -> dict[str, float]:
    state = json.loads((run_dir / f"goodput.rank{rank}.json").read_text())
    return {"wall_s": state["wall_s"], "productive_s": state["productive_s"], **state["badput"]}


def _assert_sums_to_wall(account: dict[str, float]) -> None:
    parts = account["productive_s"] + sum(account[c] for c in CAUSES)
    assert abs(parts - account["wall_s"]) <= 0.02 * account["wall_s"], account


def test_span_causes() -> None:
    names = ("eval", "validation", "generate", "checkpoint", "save", "load_checkpoint", "restore", "ema")
    assert [span_cause(n) for n in names] == [
        "eval", "eval", "eval", "checkpoint_save", "checkpoint_save", "checkpoint_restore",
        "checkpoint_restore", "other",
    ]  # fmt: skip


def test_account_of_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ot.init(run_name="gp", stall_timeout_s=0.3, prometheus_port=0, verbosity=0, hardware=False)
    session = current_session()
    clock = FakeTime().install(session, monkeypatch)
    clock.advance(0.2)  # start-up: model loading, say
    for step in range(4):
        with ot.step(step):
            clock.advance(0.05)
    with ot.span("eval"):
        clock.advance(0.2)
    with ot.span("checkpoint"):
        clock.advance(0.1)
    clock.advance(0.6)  # a stall (longer than stall_timeout_s, no span in it)
    with ot.step(4):
        clock.advance(0.05)
        with ot.span("eval"):  # an eval inside a step is eval, not productive time
            clock.advance(0.1)
    with ot.step(5):
        clock.advance(0.05)
    ot.shutdown()
    account = _account(session.run_dir)
    _assert_sums_to_wall(account)
    assert account["startup"] >= 0.2
    assert account["eval"] == pytest.approx(0.3, abs=1e-6)
    assert account["checkpoint_save"] == pytest.approx(0.1, abs=1e-6)
    assert account["stall"] == pytest.approx(
        0.6, abs=1e-6
    )  # the gap (0.9 s) less the eval and checkpoint spans in it
    assert account["restart"] == 0 and account["data"] == 0 and account["wasted_progress"] == 0
    assert account["productive_s"] == pytest.approx(
        0.3, abs=1e-6
    )  # 6 x 50 ms of step work (the nested eval excluded)
    progress = (session.run_dir / "progress.txt").read_text()
    assert "end of process | goodput" in progress and "stall" in progress
    end = [line for line in progress.splitlines() if "end of process" in line][-1]
    assert "stall 0.6s" in end and "restart" not in end and "data" not in end  # causes that took time


def test_a_gap_of_eval_batches_is_eval_time_not_a_stall(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An evaluation between steps that opens no span but whose batches call `adapters.heartbeat()`
    (DeepSpeed's eval forwards, a loop's own evaluation) is eval badput; a gap without a batch that
    follows is still a stall, though the next step's micro-batches call it too."""
    ot.init(run_name="gp-eval-batches", stall_timeout_s=0.3, prometheus_port=0, verbosity=0, hardware=False)
    session = current_session()
    clock = FakeTime().install(session, monkeypatch)
    monkeypatch.setattr(adapters, "perf_counter_ns", lambda: clock.perf_ns)
    with ot.step(0):
        clock.advance(0.05)
    for _ in range(4):  # 0.8 s of eval batches
        clock.advance(0.2)
        adapters.heartbeat()
    for step in (1, 2):  # steps of two micro-batches, each telling the watchdog
        with ot.step(step):
            clock.advance(0.025)
            adapters.heartbeat()
            clock.advance(0.025)
        if step == 1:
            clock.advance(0.5)  # no batch at all: the micro-batches of the step after it are no eval
    ot.shutdown()
    account = _account(session.run_dir)
    _assert_sums_to_wall(account)
    assert account["eval"] == pytest.approx(0.8, abs=1e-6)
    assert account["stall"] == pytest.approx(0.5, abs=1e-6)


_DEMO = [sys.executable, "-m", "examples.demo", "--steps", "12", "--batch-size", "4",
         "--context", "32", "--layers", "1", "--d-model", "32", "--eval-interval", "6",
         "--eval-batches", "2", "--sample-interval", "1000", "--log-interval", "3",
         "--prometheus-port", "0", "--watch-every", "0", "--no-tensorboard", "--no-wandb",
         "--no-mlflow", "--quiet", "--max-chars", "20000"]  # fmt: skip
ROOT = Path(__file__).resolve().parents[1]  # the demo runs from the repository root (examples/)


def _as_if_written_earlier(state_file: Path, seconds: float) -> None:
    """Move the last record in `state_file` `seconds` back on every clock the next process reads
    its restart gap from (the boot clock, `updated`, the file's own time): the scheduler's restart
    gap, without waiting it out."""
    state = json.loads(state_file.read_text())
    state["updated"] -= seconds
    if "boottime" in state:
        state["boottime"] -= seconds
    state_file.write_text(json.dumps(state))
    os.utime(state_file, (state["updated"], state["updated"]))


def test_restart_of_the_same_run_id_continues_the_account(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_TRAIN_RUN_ID="job-7", OTEL_TRAIN_HARDWARE="false")
    args = [*_DEMO, "--run-name", "restarted", "--output-dir", str(tmp_path / "runs")]
    subprocess.run(args, env=env, check=True, timeout=300, cwd=ROOT)
    run_dir = tmp_path / "runs" / "restarted"
    first = _account(run_dir)
    _assert_sums_to_wall(first)
    assert first["eval"] > 0 and first["checkpoint_save"] > 0
    _as_if_written_earlier(run_dir / "goodput.rank0.json", 1.5)  # the scheduler's restart gap
    subprocess.run(args, env=env, check=True, timeout=300, cwd=ROOT)
    second = _account(run_dir)
    _assert_sums_to_wall(second)
    assert second["restart"] >= 1.5  # the gap, plus the second process's time before init
    assert second["wall_s"] > first["wall_s"] + 1.5
    # the demo starts again from step 0: every step of the second process is a re-run
    assert second["wasted_progress"] > 0
    assert second["productive_s"] == pytest.approx(first["productive_s"], abs=1e-6)
    progress = (run_dir / "progress.txt").read_text()
    assert progress.count("end of process | goodput") == 2  # one progress file across the restart


_ONE_PROCESS = """
import sys
import otel_train as ot
ot.init(run_name="restarted", run_id="job-8", output_dir=sys.argv[1], prometheus_port=0, verbosity=0,
        hardware=False, log_interval=2)
for step in range(6):
    with ot.step(step):
        pass
ot.shutdown()
"""


def _busy_loop(seconds: float) -> subprocess.Popen[bytes]:
    code = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass"
    return subprocess.Popen([sys.executable, "-c", code])


def test_restart_gap_and_wall_time_are_exact_under_load(tmp_path: Path) -> None:
    """Two processes on one run id, 2.0 s apart (the first one's last record moved 2.0 s back),
    while busy loops load every core: the restart
    badput is the measured gap (the first process's last record to the second's start) and the
    account's wall time the real elapsed time. A start time off by a fraction of a second (psutil's
    create_time() rests on /proc/stat's whole-second btime) lost part of the gap and counted it
    twice in the wall time."""
    script = tmp_path / "one_process.py"
    script.write_text(_ONE_PROCESS)
    args = [sys.executable, str(script), str(tmp_path / "runs")]
    run_dir = tmp_path / "runs" / "restarted"
    load = [_busy_loop(60) for _ in range(os.cpu_count() or 1)]
    try:
        first_spawn = time.time()
        subprocess.run(args, check=True, timeout=120)
        first_record = json.loads((run_dir / "goodput.rank0.json").read_text())["updated"] - 2.0
        _as_if_written_earlier(run_dir / "goodput.rank0.json", 2.0)
        second_spawn = time.time()
        subprocess.run(args, check=True, timeout=120)
    finally:
        for proc in load:
            proc.kill()
            proc.wait()
    state = json.loads((run_dir / "goodput.rank0.json").read_text())
    gap = second_spawn - first_record
    elapsed = state["updated"] - first_spawn + 2.0  # the first process's wall time ran 2.0 s earlier
    assert gap >= 2.0
    assert abs(state["badput"]["restart"] - gap) <= 0.1, (state, gap)
    assert abs(state["wall_s"] - elapsed) <= 0.2, (state, elapsed)


def test_data_loading_and_checkpoint_restore_are_their_own_causes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restore before the first step is checkpoint_restore (not startup); a save is
    checkpoint_save; the step's wait in `ot.timer("data")` is data, not productive time."""
    ot.init(run_name="causes", prometheus_port=0, verbosity=0, hardware=False, log_interval=2)
    session = current_session()
    clock = FakeTime().install(session, monkeypatch)
    with ot.span("load_checkpoint"):
        clock.advance(0.3)
    for step in range(4):
        with ot.step(step):
            with ot.timer("data"):  # the loader had no batch ready: the step waits
                clock.advance(0.1)
            with ot.timer("forward"):
                clock.advance(0.01)
    with ot.span("save_checkpoint"):
        clock.advance(0.1)
    ot.shutdown()
    account = _account(session.run_dir)
    _assert_sums_to_wall(account)
    assert account["checkpoint_restore"] == pytest.approx(0.3, abs=1e-6)
    assert account["checkpoint_save"] == pytest.approx(0.1, abs=1e-6)
    assert account["data"] == pytest.approx(0.4, abs=1e-6)
    assert account["productive_s"] == pytest.approx(0.04, abs=1e-6)  # 4 x 10 ms of forward, not the waits
    startup_without_restore = session.clock.first_step_start_ns * 1e-9 - session.clock.process_start_s - 0.3
    assert account["startup"] == pytest.approx(startup_without_restore, abs=1e-6)


_RESUMED = """
import sys
import otel_train as ot
from helpers.fake_time import FakeTime
from otel_train.testing import current_session
first, last, seconds = int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
ot.init(run_name="resumed", run_id="job-10", output_dir=sys.argv[1], prometheus_port=0, verbosity=0,
        hardware=False, log_interval=2)
clock = FakeTime().install(current_session())
for step in range(first, last):
    with ot.step(step if first >= 0 else None):  # first < 0: unnumbered steps (ot.step())
        clock.advance(seconds)
ot.shutdown()
"""


def _run_resumed(script: Path, output_dir: Path, *args: object) -> None:
    """One process of `_RESUMED` (its fake clock comes from tests/helpers)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    }
    subprocess.run(
        [sys.executable, str(script), str(output_dir), *map(str, args)], env=env, check=True, timeout=120
    )


def test_a_step_that_raised_is_not_the_last_completed_step(tmp_path: Path) -> None:
    """A process that dies in step 12, after steps 0-11 in the same flush interval: the file says
    11 was the last step completed, so a resumed process's step 12 is new progress, not waste."""
    ot.init(prometheus_port=0, verbosity=0, log_interval=100, output_dir=str(tmp_path), run_name="dies",
            hardware=False)  # fmt: skip
    with pytest.raises(RuntimeError):
        for step in range(20):
            with ot.step(step):
                if step == 12:
                    raise RuntimeError("out of memory")
    ot.shutdown()
    saved = json.loads((tmp_path / "dies" / "goodput.rank0.json").read_text())
    assert saved["last_step"] == 11


def test_steps_re_run_after_a_restart_are_wasted_progress_and_the_restart_is_counted(tmp_path: Path) -> None:
    """The first process completes steps 0-9; the second resumes from a checkpoint of step 5 and
    runs 5-12: steps 5-9 again are wasted progress, not productive; one interruption."""
    script = tmp_path / "resumed.py"
    script.write_text(_RESUMED)
    run_dir = tmp_path / "runs" / "resumed"

    def run(first: int, last: int, seconds: float) -> None:
        _run_resumed(script, tmp_path / "runs", first, last, seconds)

    run(0, 10, 0.01)
    before = json.loads((run_dir / "goodput.rank0.json").read_text())
    assert before["last_step"] == 9 and before["interruptions"] == 0
    run(5, 13, 0.1)  # 5 x 0.1 s re-run (wasted), 3 x 0.1 s of new progress
    after = json.loads((run_dir / "goodput.rank0.json").read_text())
    _assert_sums_to_wall(
        {"wall_s": after["wall_s"], "productive_s": after["productive_s"], **after["badput"]}
    )
    assert after["last_step"] == 12 and after["interruptions"] == 1
    assert after["badput"]["wasted_progress"] == pytest.approx(0.5, abs=1e-6)
    assert after["productive_s"] - before["productive_s"] == pytest.approx(0.3, abs=1e-6)
    rows = [json.loads(line) for line in (run_dir / "metrics.rank0.jsonl").read_text().splitlines()]
    assert sum(row.get("train/interruptions", 0) for row in rows) == 1
    run(13, 16, 0.05)  # a second restart
    final = json.loads((run_dir / "goodput.rank0.json").read_text())
    assert final["interruptions"] == 2
    # Each row holds its interval's share: summed, the rows are the account (the counters of a
    # restarted process begin at the job's totals, which no row repeats).
    rows = [json.loads(line) for line in (run_dir / "metrics.rank0.jsonl").read_text().splitlines()]
    assert sum(row.get("train/interruptions", 0) for row in rows) == 2
    assert sum(row.get("train/productive", 0) for row in rows) == pytest.approx(
        final["productive_s"], abs=1e-6
    )
    startup = sum(row.get("train/badput/startup", 0) for row in rows)
    assert startup == pytest.approx(final["badput"]["startup"], abs=1e-6)


def test_step_deviation_is_the_interval_against_the_typical_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ot.init(run_name="deviation", prometheus_port=0, verbosity=0, hardware=False, log_interval=2)
    session = current_session()
    clock = FakeTime().install(session, monkeypatch)
    for step in range(12):
        with ot.step(step):
            clock.advance(0.02 if step < 10 else 0.2)  # the last interval is 10x slower
    ot.shutdown()
    rows = [json.loads(line) for line in (session.run_dir / "metrics.rank0.jsonl").read_text().splitlines()]
    deviation = {
        row["train/step"]: row["train/step_deviation"] for row in rows if "train/step_deviation" in row
    }
    assert deviation[1] == 0.0  # one interval: it is the typical one
    assert all(abs(deviation[step]) < 1.0 for step in (5, 7, 9)), deviation
    assert all(deviation[step] == pytest.approx(0.0, abs=1e-6) for step in (5, 7, 9)), deviation
    assert deviation[11] == pytest.approx(9.0, abs=1e-6), deviation  # 10x the median of the intervals' means


def test_unnumbered_steps_are_never_counted_as_re_runs(tmp_path: Path) -> None:
    """`ot.step()` without a number counts from 0 in every process: a restart's steps cannot be
    told apart from re-runs, so none is wasted progress (it stays productive)."""
    script = tmp_path / "resumed.py"
    script.write_text(_RESUMED)
    run_dir = tmp_path / "runs" / "resumed"
    for _ in range(2):
        _run_resumed(script, tmp_path / "runs", -4, 0, 0.05)
    after = json.loads((run_dir / "goodput.rank0.json").read_text())
    assert after["interruptions"] == 1 and after["badput"]["wasted_progress"] == 0
    assert after["productive_s"] == pytest.approx(8 * 0.05, abs=1e-6)


def _process(clock: FakeTime, state_file: Path) -> tuple[GoodputListener, InMemoryMetricReader]:
    """One process's goodput on `clock`, started now, its first step starting at once."""
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("goodput-test")
    books = StepClock(300.0, clock.clocks(started_s=clock.perf_ns * 1e-9))
    listener = GoodputListener(books, meter, state_file, "job-11")
    books.note_gap(clock.perf_ns, None)
    return listener, reader


def _points(reader: InMemoryMetricReader, name: str, attribute: str, value: str) -> list[float]:
    """The values of metric `name`'s points whose `attribute` is `value`."""
    data = reader.get_metrics_data()
    assert data is not None
    return [
        point.value
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == name
        for point in metric.data.data_points
        if point.attributes.get(attribute) == value
    ]


def _restart_badput(reader: InMemoryMetricReader) -> float:
    return sum(_points(reader, "train.badput.duration", "train.badput.cause", "restart"))


@pytest.mark.parametrize("same_boot", [True, False], ids=["same boot", "another host"])
def test_a_restart_gap_is_read_on_the_injected_clocks(tmp_path: Path, same_boot: bool) -> None:
    """A process of 5 s (4 s of steps), then the next one of the run id 30 s later on the same
    clocks: 30 s of restart badput, on the boot clock on the same boot and on the wall clock
    (agreeing with the file's own time) from another host; the counter starts at the job's totals."""
    clock, state_file = FakeTime(), tmp_path / "goodput.rank0.json"
    first, _ = _process(clock, state_file)
    clock.advance(5.0)
    first.on_flush(Interval(0, 9, clock.wall_s, 5.0, 10, 0, 0, [0.4] * 10, final=True))
    saved = json.loads(state_file.read_text())
    assert (saved["wall_s"], saved["productive_s"], saved["badput"]["other"]) == pytest.approx(
        (5.0, 4.0, 1.0)
    )
    if not same_boot:
        state_file.write_text(json.dumps({**saved, "boot_id": "another-host-boot"}))
        os.utime(state_file, (saved["updated"], saved["updated"]))
    clock.advance(30.0)
    second, reader = _process(clock, state_file)
    account = second.account()
    assert account["restart"] == pytest.approx(30.0, abs=1e-6)
    assert account["wall_s"] == pytest.approx(35.0, abs=1e-6) and account["productive_s"] == pytest.approx(
        4.0
    )
    assert _restart_badput(reader) == pytest.approx(30.0, abs=1e-6)
    assert second.interruptions == 1 and second.last_step == 9


def _total(reader: InMemoryMetricReader, name: str) -> float:
    """The sum of metric `name`'s points (every attribute set)."""
    data = reader.get_metrics_data()
    assert data is not None
    metrics = [m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics]
    return sum(p.value for m in metrics if m.name == name for p in m.data.data_points)


def test_productive_time_is_a_counter_that_continues_across_restarts(tmp_path: Path) -> None:
    """`train.productive.duration` (what otel_train:goodput:rolling1h divides) is the account's
    productive time, continued by the next process of the run id from where the last one left it,
    and with `train.badput.duration` it sums to the run id's wall time, the restart's gap included:
    a process of 5 s (4 s of steps), a 30 s gap, then 10 s (9 s of steps)."""
    clock, state_file = FakeTime(), tmp_path / "goodput.rank0.json"
    first, reader = _process(clock, state_file)
    clock.advance(5.0)
    first.on_flush(Interval(0, 9, clock.wall_s, 5.0, 10, 0, 0, [0.4] * 10, final=True))
    assert _total(reader, "train.productive.duration") == pytest.approx(4.0)
    clock.advance(30.0)
    second, reader = _process(clock, state_file)
    assert _total(reader, "train.productive.duration") == pytest.approx(4.0)  # before its first step
    clock.advance(10.0)
    second.on_flush(Interval(1, 19, clock.wall_s, 10.0, 10, 0, 0, [0.9] * 10))
    productive, badput = _total(reader, "train.productive.duration"), _total(reader, "train.badput.duration")
    assert productive == pytest.approx(13.0) == pytest.approx(second.totals["productive_s"])
    assert productive + badput == pytest.approx(45.0) == pytest.approx(second.totals["wall_s"])


def test_a_later_run_of_the_process_begins_its_account_at_its_own_init(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep's second trial (or a second Trainer, a notebook cell run again) in one process: the
    first run's account begins at the process's start (imports are its startup), the second's at
    its own ot.init(), so the first run's whole life is not the second's startup badput."""
    from otel_train import goodput

    monkeypatch.setattr(goodput, "_process_has_run", False, raising=False)
    starts = []
    for name in ("trial0", "trial1"):
        began = time.perf_counter()
        ot.init(prometheus_port=0, verbosity=0, output_dir=str(tmp_path), run_name=name, hardware=False)
        starts.append((began, current_session().clock.process_start_s))
        ot.shutdown()
    (first_init, first_start), (second_init, second_start) = starts
    assert first_start == pytest.approx(goodput.process_start_perf_s(), abs=0.05) and first_start < first_init
    assert second_start >= second_init


def test_a_failed_save_is_warned_about_counted_and_its_recovery_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A full disk keeps an old goodput file, from which a restart would book its gap and wasted
    progress: one warning per failing spell, every failure counted, one line once it saves again."""
    from otel_train import goodput

    clock, state_file = FakeTime(), tmp_path / "goodput.rank0.json"
    listener, reader = _process(clock, state_file)
    disk_full = True

    def write_json(path: Path, data: object, fsync: bool = False) -> None:
        if disk_full:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        goodput_write_json(path, data, fsync)

    goodput_write_json = goodput.write_json
    monkeypatch.setattr(goodput, "write_json", write_json)
    with caplog.at_level(logging.WARNING, logger="otel_train"):
        for step in range(3):  # three saves fail (one per SAVE_EVERY_S)
            clock.advance(goodput.SAVE_EVERY_S)
            listener.on_flush(Interval(step, step, clock.wall_s, 5.0, 1, 0, 0, [0.4]))
        assert json.loads(state_file.read_text())["last_step"] == -1  # the account saved at the start
        disk_full = False
        clock.advance(goodput.SAVE_EVERY_S)
        listener.on_flush(Interval(3, 3, clock.wall_s, 5.0, 1, 0, 0, [0.4]))
    assert json.loads(state_file.read_text())["last_step"] == 3
    messages = [r.getMessage() for r in caplog.records]
    assert sum("cannot save the goodput account" in m and "No space left" in m for m in messages) == 1
    assert sum("saved again" in m and "after 3 failed save(s)" in m for m in messages) == 1, messages
    assert _points(reader, "otel_train.dropped", "otel_train.reason", "goodput_save_failed") == [3]


@pytest.mark.parametrize("where", ["step", "data"])
def test_a_hang_inside_a_step_is_stall_badput_not_productive_time(tmp_path: Path, where: str) -> None:
    """A step that hangs past stall_timeout_s (a collective, a lock, a sleep) is stall time from its
    start to its end, as the watchdog saw it; a hang inside the step's data timer stays data badput,
    booked once."""
    ot.init(run_name=f"gp-hang-{where}", stall_timeout_s=0.3, prometheus_port=0, verbosity=0, hardware=False)
    session = current_session()
    stalled = threading.Event()
    session.events.add_callback(lambda event, message, attributes: event == "stall" and stalled.set())
    for step in range(8):
        with ot.step(step):
            if step == 3:
                with ot.timer("data" if where == "data" else "forward"):
                    assert stalled.wait(30), "no stall event"  # the watchdog declared the stall
            time.sleep(0.01)
    ot.shutdown()
    account = _account(session.run_dir)
    _assert_sums_to_wall(account)
    hung = account["data"] if where == "data" else account["stall"]
    assert hung >= 0.3
    if where == "data":
        assert account["stall"] < 0.05  # the step's time after its data wait (10 ms here) at most


def test_a_hung_step_that_then_raises_is_stall_and_keeps_the_earlier_steps_productive(tmp_path: Path) -> None:
    """A collective that hangs and then times out (gloo and NCCL raise): the failed step's stall is
    stall badput, and the steps before it stay productive (the stall is not carved out of them)."""
    ot.init(run_name="gp-hang-raise", stall_timeout_s=0.3, prometheus_port=0, verbosity=0, hardware=False)
    session = current_session()
    stalled = threading.Event()
    session.events.add_callback(lambda event, message, attributes: event == "stall" and stalled.set())
    for step in range(20):
        with ot.step(step):
            time.sleep(0.02)
    with pytest.raises(RuntimeError), ot.step(20):
        assert stalled.wait(30), "no stall event"
        time.sleep(0.3)  # the watchdog sees the step's end as progress, before shutdown
        raise RuntimeError("collective timed out")
    time.sleep(0.3)
    ot.shutdown()
    account = _account(session.run_dir)
    _assert_sums_to_wall(account)
    assert account["productive_s"] >= 0.3  # 20 steps of 20 ms
    assert account["stall"] >= 0.3


def test_a_process_that_dies_before_its_first_flush_still_leaves_its_account(tmp_path: Path) -> None:
    """A Ray Train worker that fails at its first steps (no flush yet): its successor under the
    same run id books the restart, and counts the interruption."""
    clock, state_file = FakeTime(), tmp_path / "goodput.rank0.json"
    _process(clock, state_file)  # dies: no flush, no close
    assert json.loads(state_file.read_text())["interruptions"] == 0
    clock.advance(30.0)
    listener, _ = _process(clock, state_file)
    assert listener.interruptions == 1
    assert listener.account()["restart"] == pytest.approx(30.0, abs=1.0)


FROZEN = """
import os, signal, subprocess, sys, time
import otel_train as ot
where, freeze_s, out = sys.argv[1], float(sys.argv[2]), sys.argv[3]
ot.init(output_dir=out, run_name="frozen", prometheus_port=0, verbosity=0, hardware=False,
        log_interval=5, stall_timeout_s=1.5)
def freeze():  # SIGSTOP from outside, as a VM pause or a debugger does; SIGCONT after freeze_s
    subprocess.Popen([sys.executable, "-c", f"import os, signal, time; "
                      f"os.kill({os.getpid()}, signal.SIGSTOP); time.sleep({freeze_s}); "
                      f"os.kill({os.getpid()}, signal.SIGCONT)"])
    last, deadline = time.monotonic(), time.monotonic() + 60
    while time.monotonic() < deadline:  # here until the freeze has come and gone, however late
        time.sleep(0.01)
        now = time.monotonic()
        if now - last > 0.8 * freeze_s:
            return
        last = now
    raise SystemExit("no freeze came")
for i in range(30):
    if i == 20 and where == "between":
        freeze()
    with ot.step(i):
        if i == 20 and where == "in":
            freeze()
        time.sleep(0.05)
time.sleep(1.2)  # the watchdog's next tick
ot.shutdown()
"""


@pytest.mark.parametrize("where", ["in", "between"])
def test_a_frozen_process_is_stall_time_once_inside_a_step_or_between(where: str, tmp_path: Path) -> None:
    """A SIGSTOP (a VM or container pause) also stops the watchdog: a freeze inside a step that ended
    before the watchdog ran again was productive time, and named the step the loop had reached by
    then. A freeze between steps is goodput's own gap, and is booked once."""
    freeze_s = 5.0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", FROZEN, where, str(freeze_s), str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    account = json.loads((tmp_path / "frozen" / "goodput.rank0.json").read_text())
    stall = account["badput"]["stall"]
    assert freeze_s * 0.9 <= stall <= freeze_s * 1.5, account  # booked, and once
    assert account["productive_s"] >= 30 * 0.05 * 0.9, account  # the steps' own time stays productive
    events = [
        json.loads(line) for line in (tmp_path / "frozen" / "events.rank0.jsonl").read_text().splitlines()
    ]
    [frozen] = [e for e in events if "could not run" in e["message"]]
    assert "stopped or frozen" in frozen["message"] and frozen["step"] <= 20, frozen
