"""`build_session(config)`: builds every part of a session, in order, and wires them.

The run place (`run_place`), GPU discovery, the Resource (`resource`), the SDK providers and
instruments, health events, the sinks and the bridge process (`sinks`), the flush listeners
(health, hardware, cross-rank reducer, profiled steps, goodput), the worker, the hang watchdog and
the control file; then config.json and env.json, and the threads start.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from otel_train import semconv
from otel_train.assemble.resource import build_resource, role_attribute
from otel_train.assemble.run_place import RunPlace, agree_run_place, process_group_started
from otel_train.assemble.sinks import build_sinks
from otel_train.config import Config, config_as_dict, signal_number
from otel_train.distributed import Identity
from otel_train.interval import FlushListener
from otel_train.run_directory import RunFiles, run_dir_errors_as_config_errors, write_json
from otel_train.session import Session

if TYPE_CHECKING:  # the SDK is imported at init(), not when `import otel_train` runs
    from opentelemetry.sdk.resources import Resource

    from otel_train.bridges.base import Sink
    from otel_train.cadence import Cadence
    from otel_train.crossrank import CrossRankReducer
    from otel_train.diagnostics import CollectiveMonitor, HangReporter
    from otel_train.exporters import Telemetry
    from otel_train.flush import Instruments, StepReader, Worker
    from otel_train.hardware import Discovery, HardwareMonitor
    from otel_train.health import HealthEvents

logger = logging.getLogger("otel_train")


def build_session(config: Config) -> Session:
    """A started session for `config`: every part built and wired, the worker and watchdog running."""
    place = agree_run_place(config)
    # Rank 0's cadence settings, so that ranks in lockstep flush at the same steps (init warned).
    config = replace(config, log_interval=place.log_interval, cross_rank=place.cross_rank)
    gpu_discovery = _discover_gpus(config, place.identity)
    resource = build_resource(
        config, place.identity, gpu_discovery.resource_attributes() if gpu_discovery else {}
    )
    session = _build_session(config, place, resource, gpu_discovery)
    _attach_memory_dumps(session)
    launch = _check_launch(session, place, gpu_discovery)  # collective (one gather) when distributed
    _attach_goodput(session)
    _attach_watchdog(session)
    if place.run_dir is not None and place.is_reporting_rank:
        run_dir = place.run_dir
        run_dir_errors_as_config_errors(lambda: write_run_files(run_dir, config, place, launch))
    session.worker.start()
    session.watchdog.start()
    if session.control is not None:
        control = session.control
        control.start(lambda: control.schedule(session.step_index, session.seconds_per_step()))
    return session


def _discover_gpus(config: Config, identity: Identity) -> Discovery | None:
    if not config.hardware:
        return None
    from otel_train.hardware import discover_with_timeout

    # Before the Resource: the rank's GPU UUID and PCI bus id join DCGM series to ranks.
    return discover_with_timeout(identity.local_rank, timeout_s=5.0)


def _build_session(
    config: Config, place: RunPlace, resource: Resource, gpu_discovery: Discovery | None
) -> Session:
    """The session with every part that does not call back into it (see `build_session`)."""
    from otel_train.exporters import build_job_provider, build_telemetry
    from otel_train.flush import Instruments, StepReader
    from otel_train.hardware import MpsMemory
    from otel_train.health import HealthMonitor
    from otel_train.numerics import GradientFlowMonitor
    from otel_train.profiling import ProfiledStepsCounter

    ident = place.identity
    step_reader = StepReader()
    event_attributes: dict[str, str | int] = {
        semconv.PROCESS_PID: os.getpid(),
        semconv.RUN_NAME: place.run_name,
    }
    tiered = replace(config, rank_series=place.rank_series)  # the job's tier; config keeps "auto"
    telemetry = build_telemetry(tiered, resource, event_attributes, step_reader, ident.local_rank)
    meter = telemetry.meter_provider.get_meter("otel_train", _version())
    instruments = Instruments(meter, config.max_metric_names)
    otel_logger = (
        telemetry.logger_provider.get_logger("otel_train") if telemetry.logger_provider is not None else None
    )
    events = _health_events(config, place, instruments, otel_logger)
    health = HealthMonitor(events, instruments.nonfinite_loss, config.loss_spike_factor)
    if place.resumed:
        events.emit(
            "restart",
            f"run {place.run_name!r} (run_id {ident.run_id}) restarted; appending to its files",
            {"pid": os.getpid()},
        )
    for event, message in place.notices:
        events.emit(event, message)
    sinks, console, bridges = run_dir_errors_as_config_errors(lambda: build_sinks(config, place, instruments))
    hardware = _start_hardware(config, meter, events, ident, gpu_discovery)
    job_provider = build_job_provider(config, ident, telemetry)  # rank 0: the job-level series
    job_meter = job_provider.get_meter("otel_train", _version()) if job_provider is not None else None
    reducer, cadence = _reducer_and_cadence(config, place, meter, events, job_meter)
    profiled_steps = ProfiledStepsCounter(meter)
    gradient_flow = GradientFlowMonitor(events)  # reads ot.watch's gradient norms: idle without a watch
    collectives = _collective_monitor(place, meter)
    reducer.lateness.monitor = collectives  # arrivals at collectives share its recorder reads
    listeners: list[FlushListener] = [
        health,
        gradient_flow,
        *([hardware] if hardware else []),
        *([MpsMemory(meter)] if hardware else []),  # Apple silicon memory (idle elsewhere)
        reducer,
        profiled_steps,
        *([collectives] if collectives else []),
    ]
    return Session(
        config=config, identity=ident, run_name=place.run_name, run_dir=place.run_dir,
        resource=resource, step_reader=step_reader, telemetry=telemetry, meter=meter,
        instruments=instruments, otel_logger=otel_logger, events=events, console=console,
        bridges=bridges, hardware=hardware, reducer=reducer,
        worker=_worker(config, telemetry, ident, instruments, step_reader, otel_logger, sinks, listeners),
        cadence=cadence, profiled_steps=profiled_steps,
    )  # fmt: skip


def _collective_monitor(place: RunPlace, meter: Any) -> CollectiveMonitor | None:
    """Collective metrics from the Flight Recorder, on a rank of a started process group."""
    if not place.identity.distributed:
        return None
    if not process_group_started():
        if place.identity.rank == 0:  # the launch check's no_process_group event says why, too
            logger.warning(
                "otel_train: torch.distributed had no process group when ot.init() ran: collective "
                "metrics and hang attribution are off. Call init_process_group() before ot.init()."
            )
        return None
    from otel_train.diagnostics import start_monitor

    return start_monitor(meter, place.telemetry_group, place.identity.rank)


def _health_events(
    config: Config, place: RunPlace, instruments: Instruments, otel_logger: Any | None
) -> HealthEvents:
    from otel_train.health import HealthEvents

    rank = place.identity.rank
    return HealthEvents(
        instruments.health_events,
        otel_logger,
        RunFiles(place.run_dir, rank, place.identity.role).events if place.run_dir else None,
        {semconv.RANK: rank, "host.name": place.identity.host, **role_attribute(place.identity)},
        echo=config.verbosity > 0,
    )


def _start_hardware(
    config: Config, meter: Any, events: HealthEvents, ident: Identity, gpu_discovery: Discovery | None
) -> HardwareMonitor | None:
    if not config.hardware or gpu_discovery is None:  # discovered whenever hardware is on
        return None
    from otel_train.hardware import HardwareMonitor

    hardware = HardwareMonitor(config, meter, events, ident.local_rank, gpu_discovery)
    hardware.start()
    return hardware


def _reducer_and_cadence(
    config: Config, place: RunPlace, meter: Any, events: HealthEvents, job_meter: Any = None
) -> tuple[CrossRankReducer, Cadence]:
    """The cross-rank reducer, and the flush cadence it adopts from rank 0's proposal."""
    from otel_train.cadence import Cadence
    from otel_train.crossrank import CrossRankReducer

    ident = place.identity
    lockstep = ident.distributed and config.cross_rank
    reducer = CrossRankReducer(
        ident, meter, events, config, group=place.telemetry_group, exchange=config.cross_rank,
        shape=place.exchange, job_meter=job_meter,
    )  # fmt: skip
    cadence = Cadence(
        config.log_interval,
        config.log_interval_min_s,
        config.log_interval_s,
        coordinated=lockstep,
        decides=ident.rank == 0,
    )
    if lockstep:
        reducer.on_cadence = cadence.adopt
    return reducer, cadence


def _attach_goodput(session: Session) -> None:
    from otel_train.goodput import GoodputListener

    run_dir, rank = session.run_dir, session.identity.rank
    session.goodput = GoodputListener(
        session.clock,
        session.meter,
        RunFiles(run_dir, rank, session.identity.role).goodput if run_dir else None,
        session.identity.run_id,
    )
    session.add_listener(session.goodput)


def _attach_memory_dumps(session: Session) -> None:
    from otel_train.diagnostics import MemoryDumps

    ident = session.identity
    session.memory_dumps = MemoryDumps(session.run_dir, ident.rank, session.events, role=ident.role)
    if session.hardware is not None:  # above the memory-pressure threshold too
        session.hardware.efficiency.on_pressure = session.memory_dumps.on_pressure


def _worker(
    config: Config, telemetry: Telemetry, ident: Identity, instruments: Instruments,
    step_reader: StepReader, otel_logger: Any | None, sinks: list[Sink], listeners: list[FlushListener],
) -> Worker:  # fmt: skip
    """The background worker, the one owner of the sinks and flush listeners (not started yet)."""
    from otel_train.flush import SpanWriter, Worker

    tracer = (
        telemetry.tracer_provider.get_tracer("otel_train", _version())
        if telemetry.tracer_provider is not None
        else None
    )
    return Worker(
        instruments,
        step_reader,
        sinks,
        listeners,
        SpanWriter(tracer, ident.run_id, ident.rank) if tracer is not None else None,
        queue_size=config.queue_size,
        total_steps=config.total_steps,
        otel_logger=otel_logger,
    )


def _hang_reporter(session: Session) -> HangReporter | None:
    """Hang attribution through the run directory, when the Flight Recorder feeds a monitor."""
    from otel_train.diagnostics import CollectiveMonitor, HangReporter

    monitor = next((x for x in session.listeners if isinstance(x, CollectiveMonitor)), None)
    if monitor is None or session.run_dir is None:
        return None
    ident = session.identity
    return HangReporter(
        session.run_dir, ident.rank, ident.world_size, ident.host, session.events, monitor,
        session.config.stall_timeout_s, ident.role,
    )  # fmt: skip


def _attach_watchdog(session: Session) -> None:
    from otel_train.control import ControlFile
    from otel_train.diagnostics import HangWatchdog

    config, rank = session.config, session.identity.rank
    reporter = _hang_reporter(session)
    session.watchdog = HangWatchdog(
        session.run_dir,
        rank,
        session.events,
        session.last_step,
        config.stall_timeout_s,
        signal_number(config.stack_dump_signal) if config.stack_dump_signal else None,
        on_tick=lambda: _report_stuck_worker(session),
        on_stall=reporter.on_stall if reporter is not None else None,
        role=session.identity.role,
    )
    session.control = (
        ControlFile(session.run_dir, rank, session.events, session.identity.world_size, session.identity.role)
        if session.run_dir
        else None
    )


def _report_stuck_worker(session: Session) -> None:
    """Watchdog tick: one `worker_stuck` event per flush the worker spends longer than
    stall_timeout_s on (the training's buffers are capped meanwhile)."""
    from otel_train.flush import stuck_message

    message = stuck_message(session.worker, session.config.stall_timeout_s)
    if message is not None:
        session.events.emit("worker_stuck", message, {"step": session.step_index})


def _check_launch(session: Session, place: RunPlace, gpu_discovery: Discovery | None) -> dict[str, Any]:
    from otel_train.diagnostics import check_launch, local_facts
    from otel_train.distributed import process_group_initialized
    from otel_train.hardware import RES_GPU_UUID

    gpu_uuid = gpu_discovery.resource_attributes().get(RES_GPU_UUID) if gpu_discovery else None
    mine = local_facts(place.identity, gpu_uuid, process_group_initialized())
    return check_launch(mine, place.telemetry_group, session.events)


def write_run_files(run_dir: Path, config: Config, place: RunPlace, launch: dict[str, Any]) -> None:
    from otel_train.envinfo import collect_env

    resolved = config_as_dict(config)
    resolved.update({"run_name": place.run_name, "run_id": place.identity.run_id})
    files = RunFiles(run_dir, place.identity.rank, place.identity.role)
    write_json(files.config, resolved)
    write_json(files.env, {**collect_env(), "launch": launch})


def _version() -> str:
    from otel_train.version import __version__

    return __version__
