"""Session: owns providers, readers, buffer, worker and identity. `_current` is the one global.

The training thread talks to the session only through `begin_step`, `end_step`, `end_timer`,
`record` and `flush`, all plain-Python appends and counters; everything else happens on the worker.
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import operator
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from otel_train import semconv
from otel_train.bridges.base import Sink
from otel_train.bridges.console import ConsoleSink
from otel_train.bridges.rundir import RunDirSink, write_json
from otel_train.buffer import Buffer, SpanRecord
from otel_train.config import (
    FIELDS,
    Config,
    ConfigError,
    config_as_dict,
    is_secret_key,
    load_config,
    redact,
    signal_number,
)
from otel_train.distributed import Identity, agree_run, create_telemetry_group, detect_identity
from otel_train.interval import FlushListener

if TYPE_CHECKING:  # the SDK is imported at init(), not when `import otel_train` runs
    from opentelemetry.sdk.resources import Resource

    from otel_train.bridges.process import BridgeProcess, BridgeSpec
    from otel_train.control import ControlChange
    from otel_train.exporters import Telemetry
    from otel_train.model_watch import ModelWatch
    from otel_train.profiling import ProfileWindow, StepProfiler

log = logging.getLogger("otel_train")

_current: Session | None = None  # the one global: the active session of this process
_MAX_SPAN_RECORDS = 10_000
_T = TypeVar("_T")


class Session:
    def __init__(self, config: Config) -> None:
        from otel_train.bridges.step_reader import StepReader
        from otel_train.exporters import build_telemetry
        from otel_train.health import HealthEvents, HealthMonitor
        from otel_train.pipeline import Instruments, SpanWriter, Worker

        self.config = config
        self.identity: Identity = detect_identity(config.run_id)
        # A dedicated gloo group: telemetry's one exchange per flush runs on the worker thread and
        # can never interleave with the training's own (NCCL) collectives. Needs init_process_group first.
        self.telemetry_group = create_telemetry_group(self.identity, config.collective_timeout_s)
        # One run per job: every rank adopts rank 0's run id and run name (a generated name differs
        # per process), so all ranks write into one run directory.
        self.identity, self.run_name = agree_run(
            self.identity, self.telemetry_group, config.run_name or _default_run_name()
        )
        self.is_reporting_rank = self.identity.rank == 0 or config.bridge_all_ranks
        self.run_dir = self._make_run_dir()
        self.resumed = False
        if self.run_dir is not None:
            run_dir, rank, run_id = self.run_dir, self.identity.rank, self.identity.run_id
            self.resumed = _run_dir_errors_as_config_errors(
                lambda: claim_run_dir(run_dir, rank, run_id, self.run_name)
            )
        gpu_discovery = None
        if config.hardware:
            from otel_train.hardware import discover_with_timeout

            # Before the Resource: the rank's GPU UUID and PCI bus id join DCGM series to ranks.
            gpu_discovery = discover_with_timeout(self.identity.local_rank, timeout_s=5.0)
        self.resource = self._resource(gpu_discovery.resource_attributes() if gpu_discovery else {})

        self.step_reader = StepReader()
        events: dict[str, str | int] = {semconv.PROCESS_PID: os.getpid(), semconv.RUN_NAME: self.run_name}
        self.telemetry: Telemetry = build_telemetry(
            config, self.resource, events, self.step_reader, self.identity.local_rank
        )
        self.meter = self.telemetry.meter_provider.get_meter("otel_train", _version())
        self.instruments = Instruments(self.meter, config.max_metric_names)
        otel_logger = (
            self.telemetry.logger_provider.get_logger("otel_train")
            if self.telemetry.logger_provider is not None
            else None
        )
        self.events = HealthEvents(
            self.instruments.health_events,
            otel_logger,
            self.run_dir / f"events.rank{self.identity.rank}.jsonl" if self.run_dir else None,
            {semconv.RANK: self.identity.rank, "host.name": self.identity.host},
            echo=config.verbosity > 0,
        )
        self.health = HealthMonitor(self.events, self.instruments.nonfinite_loss, config.loss_spike_factor)
        if self.resumed:
            self.events.emit(
                "restart",
                f"run {self.run_name!r} (run_id {self.identity.run_id}) restarted; appending to its files",
                {"pid": os.getpid()},
            )
        self.console: ConsoleSink | None = None
        self.bridges: BridgeProcess | None = None
        self.sinks: list[Sink] = _run_dir_errors_as_config_errors(self._sinks)
        self.listeners: list[FlushListener] = [self.health]
        self.hardware = None
        if config.hardware:
            from otel_train.hardware import HardwareMonitor

            self.hardware = HardwareMonitor(
                config, self.meter, self.events, self.identity.local_rank, discovery=gpu_discovery
            )
            self.hardware.start()
            self.listeners.append(self.hardware)
        from otel_train.straggler import CrossRankReducer

        self.reducer = CrossRankReducer(
            self.identity, self.meter, self.events, config, group=self.telemetry_group
        )
        self.listeners.append(self.reducer)
        from otel_train.cadence import Cadence

        self.cadence = Cadence(
            config.log_interval,
            config.log_interval_min_s,
            config.log_interval_s,
            coordinated=self.identity.distributed,
            wait_timeout_s=config.collective_timeout_s,
        )
        self.reducer.on_cadence = self.cadence.adopt
        from otel_train.profiling import ProfiledStepsCounter

        self.profiled_steps = ProfiledStepsCounter(self.meter)
        self.listeners.append(self.profiled_steps)
        from otel_train.goodput import GoodputListener, process_start_perf_s

        # Goodput bookkeeping, cumulative, written by the training thread only (see goodput.py).
        self.process_start_s = process_start_perf_s()
        self.first_step_start_ns: int | None = None
        self.stall_ns = 0
        self.nested_badput_ns = 0
        self.span_ns: dict[str, int] = {}
        self._gap_span_ns = 0  # spans since the last step ended (not stall time)
        self._step_open = False
        self._stall_gap_ns = int(config.stall_timeout_s * 1e9)
        self.goodput = GoodputListener(
            self,
            self.meter,
            self.run_dir / f"goodput.rank{self.identity.rank}.json" if self.run_dir else None,
            self.identity.run_id,
        )
        self.listeners.append(self.goodput)
        self.profiler: StepProfiler | None = None  # an ot.profile window, advanced at step ends
        tracer = (
            self.telemetry.tracer_provider.get_tracer("otel_train", _version())
            if self.telemetry.tracer_provider is not None
            else None
        )
        self.worker = Worker(
            self.instruments,
            self.step_reader,
            self.sinks,
            self.listeners,
            self.health,
            SpanWriter(tracer, self.identity.run_id, self.identity.rank) if tracer is not None else None,
            queue_size=config.queue_size,
            total_steps=config.total_steps,
            otel_logger=otel_logger,
        )
        from otel_train.hang import HangWatchdog

        self.watchdog = HangWatchdog(
            self.run_dir,
            self.identity.rank,
            self.events,
            self._last_step,
            config.stall_timeout_s,
            signal_number(config.stack_dump_signal) if config.stack_dump_signal else None,
            on_tick=self._poll_control,
        )
        from otel_train.control import ControlFile

        self.control = ControlFile(self.run_dir, self.identity.rank, self.events) if self.run_dir else None
        self._pending_control: ControlChange | None = None

        # hot-path state
        self.buffer = Buffer(config.max_metric_names, config.max_values_per_interval)
        self.timing_level = config.timing_log_level
        self.watches: list[ModelWatch] = []  # ot.watch(model) handles
        self.step_index = -1  # last completed step
        self.step_end_ns: int | None = None  # perf_counter_ns when it ended (the stall watchdog reads it)
        self.sampled = False  # is the current step traced?
        self._step_index_running = 0
        self.step_start_ns = 0  # perf_counter_ns at the running step's start; 0 outside a step
        self._seq = 0
        self._last_flush = time.perf_counter()
        self._time_flush = not self.identity.distributed  # time-based flushes would desync ranks
        self._interval_s = config.log_interval_s
        self._perf_to_epoch_ns = time.time_ns() - time.perf_counter_ns()
        self._closed = False
        self._lock = threading.Lock()
        # Flush attempts that found the worker's queue full: the data stays in the buffer (counters
        # keep summing) and goes with a later flush.
        self.deferred_flushes = 0
        self.lost_flushes = 0
        self.lost_steps = 0  # steps in flushes that never reached the run dir (warned with the number)
        self._step_thread: int | None = None  # the thread running ot.step(): the only one that flushes
        self._flush_requested = False  # another thread asked for a flush (log_metrics(step=...))
        self._shutdown_done = threading.Event()
        self._reinit_warned = False

        if self.run_dir is not None and self.is_reporting_rank:
            _run_dir_errors_as_config_errors(self._write_run_files)
        self.worker.start()
        self.watchdog.start()

    # --- construction helpers ---------------------------------------------------------------------
    def _make_run_dir(self) -> Path | None:
        if not self.config.run_dir_enabled:
            return None
        path = Path(self.config.output_dir) / self.run_name
        try:
            path.mkdir(parents=True, exist_ok=True)
            probe = path / f".write-test-{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as exc:
            raise _run_dir_config_error(path, exc) from None
        return path

    def _resource(self, gpu_attributes: Mapping[str, str]) -> Resource:
        from opentelemetry.sdk.resources import Resource

        ident = self.identity
        attributes: dict[str, Any] = {
            k: v
            for k, v in self.config.resource_attributes.items()
            if not is_secret_key(k)  # a secret-looking resource attribute would reach every exporter
        }
        attributes.update(gpu_attributes)
        attributes.update(
            {
                "service.name": self.config.service_name,
                "service.instance.id": ident.instance_id,
                semconv.RUN_ID: ident.run_id,
                semconv.RANK: ident.rank,
                "local_rank": ident.local_rank,
                "world_size": ident.world_size,
                "node_rank": ident.node_rank,
                "host.name": ident.host,
            }
        )
        # Resource.create() merges OTEL_RESOURCE_ATTRIBUTES (and the SDK defaults and detectors)
        # back in, so the filters run on what it returns, not only on what went in. No per-process
        # attribute stays (semconv.PROCESS_ATTRIBUTE_PREFIX): this Resource labels metric series;
        # per-launch attributes go on spans and logs only (build_telemetry's event_attributes).
        created = Resource.create(attributes)
        kept = {
            k: v
            for k, v in created.attributes.items()
            if not is_secret_key(k) and not k.startswith(semconv.PROCESS_ATTRIBUTE_PREFIX)
        }
        return Resource(kept, created.schema_url)

    def _sinks(self) -> list[Sink]:
        """Every rank keeps its own metrics JSONL (the local copy); progress, console and bridges
        are written by the reporting rank (rank 0, or every rank with bridge_all_ranks)."""
        sinks: list[Sink] = []
        if self.run_dir is not None:
            progress = self.is_reporting_rank
            sinks.append(RunDirSink(self.run_dir, self.identity.rank, self.config.total_steps, progress))
        if not self.is_reporting_rank:
            return sinks
        if self.identity.rank == 0:
            self.console = ConsoleSink(
                self.config.verbosity, self.config.progress_bar, self.config.total_steps
            )
            sinks.append(self.console)
        sinks.extend(self._bridges())
        return sinks

    def _bridge_specs(self) -> list[BridgeSpec]:
        """TensorBoard / W&B / MLflow as (module, class, plain kwargs) for the bridge process."""
        from otel_train.bridges.framing import plain

        cfg = self.config
        run_dir = str(self.run_dir or Path(cfg.output_dir) / self.run_name)
        rank_suffix = self.identity.rank if cfg.bridge_all_ranks else None
        name = self.run_name if rank_suffix is None else f"{self.run_name}-rank{rank_suffix}"
        specs: list[BridgeSpec] = []
        if cfg.tensorboard:
            specs.append(
                (
                    "otel_train.bridges.tensorboard",
                    "TensorBoardSink",
                    {"log_dir": f"{run_dir}/tensorboard", "run_name": name},
                )
            )
        if cfg.wandb:
            wandb_args = {
                "run_dir": run_dir,
                "config_dict": plain({"otel_train": config_as_dict(cfg)}),
                "project": cfg.wandb_project,
                "entity": cfg.wandb_entity,
                "group": cfg.wandb_group,
                "tags": list(cfg.wandb_tags),
                "mode": cfg.wandb_mode,
                "run_name": self.run_name,
                "run_id": self.identity.run_id,
                "rank": rank_suffix,
            }
            specs.append(("otel_train.bridges.wandb", "WandbSink", wandb_args))
        if cfg.mlflow:
            mlflow_args = {
                "run_dir": run_dir,
                "tracking_uri": cfg.mlflow_tracking_uri,
                "experiment": cfg.mlflow_experiment,
                "run_name": name,
            }
            specs.append(("otel_train.bridges.mlflow", "MlflowSink", mlflow_args))
        return specs

    def _bridges(self) -> list[Sink]:
        """TensorBoard / W&B / MLflow in one child process (`bridges.process`), off this process's
        GIL. A missing package or an unwritable directory raises here, at init(), naming the extra
        or the path (the child reports its set-up before init() returns)."""
        from otel_train.bridges.process import BridgeProcess, BridgeSetupFailed

        specs = self._bridge_specs()
        if not specs:
            return []
        try:
            self.bridges = BridgeProcess(specs, self.config.bridge_queue_size, self._count_drop)
        except BridgeSetupFailed as exc:
            raise ConfigError(str(exc)) from None
        return [self.bridges]

    def _count_drop(self, reason: str, count: int) -> None:
        self.instruments.dropped.add(count, {semconv.REASON: reason})

    def _write_run_files(self) -> None:
        from otel_train.envinfo import collect_env

        assert self.run_dir is not None
        resolved = config_as_dict(self.config)
        resolved.update({"run_name": self.run_name, "run_id": self.identity.run_id})
        write_json(self.run_dir / "config.json", resolved)
        write_json(self.run_dir / "env.json", collect_env())

    # The worker thread iterates `sinks` and `listeners` at every flush: both lists are replaced
    # (copy-on-write), never changed in place, so no flush sees a list mid-change.
    def add_listener(self, listener: FlushListener) -> None:
        """Call `listener.on_flush(interval)` on the worker at every flush from now on."""
        self.listeners = [*self.listeners, listener]
        self._share_with_worker()

    def remove_listener(self, listener: FlushListener) -> None:
        """Stop calling `listener` (idempotent)."""
        self.listeners = [x for x in self.listeners if x is not listener]
        self._share_with_worker()

    def add_sink(self, sink: Sink) -> None:
        """Hand every flush and message to `sink` too (on the worker), from the next one on."""
        self.sinks = [*self.sinks, sink]
        self._share_with_worker()

    def _share_with_worker(self) -> None:
        worker = getattr(self, "worker", None)  # None while __init__ is still wiring listeners
        if worker is not None:
            worker.sinks, worker.listeners = self.sinks, self.listeners

    def add_watch(self, watch: ModelWatch) -> None:
        """Call `watch` at every step's begin and end (training thread) until `remove_watch`."""
        self.watches.append(watch)

    def remove_watch(self, watch: ModelWatch) -> None:
        """Stop calling `watch` (idempotent; `ModelWatch.remove()` calls it)."""
        if watch in self.watches:
            self.watches.remove(watch)

    # --- hot path (training thread) ------------------------------------------------------------
    def begin_step(self, step: Any) -> int:
        if step is None:
            index = self.step_index + 1
        elif step.__class__ is int and -_MAX_STEP <= step <= _MAX_STEP:
            index = step
        else:
            index = self._step_number(step)
        self._step_thread = threading.get_ident()
        pending = self._pending_control
        if pending is not None and index >= pending.apply_at_step:
            self._apply_control(pending, index)
        cfg = self.config
        self.sampled = self.worker.span_writer is not None and (
            index < cfg.trace_first or index % cfg.trace_every == 0
        )
        self._step_index_running = index
        self._step_open = True
        if self.profiler is not None and self.profiler.next_step_active():
            self.sampled = self.worker.span_writer is not None  # profiled steps are always traced
        if self.watches:
            for watch in self.watches:
                watch.begin_step(index)
        return index

    def _step_number(self, step: Any) -> int:
        """A numpy integer, a 0-dim tensor or an integral float as a plain int; anything else
        (NaN, 3.5, 10**400, a string) continues from the last step, counted and warned once."""
        try:
            index = operator.index(step)
        except Exception:
            try:
                number = float(step)
                index = int(number) if number.is_integer() else None  # type: ignore[assignment]
            except Exception:
                index = None  # type: ignore[assignment]
        if index is None or not -_MAX_STEP <= index <= _MAX_STEP:
            self.buffer.drop("invalid_step")
            self.buffer.warn_once(
                "<step>",
                f"ot.step() got a step number it cannot use ({type(step).__name__}); continuing from "
                "the last step. Pass an int (counted in otel_train.dropped{reason=invalid_step}).",
            )
            return self.step_index + 1
        return index

    def end_step(
        self, index: int, start_ns: int, end_ns: int, tokens: int | None, samples: int | None, failed: bool
    ) -> None:
        buf = self.buffer
        if (tokens is not None and tokens.__class__ is not int) or (
            samples is not None and samples.__class__ is not int
        ):
            tokens, samples = self._count(tokens, "tokens"), self._count(samples, "samples")
        self.step_index = index
        previous_end = self.step_end_ns
        self.step_end_ns = end_ns
        self._step_open = False
        if previous_end is None:
            self.first_step_start_ns = start_ns
        elif start_ns - previous_end > self._stall_gap_ns:
            self._note_long_gap(start_ns - previous_end)
        if self._gap_span_ns:
            self._gap_span_ns = 0
        if self.watches:
            for watch in self.watches:
                watch.end_step(index, failed)
        profiled = self.profiler is not None and self._advance_profiler(index)
        if self.sampled:
            if len(buf.spans) < _MAX_SPAN_RECORDS:
                buf.spans.append(
                    SpanRecord(
                        "step",
                        start_ns,
                        end_ns,
                        index,
                        "StepFailed" if failed else None,
                        "step",
                        {"train.profiled": True} if profiled else None,
                    )
                )
            self.sampled = False
        if failed:
            return
        buf.steps += 1
        buf.step_durations.append((end_ns - start_ns) * 1e-9)
        if tokens:
            buf.tokens += tokens
        if samples:
            buf.samples += samples
        if (
            (buf.steps >= self.cadence.threshold and self.cadence.due(buf.steps))
            or (self._flush_requested and not self.identity.distributed)
            or (self._time_flush and time.perf_counter() - self._last_flush >= self._interval_s)
        ):
            self.flush()

    def _count(self, value: Any, what: str) -> int | None:
        """tokens= / samples= as a plain int (numpy integers, 0-dim tensors, integral floats)."""
        if value is None or value.__class__ is int:
            return value  # type: ignore[no-any-return]
        try:
            number = operator.index(value)
        except Exception:
            try:
                as_float = float(value)
                number = int(as_float) if as_float.is_integer() else round(as_float)
            except Exception:
                self.buffer.drop("invalid_type")
                self.buffer.warn_once(
                    f"<{what}>", f"ot.step({what}=...) got {type(value).__name__}; ignored."
                )
                return None
        return number if 0 <= number <= _MAX_STEP else None

    def _poll_control(self) -> None:
        """Watchdog thread: schedule a change from the control file (rank 0 decides the step)."""
        if self.control is None:
            return
        steps = self.goodput.steps
        end, first = self.step_end_ns, self.first_step_start_ns
        per_step = (end - first) * 1e-9 / steps if steps and end and first else None
        change = self.control.poll(self.step_index, per_step)
        if change is None:
            return
        self._pending_control = change
        self.events.emit(
            "control",
            f"runtime control v{change.version}: {dict(change.settings)} from step {change.apply_at_step}",
            {"step": change.apply_at_step, "version": change.version},
            severity="INFO",
        )

    def _apply_control(self, change: ControlChange, index: int) -> None:
        """Training thread, as step `index` begins: apply a scheduled runtime-control change."""
        import dataclasses

        from otel_train.profiling import ProfileWindow

        if self._pending_control is change:
            self._pending_control = None
        settings = dict(change.settings)
        fields = {k: settings[k] for k in settings if k != "profile"}
        self.config = dataclasses.replace(self.config, **fields)
        self.timing_level = self.config.timing_log_level
        if self.console is not None:
            self.console.verbosity = self.config.verbosity
        set_threshold = getattr(self.reducer, "set_threshold", None)
        if "straggler_threshold" in fields and callable(set_threshold):
            set_threshold(self.config.straggler_threshold)
        if "profile" in settings:
            options = dict(settings["profile"])
            ranks = options.pop("ranks", None)
            self.start_profile(ProfileWindow(**options), ranks)
        if index > change.apply_at_step:
            log.warning(
                "otel_train: runtime control v%d applied at step %d, after its step %d (this rank "
                "read the control file late)",
                change.version,
                index,
                change.apply_at_step,
            )

    def _note_long_gap(self, gap_ns: int) -> None:
        """A gap between steps longer than stall_timeout_s: stall time, less the spans inside it."""
        stalled = gap_ns - self._gap_span_ns
        if stalled > self._stall_gap_ns:
            self.stall_ns += stalled

    def _advance_profiler(self, index: int) -> bool:
        assert self.profiler is not None
        try:
            profiled = self.profiler.step_ended(index)
        except Exception as exc:  # a profiler failure must not stop training
            log.warning("otel_train: torch.profiler failed and was stopped: %s", exc)
            self.profiler = None
            return False
        if profiled:
            self.profiled_steps.total += 1
        if self.profiler.done:
            self.profiler = None
        return profiled

    def start_profile(self, window: ProfileWindow, ranks: Sequence[int] | None) -> bool:
        """Start a profiler window at the next step (training thread); False if not on this rank."""
        from otel_train.profiling import start_window

        if self.profiler is not None:
            log.warning("otel_train: ot.profile: a profiler window is still running; ignored.")
            return False
        self.profiler = start_window(
            window,
            self.run_dir,
            self.config.output_dir,
            self.run_name,
            self.identity.rank,
            ranks,
            log.warning,
        )
        return self.profiler is not None

    def end_timer(self, name: str, start_ns: int, end_ns: int, error: type[BaseException] | None) -> None:
        seconds = (end_ns - start_ns) * 1e-9
        if error is None:
            self.buffer.add_phase(name, seconds)
            if self.step_start_ns:  # straggler detection: when this rank got here in its step
                self.buffer.add_arrival(name, (end_ns - self.step_start_ns) * 1e-9)
        else:
            self.buffer.add_phase_error(name, error.__name__, seconds)
        if self.sampled and len(self.buffer.spans) < _MAX_SPAN_RECORDS:
            self.buffer.spans.append(
                SpanRecord(
                    name, start_ns, end_ns, self._step_index_running, error.__name__ if error else None
                )
            )

    def end_mark(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        error: type[BaseException] | None,
        attributes: Mapping[str, Any] | None,
    ) -> None:
        """An eval / checkpoint span: always traced (rare and short), timed as a phase, and
        accounted as goodput's eval / checkpoint badput."""
        self.end_timer(name, start_ns, end_ns, error)
        from otel_train.goodput import span_cause

        duration = end_ns - start_ns
        cause = span_cause(name)
        if cause != "other":
            self.span_ns[cause] = self.span_ns.get(cause, 0) + duration
        if self._step_open:
            if cause != "other":
                self.nested_badput_ns += duration
        else:
            self._gap_span_ns += duration
        if self.worker.span_writer is not None and len(self.buffer.spans) < _MAX_SPAN_RECORDS:
            attrs = {
                str(k): v for k, v in (attributes or {}).items() if isinstance(v, (str, int, float, bool))
            }
            self.buffer.spans.append(
                SpanRecord(
                    name,
                    start_ns,
                    end_ns,
                    max(self.step_index, 0),
                    error.__name__ if error else None,
                    "mark",
                    attrs,
                )
            )

    def flush(self, final: bool = False) -> bool:
        """Hand the interval to the worker. Never blocks when not distributed: if the queue is full
        the data stays in the buffer (counters keep summing) and the next step tries again.

        Only the thread running the steps takes the buffer (the step counters are plain ints it
        alone increments); a flush asked for on another thread is done at its next step end."""
        if not final and self._step_thread is not None and threading.get_ident() != self._step_thread:
            self._flush_requested = True
            return False
        now = time.perf_counter()
        if (
            not final
            and not self.identity.distributed
            and self.worker.pending_batches() >= self.worker.max_batches
        ):
            self.deferred_flushes += 1
            return False
        with self._lock:
            self._flush_requested = False
            batch = self.buffer.take(
                self._seq, self.step_index, now - self._last_flush, self._perf_to_epoch_ns
            )
            self._seq += 1
        batch.final = final
        if not final:
            batch.flush_interval = self.cadence.proposal(batch.steps, batch.elapsed_s)
        self._last_flush = now
        if "torch" in sys.modules and (
            any(_on_cuda(v) for vs in batch.scalars.values() for v in vs[-1:])
            or any(_on_cuda(r.values) for r in batch.layer_stats)
            or any(_on_cuda(h[2]) for h in batch.histograms)
        ):
            batch.cuda_event = _record_cuda_event()
        # Every rank must hand every flush over (its collective pairs with the peers'): when
        # distributed, wait for room; otherwise the room was checked above (final: never waits).
        wait_s = self.config.collective_timeout_s if self.identity.distributed and not final else 0.0
        with self._lock:
            handed = self.worker.submit_batch(batch, wait_s)
        if not handed:
            # Only reachable when distributed and the worker is stuck longer than collective_timeout_s.
            self.lost_flushes += 1
            self.lost_steps += batch.steps
            self.buffer.drop("lost_flush")
            log.warning(
                "otel_train: the background worker is stuck; flush %d (%d steps, up to step %d) was "
                "dropped (%d flushes lost so far).",
                batch.seq,
                batch.steps,
                batch.step,
                self.lost_flushes,
            )
            return False
        if not final:
            self.cadence.flushed(batch.seq, batch.flush_interval)
        return True

    # --- explicit logger API (not per step) ---------------------------------------------------------
    def message(self, kind: str, key: str, payload: Any, step: int | None) -> None:
        from otel_train.pipeline import Message

        self.worker.submit_message(Message(kind, key, payload, self.step_index if step is None else step))

    # --- lifecycle -----------------------------------------------------------------------------------
    def _last_step(self) -> tuple[int, float | None]:
        """(last completed step, its end as perf_counter seconds or None): for the watchdog thread."""
        end_ns = self.step_end_ns
        return self.step_index, (end_ns * 1e-9 if end_ns is not None else None)

    def shutdown(self) -> None:
        """Final flush, drain the worker, close sinks, stop exporters: bounded by shutdown_timeout_s
        for the network part. Idempotent."""
        with self._lock:
            already = self._closed
            self._closed = True
        if already:  # another thread is shutting down: wait for it (bounded)
            self._shutdown_done.wait(self.config.shutdown_timeout_s + 1.0)
            return
        try:
            self._shutdown()
        finally:
            self._shutdown_done.set()

    def _shutdown(self) -> None:
        started = time.monotonic()
        budget = self.config.shutdown_timeout_s
        for watch in list(self.watches):
            watch.remove()
        self.watchdog.close()
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
        self.flush(final=True)
        if not self.worker.stop(timeout_s=max(0.2, budget * 0.5)):
            self._report_unwritten()
        self._report_sink_errors()
        for listener in self.listeners:
            try:
                listener.close()
            except Exception as exc:
                log.debug("otel_train: listener close failed: %s", exc)
        from otel_train.goodput import final_scalars

        final = {**self.worker.final_scalars, **final_scalars(self.goodput.totals)}
        for sink in self.sinks:
            try:
                if sink is self.bridges:  # the bridge process finishes on its own past the budget
                    left = max(0.1, 0.8 * budget - (time.monotonic() - started))
                    self.bridges.close(dict(final), timeout=left)
                else:
                    sink.close(dict(final))
            except Exception as exc:
                log.warning("otel_train: closing %s failed: %s", sink.name, exc)
        # Keep a margin inside the budget for the abandon path itself.
        remaining = max(0.1, 0.9 * budget - (time.monotonic() - started))
        self.telemetry.shutdown(remaining)

    def _report_unwritten(self) -> None:
        """The worker was still busy at the deadline: say how much never reached the run dir."""
        flushes, steps = self.worker.unwritten()
        if flushes <= 0:
            return
        self.lost_flushes += flushes
        self.lost_steps += steps
        self.instruments.dropped.add(flushes, {semconv.REASON: "shutdown_deadline"})
        log.warning(
            "otel_train: shutdown deadline (%.1fs): the background worker was still busy; %d flush(es) "
            "holding %d step(s) were not written to the run dir or exporters. Raise "
            "OTEL_TRAIN_SHUTDOWN_TIMEOUT_S if this happens often.",
            self.config.shutdown_timeout_s,
            flushes,
            steps,
        )

    def _report_sink_errors(self) -> None:
        for name, count in self.worker.sink_errors.items():
            log.warning(
                "otel_train: sink %s failed %d time(s) in this run; those writes are missing.", name, count
            )

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        shutdown()

    @property
    def flush_interval_steps(self) -> int:
        """Steps per flush now (the explicit log_interval, or the adaptive cadence's current value)."""
        return self.cadence.threshold

    @property
    def prometheus_url(self) -> str | None:
        endpoint = self.telemetry.pull_endpoint
        return endpoint.url if endpoint is not None else None


_MAX_STEP = 2**63 - 1  # a step must fit an int64 (Prometheus, TensorBoard, JSON readers)
_OWNER_FILE = ".owner.rank{rank}.json"


def claim_run_dir(run_dir: Path, rank: int, run_id: str, run_name: str) -> bool:
    """Decide whether this process may write rank `rank`'s files in `run_dir`. Returns True for a
    resume (the same run_id restarted: torchrun elastic restart, SLURM requeue: append), False for
    a fresh start; raises ConfigError when an EARLIER run with another run_id wrote this rank's
    files (appending would interleave two runs). Other ranks of the same job share the directory,
    so only this rank's own files count, never the directory's existence."""
    owner = run_dir / _OWNER_FILE.format(rank=rank)
    metrics = run_dir / f"metrics.rank{rank}.jsonl"
    previous: str | None
    if owner.exists():
        try:
            previous = str(json.loads(owner.read_text(encoding="utf-8")).get("run_id"))
        except (OSError, ValueError, AttributeError):
            previous = None
    elif metrics.exists() and metrics.stat().st_size > 0:
        previous = None  # written by a version without owner files: cannot tell, so not ours
    else:  # nothing of this rank yet: a fresh start
        write_json(owner, {"run_id": run_id, "pid": os.getpid(), "started": time.time()})
        return False
    if previous == run_id:
        return True
    raise ConfigError(
        f"run_name {run_name!r}: {run_dir} already holds rank {rank}'s files from another run "
        f"(run_id {previous or 'unknown'}; this one is {run_id}); appending would mix the two. Choose "
        "a new name (init(run_name=...) / OTEL_TRAIN_RUN_NAME, or leave it unset for a unique one), "
        "move the old directory away, or set the same run_id (OTEL_TRAIN_RUN_ID) to resume that run."
    )


def _run_dir_config_error(path: Path, exc: OSError) -> ConfigError:
    where = exc.filename or path
    return ConfigError(
        f"output_dir: cannot write {str(where)!r} ({exc.strerror or exc}). Free space there or point "
        "OTEL_TRAIN_OUTPUT_DIR / init(output_dir=...) at a writable directory, or set run_dir_enabled=False."
    )


def _run_dir_errors_as_config_errors(make: Callable[[], _T]) -> _T:
    """Run-dir files created at init(): a full or read-only disk is a ConfigError naming the file."""
    try:
        return make()
    except OSError as exc:
        raise _run_dir_config_error(Path(exc.filename or "?"), exc) from None


def _on_cuda(value: Any) -> bool:
    device = getattr(value, "device", None)
    return device is not None and getattr(device, "type", "") == "cuda"


def _record_cuda_event() -> Any:
    import torch

    event = torch.cuda.Event()
    event.record()  # on the training thread's current stream; the worker waits on it
    return event


def _default_run_name() -> str:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{secrets.token_hex(2)}"


def _version() -> str:
    from otel_train.version import __version__

    return __version__


# --- module-level lifecycle ------------------------------------------------------------------------
_hooks_installed = False
_previous_sigterm: Any = None
_closing: Session | None = None  # the session being (or last) shut down, so a second caller can wait


def init(
    config: Config | None = None, config_file: str | None = None, settings: Mapping[str, Any] | None = None
) -> Session:
    """Start (or return) the process's session."""
    global _current
    if _current is not None:
        _warn_if_different(_current, config, config_file, settings)
        return _current
    resolved = config or load_config(settings, config_file=config_file)
    session = Session(resolved)
    _current = session
    _install_hooks()
    return session


def _warn_if_different(
    session: Session, config: Config | None, config_file: str | None, settings: Mapping[str, Any] | None
) -> None:
    """A second init() returns the running session; if it asked for other settings, say so once."""
    if session._reinit_warned or (config is None and not config_file and not settings):
        return
    try:
        wanted = config or load_config(settings, config_file=config_file)
    except ConfigError:
        wanted = None
    if wanted == session.config:
        return
    session._reinit_warned = True
    differing = (
        sorted(k for k in FIELDS if getattr(wanted, k) != getattr(session.config, k))
        if wanted is not None
        else sorted(settings or {})
    )
    log.warning(
        "otel_train: init() was called again with different settings (%s); the running session keeps "
        "its own. Call ot.shutdown() first to start a new session with them.",
        ", ".join(differing) or "invalid settings",
    )


def shutdown() -> None:
    global _current, _closing
    session = _current
    if session is None:
        closing = _closing
        if closing is not None:  # shutting down on another thread (SIGTERM relay, atexit): wait
            closing._shutdown_done.wait(closing.config.shutdown_timeout_s + 1.0)
        return
    _current = None  # from here on every record call is a no-op
    _closing = session
    session.shutdown()


def current() -> Session | None:
    return _current


def _forget_in_child() -> None:
    """After fork (DataLoader workers): the child never exports and every API call is a no-op."""
    global _current, _closing
    if _current is not None and _current.bridges is not None:
        _current.bridges.forget_in_child()
    _current = None
    _closing = None


class _SigtermRelay:
    """Does the SIGTERM shutdown on a thread of its own.

    A signal handler runs on the main thread between two bytecodes, possibly while that thread
    holds the session lock or a queue's mutex (flush takes both); a handler that took either would
    wait forever. So the handler only writes a byte to a pipe (no lock anywhere) and returns; this
    thread shuts down (the training thread keeps running and releases its locks) and then sends
    SIGTERM again, which the handler now answers with the previous handler or the default action,
    so the exit status still says "terminated by SIGTERM"."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self.requested = False
        self.done = False
        threading.Thread(target=self._run, name="otel_train-sigterm", daemon=True).start()

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self.pid or self.done:  # a forked child, or our shutdown is over
            _deliver_sigterm(signum, frame)
            return
        if not self.requested:
            self.requested = True
            try:
                os.write(self._write_fd, b"T")
            except OSError:
                self.done = True
                _deliver_sigterm(signum, frame)
        # else: the shutdown is under way; the relay delivers when it is done

    def _run(self) -> None:
        try:
            os.read(self._read_fd, 1)
        except OSError:
            return
        session = _current or _closing
        budget = session.config.shutdown_timeout_s + 1.0 if session is not None else 0.0
        worker = threading.Thread(target=shutdown, name="otel_train-sigterm-shutdown", daemon=True)
        worker.start()
        worker.join(budget)  # shutdown is bounded; this is the backstop
        self.done = True
        os.kill(self.pid, signal.SIGTERM)


_relay: _SigtermRelay | None = None


def _deliver_sigterm(signum: int, frame: FrameType | None) -> None:
    previous = _previous_sigterm
    if callable(previous):
        previous(signum, frame)
        return
    # Re-deliver with the default action so the exit status still says "terminated by SIGTERM".
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    relay = _relay
    if relay is None:
        _deliver_sigterm(signum, frame)
    else:
        relay.handle(signum, frame)


def _install_hooks() -> None:
    global _hooks_installed, _previous_sigterm, _relay
    if _hooks_installed:
        if _relay is not None and _relay.pid != os.getpid():  # init() again in a forked child
            _relay = _SigtermRelay()
        return
    _hooks_installed = True
    atexit.register(shutdown)
    os.register_at_fork(after_in_child=_forget_in_child)
    if threading.current_thread() is threading.main_thread():
        previous = signal.getsignal(signal.SIGTERM)
        if previous in (signal.SIG_DFL, None) or callable(previous):
            _previous_sigterm = previous if callable(previous) else None
            _relay = _SigtermRelay()
            signal.signal(signal.SIGTERM, _on_sigterm)


def message_step(step: Any) -> int | None:
    """A step= argument of the logger API as a plain int (numpy, tensor, float) or None."""
    if step is None or step.__class__ is int:
        return step  # type: ignore[no-any-return]
    try:
        return operator.index(step)
    except Exception:
        number = float(step)
        return int(number) if number.is_integer() else None


def redacted_hparams(params: Mapping[str, Any]) -> dict[str, Any]:
    return redact(dict(params))
