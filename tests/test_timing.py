"""The public step/phase API for adapters: ot.begin_step/end_step, timer and span start/stop,
ot.phase, ot.run_info — checked through what a flush hands to listeners and sinks."""

from __future__ import annotations

import contextlib
import time
from time import perf_counter_ns

import pytest

import otel_train as ot
from otel_train import adapters
from otel_train.core.buffer import Interval
from otel_train.testing import capture_metrics, current_session


class Intervals:
    """A flush listener that keeps every interval."""

    def __init__(self) -> None:
        self.seen: list[Interval] = []

    def on_flush(self, interval: Interval) -> None:
        self.seen.append(interval)

    def close(self) -> None:
        pass

    def merged(self, field: str) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for interval in self.seen:
            for name, values in getattr(interval, field).items():
                out.setdefault(name, []).extend(values)
        return out


def _listen() -> Intervals:
    listener = Intervals()
    session = current_session()
    assert session is not None
    session.worker.add_listener(listener)
    return listener


def test_begin_end_step_counts_steps_tokens_and_arrivals() -> None:
    with capture_metrics(log_interval=2, run_dir_enabled=False) as cap:
        seen = _listen()
        for i in range(4):
            mark = perf_counter_ns()
            assert adapters.begin_step(i, start_ns=mark - 2_000_000) == i  # backdated by 2 ms
            ot.timer("forward").start().stop()
            adapters.end_step(tokens=10, samples=2)
    assert sum(x.steps for x in seen.seen) == 4
    assert sum(x.tokens for x in seen.seen) == 40
    assert sum(x.samples for x in seen.seen) == 8
    arrivals = seen.merged("arrivals")["forward"]
    # A timer inside a begun step records its arrival, measured from the backdated start.
    assert len(arrivals) == 4 and all(a >= 0.002 for a in arrivals)
    assert all(d >= 0.002 for x in seen.seen for d in x.step_durations)
    assert cap.last("train/steps") is not None


def test_timer_start_at_an_earlier_reading_times_from_there() -> None:
    with capture_metrics(log_interval=1, run_dir_enabled=False):
        seen = _listen()
        adapters.begin_step(0)
        earlier = perf_counter_ns() - 50_000_000
        ot.timer("data").start(at_ns=earlier).stop()
        adapters.end_step()
    (duration,) = seen.merged("phases")["data"]
    assert 0.05 <= duration < 5.0


def test_timer_stop_at_an_earlier_reading_ends_and_arrives_there() -> None:
    with capture_metrics(log_interval=1, run_dir_enabled=False):
        seen = _listen()
        start = perf_counter_ns()
        adapters.begin_step(0, start_ns=start)
        ended = start + 30_000_000
        time.sleep(0.08)  # the hook runs later than the phase's end
        ot.timer("data").start(at_ns=start).stop(at_ns=ended)
        ot.timer("late").start(at_ns=ended).stop(at_ns=ended - 1)  # before its start: zero, not negative
        ot.timer("ahead").start(at_ns=start).stop(at_ns=start + 10**12)  # after now: ends now, not 1000 s on
        adapters.end_step()
    assert 0.08 <= seen.merged("phases")["ahead"][0] < 100.0
    assert seen.merged("phases")["data"] == [pytest.approx(0.03)]
    assert seen.merged("arrivals")["data"] == [pytest.approx(0.03)]  # where it ended, not when stopped
    assert seen.merged("phases")["late"] == [0.0]


def test_phase_by_duration_is_counted_without_an_arrival() -> None:
    with capture_metrics(log_interval=1, run_dir_enabled=False):
        seen = _listen()
        with ot.step(0):
            adapters.phase("generation", 0.25)
            adapters.phase("bad", -1.0)
            adapters.phase("bad", float("nan"))
            adapters.phase("bad", "x")  # type: ignore[arg-type]
            adapters.phase("deep", 1.0, level=2)  # above timing_log_level=1: ignored
    phases = seen.merged("phases")
    assert phases["generation"] == [0.25]
    assert "bad" not in phases and "deep" not in phases
    assert "generation" not in seen.merged("arrivals")


def test_span_start_stop_is_a_traced_mark() -> None:
    with capture_metrics(log_interval=1, run_dir_enabled=False):
        seen = _listen()
        with ot.step(0):
            pass
        ot.span("eval", {"k": 1}).start(at_ns=perf_counter_ns() - 10_000_000).stop()
        with ot.step(1):
            pass
    (duration,) = seen.merged("phases")["eval"]
    assert duration >= 0.01


def test_end_step_without_begin_and_double_begin_are_handled(caplog) -> None:
    with capture_metrics(log_interval=100, run_dir_enabled=False):
        seen = _listen()
        adapters.end_step()  # nothing open: dropped, counted, warned
        adapters.begin_step(0)
        adapters.begin_step(1)  # step 0 still open: ended first
        adapters.end_step()
        adapters.end_step()  # second end: ignored
        session = current_session()
        assert session is not None
        assert session.buffer.dropped.get("no_open_step") == 2
    assert sum(x.steps for x in seen.seen) == 2
    assert "without ot.begin_step" in caplog.text and "while step 0 is open" in caplog.text


def test_failed_step_is_not_counted() -> None:
    with capture_metrics(log_interval=100, run_dir_enabled=False):
        seen = _listen()
        adapters.begin_step(0)
        adapters.end_step(failed=True)
        adapters.begin_step(1)
        adapters.end_step()
    assert sum(x.steps for x in seen.seen) == 1


def test_failed_steps_are_counted_by_error_type() -> None:
    """A loop that skips a failing batch (an OOM, a bad sample) sees each failure as phase `step`
    with the error's type, beside the counts and durations of the steps that completed."""
    with capture_metrics(log_interval=100) as cap:
        for index in range(5):
            with contextlib.suppress(MemoryError), ot.step(index):
                if index in (1, 3):
                    raise MemoryError
        adapters.begin_step(5)
        adapters.end_step(failed=True)  # a framework's step whose end hook never came
    flushed = cap.flushes[-1][1]
    assert flushed["train/steps"] == 3 and flushed["timers/step/count"] == 3
    assert flushed["timers/step/MemoryError/count"] == 2
    assert flushed["timers/step/StepFailed/count"] == 1


def test_a_span_stopped_at_an_earlier_reading_ends_there() -> None:
    """`ot.span(name).start(at_ns=a).stop(at_ns=b)`: a hook that runs after the end books the
    span's own time (b - a); a reading before its start ends it at its start; a float is a bug."""
    with capture_metrics(log_interval=100, run_dir_enabled=False):
        seen = _listen()
        begun = perf_counter_ns() - 10_000_000  # 10 ms ago
        ot.span("checkpoint_restore").start(at_ns=begun).stop(at_ns=begun + 2_000_000)
        ot.span("eval").start(at_ns=begun).stop(at_ns=begun - 5)
        with pytest.raises(TypeError, match="at_ns"):
            ot.span("eval").start().stop(at_ns=1.5)  # type: ignore[arg-type]
        with ot.step(0):
            pass
    phases = seen.merged("phases")
    assert phases["checkpoint_restore"] == [pytest.approx(0.002)]
    assert phases["eval"][0] == 0.0


def test_everything_is_a_no_op_before_init() -> None:
    assert adapters.begin_step(3) is None
    adapters.end_step(tokens=5)
    adapters.phase("x", 1.0)
    ot.timer("x").start().stop()
    ot.span("x").start().stop()
    assert ot.run_info() is None


def test_stop_without_start_does_nothing() -> None:
    with capture_metrics(log_interval=1, run_dir_enabled=False):
        seen = _listen()
        scope = ot.timer("forward")
        scope.stop()
        scope.start()
        scope.stop()
        scope.stop()
        with ot.step(0):
            pass
    assert len(seen.merged("phases")["forward"]) == 1


@pytest.mark.parametrize("run_dir", [True, False])
def test_run_info_names_the_run(run_dir: bool) -> None:
    with capture_metrics(run_dir_enabled=run_dir, run_name="info-run"):
        info = ot.run_info()
        assert info is not None
        assert (info.run_name, info.rank, info.world_size, info.step) == ("info-run", 0, 1, -1)
        assert (info.run_dir is not None) == run_dir
        with ot.step(0):
            time.sleep(0)
        assert ot.run_info().step == 0  # type: ignore[union-attr]


def test_timer_stop_at_an_earlier_reading_clamps_and_respects_the_level() -> None:
    with capture_metrics(log_interval=1, run_dir_enabled=False):
        seen = _listen()
        step_start = perf_counter_ns()
        adapters.begin_step(0, start_ns=step_start)
        start, end = step_start + 1_000_000, step_start + 4_000_000  # a phase reported after the fact
        time.sleep(0.02)
        ot.timer("forward").start(at_ns=start).stop(at_ns=end)
        ot.timer("clamped").start(at_ns=end).stop(at_ns=start)  # an end before the start: zero length
        ot.timer("deep", level=2).start(at_ns=start).stop(at_ns=end)  # above the level: no-op
        adapters.end_step()
    phases, arrivals = seen.merged("phases"), seen.merged("arrivals")
    assert phases["forward"] == [pytest.approx(0.003)] and phases["clamped"] == [0.0]
    assert arrivals["forward"] == [pytest.approx(0.004)]  # where it ended, not when stop() ran
    assert "deep" not in phases


def test_a_later_start_reading_is_counted_and_wrong_argument_types_raise(caplog) -> None:
    """A later or non-positive `perf_counter_ns()` reading is a bad value: timed from now, counted
    and warned once. A float reading (`perf_counter()` seconds), a str, or an exception instance
    for `error=` is the caller's bug: TypeError naming the fix, also before `init()`."""
    bad_calls = [
        (lambda: ot.timer("float").start(at_ns=time.perf_counter()), r"start\(at_ns=.*\) needs an int from"),
        (lambda: ot.timer("text").start(at_ns="x"), r"start\(at_ns='x'\) needs an int"),  # type: ignore[arg-type]
        (lambda: ot.timer("t").start().stop(at_ns=1.5), r"stop\(at_ns=1.5\) needs an int"),  # type: ignore[arg-type]
        (lambda: ot.timer("t").start().stop(error=ValueError("boom")), r"pass type\(exc\)"),  # type: ignore[arg-type]
        (lambda: ot.span("eval").start(at_ns=1.5), r"needs an int from time.perf_counter_ns"),  # type: ignore[arg-type]
        (lambda: ot.span("eval").start().stop(error=KeyError("k")), r"pass type\(exc\)"),  # type: ignore[arg-type]
        (lambda: adapters.begin_step(start_ns=1.5), r"begin_step\(start_ns=1.5\) needs an int"),  # type: ignore[arg-type]
    ]
    for call, fix in bad_calls:  # before init(): the same checks on the no-op scopes
        with pytest.raises(TypeError, match=fix):
            call()
    with capture_metrics(log_interval=1, run_dir_enabled=False) as cap:
        seen = _listen()
        with ot.step(0):
            for call, fix in bad_calls[:-1]:
                with pytest.raises(TypeError, match=fix):
                    call()
            ot.timer("future").start(at_ns=perf_counter_ns() + 10**12).stop()
            ot.timer("zero").start(at_ns=0).stop()
            ot.timer("failed").start().stop(error=ValueError)
    phases = seen.merged("phases")
    assert all(d < 1.0 for name in ("future", "zero") for d in phases[name])  # not the uptime
    assert cap.last("otel_train/dropped/invalid_value") == 2
    assert caplog.text.count("is not an earlier time.perf_counter_ns() reading") == 1


def test_a_single_process_flushes_after_log_interval_s_and_when_another_thread_asks() -> None:
    import threading

    # log_interval far away: only the two slow reasons can flush here (2 s: room on a loaded host)
    with capture_metrics(log_interval=1_000_000, log_interval_s=2.0, run_dir_enabled=False):
        seen = _listen()
        with ot.step(0):
            pass
        assert seen.seen == []
        time.sleep(2.1)
        with ot.step(1):
            pass  # ends after log_interval_s: flushes
        deadline = time.monotonic() + 10
        while not seen.seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [x.step for x in seen.seen] == [1]
        with ot.step(2):
            pass  # within log_interval_s of the last flush: none
        session = current_session()
        assert session is not None

        def ask() -> None:  # as the SIGTERM thread does when a user handler keeps the run going
            ot.log_metrics({"eval/loss": 1.5}, step=2)
            session.flush()

        asker = threading.Thread(target=ask)
        asker.start()
        asker.join()
        with ot.step(3):
            pass  # the flush the other thread asked for
        while len(seen.seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [x.step for x in seen.seen] == [1, 3]
        assert seen.seen[1].scalars["eval.loss"] == [1.5]


@pytest.mark.parametrize("log_interval", [None, 5])
def test_an_infinite_log_interval_s_never_flushes_on_time_and_never_raises(log_interval: int | None) -> None:
    """log_interval_s=inf (accepted: > 0) means "never by time": no OverflowError at init() or in
    the adaptive cadence, and the steps still flush."""
    with capture_metrics(log_interval=log_interval, log_interval_s=float("inf"), run_dir_enabled=False):
        seen = _listen()
        for i in range(30):
            with ot.step(i):
                pass
        deadline = time.monotonic() + 10
        while not seen.seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen.seen and seen.seen[0].step in (4, 9)


class _FakeCuda:
    """torch.cuda's part a CUDA timer uses, on a host: streams are names, and an event's time is
    the fake clock's reading when it was recorded (what the device reports, in ms)."""

    def __init__(self) -> None:
        self.stream = "default"
        self.now_ms = 0.0
        self.stream_lookups = 0
        self.recorded: list[str] = []
        cuda = self

        class Event:
            def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
                # blocking: the worker waiting for the end event sleeps instead of spinning a core
                assert enable_timing and blocking
                self.at_ms: float | None = None

            def record(self, stream: str | None = None) -> None:
                assert stream is not None  # the stream of the timer's start, never a fresh lookup
                cuda.recorded.append(stream)
                self.at_ms = cuda.now_ms

            def synchronize(self) -> None:
                assert self.at_ms is not None

            def elapsed_time(self, end: Event) -> float:
                assert self.at_ms is not None and end.at_ms is not None
                return end.at_ms - self.at_ms

        self.Event = Event

    def current_stream(self) -> str:
        self.stream_lookups += 1
        return self.stream


def test_a_cuda_timer_records_both_events_on_the_stream_current_at_its_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`ot.timer(cuda=True)` looks the current stream up once and records its end event there too,
    even when the body switched streams; the worker reads the device's time between the two."""
    from otel_train.core import scopes

    cuda = _FakeCuda()
    monkeypatch.setattr(scopes, "_torch_cuda", cuda)
    with capture_metrics(log_interval=2, run_dir_enabled=False):
        seen = _listen()
        for i in range(2):
            with ot.step(i):
                with ot.timer("forward", cuda=True):
                    cuda.stream = "side"  # the body moves to another stream and stays there
                    cuda.now_ms += 30.0
                cuda.stream = "default"
                with ot.timer("backward", cuda=True):
                    cuda.now_ms += 50.0
    assert cuda.stream_lookups == 4  # one per timer
    assert cuda.recorded == ["default"] * 8
    phases = seen.merged("phases")
    assert phases["forward"] == pytest.approx([0.030, 0.030])  # the device's time, not the host's
    assert phases["backward"] == pytest.approx([0.050, 0.050])


def test_a_cuda_timer_without_cuda_is_a_host_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    from otel_train.core import scopes

    monkeypatch.setattr(scopes, "_torch_cuda", False)
    with capture_metrics(log_interval=1, run_dir_enabled=False):
        seen = _listen()
        with ot.step(0), ot.timer("forward", cuda=True):
            time.sleep(0.002)
    [forward] = seen.merged("phases")["forward"]
    assert forward >= 0.002
