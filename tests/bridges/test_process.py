"""The bridge process: TensorBoard/W&B/MLflow run in one child process fed once per flush. Order is
kept, drops are counted, set-up errors raise at init(), a hung bridge cannot hold shutdown() past
its budget, and a SIGKILLed trainer loses at most one flush and leaves no process behind."""

from __future__ import annotations

import ast
import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
from helpers.readback import read_tensorboard
from helpers.waiting import process_gone

import otel_train as ot
from otel_train.bridges import host
from otel_train.bridges.process import BridgeProcess
from otel_train.config import ConfigError
from otel_train.core import assemble
from otel_train.core.assemble import RunPlace
from otel_train.testing import current_session

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent


@pytest.fixture
def fixtures_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bridge process imports tests/helpers/bridge_fixtures.py (tests/ on its PYTHONPATH)."""
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    )


def _idle_policy() -> int:
    """The idle policy a bridge process (at nice 10) takes here: SCHED_IDLE where it may leave it
    again, else SCHED_BATCH (host.CpuPolicy)."""
    chosen: list[int] = []

    def at_nice_10() -> None:  # nice is per thread on Linux; the probe's thread inherits it
        os.nice(10)
        chosen.append(os.SCHED_IDLE if host._may_leave_idle() else os.SCHED_BATCH)

    thread = threading.Thread(target=at_nice_10)
    thread.start()
    thread.join()
    return chosen[0]


@pytest.mark.usefixtures("fixtures_on_path")
def test_calls_arrive_in_order_as_plain_data(tmp_path: Path) -> None:
    import numpy as np

    path = tmp_path / "calls.jsonl"
    bridges = BridgeProcess([("helpers.bridge_fixtures", "Recording", {"path": str(path)})], queue_size=64)
    bridges.write_hparams({"lr": np.float64(3e-4), "shape": (2, 3), "dtype": np.dtype("float32")})
    bridges.write_scalars(9, 1.0, {"train/loss": 2.5})
    bridges.write_text("notes", "hello", 9)
    bridges.write_samples("samples", [("def ", "main():")], 9)
    bridges.write_histogram("weights", [0.1, 0.2], 9)
    bridges.write_scalars(19, 2.0, {"train/loss": 1.5})
    bridges.close({"train/loss": 1.5}, timeout=60)
    assert bridges.closed_cleanly and bridges.dropped == 0
    calls = [json.loads(line) for line in path.read_text().splitlines()]
    assert [c[0] for c in calls] == ["hparams", "scalars", "text", "samples", "histogram", "scalars", "close"]
    assert calls[0][1] == {"lr": 3e-4, "shape": [2, 3], "dtype": "float32"}  # plain data, never objects
    assert calls[1] == ["scalars", 9, {"train/loss": 2.5}] and calls[-1] == ["close", {"train/loss": 1.5}]
    assert bridges.wait(30)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux-only")
@pytest.mark.usefixtures("fixtures_on_path")
def test_bridge_process_runs_below_the_training(tmp_path: Path) -> None:
    """SCHED_IDLE (never preempts a training thread) and nice 10, measured reason in bridges/host.py."""
    bridges = BridgeProcess(
        [("helpers.bridge_fixtures", "Recording", {"path": str(tmp_path / "c.jsonl"), "note_policy": True})],
        8,
    )
    try:
        assert bridges.pid is not None
        assert os.sched_getscheduler(bridges.pid) == _idle_policy()
        assert psutil.Process(bridges.pid).nice() == 10
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the training process keeps its own policy
    finally:
        bridges.close({}, timeout=30)
    assert bridges.wait(30)
    # The set-up ran at normal scheduling (nice 10): under SCHED_IDLE, on a machine whose cores are
    # all busy, importing the backends starved past the set-up limit and init() failed.
    first = json.loads((tmp_path / "c.jsonl").read_text().splitlines()[0])
    assert first == ["setup_policy", os.SCHED_OTHER]


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux-only")
@pytest.mark.usefixtures("fixtures_on_path")
def test_the_close_lifts_the_bridge_process_out_of_sched_idle_from_the_parent(tmp_path: Path) -> None:
    """Under SCHED_IDLE the bridge process may get no CPU at all while every core is busy (other
    ranks of the node still training): the training process lifts it to normal scheduling before it
    hands over the close, so the close does not wait for an idle core; and the bridge process stays
    lifted while a backlog waits in the pipe (its own queues, nearly empty, do not show it), so the
    backlog and the close are read at normal scheduling. Here the bridge process is stopped
    (SIGSTOP), as starved, while the backlog and the close are handed over."""
    path = tmp_path / "c.jsonl"
    bridges = BridgeProcess(
        [("helpers.bridge_fixtures", "Recording", {"path": str(path), "note_policy": True})], 64
    )
    assert bridges.pid is not None and os.sched_getscheduler(bridges.pid) == _idle_policy()
    os.kill(bridges.pid, signal.SIGSTOP)
    try:
        for step in range(20):  # fewer than half the queue: no lift before the close
            bridges.write_scalars(step, 0.0, {"x": float(step)})
        time.sleep(0.5)  # into the pipe
        assert os.sched_getscheduler(bridges.pid) == _idle_policy()
        bridges.close({"x": 1.0}, timeout=0.5)  # no reply from a stopped process: gives up at once
        assert os.sched_getscheduler(bridges.pid) == os.SCHED_OTHER
        assert psutil.Process(bridges.pid).nice() == 10  # below the training still
    finally:
        os.kill(bridges.pid, signal.SIGCONT)
    assert bridges.wait(30)
    calls = [json.loads(line) for line in path.read_text().splitlines()]
    assert calls[-1] == ["close", {"x": 1.0}]  # it still closed
    policies = [c[1] for c in calls if c[0] == "policy"]
    assert len(policies) == 20 and set(policies) == {os.SCHED_OTHER}, policies  # the whole backlog


@pytest.mark.usefixtures("fixtures_on_path")
def test_a_close_that_may_not_wait_says_it_waited_no_time(caplog: pytest.LogCaptureFixture) -> None:
    """`close(timeout=0)` (no budget left at shutdown) on a bridge still writing: the warning names
    the wait it had, not the default grace."""
    bridges = BridgeProcess([("helpers.bridge_fixtures", "Slow", {"seconds": 2.0})], 64)
    bridges.write_scalars(0, 0.0, {"x": 1.0})
    with caplog.at_level("WARNING", logger="otel_train"):
        bridges.close({}, timeout=0.0)
    assert bridges.wait(30)
    warned = [r.getMessage() for r in caplog.records if "did not finish within" in r.getMessage()]
    assert len(warned) == 1 and "within 0.0 s" in warned[0], warned
    assert "bridges (bridge_fixtures) did not" in warned[0], warned
    assert "raise shutdown_timeout_s to wait for them" in warned[0], warned


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux-only")
@pytest.mark.usefixtures("fixtures_on_path")
def test_a_bridge_process_that_stops_reading_is_lifted_and_returns_to_sched_idle(tmp_path: Path) -> None:
    """Starved under SCHED_IDLE (here: stopped), the bridge process cannot see its queues fill: the
    training process lifts it when its own queue to it is half full; it goes back to SCHED_IDLE by
    itself once it has caught up, and nothing that fitted in the queues is lost."""
    path = tmp_path / "c.jsonl"
    bridges = BridgeProcess([("helpers.bridge_fixtures", "Recording", {"path": str(path)})], 64)
    assert bridges.pid is not None
    os.kill(bridges.pid, signal.SIGSTOP)
    try:
        big = {f"k{i}": float(i) for i in range(400)}  # ~10 KB a frame: the pipe fills in a few
        step = 0
        deadline = time.monotonic() + 30
        idle = _idle_policy()
        while os.sched_getscheduler(bridges.pid) == idle and time.monotonic() < deadline:
            bridges.write_scalars(step, 0.0, big)
            step += 1
            time.sleep(0.01)  # the writer thread moves frames into the pipe until it is full
        assert os.sched_getscheduler(bridges.pid) == os.SCHED_OTHER, step
        assert bridges.dropped == 0 and step >= 32  # lifted at half of the 64-frame queue, not before
    finally:
        os.kill(bridges.pid, signal.SIGCONT)
    deadline = time.monotonic() + 30  # caught up: a call with empty queues puts it back
    while os.sched_getscheduler(bridges.pid) != idle and time.monotonic() < deadline:
        bridges.write_scalars(step, 0.0, {"x": 1.0})
        step += 1
        time.sleep(0.2)
    assert os.sched_getscheduler(bridges.pid) == idle
    bridges.close({}, timeout=60)
    assert bridges.closed_cleanly and bridges.dropped == 0
    assert sum(1 for line in path.read_text().splitlines() if line.startswith('["scalars"')) == step


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux-only")
def test_a_user_who_may_not_leave_sched_idle_gets_sched_batch_and_still_catches_up() -> None:
    """Linux lets a process leave SCHED_IDLE only with CAP_SYS_NICE or RLIMIT_NICE >= 10 (at nice 10):
    an ordinary user could never catch up. As such a user (root drops to nobody in a forked child;
    another user runs as itself), the idle policy is SCHED_BATCH, and the catch-up works."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            cpu = host.CpuPolicy()
            cpu.start()
            cpu.set_up()
            seen = [os.sched_getscheduler(0)]
            for fill in (0.6, 0.0):
                cpu.update(fill)
                seen.append(os.sched_getscheduler(0))
            os.write(write_end, repr((seen, cpu.idle_policy, os.nice(0))).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        report = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, report
    seen, idle_policy, nice = ast.literal_eval(report)
    assert nice == 10 and idle_policy in (os.SCHED_IDLE, os.SCHED_BATCH)
    if os.geteuid() == 0:  # nobody has neither CAP_SYS_NICE nor RLIMIT_NICE >= 10 by default
        assert idle_policy == os.SCHED_BATCH or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 10
    assert seen == [idle_policy, os.SCHED_OTHER, idle_policy]  # below, caught up, below again


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux-only")
def test_bridges_leave_sched_idle_while_they_fall_behind() -> None:
    """Starved by a training that keeps every core busy, the bridges' queues fill: the whole process
    tree then runs normally (nice 10) until the queues are nearly empty (in a child: it renices)."""
    script = textwrap.dedent(
        """
        import os, subprocess, sys, time
        from otel_train.bridges.host import CpuPolicy
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        cpu = CpuPolicy()
        cpu.start()
        seen = []
        for fill in (0.0, 0.3, 0.5, 0.3, 0.2, 0.1, 0.0):
            cpu.update(fill)
            seen.append((os.sched_getscheduler(0), os.sched_getscheduler(helper.pid)))
        helper.kill()
        print(repr((seen, os.nice(0), os.SCHED_IDLE, os.SCHED_OTHER)))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    seen, nice, idle, other = ast.literal_eval(out.stdout.strip())
    assert nice == 10
    started_after = idle  # the helper was started before start(): it is switched too
    assert seen == [
        (idle, started_after),
        (idle, idle),
        (other, other),  # half full: catch up
        (other, other),  # hysteresis: stays until nearly empty
        (other, other),
        (idle, idle),
        (idle, idle),
    ]


@pytest.mark.usefixtures("fixtures_on_path")
def test_drops_in_the_bridge_process_are_counted(tmp_path: Path) -> None:
    drops: list[tuple[str, int]] = []
    bridges = BridgeProcess(
        [("helpers.bridge_fixtures", "Slow", {"seconds": 2.0})],
        queue_size=2,
        count_drop=lambda r, n: drops.append((r, n)),
    )
    for step in range(10):
        bridges.write_scalars(step, 0.0, {"x": float(step)})
        time.sleep(0.05)  # one flush at a time: the pipe keeps up, the slow bridge does not
    bridges.close({}, timeout=60)
    assert bridges.closed_cleanly
    # one call in the slow write, two queued behind it; the rest dropped, in this process (its queue
    # to the pipe) or in the bridge process (the bridge's own queue), and every drop counted
    assert bridges.dropped + bridges.bridge_stats["slow"]["dropped"] == 7
    assert sum(n for _, n in drops) == 7 and {r for r, _ in drops} <= {"bridge_queue", "bridge_slow"}
    assert bridges.bridge_stats["slow"]["dropped"] > 0


def test_setup_error_raises_at_init_naming_the_path(tmp_path: Path) -> None:
    run_dir = tmp_path / "blocked"
    run_dir.mkdir()
    (run_dir / "tensorboard").write_text("a file where the log dir should be")
    with pytest.raises(ConfigError) as info:
        ot.init(output_dir=str(tmp_path), run_name="blocked", tensorboard=True, prometheus_port=0, verbosity=0,
                hardware=False)  # fmt: skip
    assert "TensorBoard" in str(info.value) and str(run_dir / "tensorboard") in str(info.value)
    assert current_session() is None


@pytest.mark.usefixtures("fixtures_on_path")
def test_a_hung_bridge_cannot_hold_shutdown_past_its_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    specs = assemble.bridge_specs

    def with_hanging(config: ot.Config, place: RunPlace) -> list:
        return [*specs(config, place), ("helpers.bridge_fixtures", "Hanging", {})]

    monkeypatch.setattr(assemble, "bridge_specs", with_hanging)
    budget = 1.5
    ot.init(output_dir=str(tmp_path), run_name="hung", tensorboard=True, prometheus_port=0, verbosity=0,
                      hardware=False, log_interval=2, shutdown_timeout_s=budget)  # fmt: skip
    session = current_session()
    assert session.bridges is not None
    for step in range(6):
        with ot.step(step):
            ot.record("loss", 1.0 / (step + 1))
    started = time.monotonic()
    ot.shutdown()
    elapsed = time.monotonic() - started
    assert elapsed <= budget + 0.5, elapsed  # the budget, in total (no 10 s per hung bridge)
    # the healthy bridge beside the hung one still wrote everything (its close is not held up)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        run = read_tensorboard(tmp_path / "hung" / "tensorboard")
        if sorted({s for s, _ in run.scalars.get("train/loss", [])}) == [1, 3, 5]:
            break
        time.sleep(0.5)
    assert sorted({s for s, _ in run.scalars["train/loss"]}) == [1, 3, 5]  # (+ the final flush at 5)
    assert session.bridges.proc is not None
    session.bridges.proc.kill()  # do not wait for its grace period to run out
    session.bridges.wait(10)


TRAINER = textwrap.dedent(
    """
    import sys, time
    import otel_train as ot
    from otel_train.testing import current_session

    ot.init(output_dir=sys.argv[1], run_name="killed", tensorboard=True, prometheus_port=0,
                      verbosity=0, hardware=False, log_interval=1)
    session = current_session()
    if sys.argv[2:] == ["stopped"]:  # the test stops the bridge process before the steps
        print(session.bridges.pid, flush=True)
        sys.stdin.readline()
    for step in range(20):
        with ot.step(step):
            ot.record("loss", float(step))
            time.sleep(0.02)
    while session.worker.flushes < 20 - session.deferred_flushes:  # every flush reached the bridges
        time.sleep(0.01)
    while session.bridges.queued:  # and the pipe (on a busy machine the bridge process may be
        time.sleep(0.01)  # starved under SCHED_IDLE: what is in the pipe it still reads after the kill)
    time.sleep(0.1)  # the writer thread's last write
    print(session.bridges.pid, flush=True)
    time.sleep(600)
    """
)


def test_calls_still_in_the_pipe_when_the_trainer_is_killed_reach_the_bridges(tmp_path: Path) -> None:
    """A bridge process behind (starved on a busy machine; here stopped) when the trainer is
    SIGKILLed still reads what the trainer had written into the pipe before it closes the bridges,
    instead of leaving at the death signal with its backlog unread."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    )
    trainer = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), "stopped"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
    )  # fmt: skip
    bridge_pid = 0
    try:
        assert trainer.stdin is not None and trainer.stdout is not None
        bridge_pid = int(trainer.stdout.readline())
        os.kill(bridge_pid, signal.SIGSTOP)
        trainer.stdin.write(b"go\n")
        trainer.stdin.flush()
        assert int(trainer.stdout.readline()) == bridge_pid  # all 20 flushes are in the pipe
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(30)
    finally:
        if trainer.poll() is None:
            trainer.kill()
        if bridge_pid:
            os.kill(bridge_pid, signal.SIGCONT)
    assert process_gone(bridge_pid, 60), "the bridge process outlived the SIGKILLed trainer"
    steps = [s for s, _ in read_tensorboard(tmp_path / "killed" / "tensorboard").scalars["train/loss"]]
    assert steps == list(range(20)), steps


def test_sigkill_of_the_trainer_loses_at_most_one_flush_and_no_orphan(tmp_path: Path) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    )
    trainer = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, env=env)
    try:
        assert trainer.stdout is not None
        line = trainer.stdout.readline()
        assert line.strip(), "the trainer did not start"
        bridge_pid = int(line)
        assert psutil.Process(bridge_pid).ppid() == trainer.pid
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(30)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert process_gone(bridge_pid, 60), "the bridge process outlived the SIGKILLed trainer"
    steps = [s for s, _ in read_tensorboard(tmp_path / "killed" / "tensorboard").scalars["train/loss"]]
    assert steps == sorted(set(steps)) and steps[0] == 0, steps
    assert steps[-1] >= 18, steps  # every flush handed over, except at most the one in flight


RESTART_TRAINER = textwrap.dedent(
    """
    import sys, time
    import otel_train as ot
    from otel_train.testing import current_session

    ot.init(output_dir=sys.argv[1], run_name="restarted", tensorboard=True, prometheus_port=0,
            verbosity=0, hardware=False, log_interval=1)
    session = current_session()
    print(session.bridges.pid, flush=True)
    step = 0
    stop = sys.argv[2]
    import os, select
    while True:  # steps until the test writes a line
        with ot.step(step):
            ot.record("loss", float(step))
            time.sleep(0.01)
        step += 1
        if stop == "stdin" and select.select([sys.stdin], [], [], 0)[0]:
            break
        if stop != "stdin" and step >= int(stop):
            break
    print("last", step - 1, session.bridges.pid, flush=True)
    ot.shutdown()
    print("restarts", getattr(session.bridges, "restarts", None), flush=True)
    """
)


def _trainer_env() -> dict[str, str]:
    return dict(
        os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    )


def _tb_steps(log_dir: Path) -> list[int]:
    return sorted({s for s, _ in read_tensorboard(log_dir).scalars.get("train/loss", [])})


def _wait_for_steps(log_dir: Path, above: int, guard_s: float) -> list[int]:
    """TensorBoard's steps once one is above `above`; the guard only ends a wait that never would."""
    deadline = time.monotonic() + guard_s
    steps = _tb_steps(log_dir)
    while not (steps and steps[-1] > above) and time.monotonic() < deadline:
        time.sleep(0.5)
        steps = _tb_steps(log_dir)
    return steps


def test_a_killed_bridge_process_is_restarted_and_later_steps_reach_tensorboard(tmp_path: Path) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(RESTART_TRAINER)
    trainer = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), "stdin"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_trainer_env(),
    )  # fmt: skip
    log_dir = tmp_path / "restarted" / "tensorboard"
    try:
        assert trainer.stdout is not None and trainer.stdin is not None
        first_pid = int(trainer.stdout.readline())
        before = _wait_for_steps(log_dir, 20, 120)
        assert before and before[-1] > 20, before
        os.kill(first_pid, signal.SIGKILL)  # what the OOM killer does
        assert process_gone(first_pid, 30)
        killed_at = _tb_steps(log_dir)[-1]
        after = _wait_for_steps(log_dir, killed_at + 20, 120)
        trainer.stdin.write("stop\n")
        trainer.stdin.flush()
        out, err = trainer.communicate(timeout=120)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    assert trainer.returncode == 0, err[-3000:]
    assert after[-1] > killed_at + 20, (killed_at, after[-5:])  # written by the new bridge process
    lines = dict(line.split(" ", 1) for line in out.splitlines() if line.startswith(("last ", "restarts ")))
    assert set(lines) == {"last", "restarts"}, out
    last, second_pid = (int(v) for v in lines["last"].split())
    assert second_pid != first_pid and lines["restarts"] == "1"
    assert f"the bridge process (pid {first_pid}) died (killed by SIGKILL); restarting it" in err, err[-3000:]
    assert "finishes on its own" not in err and "is gone" not in err, err[-3000:]
    steps = _tb_steps(log_dir)
    assert steps[-1] == last and process_gone(second_pid, 30)  # the close reached the new one: every step


def test_a_bridge_process_stopped_past_the_trainers_exit_never_holds_its_output(tmp_path: Path) -> None:
    """SIGSTOP the bridge process and let the trainer end: the trainer's stdout and stderr reach
    EOF when it exits (a caller reading them is not held), and the bridge process is gone after."""
    script = tmp_path / "trainer.py"
    script.write_text(RESTART_TRAINER)
    trainer = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), "30"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_trainer_env(),
    )  # fmt: skip
    bridge_pid = 0
    try:
        assert trainer.stdout is not None
        bridge_pid = int(trainer.stdout.readline())
        os.kill(bridge_pid, signal.SIGSTOP)
        _, err = trainer.communicate(timeout=120)  # hangs here while the child holds the pipes
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        if bridge_pid and not process_gone(bridge_pid, 0):
            os.kill(bridge_pid, signal.SIGCONT)
    assert trainer.returncode == 0, err[-3000:]
    assert f"pid {bridge_pid}, found stopped: continued" in err, err[-3000:]
    assert process_gone(bridge_pid, 60), "the stopped bridge process outlived the trainer"
