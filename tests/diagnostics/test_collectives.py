"""The collective layer from PyTorch's Flight Recorder: per-rank collective metrics on real gloo
ranks, the `train.collective.last_seconds` hang signal, and hang attribution (the `hang` event and
`otel-train diagnose`) when one rank stops calling the collective the others wait in."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import pickle
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
from helpers.events import Events, every_rank_events, log_messages
from helpers.multirank import DEFAULT_FR, RankError, run_ranks
from helpers.ports import free_port
from prometheus_client.parser import text_string_to_metric_families

from otel_train import semconv
from otel_train.diagnostics.collectives import OFF_MESSAGE, CollectiveMonitor
from otel_train.diagnostics.hang_attribution import Verdict, attribute

FR_ON = {"TORCH_FR_BUFFER_SIZE": "500"}
STALL_S = 1.5


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k.startswith("train_collective")))
            samples[(s.name, labels)] = s.value
    return samples


def _metrics_target(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import otel_train as ot
    from otel_train.testing import current_session

    messages = log_messages()
    from otel_train.diagnostics import collectives

    collectives.MAX_READ_SHARE = 1.0  # read the recorder at every flush: this test counts exactly
    port = free_port()  # the pull endpoint listens on prometheus_port + local rank
    ot.init(
        run_name="coll",
        prometheus_port=port - rank,
        verbosity=0,
        hardware=False,
        log_interval=2,
        output_dir=out_dir,
    )
    tensor = torch.ones(1000)
    for step in range(6):
        with ot.step(step):
            dist.all_reduce(tensor)
            dist.broadcast(tensor[:10], src=0)
    dist.barrier()
    time.sleep(0.5)  # gloo retires a collective's record just after it returns
    for step in range(6, 8):  # two steps without collectives: the flush after step 7 reads them all
        with ot.step(step):
            pass
    session = current_session()
    assert session is not None
    session.worker.stop(timeout_s=10)  # that flush done, the SDK serves what it counted
    samples = _scrape(port)
    ot.shutdown()
    return {"samples": samples, "messages": messages}


def _series(samples: dict, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: value for (n, labels), value in samples.items() if n == name}


@pytest.mark.multirank
def test_collectives_per_group_and_op_on_the_pull_endpoint(tmp_path: Path) -> None:
    results = run_ranks(2, _metrics_target, (str(tmp_path),), timeout=120, env=FR_ON)
    count = semconv.COLLECTIVE_COUNT.prometheus_name
    size = semconv.COLLECTIVE_SIZE.prometheus_name
    for result in results:
        counts = _series(result["samples"], count)
        group, op = "train_collective_group", "train_collective_op"
        all_reduce = ((group, "default_pg"), (op, "all_reduce"))
        broadcast = ((group, "default_pg"), (op, "broadcast"))
        assert counts[all_reduce] == 6 and counts[broadcast] == 6, counts
        sizes = _series(result["samples"], size)
        assert sizes[all_reduce] == 6 * 1000 * 4 and sizes[broadcast] == 6 * 10 * 4, sizes
        # otel_train's own exchange (its gloo telemetry group) is not the job's traffic
        assert all(dict(labels)[group] == "default_pg" for labels in counts), counts
        # gloo measures no collective time; the hang signal is there and small on a healthy rank
        assert not _series(result["samples"], semconv.COLLECTIVE_TIME.prometheus_name)
        (last,) = _series(result["samples"], semconv.COLLECTIVE_LAST.prometheus_name).values()
        assert 0 <= last < 30
        assert not [m for m in result["messages"] if "Flight Recorder is off" in m]


@pytest.mark.multirank
def test_recorder_on_by_torch_default_is_read_without_the_variable(tmp_path: Path) -> None:
    """torch 2.13 records collectives with neither variable set (2,000 entries): otel_train reads
    that recorder as it reads one the variable asked for, and says nothing about it being off."""
    results = run_ranks(2, _metrics_target, (str(tmp_path),), timeout=120, env=DEFAULT_FR)
    assert [[m for m in result["messages"] if "Flight Recorder" in m] for result in results] == [[], []]
    count = semconv.COLLECTIVE_COUNT.prometheus_name
    for result in results:
        counts = _series(result["samples"], count)
        all_reduce = (("train_collective_group", "default_pg"), ("train_collective_op", "all_reduce"))
        assert counts[all_reduce] == 6, counts


@pytest.mark.multirank
def test_recorder_off_is_said_once_for_the_job_and_exports_nothing(tmp_path: Path) -> None:
    env = {"TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}
    results = run_ranks(2, _metrics_target, (str(tmp_path),), timeout=120, env=env)
    said = [[m for m in result["messages"] if "Flight Recorder is off" in m] for result in results]
    assert said == [[OFF_MESSAGE], []]  # once for the job: rank 0
    for result in results:
        assert not [n for (n, _) in result["samples"] if n.startswith("train_collective")]


def _sample_last_seconds(port: int, path: Path, stop: threading.Event) -> None:
    """Append (unix time, train.collective.last_seconds) from this rank's /metrics every 0.25 s."""
    name = semconv.COLLECTIVE_LAST.prometheus_name
    with path.open("a") as out:
        while not stop.wait(0.25):
            with contextlib.suppress(OSError):
                (value,) = _series(_scrape(port), name).values()
                out.write(f"{time.time()} {value}\n")
                out.flush()


def _hang_target(rank: int, world_size: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    import otel_train as ot
    from otel_train.testing import current_session

    port = free_port()
    ot.init(
        run_name="hang", stall_timeout_s=STALL_S, prometheus_port=port - rank, verbosity=0, hardware=False,
        log_interval=2, output_dir=out_dir,
    )  # fmt: skip
    session = current_session()
    assert any(isinstance(x, CollectiveMonitor) for x in session.worker.listeners)
    stop = threading.Event()
    threading.Thread(
        target=_sample_last_seconds, args=(port, Path(out_dir) / f"last.rank{rank}.txt", stop), daemon=True
    ).start()
    run_dir = session.run_dir
    assert run_dir is not None
    tensor = torch.ones(4)
    for step in range(100):
        with ot.step(step):
            if step == 4 and rank == 1:
                # This rank stops calling the collective: sleep until a peer named it, then die.
                deadline = time.monotonic() + 90
                while time.monotonic() < deadline and not _hang_events(run_dir):
                    time.sleep(0.2)
                time.sleep(1.0)
                (Path(out_dir) / "killed_at").write_text(str(time.time()))
                os._exit(1)
            if step == 4:
                (Path(out_dir) / f"blocked_at.rank{rank}").write_text(str(time.time()))
            dist.all_reduce(tensor)


def _hang_events(run_dir: Path) -> list[dict[str, Any]]:
    return [e for events in every_rank_events(run_dir, "hang").values() for e in events]


def _run_the_hang(tmp_path: Path, world_size: int) -> tuple[Path, str]:
    """Run `_hang_target`; the job ends when rank 1 dies. A job that failed before its ranks
    reached the hang (a gloo connect timeout or a taken port on a loaded host: a launch problem,
    not what this test is about) is launched once more; what it raised is returned either way."""
    for attempt in range(2):
        out = tmp_path / f"try{attempt}"
        out.mkdir()
        began = time.monotonic()
        with pytest.raises((RankError, TimeoutError)) as raised:
            run_ranks(world_size, _hang_target, (str(out),), timeout=150, env=FR_ON)
        # (a first job that ran long is not launched again: two would outlast pytest's timeout)
        if (out / "killed_at").exists() or attempt == 1 or time.monotonic() - began > 60:
            break
        logging.getLogger(__name__).warning("the hang job failed before it hung; again: %s", raised.value)
    return out, str(raised.value)


def _events_by_rank(run_dir: Path) -> dict[str, list[str]]:
    """Every rank's event names (what a failure prints)."""
    return {name: [e["event"] for e in events] for name, events in every_rank_events(run_dir).items()}


@pytest.mark.multirank
def test_hang_names_the_rank_that_never_reached_the_collective(tmp_path: Path) -> None:
    world_size = 4
    tmp_path, raised = _run_the_hang(tmp_path, world_size)
    run_dir = tmp_path / "hang"
    hangs = _hang_events(run_dir)
    assert len(hangs) == 1, (raised, _events_by_rank(run_dir))  # one for the job, from a waiting rank
    (event,) = hangs
    assert event["missing_ranks"] == "1" and event["op"] == "all_reduce"
    assert event["process_group"] == "default_pg"
    assert event["waiting_ranks"] == "0,2,3" and event["rank"] == 0
    assert event["files"].split(",")[0].endswith("stacks.rank1.0.txt")
    assert "rank 1" in event["message"] and "all_reduce" in event["message"]
    # the raw buffer beside the stacks, for torch's own fr_trace tool, without C++ stack traces
    # (symbolizing them imports torch._dynamo at the first dump: seconds of a frozen-looking watchdog)
    entries = pickle.loads((run_dir / "flight_recorder.rank1.0").read_bytes())["entries"]
    assert entries and not any(entry.get("frames") for entry in entries)
    # within one stall timeout (+ the grace for the peers' files), and while rank 1 still slept
    blocked_at = max(float((tmp_path / f"blocked_at.rank{r}").read_text()) for r in (0, 2, 3))
    # (a bound for 4 ranks on 2 shared cores, not a speed claim: the fresh-clone CI run measured
    # 8.9 s with other tests running; the watchdog polls about once a second)
    assert event["time"] - blocked_at < STALL_S + 2.0 + 15.0
    assert event["time"] < float((tmp_path / "killed_at").read_text())
    # last_seconds rose past the stall timeout on every rank while they hung
    killed_at = float((tmp_path / "killed_at").read_text())
    for rank in range(world_size):
        lines = (tmp_path / f"last.rank{rank}.txt").read_text().splitlines()
        hung = [float(v) for t, v in map(str.split, lines) if blocked_at + 0.5 < float(t) < killed_at]
        assert hung and hung == sorted(hung) and hung[-1] > STALL_S, (rank, hung)
    # and offline, after the job is gone, from the files the ranks left
    from otel_train.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["diagnose", str(run_dir)]) == 0
    text = out.getvalue()
    assert "rank 1" in text and "never reached all_reduce" in text and "default_pg" in text, text


def _busy_target(rank: int, world_size: int, out_dir: str) -> None:
    """Rank 0 evaluates (inside ot.span("eval"), no stall) for three stall windows while rank 1
    waits for it in the next all_reduce and stalls there."""
    import torch
    import torch.distributed as dist

    import otel_train as ot

    ot.init(run_name="busy", stall_timeout_s=STALL_S, prometheus_port=0, verbosity=0, hardware=False,
            log_interval=2, output_dir=out_dir)  # fmt: skip
    tensor = torch.ones(4)
    for step in range(8):
        with ot.step(step):
            dist.all_reduce(tensor)
        if step == 3 and rank == 0:
            with ot.span("eval"):
                time.sleep(3 * STALL_S + 6.0)  # past rank 1's stall, its grace and the question
    ot.shutdown()


@pytest.mark.multirank
def test_a_rank_busy_outside_the_collective_is_named_busy_not_hung(tmp_path: Path) -> None:
    """The ranks waiting in a collective ask the ranks that left no stall summary whether they are
    alive: rank 0, evaluating, answers, so its wait is a `collective_wait` naming it busy, never a
    `hang` (which reads as a dead host, and which an `on_event` hook may stop the job on)."""
    run_ranks(2, _busy_target, (str(tmp_path),), timeout=150, env=FR_ON)
    run_dir = tmp_path / "busy"
    events = every_rank_events(run_dir)
    assert not _hang_events(run_dir), _events_by_rank(run_dir)
    waits = [e for rank_events in events.values() for e in rank_events if e["event"] == "collective_wait"]
    assert len(waits) == 1, _events_by_rank(run_dir)
    (wait,) = waits
    assert wait["missing_ranks"] == "0" and wait["waiting_ranks"] == "1" and wait["rank"] == 1
    assert "rank 0" in wait["message"] and "not stalled" in wait["message"], wait["message"]


def _wait_for_event(run_dir: Path, name: str, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(every_rank_events(run_dir, name).values()):
            return True
        time.sleep(0.2)
    return False


def _busy_then_stuck_target(rank: int, world_size: int, out_dir: str, how: str) -> None:
    """Rank 0 evaluates while rank 1 waits for it in the next all_reduce; once rank 1 named it busy
    (`collective_wait`), rank 0 gets stuck in its evaluation: its own stall (past eval_timeout_s),
    or frozen (SIGSTOP; rank 1 sends SIGCONT once a `hang` is out, or after a minute)."""
    import signal

    import torch
    import torch.distributed as dist

    import otel_train as ot
    from otel_train.testing import current_session

    ot.init(run_name="stuck", stall_timeout_s=STALL_S, prometheus_port=0, verbosity=0, hardware=False,
            log_interval=2, output_dir=out_dir, eval_timeout_s=20.0 if how == "stalls" else 7200.0)  # fmt: skip
    run_dir = current_session().run_dir
    assert run_dir is not None
    pid_file = Path(out_dir) / "rank0.pid"
    if rank == 0:
        pid_file.write_text(str(os.getpid()))
    tensor = torch.ones(4)
    for step in range(8):
        with ot.step(step):
            dist.all_reduce(tensor)
        if step == 3 and rank == 0:
            with ot.span("eval"):
                _wait_for_event(run_dir, "collective_wait")
                (Path(out_dir) / "stuck_at").write_text(str(time.time()))
                if how == "freezes":
                    os.kill(os.getpid(), signal.SIGSTOP)
                else:
                    _wait_for_event(run_dir, "hang")
        if step == 3 and rank == 1 and how == "freezes":

            def wake_rank0() -> None:
                _wait_for_event(run_dir, "hang")
                os.kill(int(pid_file.read_text()), signal.SIGCONT)

            threading.Thread(target=wake_rank0, daemon=True).start()
    ot.shutdown()


@pytest.mark.multirank
@pytest.mark.parametrize("how", ["stalls", "freezes"])
def test_a_busy_rank_that_then_gets_stuck_turns_the_wait_into_a_hang(tmp_path: Path, how: str) -> None:
    """A `collective_wait` is not the last word: while the waiting rank stays stalled it asks the
    busy rank again every stall timeout, and a busy rank that stalls itself, or stops answering
    (frozen), is then named in a `hang`."""
    run_ranks(2, _busy_then_stuck_target, (str(tmp_path), how), timeout=150, env=FR_ON)
    run_dir = tmp_path / "stuck"
    names = _events_by_rank(run_dir)
    waits = [e for events in every_rank_events(run_dir, "collective_wait").values() for e in events]
    assert len(waits) == 1 and waits[0]["rank"] == 1, names
    hangs = _hang_events(run_dir)
    assert len(hangs) == 1, names
    (hang,) = hangs
    assert hang["rank"] == 1 and hang["missing_ranks"] == "0" and hang["waiting_ranks"] == "1"
    assert "not stalled" not in hang["message"], hang["message"]
    # after rank 0 got stuck: within its eval timeout (its own stall) or a few questions (frozen)
    stuck_at = float((tmp_path / "stuck_at").read_text())
    assert hang["time"] > stuck_at


def _summary(rank: int, enqueued: int, completed: int, ops: dict[str, str]) -> dict[str, Any]:
    group = {"label": "default_pg", "last_enqueued": enqueued, "last_completed": completed, "ops": ops}
    return {"rank": rank, "host": f"h{rank}", "stacks": f"stacks.rank{rank}.0.txt", "groups": {"0": group}}


def _quiet_work_target(rank: int, world_size: int, out_dir: str) -> dict[str, list[float]]:
    """Both ranks evaluate 15 batches with no collective; then rank 0 alone while rank 1 waits for it
    in a barrier; then both sit 2.5 s with no progress at all (stalled); then rank 0 writes a
    checkpoint while rank 1 waits for it in a barrier, both inside `ot.span("checkpoint")`.
    `last_seconds` sampled in each. Rank 0 ends its evaluation and its save when rank 1 says (a
    file) it has the samples of its wait that the test needs, not after a set time: on a loaded
    host rank 1 may reach the barrier late, or sample it seldom."""
    import torch
    import torch.distributed as dist

    import otel_train as ot
    from otel_train import adapters
    from otel_train.testing import current_session

    ot.init(
        run_name="quiet", stall_timeout_s=STALL_S, prometheus_port=0, verbosity=0, hardware=False,
        output_dir=out_dir,
    )  # fmt: skip
    session = current_session()
    monitor = next(x for x in session.worker.listeners if isinstance(x, CollectiveMonitor))
    seen: dict[str, list[float]] = {"eval": [], "alone": [], "waiting": [], "stalled": [], "saving": []}

    def evaluate(key: str, batches: int) -> None:
        for _ in range(batches):
            time.sleep(0.2)
            adapters.heartbeat()  # an eval batch: progress, and no collective
            seen[key].append(monitor.last_seconds())

    def wait_in_barrier(key: str, enough: Callable[[list[float]], bool]) -> None:
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.2):
                seen[key].append(monitor.last_seconds())
                if enough(seen[key]):
                    (Path(out_dir) / key).touch()  # rank 0 may let it go

        sampler = threading.Thread(target=sample)
        sampler.start()
        dist.barrier()
        stop.set()
        sampler.join()

    def until_rank1_has(key: str, work: Callable[[], None]) -> None:
        give_up = time.monotonic() + 60  # rank 1 never says: its samples fail the test below
        while not (Path(out_dir) / key).exists() and time.monotonic() < give_up:
            work()

    tensor = torch.ones(4)
    for step in range(3):
        with ot.step(step):
            dist.all_reduce(tensor)
    evaluate("eval", 15)
    if rank == 0:
        evaluate("alone", 5)
        until_rank1_has("waiting", lambda: evaluate("alone", 1))
        dist.barrier()
    else:
        wait_in_barrier("waiting", lambda waited: len(waited) >= 5 and waited[-1] > 1.0)
    for _ in range(10):  # no step, no eval batch: past the stall timeout, with no collective pending
        time.sleep(0.25)
        seen["stalled"].append(monitor.last_seconds())  # read as each export reads it
    dist.barrier()
    with ot.span("checkpoint"):
        if rank == 0:
            until_rank1_has("saving", lambda: time.sleep(0.05))  # torch.save of the whole model
            dist.barrier()
        else:
            wait_in_barrier("saving", lambda waited: len(waited) >= 5)
    ot.shutdown()
    return seen


@pytest.mark.multirank
def test_last_seconds_rises_in_a_pending_collective_or_a_stall_not_in_quiet_progress(tmp_path: Path) -> None:
    """An evaluation that runs no collective is no collective hang (it read 3 s here, and paged at
    5 min): 0 on a rank that makes progress with nothing pending, rising on the rank waiting in the
    barrier for it, and on a stalled rank even with nothing pending; 0 on a rank that waits in a
    barrier inside a declared checkpoint save."""
    rank0, rank1 = run_ranks(2, _quiet_work_target, (str(tmp_path),), timeout=120, env=FR_ON)
    for seen in (rank0, rank1):
        assert len(seen["eval"]) == 15 and set(seen["eval"]) == {0.0}
        assert seen["stalled"][-1] > STALL_S
    assert len(rank0["alone"]) >= 5 and set(rank0["alone"]) == {0.0}
    waiting = rank1["waiting"]  # (the last sample may come after the barrier let go)
    rising = waiting[: waiting.index(max(waiting)) + 1]
    assert len(rising) >= 5 and rising == sorted(rising) and rising[-1] > 1.0, waiting
    assert len(rank1["saving"]) >= 5 and set(rank1["saving"]) == {0.0}, rank1["saving"]


def test_a_waiting_rank_leaves_the_word_to_a_lower_rank_whose_summary_comes_late(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loaded host (seen in CI): ranks 0 and 3 stall, and write their summaries, a grace later
    than rank 2. Rank 2 must not speak for the job with waiting ranks '2': rank 1 (the culprit) is
    known already, so it waits one more grace for rank 0, which then speaks with every waiter."""
    from otel_train.diagnostics import hang_attribution
    from otel_train.diagnostics.hang_attribution import HangReporter

    waiting = {str(s): "all_reduce" for s in range(3, 8)}
    everyone = {r: _summary(r, 7, 6, waiting) for r in (0, 2, 3)} | {
        1: _summary(1, 6, 6, {"6": "all_reduce"})
    }
    events = Events()
    reporter = HangReporter(tmp_path, 2, 4, "h2", events, cast(Any, None), stall_timeout_s=1.0)
    reporter.grace_s = 0.3
    compared: list[int] = []  # ranks 0 and 3 write only once rank 2 has compared what it had

    def read(run_dir: Path, since: float, role: str) -> dict[int, dict[str, Any]]:
        return {r: summary for r, summary in everyone.items() if r in (1, 2) or compared}

    def compare(summaries: dict[int, Any], world_size: int) -> list[Verdict]:
        compared.append(len(summaries))
        return attribute(summaries, world_size)

    monkeypatch.setattr(hang_attribution, "read_summaries", read)
    monkeypatch.setattr(hang_attribution, "attribute", compare)
    reporter._compare(since=(0.0, 0.0))
    assert compared == [2, 4]
    assert reporter.verdicts == [Verdict("default_pg", "all_reduce", 7, (1,), (0, 2, 3), ())]
    assert events.named("hang") == []  # rank 0 speaks for the job
    # Ranks 0 and 3 never write: after its second grace rank 2 speaks, naming the culprit
    del everyone[0], everyone[3]
    reporter._compare(since=(0.0, 0.0))
    assert [e[2]["missing_ranks"] for e in events.named("hang")] == ["1"]
    assert events.named("hang")[0][2]["waiting_ranks"] == "2"


def test_attribution_names_missing_ranks_and_silent_ones_only_when_none_is_missing() -> None:
    waiting = {str(s): "all_reduce" for s in range(3, 8)}
    summaries = {r: _summary(r, 7, 6, waiting) for r in (0, 2, 3)} | {
        1: _summary(1, 6, 6, {"6": "all_reduce"})
    }
    assert attribute(summaries, 4) == [Verdict("default_pg", "all_reduce", 7, (1,), (0, 2, 3), ())]
    # rank 1 left nothing (dead): it is named as silent
    del summaries[1]
    assert attribute(summaries, 4) == [Verdict("default_pg", "all_reduce", 7, (), (0, 2, 3), (1,))]
    # in a subgroup, a rank without a file may not be a member: not named
    subgroup = {r: {**summaries[r], "groups": {"5": summaries[r]["groups"]["0"]}} for r in summaries}
    assert attribute(subgroup, 4) == []
    # every member inside the same collective and all present: nobody to blame
    summaries[1] = _summary(1, 7, 6, waiting)
    assert attribute(summaries, 4) == []


def _entry(rid: int, op: str = "all_reduce", retired: bool = True) -> dict[str, Any]:
    return {
        "record_id": rid, "process_group": ["0", "default_pg"], "profiling_name": f"gloo:{op}",
        "input_sizes": [[10, 2]], "input_dtypes": ["BFloat16"], "retired": retired, "state": "scheduled",
    }  # fmt: skip


def test_each_collective_is_counted_once_and_a_wrapped_buffer_is_said_once(caplog) -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    monitor = CollectiveMonitor(MeterProvider(metric_readers=[reader]).get_meter("t"), {"7"})
    telemetry = {**_entry(4), "process_group": ["7", "otel_train"]}  # otel_train's own: never counted
    monitor.count([_entry(0), _entry(1), _entry(2, retired=False)])  # #2 still running
    monitor.count([_entry(1), _entry(2), _entry(3, "broadcast"), telemetry])  # read again: #1 not twice
    monitor.count([telemetry, _entry(5)])  # no gap: #4 is the telemetry group's
    monitor.count([_entry(11), _entry(12)])  # #6-#10 left the ring buffer unread
    monitor.count([_entry(13), _entry(14)])
    # the NCCL recorder numbers its own entries from 0, and measures durations
    nccl = {**_entry(0, "reduce_scatter", retired=False), "state": "completed", "duration_ms": 250.0}
    monitor.count([{**nccl, "process_group": ["3", "dp"]}], "nccl")
    points = {
        (m.name, p.attributes[semconv.COLLECTIVE_OP]): p.value
        for rm in reader.get_metrics_data().resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name != semconv.COLLECTIVE_LAST.name
        for p in m.data.data_points
    }
    assert points[(semconv.COLLECTIVE_COUNT.name, "all_reduce")] == 8
    assert points[(semconv.COLLECTIVE_COUNT.name, "broadcast")] == 1
    assert points[(semconv.COLLECTIVE_SIZE.name, "all_reduce")] == 8 * 40
    assert points[(semconv.COLLECTIVE_COUNT.name, "reduce_scatter")] == 1
    assert points[(semconv.COLLECTIVE_TIME.name, "reduce_scatter")] == 0.25
    assert {op for (_, op) in points} == {"all_reduce", "broadcast", "reduce_scatter"}
    assert monitor.overwritten == 5
    assert len([r for r in caplog.records if "wrapped" in r.getMessage()]) == 1


def test_a_gloo_status_behind_its_retired_entry_is_no_pending_collective(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch 2.13's gloo status can keep `last_completed_collective` one behind an op whose entry is
    retired, for good (about one run in ten after a step's all_reduce): then nothing is pending and
    an evaluation after it reads 0, not a wait rising from that op. An op not retired still pends,
    and so does a group NCCL records (its watchdog keeps its status with its entries)."""
    from opentelemetry.sdk.metrics import MeterProvider

    from otel_train.diagnostics import collectives

    status = {"0": {"last_enqueued_collective": 3, "last_completed_collective": 2}}
    entry = {**_entry(7), "collective_seq_id": 3}
    dump: dict[str, Any] = {"pg_status": status, "statuses": {"cpu": status}, "recorders": {"cpu": [entry]}}
    monkeypatch.setattr(collectives, "read_dump", lambda entries: dump)
    monitor = CollectiveMonitor(MeterProvider().get_meter("t"), set())
    assert [monitor.last_seconds(), monitor.last_seconds()] == [0.0, 0.0]
    status["0"] = {"last_enqueued_collective": 4, "last_completed_collective": 2}  # 4 runs, unretired
    monitor.last_seconds()  # the sequence ids moved: the wait counts from here
    assert monitor.last_seconds() > 0.0
    dump["statuses"] = {"nccl": status}
    status["0"] = {"last_enqueued_collective": 3, "last_completed_collective": 2}
    monitor.last_seconds()
    assert monitor.last_seconds() > 0.0


def _gloo_dump(completed: int, seqs: list[int], backend: str = "cpu") -> dict[str, Any]:
    """A rank's dump after all_reduce #10, the shape a real gloo rank wrote: its status says `completed`,
    and its recorder holds entries for `seqs` (all retired but #10 when `seqs` ends at 9)."""
    status = {"0": {"last_enqueued_collective": 10, "last_completed_collective": completed}}
    entries = [{**_entry(s), "collective_seq_id": s, "is_p2p": False} for s in seqs]
    if 10 not in seqs:
        entries.append({**_entry(10, retired=False), "collective_seq_id": 10, "is_p2p": False})
    return {
        "pg_status": status,
        "statuses": {backend: status},
        "entries": entries,
        "recorders": {backend: entries},
    }


def test_a_gloo_status_behind_its_retired_entries_is_not_a_rank_waiting_for_a_silent_peer() -> None:
    """torch 2.13's gloo status can stay behind ops whose entries are retired (seen 3 behind, with
    #8-#10 retired, after back-to-back all_reduces): every rank is done with #10 and stalled outside
    the collectives, one rank left no file. Nobody waits in a collective, so no verdict (read as is,
    rank 0 waited in #10 for silent rank 2)."""
    from otel_train.diagnostics.hang_attribution import summarize

    def completed(dump: dict[str, Any]) -> int:
        return int(summarize(dump, set(), 0, 3, "h0", None, None)["groups"]["0"]["last_completed"])

    lagging, healthy = _gloo_dump(7, [8, 9, 10]), _gloo_dump(10, [8, 9, 10])
    summaries = {r: summarize(d, set(), r, 3, f"h{r}", None, None) for r, d in enumerate([lagging, healthy])}
    assert summaries[0]["groups"]["0"]["last_completed"] == 10
    assert attribute(summaries, 3) == []
    assert completed(_gloo_dump(7, [8, 9])) == 9  # #10 still runs: rank 0 waits in it
    assert completed(_gloo_dump(7, [9, 10])) == 7  # #8 has no entry: nothing past it is assumed
    assert completed(_gloo_dump(7, [8, 9, 10], "nccl")) == 7  # NCCL's status is read as it is


def test_stray_and_malformed_files_are_skipped_not_fatal(tmp_path: Path) -> None:
    from otel_train.diagnostics.hang_attribution import read_summaries, summarize
    from otel_train.run_directory import RunFiles

    waiting = {str(s): "all_reduce" for s in range(3, 8)}
    for rank in (0, 2):
        RunFiles(tmp_path, rank).collectives.write_text(
            json.dumps({**_summary(rank, 7, 6, waiting), "written_at": 1.0})
        )
    RunFiles(tmp_path, 1).collectives.write_text(json.dumps({"rank": "x", "groups": []}))  # another version's
    RunFiles(tmp_path, 3).collectives.write_text(
        json.dumps({"rank": 3, "groups": {"0": {"last_enqueued": "7"}}})
    )
    assert sorted(read_summaries(tmp_path)) == [0, 2]
    # a Flight Recorder entry without a sequence id (an op gloo records outside a group) is skipped
    dump = {"pg_status": {"0": {"last_enqueued_collective": 2, "last_completed_collective": 1}},
            "entries": [{"process_group": ["0", "default_pg"], "collective_seq_id": None, "profiling_name": "x"},
                        {"process_group": ["0", "default_pg"], "collective_seq_id": 2, "profiling_name": "gloo:all_reduce"}]}  # fmt: skip
    summary = summarize(dump, set(), 0, 2, "h0", None, 1.0)
    assert list(summary["groups"]["0"]["ops"]) == ["2"]


def test_led_by_the_exchange_a_flush_reads_only_when_rank_0_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the cross-rank exchange timing the reads, a flush's own read on the budget freed since
    the last one would leave none for rank 0's next ask (its arrivals never came): the flush reads
    only the dump the exchange asked for at that flush, or at the final flush."""
    from types import SimpleNamespace

    from opentelemetry.sdk.metrics import MeterProvider

    from otel_train.diagnostics import collectives

    reads: list[bool] = []

    def read_dump(entries: bool) -> dict[str, Any]:
        reads.append(entries)
        return {"pg_status": {}, "statuses": {}, "recorders": {"cpu": [_entry(len(reads))]}}

    monkeypatch.setattr(collectives, "read_dump", read_dump)
    monitor = CollectiveMonitor(MeterProvider().get_meter("t"), set())
    monitor.led = lambda: True
    monitor.on_flush(SimpleNamespace(seq=1, final=False))  # type: ignore[arg-type]
    assert reads == [] and monitor.may_read()  # the budget is left for rank 0's ask
    monitor.read(2, force=True)  # the exchange's read at flush 2
    monitor.on_flush(SimpleNamespace(seq=2, final=False))  # type: ignore[arg-type]
    assert reads == [True]  # counted from that read, not read again
    monitor.on_flush(SimpleNamespace(seq=3, final=True))  # type: ignore[arg-type]
    assert reads == [True, True]
    monitor.led = lambda: False  # the exchange is off: the flushes read on their own budget
    monitor._next_read = 0.0
    monitor.on_flush(SimpleNamespace(seq=4, final=False))  # type: ignore[arg-type]
    assert reads == [True, True, True]


def test_a_planted_fifo_as_the_hang_request_never_blocks_the_watchdog(tmp_path: Path) -> None:
    """A rank that is not stalled looks for a stalled peer's request on its watchdog's tick: a FIFO
    there (anyone who can write the run dir may plant one) would block that thread for ever, and
    with it every later stall report."""
    from otel_train.diagnostics.hang_attribution import HangReporter
    from otel_train.run_directory import RunFiles

    os.mkfifo(RunFiles(tmp_path).hang_request)
    reporter = HangReporter(tmp_path, 1, 2, "host", cast(Any, None), cast(Any, None), stall_timeout_s=5.0)
    tick = threading.Thread(target=reporter.answer_requests, daemon=True)
    tick.start()
    tick.join(10)  # guards against the block only; it never measures speed
    assert not tick.is_alive(), "answer_requests blocked on a FIFO"


def test_only_a_fresh_question_of_another_rank_is_answered(tmp_path: Path) -> None:
    """An old hang_request.json (a stall long resolved) answered later overwrote the rank's summary
    from its own stall, which `otel-train diagnose` reads: it named invented culprits. Nor does a
    rank answer its own question."""
    from otel_train.diagnostics.hang_attribution import HangReporter
    from otel_train.run_directory import RunFiles

    reporter = HangReporter(tmp_path, 1, 4, "host", cast(Any, None), cast(Any, None), stall_timeout_s=4.0)
    answered: list[bool] = []
    reporter._write_summary = lambda stacks, progressing=False: answered.append(progressing)  # type: ignore[method-assign]
    request = RunFiles(tmp_path).hang_request

    def ask(by: int, age_s: float) -> None:
        request.write_text(json.dumps({"written_at": time.time() - age_s, "by": by}))
        os.utime(request, (time.time() - age_s, time.time() - age_s))
        reporter._request_checked = -math.inf  # the next tick looks
        reporter.answer_requests()

    ask(by=0, age_s=120.0)  # a stall long over
    ask(by=1, age_s=0.0)  # its own question
    assert answered == []
    ask(by=0, age_s=0.5)
    assert answered == [True]
