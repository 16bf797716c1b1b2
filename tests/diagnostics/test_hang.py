"""Hang diagnosis: stack dumps on stall and on SIGUSR1, also while a rank is stuck in a collective."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from helpers.events import run_events
from helpers.ports import free_port
from helpers.waiting import wait_for
from prometheus_client.parser import text_string_to_metric_families

import otel_train as ot
from otel_train import adapters, semconv
from otel_train.config import ConfigError
from otel_train.testing import current_session


def _parked_in_marker_function(release: threading.Event) -> None:
    release.wait(30)


def test_stall_writes_stacks_and_an_event_naming_them(tmp_path: Path) -> None:
    ot.init(run_name="stall", stall_timeout_s=0.4, prometheus_port=0, verbosity=0, hardware=False)
    session = current_session()
    for step in range(3):
        with ot.step(step):
            pass
    release = threading.Event()
    blocker = threading.Thread(target=_parked_in_marker_function, args=(release,), name="trainer-like")
    blocker.start()
    try:
        path = wait_for(lambda: next(iter(session.run_dir.glob("stacks.rank0.*.txt")), None), 10, "stacks")
        text = path.read_text()
        assert "rank 0" in text and "last step 2" in text
        assert '--- thread "trainer-like"' in text and "_parked_in_marker_function" in text
        stall = wait_for(lambda: run_events(session.run_dir, event="stall"), 5, "event")
        assert stall[0]["file"] == str(path) and stall[0]["step"] == 2
        time.sleep(1.0)
        assert len(list(session.run_dir.glob("stacks.rank0.*.txt"))) == 1  # one stall, one dump
    finally:
        release.set()
        blocker.join()
    with ot.step(3):  # a step ends the stall; the next one is reported again
        pass
    wait_for(lambda: len(list(session.run_dir.glob("stacks.rank0.*.txt"))) == 2, 10, "second stall dump")


def test_eval_batches_keep_the_stall_watchdog_quiet_until_they_stop(tmp_path: Path) -> None:
    """An evaluation after a step, longer than stall_timeout_s, whose batches call
    `adapters.heartbeat()` is no stall; once they stop (a hung eval), the stall is reported."""
    ot.init(run_name="eval", stall_timeout_s=1.0, prometheus_port=0, verbosity=0, hardware=False)
    session = current_session()
    with ot.step(0):
        pass
    ended = session.last_step()[1]
    evaluating = time.monotonic()
    while time.monotonic() - evaluating < 3.0:  # three stall timeouts of eval batches
        before_batch = time.perf_counter()
        adapters.heartbeat()
        time.sleep(0.02)
    assert session.last_step()[1] >= before_batch > ended  # the watchdog counts from the latest batch
    assert list(session.run_dir.glob("stacks.*")) == []
    stall = wait_for(lambda: run_events(session.run_dir, event="stall"), 10, "stall")
    assert stall[0]["step"] == 0 and "no step or eval batch for" in stall[0]["message"]
    adapters.idle()
    adapters.heartbeat()  # while the run idles on purpose, a batch does not arm the watchdog
    assert session.last_step() == (0, None)


def test_a_pause_marked_idle_longer_than_the_backstop_is_no_stall(tmp_path: Path) -> None:
    """`adapters.idle()` then a pause longer than faulthandler's backstop (stall_timeout_s + 2 s):
    no stack dump, no `stall` event (neither during the pause nor at the next step, as a watchdog
    that could not run), and no stall time in goodput."""
    import json

    ot.init(run_name="idle", stall_timeout_s=0.5, prometheus_port=0, verbosity=0, hardware=False)
    session = current_session()
    for step in range(3):
        with ot.step(step):
            time.sleep(0.2)  # the watchdog ticks (and arms its backstop) while the loop steps
    adapters.idle()  # e.g. evaluating after fit, or pushing to the Hub after train()
    time.sleep(3.5)
    with ot.step(3):
        pass
    time.sleep(0.5)  # a few watchdog ticks after the pause
    ot.shutdown()
    assert run_events(session.run_dir, event="stall") == []
    raw = session.run_dir / "faulthandler.rank0.txt"  # removed at shutdown when nothing was dumped
    assert not raw.exists() or "Timeout" not in raw.read_text()
    goodput = json.loads((session.run_dir / "goodput.rank0.json").read_text())
    assert goodput["badput"]["stall"] == 0


def test_eval_batches_past_eval_timeout_s_are_a_stall(tmp_path: Path) -> None:
    """An evaluation whose loader never ends: its batches call `adapters.heartbeat()` forever, so
    past `eval_timeout_s` after the last step they keep the watchdog quiet no longer, and the stall
    (event, stacks, `train.stall.duration`) says so; a step ends it."""
    ot.init(run_name="endless-eval", stall_timeout_s=0.5, eval_timeout_s=1.5, prometheus_port=0, verbosity=0,
            hardware=False)  # fmt: skip
    session = current_session()
    with ot.step(0):
        pass
    ended = session.last_step()[1]
    assert ended is not None

    def stalls() -> list[dict[str, Any]]:
        adapters.heartbeat()  # an eval batch, while the test waits
        time.sleep(0.02)
        return run_events(session.run_dir, event="stall")

    stall = wait_for(stalls, 20, "a stall while eval batches go on")[0]
    assert stall["step"] == 0 and "(past eval_timeout_s)" in stall["message"], stall
    evaluated_s = float(stall["message"].split("no step for ")[1].split("s ")[0])
    assert evaluated_s >= 1.5  # never before the eval timeout, whatever the heartbeats
    assert Path(stall["file"]).exists()
    assert session.evaluating_s() >= 1.5 and session.watchdog.stalled_s() > 0
    assert session.last_step()[1] == pytest.approx(ended + 1.5)  # batches count until the timeout only
    with ot.step(1):
        pass
    assert session.evaluating_s() == 0.0 and session.watchdog.stalled_s() == 0.0


def test_a_checkpoint_save_has_its_own_timeout(tmp_path: Path) -> None:
    """An open `ot.span("checkpoint")` longer than stall_timeout_s is no stall; one longer than
    checkpoint_timeout_s is, and says so; a save a framework announces
    (`adapters.saving_checkpoint`) counts until the next step begins."""
    ot.init(run_name="save", stall_timeout_s=0.5, checkpoint_timeout_s=3.0, prometheus_port=0, verbosity=0,
            hardware=False)  # fmt: skip
    session = current_session()
    with ot.step(0):
        pass
    with ot.span("checkpoint"):
        assert session.saving()
        time.sleep(1.5)  # three stall timeouts, half the checkpoint timeout
        almost_done = time.perf_counter()
    # the stall timeout counts from the save's end, not from the step before it (a next step longer
    # than the watchdog's poll was reported as a stall of the save's length)
    assert session.last_step()[1] >= almost_done
    with ot.step(1):  # at once
        pass
    assert not session.saving() and list(session.run_dir.glob("stacks.*")) == []
    adapters.saving_checkpoint()  # due before the next step
    assert session.saving()
    adapters.heartbeat()  # an evaluation before the save: its batches keep the stall timeout
    assert not session.saving()
    adapters.saving_checkpoint()  # announced again after it
    with ot.step(2):
        assert not session.saving()  # the step began: the stall timeout again
    hung = ot.span("checkpoint_save").start()
    stall = wait_for(lambda: run_events(session.run_dir, event="stall"), 20, "stall")
    assert stall[0]["step"] == 2 and "(in a checkpoint save)" in stall[0]["message"]
    hung.stop()


def test_an_eval_span_has_the_eval_timeout(tmp_path: Path) -> None:
    """An open `ot.span("eval")` (the user's evaluation, no heartbeats: its batches, then its
    metrics) longer than stall_timeout_s is no stall; one longer than eval_timeout_s is, and says
    so; the next step ends it either way."""
    ot.init(run_name="eval", stall_timeout_s=0.5, eval_timeout_s=3.0, prometheus_port=0, verbosity=0,
            hardware=False)  # fmt: skip
    session = current_session()
    with ot.step(0):
        pass
    with ot.span("eval"):
        assert session.in_eval()
        time.sleep(1.5)  # three stall timeouts, half the eval timeout
    assert not session.in_eval()
    started = time.perf_counter()
    with ot.step(1):  # at once
        pass
    assert list(session.run_dir.glob("stacks.*")) == [] and run_events(session.run_dir, event="stall") == []
    hung = ot.span("evaluate").start()
    stall = wait_for(lambda: run_events(session.run_dir, event="stall"), 20, "stall")
    assert time.perf_counter() - started >= 3.0
    assert stall[0]["step"] == 1 and "(in an eval span)" in stall[0]["message"], stall
    hung.stop()


def _stalled_s(port: int) -> float:
    """`train.stall.duration` as the rank's pull endpoint serves it."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    name = semconv.STALL_DURATION.prometheus_name
    values = [s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]
    assert len(values) == 1, text
    return values[0]


def test_the_stall_gauge_follows_the_watchdogs_verdict(tmp_path: Path) -> None:
    """What the alert rules read: 0 before the first step, through an evaluation's batches, during a
    save shorter than checkpoint_timeout_s and while idle; the seconds since the last step or batch
    once a stall (or a hung save) passes its timeout, back to 0 at the next step."""
    port = free_port()
    ot.init(run_name="gauge", stall_timeout_s=1.0, checkpoint_timeout_s=4.0, prometheus_port=port, verbosity=0,
            hardware=False)  # fmt: skip
    time.sleep(1.5)
    assert _stalled_s(port) == 0.0  # start-up is no stall
    with ot.step(0):
        pass
    evaluating = time.monotonic()
    while time.monotonic() - evaluating < 2.5:  # an evaluation longer than the stall timeout
        adapters.heartbeat()
        time.sleep(0.02)
    assert _stalled_s(port) == 0.0
    assert wait_for(lambda: _stalled_s(port) >= 1.0, 10, "the hung evaluation's stall")
    with ot.step(1):
        pass
    assert _stalled_s(port) == 0.0
    with ot.span("checkpoint"):
        time.sleep(2.0)  # twice the stall timeout, half the checkpoint timeout
        assert _stalled_s(port) == 0.0
        assert wait_for(lambda: _stalled_s(port) >= 4.0, 15, "the hung save's stall")
    with ot.step(2):
        pass
    adapters.idle()
    time.sleep(1.5)
    assert _stalled_s(port) == 0.0  # a pause on purpose


def test_no_stall_before_the_first_step(tmp_path: Path) -> None:
    ot.init(run_name="startup", stall_timeout_s=0.2, prometheus_port=0, verbosity=0, hardware=False)
    session = current_session()
    time.sleep(1.0)  # start-up (model loading, compile) is not a stall
    assert list(session.run_dir.glob("stacks.*")) == []


def test_a_first_step_that_never_ends_is_a_stall_after_its_own_timeout(tmp_path: Path) -> None:
    """The classic hang at the first batch or the first all-reduce: no step has ended, so it is
    judged from the first step's start by first_step_timeout_s (longer than stall_timeout_s:
    compilation and warm-up run in it), with stacks, an event and the stall gauge."""
    port = free_port()
    ot.init(run_name="first", stall_timeout_s=0.2, first_step_timeout_s=1.0, prometheus_port=port,
            verbosity=0, hardware=False)  # fmt: skip
    session = current_session()
    release = threading.Event()
    first = threading.Thread(target=_first_step_parked, args=(release,), name="trainer-like")
    first.start()
    try:
        time.sleep(0.6)  # past stall_timeout_s, inside first_step_timeout_s: warm-up, no stall
        assert run_events(session.run_dir, event="stall") == [] and _stalled_s(port) == 0.0
        (stall,) = wait_for(lambda: run_events(session.run_dir, event="stall"), 10, "the first step's stall")
        assert stall["step"] == -1 and "the first step has run for" in stall["message"]
        assert "_parked_in_marker_function" in Path(stall["file"]).read_text()
        assert _stalled_s(port) >= 1.0
    finally:
        release.set()
        first.join()
    ot.shutdown()


def _first_step_parked(release: threading.Event) -> None:
    with ot.step(0):
        _parked_in_marker_function(release)


def test_sigusr1_dumps_on_the_watchdog_thread(tmp_path: Path) -> None:
    ot.init(run_name="usr1", prometheus_port=0, verbosity=0, hardware=False)
    session = current_session()
    with ot.step(0):
        pass
    os.kill(os.getpid(), signal.SIGUSR1)
    path = wait_for(lambda: next(iter(session.run_dir.glob("stacks.rank0.*.txt")), None), 10, "stacks")
    assert "signal" in path.read_text().splitlines()[0]
    wait_for(lambda: run_events(session.run_dir, event="stack_dump"), 5, "event")
    ot.shutdown()
    # At shutdown a no-op handler stays, not the default action (which would kill the process).
    assert signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, signal.SIG_IGN)
    os.kill(os.getpid(), signal.SIGUSR1)  # harmless now


def test_stack_dump_signal_is_validated() -> None:
    with pytest.raises(ConfigError, match="stack_dump_signal"):
        ot.init(stack_dump_signal="SIGNOPE", prometheus_port=0)


@pytest.mark.parametrize("name", ["SIGKILL", "9", "SIGSTOP", "stop"])
def test_a_signal_that_cannot_be_caught_is_refused_naming_the_fix(name: str) -> None:
    # signal.signal() raises a bare OSError for these: refused as a setting instead, before init
    with pytest.raises(ConfigError, match=r"stack_dump_signal = .*cannot be caught.*SIGUSR1.*or off to turn"):
        ot.init(stack_dump_signal=name, prometheus_port=0)


def test_a_signal_someone_else_handles_is_left_alone_with_a_true_fix(
    caplog: pytest.LogCaptureFixture,
) -> None:
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: None)
    try:
        with caplog.at_level("WARNING", logger="otel_train"):
            ot.init(stack_dump_signal="SIGUSR2", prometheus_port=0, verbosity=0, hardware=False)
            ot.shutdown()
    finally:
        signal.signal(signal.SIGUSR2, previous)
    [warning] = [r.getMessage() for r in caplog.records if "already has a handler" in r.getMessage()]
    # the fix it names is one the settings accept
    assert "to another signal, e.g. SIGUSR1, or to off to silence this" in warning, warning
    assert "0 to silence" not in warning


_RANK_SCRIPT = """
import os, sys, time
import torch, torch.distributed as dist
import otel_train as ot

rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
ot.init(run_name="hang", stall_timeout_s=2.0, prometheus_port=0, verbosity=0, hardware=False,
        log_interval=2, output_dir=sys.argv[1])
tensor = torch.ones(4)
for step in range(100):
    with ot.step(step):
        if step == 3 and rank == 0:
            time.sleep(300)  # rank 0 hangs in its data loading ...
        with ot.timer("backward"):
            dist.all_reduce(tensor)  # ... and rank 1 waits for it here, forever
"""


@pytest.mark.multirank
def test_rank_blocked_in_a_collective_dumps_its_stack_and_answers_sigusr1(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(_RANK_SCRIPT))
    port = free_port()
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
            LOCAL_RANK=str(rank), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
        )  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, str(script), str(tmp_path / "runs")], env=env))
    run_dir = tmp_path / "runs" / "hang"
    try:
        for rank in (0, 1):
            wait_for(lambda r=rank: list(run_dir.glob(f"stacks.rank{r}.*.txt")), 90, f"rank {rank} stacks")
        blocked = (run_dir / "stacks.rank1.0.txt").read_text()
        assert "all_reduce" in blocked  # the culprit's peer: stuck in the collective
        assert "time.sleep(300)" in (run_dir / "stacks.rank0.0.txt").read_text()
        for rank in (0, 1):
            # the watchdog writes the stacks first, then the event that names them
            wait_for(lambda r=rank: run_events(run_dir, r, event="stall"), 30, "stall event")
            stalls = run_events(run_dir, rank, event="stall")
            assert stalls[0]["file"].endswith(f"stacks.rank{rank}.0.txt")
        # The main thread of rank 1 is inside gloo (C++, GIL released): a Python-level handler
        # would never run, the watchdog still answers.
        procs[1].send_signal(signal.SIGUSR1)
        wait_for(lambda: (run_dir / "stacks.rank1.1.txt").exists(), 20, "dump on SIGUSR1")
        assert "all_reduce" in (run_dir / "stacks.rank1.1.txt").read_text()
        assert all(p.poll() is None for p in procs)  # the job's own timeout behaviour is unchanged
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=30)


def test_stall_stack_dumps_are_capped_per_run_and_the_cap_is_said(tmp_path: Path, caplog) -> None:
    """A loop slower than stall_timeout_s stalls at every step: the first MAX_STALL_DUMPS stalls
    write stacks, later ones are events without a file, and reaching the cap is said once."""
    from otel_train.diagnostics.hang import MAX_STALL_DUMPS, HangWatchdog

    events: list[tuple[str, dict[str, Any]]] = []

    class Events:
        def emit(self, event: str, message: str, attributes: Any = None, severity: str = "WARNING") -> None:
            events.append((event, dict(attributes or {})))

    last = {"step": 0}
    long_ago = time.perf_counter() - 100.0
    watchdog = HangWatchdog(
        tmp_path, 0, Events(), lambda: (last["step"], long_ago + last["step"]), 0.5, dump_signal=None
    )
    with caplog.at_level("WARNING", logger="otel_train"):
        for step in range(MAX_STALL_DUMPS + 5):  # each step ended long ago: a new stall each time
            last["step"] = step
            watchdog._check_stall()
    stalls = [attributes for event, attributes in events if event == "stall"]
    assert len(stalls) == MAX_STALL_DUMPS + 5
    assert [("file" in a) for a in stalls] == [True] * MAX_STALL_DUMPS + [False] * 5
    assert len(list(tmp_path.glob("stacks.rank0.*.txt"))) == MAX_STALL_DUMPS
    said = [
        r.getMessage() for r in caplog.records if "later stalls are reported without stacks" in r.getMessage()
    ]
    assert len(said) == 1, said


def test_a_freeze_after_a_declared_stall_is_booked_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watchdog declared a stall inside step 5; then the process froze for 20 s and the step
    ended: settling the stall books the freeze's time already, so the freeze itself adds none."""
    from otel_train.diagnostics.hang import HangWatchdog

    class Events:
        def emit(self, *args: Any, **kwargs: Any) -> None:
            pass

    booked: list[tuple[Any, ...]] = []
    state: dict[str, Any] = {"step": 4, "ended": 100.0, "start_ns": int(100.5e9)}
    watchdog = HangWatchdog(
        tmp_path, 0, Events(), lambda: (state["step"], state["ended"]), 1.5, dump_signal=None,  # type: ignore[arg-type]
        step_start=lambda: state["start_ns"], on_step_stall=lambda *a: booked.append(a),
    )  # fmt: skip
    watchdog._raw.open(tmp_path / "faulthandler.txt")
    monotonic = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: monotonic[0])
    monkeypatch.setattr(time, "perf_counter", lambda: 103.0)
    monkeypatch.setattr(watchdog, "dump", lambda *a: None)

    def tick() -> None:  # one pass of the watchdog's loop
        settled = watchdog._settle_step_stall()
        watchdog._check_stall()
        watchdog._arm_backstop(booked=settled or watchdog._stalled_in_step is not None)

    tick()
    monotonic[0] += 0.4
    tick()  # 3 s without progress: a stall declared inside step 5
    monotonic[0] += 20.0  # SIGSTOP for 20 s, then step 5 ends
    state.update(step=5, ended=123.5, start_ns=0)
    tick()
    watchdog._raw.close()
    assert booked == [(4, 23.0, None)]
