"""The instrumentation API: no-op before init, steps, timers (nesting, threads, async, errors),
levels, idempotent lifecycle, and the flattening the bridges receive."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import otel_train as ot
from otel_train import semconv
from otel_train.testing import capture_metrics, current_session


def test_everything_is_a_noop_before_init() -> None:
    assert current_session() is None
    with ot.step(0, tokens=10), ot.timer("forward"):
        ot.record("loss", 1.0)
    ot.log_metrics({"a": 1})
    ot.log_text("t", "x")
    ot.shutdown()  # nothing to shut down, still fine

    @ot.timer("f")
    def f() -> int:
        return 3

    assert f() == 3


def test_init_is_idempotent_and_context_manager(tmp_path) -> None:
    with ot.init(prometheus_port=0, verbosity=0, output_dir=str(tmp_path), run_name="r") as run:
        assert isinstance(run, ot.Run) and ot.init() == run  # the same run, not a second session
        assert run.run_dir is not None and run.run_dir == tmp_path / "r" and run.run_name == "r"
        assert (run.rank, run.world_size, run.prometheus_url) == (0, 1, None)
        with ot.step(0):
            pass
        info = run.info()
        assert info == ot.run_info() and info.run_id == run.run_id and info.step == 0
    assert current_session() is None  # the block shut it down
    run.shutdown()  # again: nothing to do
    ot.shutdown()


def test_steps_timers_and_flattened_keys() -> None:
    with capture_metrics(log_interval=4, run_id="r1") as cap:
        for i in range(8):
            with ot.step(i, tokens=100, samples=2):
                with ot.timer("forward"):
                    time.sleep(0.002)
                with ot.timer("backward"):
                    pass
                ot.record("loss", 3.0 - i)
    first = cap.flushes[0][1]
    assert cap.flushes[0][0] == 3
    assert first["train/steps"] == 4
    assert first["throughput/tokens"] == 400
    assert first["throughput/tokens_per_s"] > 0
    assert first["timers/forward/count"] == 4
    assert first["timers/forward/mean"] >= 0.002
    assert first["timers/forward/min"] <= first["timers/forward/mean"] <= first["timers/forward/max"]
    assert "timers/forward/p50" in first
    assert first["timers/step/count"] == 4
    assert first["train/loss"] == 1.5  # the interval's mean: (3 + 2 + 1 + 0) / 4
    assert (first["train/loss_min"], first["train/loss_max"], first["train/loss_last"]) == (0.0, 3.0, 0.0)
    assert cap.last("train/loss") == -2.5


def test_step_and_phase_quantiles_are_the_intervals_own() -> None:
    """Not the buckets' interpolation: 0.1 ms durations share the first bucket with a slow one, and
    interpolating there put the median ~20 times above them (and above the mean)."""
    from otel_train import adapters

    with capture_metrics(log_interval=10) as cap:
        for i in range(10):
            with ot.step(i):
                adapters.phase("generate", 0.004 if i == 9 else 0.0001)
    row = cap.flushes[0][1]
    assert row["timers/generate/p50"] == pytest.approx(0.0001)
    assert row["timers/generate/p95"] == pytest.approx(0.0001 + 0.0039 * 0.55)  # rank 8.55 of 0..9
    assert row["timers/step/p50"] <= row["timers/step/p95"] <= row["timers/step/max"]


def test_a_generator_function_is_refused_as_a_timed_function() -> None:
    """Its call only makes the generator: a timer around it would time nothing (a bug to say)."""

    def batches() -> Any:
        yield 1

    async def agen() -> Any:
        yield 1

    for fn in (batches, agen):
        with pytest.raises(TypeError, match="cannot decorate the generator function"):
            ot.timer("data")(fn)
        with pytest.raises(TypeError, match="around the loop body"):
            ot.step(fn)


@pytest.mark.parametrize("initialised", [False, True])
def test_a_timer_decorator_without_a_name_says_so_at_the_first_call(initialised: bool) -> None:
    """`@ot.timer` (as `@ot.step` may be written) made the function the name: each call returned a
    wrapper of its argument instead of the result, silently."""
    if initialised:
        ot.init(prometheus_port=0, verbosity=0, run_dir_enabled=False, hardware=False)

    @ot.timer  # type: ignore[arg-type]
    def forward(x: int) -> int:
        return 2 * x

    with pytest.raises(
        TypeError, match=r"@ot.timer on .*forward.* needs a name: write @ot.timer\('forward'\)"
    ):
        forward(21)
    with pytest.raises(TypeError, match="needs a name"):
        forward(lambda: None)  # a callable argument too (a model) would be wrapped, not timed


def test_decorators_nesting_threads_async_and_errors() -> None:
    @ot.step
    def train_step() -> None:
        with ot.timer("outer"), ot.timer("inner"):
            pass

    @ot.timer("async_phase")
    async def async_work() -> int:
        await asyncio.sleep(0.001)
        return 7

    @ot.timer("raises")
    def boom() -> None:
        raise ValueError("boom")

    def worker() -> None:
        for _ in range(5):
            with ot.timer("thread_phase"):
                pass

    with capture_metrics(log_interval=100) as cap:
        for _ in range(3):
            train_step()
        assert asyncio.run(async_work()) == 7
        threads = [threading.Thread(target=worker) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with pytest.raises(ValueError, match="boom"):
            boom()
    flushed = cap.flushes[-1][1]
    assert flushed["train/steps"] == 3
    assert flushed["timers/outer/count"] == 3 and flushed["timers/inner/count"] == 3
    assert flushed["timers/async_phase/count"] == 1
    assert flushed["timers/thread_phase/count"] == 15
    assert flushed["timers/raises/ValueError/count"] == 1  # error.type attribute -> key segment


def test_timing_level_filters_timers() -> None:
    with capture_metrics(log_interval=100, timing_log_level=1) as cap, ot.step(0):
        with ot.timer("coarse", level=0):
            pass
        with ot.timer("fine", level=2):
            pass
    flushed = cap.flushes[-1][1]
    assert "timers/coarse/count" in flushed
    assert not any(k.startswith("timers/fine") for k in flushed)


def test_timer_decorates_before_and_after_init_and_keeps_its_level() -> None:
    """`@ot.timer(name)` (what `ot.timed` was): a fresh timer per call, also for a function decorated
    before `init()`, and the decorated level is checked at each call against the running session's."""

    @ot.timer("fine_fn", level=2)
    def fine() -> None:
        pass

    @ot.timer("coarse_fn")
    def coarse() -> None:
        pass

    with capture_metrics(log_interval=100, timing_log_level=1) as cap, ot.step(0):
        fine()
        coarse()
        coarse()
        late = ot.timer("late_fn", level=2)(lambda: None)  # decorated while above the level
        late()
    flushed = cap.flushes[-1][1]
    assert flushed["timers/coarse_fn/count"] == 2
    assert not any(k.startswith(("timers/fine_fn", "timers/late_fn")) for k in flushed)
    with capture_metrics(log_interval=100, timing_log_level=2) as cap, ot.step(0):
        fine()
        late()
    flushed = cap.flushes[-1][1]
    assert flushed["timers/fine_fn/count"] == 1 and flushed["timers/late_fn/count"] == 1


def test_adapters_current_run_is_the_running_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from otel_train import adapters

    assert adapters.current_run() is None  # never starts one
    with ot.init(prometheus_port=0, verbosity=0, output_dir=str(tmp_path), run_name="a") as run:
        assert adapters.current_run() == run and adapters.current_run() == ot.init()
    assert adapters.current_run() is None
    with ot.init(prometheus_port=0, verbosity=0, output_dir=str(tmp_path), run_name="b"):
        assert adapters.current_run() != run and adapters.current_run() is not None


def test_log_metrics_prefix_and_eval_keys() -> None:
    with capture_metrics(log_interval=100) as cap:
        with ot.step(0):
            pass
        ot.log_metrics({"loss": 1.25, "perplexity": 3.49, "accuracy": 0.5}, step=0, prefix="eval/")
        ot.log_metrics({"my_metric": 2})
    # step= is one row at that step (it rides the final flush: log_interval=100), and only there
    evals = [(s, f) for s, f in cap.flushes if "eval/loss" in f]
    assert [s for s, _ in evals] == [0]
    assert evals[0][1]["eval/loss"] == 1.25
    assert evals[0][1]["eval/perplexity"] == 3.49
    assert evals[0][1]["eval/accuracy"] == 0.5
    assert cap.flushes[-1][1]["train/my_metric"] == 2


def test_log_metrics_files_values_under_the_step_given(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`step=N` is the step the run dir and every bridge file the values under, and the only one, as
    a framework's built-in logger does: for a past step, a future one and the open one alike (an
    eval logged with `step=6` after step 9 is at 6), never again in a later flush's row although
    the gauge keeps its value."""
    from helpers.readback import read_tensorboard

    ot.init(prometheus_port=0, verbosity=0, log_interval=5, output_dir=str(tmp_path), run_name="s",
            tensorboard=True)  # fmt: skip
    for i in range(10):
        with ot.step(i):
            ot.record("loss", 1.0)
            if i == 4:
                ot.log_metrics({"eval/F1": 0.25}, step=4)  # inside the open step 4
    ot.log_metrics({"eval/F1": 0.5, "eval/loss": 2.0}, step=6)  # late: after step 9
    ot.log_metrics({"eval/F1": 0.75}, step=9)  # the last completed step
    for i in range(10, 20):
        with ot.step(i):
            ot.record("loss", 1.0)
    ot.shutdown()
    rows = [json.loads(line) for line in (tmp_path / "s" / "metrics.rank0.jsonl").read_text().splitlines()]
    filed = [(r["step"], r["eval/F1"]) for r in rows if "eval/F1" in r]
    assert sorted(filed) == [(4, 0.25), (6, 0.5), (9, 0.75)]
    assert [r["step"] for r in rows if "eval/loss" in r] == [6]
    assert not any(k.startswith("eval/F1_") for r in rows for k in r)  # no interval statistics either
    assert sum("train/loss" in r for r in rows) >= 4  # the training values' flushes go on
    scalars = read_tensorboard(tmp_path / "s" / "tensorboard").scalars
    assert sorted(scalars["eval/F1"]) == [(4, 0.25), (6, 0.5), (9, 0.75)]
    assert sorted(scalars["eval/loss"]) == [(6, 2.0)]


def test_log_metrics_with_each_step_keeps_the_flush_schedule(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A `wandb.log(..., step=i)` port: `log_metrics(step=i)` after every step files each value at
    its step, and the flushes stay on their schedule (every 10 steps here), not one per call."""
    ot.init(prometheus_port=0, verbosity=0, log_interval=10, output_dir=str(tmp_path), run_name="s")
    for i in range(50):
        with ot.step(i):
            pass
        ot.log_metrics({"loss": float(i)}, step=i)
    ot.shutdown()
    rows = [json.loads(line) for line in (tmp_path / "s" / "metrics.rank0.jsonl").read_text().splitlines()]
    assert sorted((r["step"], r["train/loss"]) for r in rows if "train/loss" in r) == [
        (i, float(i)) for i in range(50)
    ]
    assert sum("train/steps" in r for r in rows) <= 6  # the flushes' rows: 5 scheduled and the final


def test_values_logged_after_the_last_flush_leave_at_a_pause() -> None:
    """An eval logged after the last step's flush is on /metrics once the loop pauses
    (`adapters.idle()`, which a framework calls at fit's end), with no step after it."""
    import urllib.request

    from helpers.ports import free_port
    from helpers.waiting import wait_for
    from prometheus_client.parser import text_string_to_metric_families

    from otel_train import adapters

    port = free_port()
    ot.init(prometheus_port=port, verbosity=0, log_interval=1, hardware=False)
    session = current_session()
    assert session is not None
    for i in range(3):
        with ot.step(i):
            pass
    ot.log_metrics({"eval/loss": 2.5}, step=2)
    adapters.idle()
    wait_for(lambda: session.worker.pending_batches() == 0, 60, "the worker to take every flush")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    ot.shutdown()
    scraped = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert scraped.get("eval_loss") == 2.5


def test_user_instruments_on_library_meter_reach_bridges() -> None:
    with capture_metrics(log_interval=2) as cap:
        meter = ot.get_meter()
        counter = meter.create_counter("my.widgets")
        hist = meter.create_histogram("my.latency", unit="s")
        for i in range(4):
            with ot.step(i):
                counter.add(2)
                hist.record(0.5)
    # User instruments record at call time; each flush carries the delta collected so far.
    assert sum(v for _, v in cap.series("my/widgets")) == 8
    assert sum(v for _, v in cap.series("my/latency/count")) == 4
    assert cap.last("my/latency/mean") == 0.5


def test_total_steps_gives_eta_and_progress_file(tmp_path) -> None:
    ot.init(prometheus_port=0, verbosity=0, log_interval=5, total_steps=20, output_dir=str(tmp_path))
    session = current_session()
    for i in range(10):
        with ot.step(i, tokens=10):
            time.sleep(0.001)
    ot.shutdown()
    rows = [json.loads(line) for line in (session.run_dir / "metrics.rank0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows[:2]] == [4, 9]
    assert rows[0]["progress/eta_s"] > 0
    assert rows[0]["train/steps"] == 5
    progress = (session.run_dir / "progress.txt").read_text().splitlines()
    assert "step 5/20" in progress[0] and "tokens 50" in progress[0] and "eta" in progress[0]
    assert json.loads((session.run_dir / "config.json").read_text())["total_steps"] == 20
    env = json.loads((session.run_dir / "env.json").read_text())
    assert env["python"] and "opentelemetry-sdk" in env["packages"]


def test_the_progress_file_counts_samples_when_the_steps_count_no_tokens(tmp_path) -> None:
    with ot.init(prometheus_port=0, verbosity=0, log_interval=5, output_dir=str(tmp_path)) as run:
        for i in range(10):
            with ot.step(i, samples=4):
                pass
    first = (run.run_dir / "progress.txt").read_text().splitlines()[0]
    assert "samples 20 | throughput" in first and "samples/s" in first and "tokens" not in first, first


def test_console_summary_and_timer_table(capsys) -> None:
    ot.init(prometheus_port=0, verbosity=1, log_interval=2, run_dir_enabled=False)
    for i in range(4):
        with ot.step(i, tokens=10):
            with ot.timer("forward"):
                pass
            ot.record("loss", 1.5)
    ot.log_samples([("def ", "main():")], step=3)
    ot.shutdown()
    out = capsys.readouterr().out
    assert "step 2 | loss 1.5000" in out
    assert "'def ' → def main():" in out
    assert "timer" in out and "forward" in out and "% time" in out


def test_console_prints_no_stale_line_after_an_eval(capsys) -> None:
    ot.init(prometheus_port=0, verbosity=1, progress_bar=False, log_interval=10, run_dir_enabled=False,
            hardware=False)  # fmt: skip
    for step in range(40):
        with ot.step(step):
            ot.record("loss", 2.0)
        if step in (19, 39):  # eval after steps 20 and 40, like the demo
            ot.log_metrics({"eval/loss": 1.5 if step == 19 else 1.25}, step=step)
    ot.shutdown()
    lines = [line for line in capsys.readouterr().out.splitlines() if re.match(r"step \d+( |$)", line)]
    assert [line.split(" |")[0] for line in lines] == ["step 10", "step 20", "step 20", "step 30", "step 40",
                                                       "step 40"]  # fmt: skip
    assert "eval_loss" not in lines[1] and lines[2] == "step 20 | eval_loss 1.5000"  # only the new eval
    assert "val_loss" not in lines[3]  # the eval after step 20 is not repeated as if new
    assert "eval_loss" not in lines[4] and lines[5] == "step 40 | eval_loss 1.2500"  # never the stale 1.5


def test_quiet_mode_prints_nothing(capsys) -> None:
    ot.init(prometheus_port=0, verbosity=0, log_interval=1, run_dir_enabled=False)
    with ot.step(0):
        ot.record("loss", 1.0)
    ot.shutdown()
    assert capsys.readouterr().out == ""


def test_on_event_sees_the_librarys_own_events_and_a_raising_callback_is_contained(tmp_path) -> None:
    seen: list[tuple[str, str, dict]] = []

    def boom(event: str, message: str, attrs: dict) -> None:
        raise RuntimeError("user bug")

    ot.on_event(seen.append)  # before init(): nothing (and no error)
    ot.init(prometheus_port=0, verbosity=0, log_interval=2, output_dir=str(tmp_path), run_name="ev")
    ot.on_event(boom)
    ot.on_event(lambda event, message, attrs: seen.append((event, message, attrs)))
    for i in range(4):
        with ot.step(i):
            ot.record("loss", float("nan") if i == 1 else 1.0)
    ot.event("worker_failure", "worker 3 failed", {"worker.rank": 3})
    ot.shutdown()
    events = {event: attrs for event, _, attrs in seen}
    assert events["nonfinite"]["step"] == 1, seen  # the library's own, from the worker thread
    assert events["worker_failure"]["worker.rank"] == 3
    written = (tmp_path / "ev" / "events.rank0.jsonl").read_text()
    assert '"nonfinite"' in written and '"worker_failure"' in written  # the raising callback lost nothing


# The public API (issue #45: at most 16 names, no two doing one job), each with why it is here.
PUBLIC_API: dict[str, str] = {
    "init": "starts the run (settings by keyword, env, YAML); returns the `Run` (id, dir, profile)",
    "shutdown": "ends it: final flush, exporters stopped (`with ot.init()` or `run.shutdown()` alike)",
    "step": "marks a training step (context manager or decorator): step counts, throughput, traces",
    "timer": "times a phase inside a step (context manager or decorator; `.start()`/`.stop()`)",
    "span": "a traced region outside the step's timers (eval, checkpoint), also timed as a phase",
    "record": "one scalar on the hot path (a tensor stays on device until the flush)",
    "log_metrics": "a dict of scalars, optionally filed under a given step (eval after step N)",
    "log_hyperparams": "the run's configuration for every bridge (secrets redacted)",
    "log_text": "free text for every bridge",
    "log_samples": "(prompt, output) pairs: a console table and a table in every bridge",
    "log_histogram": "a distribution for every bridge",
    "watch": "the model's gradient/parameter statistics (and a GradScaler's scale and skipped steps)",
    "event": "a health event of the caller's own (events file, OTel log, events counter)",
    "on_event": "a callback on every health event (stop on a hang, page someone)",
    "get_meter": "the library's OTel meter for the user's own instruments (every exporter gets them)",
    "run_info": "the running run's facts (id, dir, rank, step) without holding the `Run`",
}
# Names that left the top level, and where each went (docs/changelog.md lists the same).
MOVED: dict[str, str] = {
    "finish": "ot.shutdown (the same function)",
    "timed": "ot.timer, which is a decorator too",
    "watch_scaler": "ot.watch(model, scaler=...)",
    "profile": "Run.profile (ot.init() returns the Run)",
    "current_session": "otel_train.testing.current_session (internals)",
    "begin_step": "otel_train.adapters",
    "end_step": "otel_train.adapters",
    "phase": "otel_train.adapters",
    "watch_batch": "otel_train.adapters",
    "watch_read": "otel_train.adapters",
    "on_straggler": "otel_train.adapters",
}


def test_public_api_is_pinned() -> None:
    assert len(ot.__all__) <= 16
    assert sorted(ot.__all__) == sorted(PUBLIC_API)


def test_moved_names_are_gone_from_the_top_level_and_live_where_the_changelog_says() -> None:
    """Pre-1.0: no aliases. Each removed name raises AttributeError at the top level, and its new
    home has it (a module's name, or the call that replaces it)."""
    import otel_train.adapters
    import otel_train.testing

    for name in MOVED:
        assert not hasattr(ot, name), name
        assert name not in ot.__all__
    assert set(otel_train.adapters.__all__) >= {
        n for n, home in MOVED.items() if home == "otel_train.adapters"
    }
    assert callable(otel_train.testing.current_session) and callable(ot.Run.profile)
    changelog = (Path(__file__).resolve().parents[1] / "docs" / "changelog.md").read_text()
    for name in MOVED:
        assert f"`{name}`" in changelog, f"docs/changelog.md does not say where {name} went"


def test_types_are_importable_but_not_in_all() -> None:
    """`Run`, `RunInfo` (what init/run_info return), `Config` and `ConfigError` (what a user catches
    for bad settings) are types to annotate and catch with, not API calls; `__version__` an attribute."""
    from otel_train import Config, ConfigError, Run, RunInfo, __version__

    assert {Config.__name__, ConfigError.__name__, Run.__name__, RunInfo.__name__} == {
        "Config", "ConfigError", "Run", "RunInfo"
    }  # fmt: skip
    assert issubclass(ConfigError, Exception) and isinstance(__version__, str)
    assert not {"Config", "ConfigError", "Run", "RunInfo", "__version__"} & set(ot.__all__)
    with pytest.raises(ConfigError):
        ot.init(log_interval=-1)


def test_import_is_light() -> None:
    import subprocess
    import sys

    code = (
        "import sys, otel_train; "
        "heavy = [m for m in ('torch', 'wandb', 'tensorboard', 'mlflow', 'pynvml', 'grpc', 'transformers', "
        "'lightning', 'accelerate', 'otel_train.integrations', "
        "'opentelemetry.exporter.otlp.proto.http', 'opentelemetry.sdk.metrics') if m in sys.modules]; "
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_semconv_catalogue_is_consistent() -> None:
    names = [m.name for m in semconv.CATALOGUE]
    assert len(names) == len(set(names))
    for spec in semconv.CATALOGUE:
        assert spec.name == spec.name.lower() and "total" not in spec.name
        if spec.kind is semconv.Kind.HISTOGRAM:
            assert spec.unit == "s" and spec.buckets, spec.name  # seconds need explicit buckets
    assert semconv.instrument_name_for("loss") == "train.loss"
    assert semconv.instrument_name_for("train/loss") == "train.loss"
    assert semconv.instrument_name_for("eval/perplexity") == "eval.perplexity"
    assert semconv.instrument_name_for("9 bad!") is None
    # The user's own names keep their case; catalogue names match in any case.
    assert semconv.instrument_name_for("FloatTensor") == "train.FloatTensor"
    assert semconv.instrument_name_for("eval/F1") == "eval.F1"
    assert semconv.instrument_name_for("Train/Loss") == "train.loss"
    assert semconv.instrument_name_for("Eval/Perplexity") == "eval.perplexity"
    assert semconv.otel_name("eval.F1") == "eval.f1"


def test_names_differing_only_in_case_keep_their_own_keys(tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    """TensorBoard, W&B, MLflow and the run dir are case-sensitive: `Acc` and `acc` are two keys with
    their own values there (tests/bridges/test_every_bridge_end_to_end.py reads every bridge back). OTel instrument
    names are case-insensitive: the pull endpoint has one folded series, and a warning says so."""
    import urllib.request

    from helpers.ports import free_port
    from helpers.waiting import wait_for
    from prometheus_client.parser import text_string_to_metric_families

    caplog.set_level("WARNING", logger="otel_train")
    ot.init(
        prometheus_port=free_port(), verbosity=0, log_interval=2, output_dir=str(tmp_path), run_name="case"
    )
    session = current_session()
    assert session is not None
    for i in range(4):
        with ot.step(i):
            ot.record("Acc", 0.25)
            ot.record("acc", 0.75)
            ot.record("FloatTensor", 2.0)
    rows_file = tmp_path / "case" / "metrics.rank0.jsonl"
    wait_for(lambda: rows_file.exists() and len(rows_file.read_text().splitlines()) >= 2, 30, "two rows")
    text = urllib.request.urlopen(session.prometheus_url, timeout=5).read().decode()
    ot.shutdown()
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    assert all(
        r["train/Acc"] == 0.25 and r["train/acc"] == 0.75 and r["train/FloatTensor"] == 2.0 for r in rows
    )
    assert not any("train/floattensor" in r for r in rows)
    names = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    assert "train_acc" in names and "train_floattensor" in names
    assert not {n for n in names if n.lower() != n}  # the SDK's names are folded: no second series
    assert sum("differ only in case" in r.getMessage() for r in caplog.records) == 1


def test_event_reaches_the_events_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ot.event("worker_failure", "before init: nothing")  # a no-op before init()
    ot.init(run_name="ev", output_dir=str(tmp_path), prometheus_port=0, verbosity=0, hardware=False)
    try:
        ot.event("worker_failure", "worker 1 failed", {"worker.rank": 1})
    finally:
        ot.shutdown()
    import json

    (line,) = (tmp_path / "ev" / "events.rank0.jsonl").read_text().splitlines()
    row = json.loads(line)
    assert (row["event"], row["message"], row["worker.rank"]) == ("worker_failure", "worker 1 failed", 1)


def test_a_nan_loss_event_names_its_own_step_in_a_long_interval(tmp_path: Path) -> None:
    """One loss a step, flushed every 50 steps: a NaN at step 13 is reported at step 13 (not at
    the interval's last step, 49), with the count and the last one when there are several; a loss
    recorded twice in some steps (no way to tell the steps) falls back to the interval's end."""
    from helpers.events import run_events

    ot.init(prometheus_port=0, verbosity=0, log_interval=50, output_dir=str(tmp_path), run_name="nan")
    for i in range(150):
        with ot.step(i):
            nan = i == 13 or i in (70, 81)
            ot.record("loss", float("nan") if nan else 1.0)
            if 100 <= i < 102:
                ot.record("loss", float("nan") if i == 100 else 1.0)  # 152 values for 50 steps
    ot.shutdown()
    events = run_events(tmp_path / "nan", event="nonfinite")
    assert [e["step"] for e in events] == [13, 70, 149], events
    assert "at step 13" in events[0]["message"]
    assert "2 in the interval, the last at step 81" in events[1]["message"]
    assert "in the interval ending at step 149" in events[2]["message"]


def test_a_loss_recorded_after_its_decorated_step_returns_is_filed_under_that_step(tmp_path: Path) -> None:
    """`loss = train_step(batch); ot.record("loss", loss)` with `@ot.step`: each value comes between
    steps, after the step it belongs to. A NaN at step 13 and a spike at step 30 are named there,
    also across flushes (every 10 steps) and in the first interval; a value recorded inside the
    steps keeps its own step."""
    from helpers.events import run_events

    @ot.step
    def train_step(i: int) -> float:
        ot.record("grad_norm", 1.0)  # inside the step
        if i == 13:
            return float("nan")
        return 50.0 if i == 30 else 1.0

    ot.init(prometheus_port=0, verbosity=0, log_interval=10, output_dir=str(tmp_path), run_name="dec")
    for i in range(45):
        loss = train_step(i)
        ot.record("loss", loss)
    ot.shutdown()
    run_dir = tmp_path / "dec"
    assert [e["step"] for e in run_events(run_dir, event="nonfinite")] == [13]
    assert [e["step"] for e in run_events(run_dir, event="loss_spike")] == [30]
