"""run.profile (the `Run` ot.init() returns): torch.profiler windows on a step schedule, traces per rank, profiled steps marked."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from helpers.otlp_receiver import attributes, http_receiver

import otel_train as ot
from otel_train.profiling import ProfileWindow
from otel_train.testing import capture_metrics, current_session


def _train(steps: int, start: int = 0) -> None:
    weight = torch.randn(16, 16)
    for step in range(start, start + steps):
        with ot.step(step), ot.timer("forward"):
            (weight @ weight).relu_().sum()


def _trace_steps(path: Path) -> set[str]:
    events = json.loads(path.read_text())["traceEvents"]
    return {e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")}


def test_window_positions() -> None:
    window = ProfileWindow(wait=1, warmup=1, active=2, repeat=2, skip_first=1)
    assert [window.is_active(p) for p in range(10)] == [
        False, False, False, True, True, False, False, True, True, False,
    ]  # fmt: skip
    assert window.length == 9
    with pytest.raises(ValueError, match="repeat >= 1"):
        ProfileWindow(repeat=0)


def test_traces_cover_exactly_the_scheduled_steps_and_are_counted() -> None:
    with capture_metrics(run_name="prof", log_interval=4, hardware=False) as capture:
        _train(2)  # steps 0, 1 run unprofiled
        assert ot.init().profile(wait=1, warmup=1, active=2, repeat=2) is True  # the running run
        _train(10, start=2)  # window: 2 wait, 3 warmup, 4-5 active, 6 wait, 7 warmup, 8-9 active
        session = current_session()
        assert session is not None and session.profiler is None  # finished and detached
        run_dir = session.run_dir
    traces = sorted((run_dir / "profiles" / "rank0").glob("*.json"))
    assert [t.name for t in traces] == ["steps4-5.json", "steps8-9.json"]
    for trace in traces:
        assert len(_trace_steps(trace)) == 2  # two recorded steps in each trace, no more
    assert sum(v for _, v in capture.series("train/profiled_steps")) == 4
    assert capture.last("train/steps") is not None  # the run went on


def test_a_repeating_window_cut_short_names_its_last_trace_by_the_steps_it_holds() -> None:
    """The run ends inside the third active stretch, after its first step: that trace holds step
    12 alone and is named so, not after the earlier stretch's step 9 too."""
    with capture_metrics(run_name="prof-cut", log_interval=4, hardware=False):
        _train(2)
        assert ot.init().profile(wait=1, warmup=1, active=2, repeat=3) is True
        _train(11, start=2)  # actives 4-5, 8-9, then 12 and the run ends
        run_dir = current_session().run_dir
    traces = {t.name for t in (run_dir / "profiles" / "rank0").glob("*.json")}
    assert traces == {"steps4-5.json", "steps8-9.json", "steps12-12.json"}


def test_profile_on_other_ranks_only_is_a_no_op_here() -> None:
    with capture_metrics(run_name="prof-ranks", hardware=False):
        assert ot.init().profile(active=1, ranks=[1, 2]) is False
        _train(3)
        session = current_session()
        assert session is not None
        assert not (session.run_dir / "profiles").exists()


def test_profiled_steps_are_traced_and_marked_in_their_spans() -> None:
    with http_receiver() as (endpoint, received):
        run = ot.init(
            run_name="prof-spans", otlp_endpoint=endpoint, prometheus_port=0, verbosity=0,
            hardware=False, trace_first=0, trace_every=1000,
        )  # fmt: skip
        _train(1)
        run.profile(wait=0, warmup=1, active=2)
        _train(4, start=1)
        ot.shutdown()
        steps = {
            attributes(span.attributes)["train.step"]: attributes(span.attributes)
            for _, span in received.spans()
            if span.name.startswith("train.step ")
        }
    # Only steps 2 and 3 were profiled; sampling (trace_every=1000) would have traced step 0 only.
    assert {s for s, a in steps.items() if a.get("train.profiled")} == {2, 3}
    assert set(steps) == {0, 2, 3}


def test_profile_after_shutdown_and_bad_arguments() -> None:
    with capture_metrics(run_name="prof-args", hardware=False):
        run = ot.init()
        with pytest.raises(ValueError, match="active >= 1"):
            run.profile(active=0)
    assert run.profile() is False  # the run has ended: nothing to profile


def test_a_trace_that_takes_seconds_to_write_is_no_stall(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writing a large window's trace (145 MB took 2 s) comes after its step's end: the watchdog
    must count it as progress, not page a stall with a stack dump."""
    from helpers.events import run_events

    export = torch.profiler.profile.export_chrome_trace

    def slow_export(self: torch.profiler.profile, path: str) -> None:
        time.sleep(3.0)  # a big trace on a slow disk: three stall windows
        export(self, path)

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", slow_export)
    with capture_metrics(
        run_name="slow-trace", output_dir=str(tmp_path), stall_timeout_s=1.0, hardware=False
    ):
        # before the first step, where nothing is judged: starting torch.profiler took 1.2 s here
        assert ot.init().profile(wait=0, warmup=0, active=2) is True
        _train(4)
        run_dir = current_session().run_dir
    assert sorted(p.name for p in (run_dir / "profiles" / "rank0").glob("*.json")) == ["steps0-1.json"]
    assert "stall" not in [e["event"] for e in run_events(run_dir)], run_events(run_dir)
