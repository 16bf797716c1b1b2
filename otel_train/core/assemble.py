"""Assembly: `build_session(config)` builds every part of a session, in order, and wires them, from
what every rank agrees at init (the run place), the Resource and the sinks. Design:
docs/design/core.md#assemble.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from otel_train import semconv
from otel_train.bridges.base import Sink
from otel_train.bridges.console import ConsoleSink
from otel_train.bridges.rundir import RunDirSink
from otel_train.config import Config, ConfigError, RankSeries, config_as_dict, signal_number
from otel_train.core.buffer import FlushListener
from otel_train.core.session import Session
from otel_train.crossrank import ExchangeShape, decide_shape, node_key, node_ranks
from otel_train.distributed import (
    NODE_UNKNOWN,
    Agreement,
    Identity,
    agree_job,
    create_telemetry_group,
    detect_identity,
    process_group_initialized,
)
from otel_train.redaction import is_secret_key, redact_attributes
from otel_train.run_directory import (
    RunFiles,
    avoid_live_owner,
    claim_run_dir,
    default_run_name,
    make_run_dir,
    run_dir_errors_as_config_errors,
    write_json,
)

if TYPE_CHECKING:  # the SDK is imported at init(), not when `import otel_train` runs
    from opentelemetry.sdk.resources import Resource

    from otel_train.bridges.process import BridgeProcess
    from otel_train.bridges.table import BridgeSpec
    from otel_train.core.cadence import Cadence
    from otel_train.core.instruments import Instruments, StepReader
    from otel_train.core.worker import Worker
    from otel_train.crossrank import CrossRankReducer
    from otel_train.diagnostics import CollectiveMonitor, HangReporter
    from otel_train.exporters import Telemetry
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
    reducer = session.reducer
    session.worker.row_values = lambda: reducer.job_row  # rank 0: a pipeline's last-stage loss
    if reducer.group is not None:  # a rank that is not flushing still tells rank 0 it is alive
        session.worker.idle_s = reducer.keepalive_s / 2
        session.worker.on_idle = reducer.keep_alive
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
    from otel_train.hardware import discover_with_timeout, torch_cuda_if_loaded

    # Before the Resource: the rank's GPU UUID and PCI bus id join DCGM series to ranks. Torch's
    # device, when CUDA is initialised already; else CUDA_VISIBLE_DEVICES (checked again later).
    return discover_with_timeout(identity.local_rank, torch_cuda=torch_cuda_if_loaded(), timeout_s=5.0)


def _build_session(
    config: Config, place: RunPlace, resource: Resource, gpu_discovery: Discovery | None
) -> Session:
    """The session with every part that does not call back into it (see `build_session`)."""
    from otel_train.core.instruments import Instruments, StepReader
    from otel_train.exporters import build_job_provider, build_telemetry
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
    if collectives is not None:
        collectives.led = lambda: reducer.distributed
    # MpsMemory: Apple silicon's memory (idle elsewhere)
    on_hardware: list[FlushListener] = [hardware, MpsMemory(meter)] if hardware else []
    listeners: list[FlushListener] = [health, gradient_flow, *on_hardware, reducer, profiled_steps]
    listeners += [collectives] if collectives else []
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
    if not process_group_initialized():
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
        echo_source=f" (rank {rank})" if place.identity.distributed else "",
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
    config: Config, place: RunPlace, meter: Any, events: HealthEvents, job_meter: Any
) -> tuple[CrossRankReducer, Cadence]:
    """The cross-rank reducer, and the flush cadence it adopts from rank 0's proposal."""
    from otel_train.core.cadence import Cadence
    from otel_train.crossrank import CrossRankReducer

    ident = place.identity
    lockstep = ident.distributed and config.cross_rank
    reducer = CrossRankReducer(
        ident, meter, events, config, group=place.telemetry_group, exchange=config.cross_rank,
        shape=place.exchange, job_meter=job_meter,
    )  # fmt: skip
    interval, min_s, max_s = config.log_interval, config.log_interval_min_s, config.log_interval_s
    cadence = Cadence(interval, min_s, max_s, coordinated=lockstep, decides=ident.rank == 0)
    if lockstep:
        reducer.on_cadence = cadence.adopt
    return reducer, cadence


def _attach_goodput(session: Session) -> None:
    from otel_train.goodput import GoodputListener

    run_dir, ident = session.run_dir, session.identity
    path = RunFiles(run_dir, ident.rank, ident.role).goodput if run_dir else None
    session.goodput = GoodputListener(session.clock, session.meter, path, ident.run_id)
    for instrument, attributes, amount in session.goodput.carried:
        if amount:
            session.step_reader.carry(instrument, attributes, amount)
    session.worker.add_listener(session.goodput)


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
    from otel_train.core.instruments import SpanWriter
    from otel_train.core.worker import Worker

    provider = telemetry.tracer_provider
    writer = None
    if provider is not None:
        writer = SpanWriter(provider.get_tracer("otel_train", _version()), ident.run_id, ident.rank)
    return Worker(
        instruments, step_reader, sinks, listeners, writer, config.queue_size, config.total_steps, otel_logger
    )


def _hang_reporter(session: Session) -> HangReporter | None:
    """Hang attribution through the run directory, when the Flight Recorder feeds a monitor."""
    from otel_train.diagnostics import CollectiveMonitor, HangReporter

    monitor = next((x for x in session.worker.listeners if isinstance(x, CollectiveMonitor)), None)
    if monitor is None or session.run_dir is None:
        return None
    ident = session.identity
    return HangReporter(
        session.run_dir, ident.rank, ident.world_size, ident.host, session.events, monitor,
        session.config.stall_timeout_s, ident.role,
    )  # fmt: skip


def _on_watchdog_tick(session: Session, reporter: HangReporter | None) -> None:
    _report_stuck_worker(session)
    if reporter is not None and not session.watchdog.stalled_s():
        reporter.answer_requests()  # a stalled peer may ask whether this rank is alive


def _attach_watchdog(session: Session) -> None:
    from opentelemetry.metrics import Observation

    from otel_train.control import ControlFile
    from otel_train.diagnostics import HangWatchdog

    config, rank = session.config, session.identity.rank
    reporter = _hang_reporter(session)
    watchdog = session.watchdog = HangWatchdog(
        session.run_dir,
        rank,
        session.events,
        session.last_step,
        config.stall_timeout_s,
        signal_number(config.stack_dump_signal),
        on_tick=lambda: _on_watchdog_tick(session, reporter),
        on_stall=reporter.on_stall if reporter is not None else None,
        role=session.identity.role,
        saving=session.saving,
        checkpoint_timeout_s=config.checkpoint_timeout_s,
        first_step_timeout_s=config.first_step_timeout_s,
        step_start=lambda: session.step_start_ns,
        on_step_stall=session.clock.note_step_stall,
        evaluating_s=session.evaluating_s,
        in_eval=session.in_eval,
        eval_timeout_s=config.eval_timeout_s,
    )
    if reporter is not None:
        reporter.stalled = lambda: not session.shutdown_done.is_set() and watchdog.stalled_s() > 0
    # Read at each export, on the SDK's thread: it rises while the step thread hangs.
    semconv.STALL_DURATION.create(session.meter, lambda options: [Observation(watchdog.stalled_s())])
    # A rank that progresses, or waits in a collective inside a declared save, is no collective hang.
    collectives = session.reducer.lateness.monitor
    if collectives is not None:
        collectives.stalled_s, collectives.saving = watchdog.stalled_s, session.saving
    session.control = None
    if session.run_dir:
        ident = session.identity
        session.control = ControlFile(session.run_dir, rank, session.events, ident.world_size, ident.role)


def _report_stuck_worker(session: Session) -> None:
    """Watchdog tick: one `worker_stuck` event per flush the worker spends over stall_timeout_s on."""
    from otel_train.core.worker import stuck_message

    message = stuck_message(session.worker, session.config.stall_timeout_s)
    if message is not None:
        session.events.emit("worker_stuck", message, {"step": session.step_index})


def _check_launch(session: Session, place: RunPlace, gpu_discovery: Discovery | None) -> dict[str, Any]:
    from otel_train.diagnostics import check_launch, local_facts
    from otel_train.hardware import RES_GPU_UUID

    gpu_uuid = gpu_discovery.resource_attributes().get(RES_GPU_UUID) if gpu_discovery else None
    mine = local_facts(place.identity, gpu_uuid, process_group_initialized())
    return check_launch(mine, place.telemetry_group, session.events)


def write_run_files(run_dir: Path, config: Config, place: RunPlace, launch: dict[str, Any]) -> None:
    from otel_train.envinfo import collect_env

    resolved = {**config_as_dict(config), "run_name": place.run_name, "run_id": place.identity.run_id}
    files = RunFiles(run_dir, place.identity.rank, place.identity.role)
    write_json(files.config, resolved)
    write_json(files.env, {**collect_env(), "launch": launch})


def _version() -> str:
    from otel_train.version import __version__

    return __version__


# --- what every rank decides together at init, from facts each reports in one all_gather: a
# refusal anywhere is every rank's, and the exchange's shape (docs/design/core.md#agreement) ---
REASON_BYTES = 240  # a refusal's message travels in at most this many UTF-8 bytes
_REFUSED, _FANIN, _NODE, _ROLE, _REASON_LEN, _RANK_SERIES = range(6)  # int64 fields, then the reason's bytes
_INTS = 6
RANK_SERIES_CODES = ("auto", "full", "essential")  # Config.rank_series as it travels in the row
ROW_LEN = _INTS * 8 + REASON_BYTES


@dataclass(frozen=True)
class JobFacts:
    """Every rank's reported facts, by rank, and what they decide."""

    fanins: tuple[int, ...]
    roles: tuple[int, ...]  # role fingerprints (`_role_key`)
    refusals: tuple[tuple[int, str], ...]  # (rank, its message), for each rank that refused
    shape: ExchangeShape
    rank_series: tuple[str, ...] = ()  # the rank_series setting each rank asked for (rank 0's wins)
    node_keys: tuple[int, ...] = ()  # each rank's `node_key`


def gather_job_facts(
    group: Any, identity: Identity, fanin: int, refusal: str | None = None, rank_series: str = "auto"
) -> JobFacts | None:
    """Every rank's facts on every rank (one all_gather on the telemetry group); None when it
    failed (logged: this rank then keeps to itself, as when the group could not be made)."""
    import torch
    import torch.distributed as dist

    reason = (refusal or "").encode("utf-8")[:REASON_BYTES]
    ints = [int(refusal is not None), fanin, node_key(identity.host, identity.node_rank)]
    ints += [_role_key(identity.role), len(reason), RANK_SERIES_CODES.index(rank_series)]
    mine = torch.zeros(ROW_LEN, dtype=torch.uint8)
    mine[: _INTS * 8] = torch.tensor(ints, dtype=torch.int64).view(torch.uint8)
    if reason:
        mine[_INTS * 8 : _INTS * 8 + len(reason)] = torch.frombuffer(bytearray(reason), dtype=torch.uint8)
    rows = [torch.zeros(ROW_LEN, dtype=torch.uint8) for _ in range(identity.world_size)]
    try:
        dist.all_gather(rows, mine, group=group)
    except RuntimeError as exc:  # torch.distributed's errors (a timeout, a peer gone)
        logger.warning("otel_train: the ranks could not agree at init (%s); this rank keeps to itself", exc)
        return None
    fields = [row[: _INTS * 8].view(torch.int64).tolist() for row in rows]
    refusals = tuple(
        (rank, bytes(rows[rank][_INTS * 8 : _INTS * 8 + f[_REASON_LEN]].tolist()).decode("utf-8", "replace"))
        for rank, f in enumerate(fields)
        if f[_REFUSED]
    )
    fanins = tuple(f[_FANIN] for f in fields)
    shape = decide_shape(fanins, [f[_NODE] for f in fields])
    tiers = tuple(RANK_SERIES_CODES[f[_RANK_SERIES]] for f in fields)
    keys = tuple(f[_NODE] for f in fields)
    return JobFacts(fanins, tuple(f[_ROLE] for f in fields), refusals, shape, tiers, keys)


def refuse_if_any(facts: JobFacts, identity: Identity) -> None:
    """Raise ConfigError on every rank when any rank refused or names another role than rank 0."""
    others = [(rank, reason) for rank, reason in facts.refusals if rank != identity.rank]
    if len(others) < len(facts.refusals):
        return  # this rank refused itself: its caller raises its own error
    if others:
        rank, reason = others[0]
        more = f" (and rank(s) {[r for r, _ in others[1:]]})" if len(others) > 1 else ""
        raise ConfigError(
            f"rank {rank} of this process group refused ot.init(){more}: {reason}. Every rank refuses "
            f"with it (the ranks of one process group are one job): fix the setting on rank {rank}."
        )
    differ = [rank for rank, role in enumerate(facts.roles) if role != facts.roles[0]]
    if not differ:
        return
    if identity.rank in differ:
        raise ConfigError(
            f"role: rank {identity.rank} has role {identity.role!r} but rank 0 of its process group "
            "another; ranks are compared only within one role, so one torch process group holds one "
            "role. Give every rank of the group the same OTEL_TRAIN_ROLE (each role with its own "
            "process group)."
        )
    who = f"rank {differ[0]}" if len(differ) == 1 else f"ranks {', '.join(str(r) for r in differ)}"
    raise ConfigError(
        f"role: {who} of this process group name another role than rank 0; ranks are "
        "compared only within one role, so one torch process group holds one role and every rank "
        "refuses. Give every rank of the group the same OTEL_TRAIN_ROLE (each role with its own "
        "process group)."
    )


def refuse_together(reason: str) -> None:
    """This rank refuses ot.init() (`reason`: its ConfigError): where it is one rank of a process
    group, it joins the telemetry group and the facts gather first, so that every other rank
    refuses with it at once. The caller raises its own error after this."""
    if not process_group_initialized():
        return
    identity = detect_identity(None)
    if not identity.distributed:
        return
    # Its settings are what failed: the group waits as long as the default collective_timeout_s.
    group = create_telemetry_group(identity, Config.collective_timeout_s)
    if group is not None:
        gather_job_facts(group, identity, 0, reason)


def _role_key(role: str) -> int:
    return int.from_bytes(hashlib.blake2b(role.encode(), digest_size=8).digest(), "little", signed=True)


# --- the run place: this process's identity, the telemetry gloo group and the one run (name,
# directory, cadence) every rank agrees on (docs/design/core.md#run-place) ---


@dataclass(frozen=True)
class RunPlace:
    """Who this process is in the job and where the run writes."""

    identity: Identity
    telemetry_group: Any  # a torch.distributed ProcessGroup, or None when not distributed
    run_name: str
    is_reporting_rank: bool  # writes progress, console and bridges (rank 0, or all with bridge_all_ranks)
    run_dir: Path | None
    resumed: bool  # the same run_id restarted: append to this rank's files
    log_interval: int | None  # rank 0's in lockstep (every rank flushes at the same steps)
    cross_rank: bool  # rank 0's
    # (event, message): what init found about the job as a whole, emitted once the events exist
    notices: tuple[tuple[str, str], ...] = ()
    exchange: ExchangeShape | None = None  # the exchange's shape, the job's (None: not agreed)
    rank_series: RankSeries = "full"  # the series tier, resolved from rank 0's setting and the world size


def agree_run_place(config: Config) -> RunPlace:
    identity = detect_identity(config.run_id, role=config.role)
    # A dedicated gloo group: telemetry's one exchange per flush runs on the worker thread and
    # can never interleave with the training's own (NCCL) collectives. Needs init_process_group first.
    group = create_telemetry_group(identity, config.collective_timeout_s)
    # Refusals and the exchange's shape first, decided together from every rank's facts (agreement).
    facts = None
    if group is not None:
        facts = gather_job_facts(group, identity, config.exchange_fanin, rank_series=config.rank_series)
    if facts is None:
        group = None  # this rank could not agree with the others: it keeps to itself (run_split)
    else:
        refuse_if_any(facts, identity)
        if identity.node_rank == NODE_UNKNOWN:  # no launcher named the node: every rank's host does
            identity = replace(identity, node_rank=node_ranks(facts.node_keys)[identity.rank])
    # One run per job: every rank adopts rank 0's run id, run name (a generated name differs per
    # process) and log_interval, so all ranks write into one run directory and flush together.
    run_name = config.run_name or default_run_name()
    if identity.rank == 0 and config.run_dir_enabled:  # rank 0's choice is every rank's (agree_job)
        run_name = avoid_live_owner(Path(config.output_dir), run_name, identity.run_id, identity.role)
    agreed = agree_job(identity, group, run_name, config.log_interval, config.cross_rank)
    identity, run_name = agreed.identity, agreed.run_name
    run_dir = make_run_dir(config, run_name)
    resumed = run_dir is not None and run_dir_errors_as_config_errors(
        lambda: claim_run_dir(run_dir, identity.rank, identity.run_id, run_name, identity.role)
    )

    reporting = identity.rank == 0 or config.bridge_all_ranks
    from otel_train.exporters import resolve_rank_series

    # Rank 0's setting and the job's world size: every rank sends the same tier's series.
    asked_tier = facts.rank_series[0] if facts is not None else config.rank_series
    rank_series = resolve_rank_series(asked_tier, identity.world_size)
    notices = _job_notices(config, agreed, group, run_dir, facts)
    for _, message in notices:
        logger.warning("otel_train: %s", message)
    # A rank split off from the others (no telemetry group) keeps to itself: no exchange, and no
    # second try at the collective group creation (a peer that never joins would make it wait again).
    split = identity.distributed and group is None
    return RunPlace(
        identity,
        group,
        run_name,
        reporting,
        run_dir,
        resumed,
        agreed.log_interval,
        agreed.cross_rank and not split,
        notices,
        facts.shape if facts is not None else None,
        rank_series,
    )


def _job_notices(
    config: Config, agreed: Agreement, group: Any, run_dir: Path | None, facts: JobFacts | None
) -> tuple[tuple[str, str], ...]:
    """What this rank must say about the job at init: it was split off (no telemetry group, so
    no agreed run directory), or it asked for another log_interval, cross_rank, exchange_fanin or
    rank_series than rank 0."""
    ident = agreed.identity
    if ident.distributed and group is None and process_group_initialized():
        return (
            (
                "run_split",
                f"rank {ident.rank} could not join the other ranks' telemetry group (the warning above "
                f"says why: a rank called ot.init() more than collective_timeout_s="
                f"{config.collective_timeout_s:g} s later than another or never, or a peer is gone or "
                f"refused the connection): it writes its own run directory "
                f"{run_dir or agreed.run_name} under run id {ident.run_id}, and has no cross-rank stats. "
                "Give every rank the same run_name (or OTEL_TRAIN_RUN_ID) to keep one directory, call "
                "ot.init() at the same point on every rank, or raise collective_timeout_s.",
            ),
        )
    differs = [n for n in agreed.differs if n != "role"]
    asked = {"log_interval": _cadence_text(config.log_interval), "cross_rank": str(config.cross_rank)}
    rank0 = {"log_interval": _cadence_text(agreed.log_interval), "cross_rank": str(agreed.cross_rank)}
    if facts is not None and facts.fanins[ident.rank] != facts.fanins[0]:
        differs.append("exchange_fanin")
        asked["exchange_fanin"], rank0["exchange_fanin"] = str(config.exchange_fanin), str(facts.fanins[0])
    if facts is not None and facts.rank_series[ident.rank] != facts.rank_series[0]:
        differs.append("rank_series")
        asked["rank_series"], rank0["rank_series"] = repr(config.rank_series), repr(facts.rank_series[0])
    if not differs:
        return ()
    names = " and ".join(differs)
    return (
        (
            "settings_mismatch",
            f"{names} differ{'s' if len(differs) == 1 else ''} across ranks: rank {ident.rank} asked "
            f"for {', '.join(asked[n] for n in differs)}, rank 0 for {', '.join(rank0[n] for n in differs)}; "
            "every rank uses rank 0's, so that the ranks exchange at the same flushes and steps, in "
            f"one shape, and send one tier's series. Set the same {names} on every rank.",
        ),
    )


def _cadence_text(log_interval: int | None) -> str:
    return "the adaptive cadence (log_interval unset)" if log_interval is None else f"{log_interval} steps"


# --- the sinks: every rank's metrics JSONL; on the reporting rank the progress file, the console
# and the bridge process ---
def build_sinks(
    config: Config, place: RunPlace, instruments: Instruments
) -> tuple[list[Sink], ConsoleSink | None, BridgeProcess | None]:
    """Every rank keeps its own metrics JSONL (the local copy); progress, console and bridges
    are written by the reporting rank (rank 0, or every rank with bridge_all_ranks)."""
    ident = place.identity
    sinks: list[Sink] = []
    if place.run_dir is not None:
        sinks.append(RunDirSink(place.run_dir, ident.rank, place.is_reporting_rank, ident.role))
    if not place.is_reporting_rank:
        return sinks, None, None
    console = None
    if ident.rank == 0:
        console = ConsoleSink(config.verbosity, config.progress_bar, run_dir=place.run_dir)
        sinks.append(console)
    bridges = _bridge_process(config, place, instruments)
    if bridges is not None:
        sinks.append(bridges)
    return sinks, console, bridges


def bridge_specs(config: Config, place: RunPlace) -> list[BridgeSpec]:
    """The switched-on bridges (`bridges/table`) as the bridge process builds them."""
    from otel_train.bridges.table import BridgePlace, specs

    ident, run_dir = place.identity, place.run_dir or Path(config.output_dir) / place.run_name
    where = BridgePlace(
        run_dir, place.run_name, ident.run_id, ident.rank, ident.role, config.bridge_all_ranks
    )
    return specs(config, where)


def _bridge_process(config: Config, place: RunPlace, instruments: Instruments) -> BridgeProcess | None:
    """TensorBoard / W&B / MLflow in one child process, off this process's GIL. A missing package
    or an unwritable directory raises here, at init(), naming the extra or the path."""
    from otel_train.bridges.errors import BridgeSetupFailed
    from otel_train.bridges.process import BridgeProcess

    specs = bridge_specs(config, place)
    if not specs:
        return None

    def count_drop(reason: str, count: int) -> None:
        instruments.dropped.add(count, {semconv.REASON: reason})

    try:
        return BridgeProcess(specs, config.bridge_queue_size, count_drop)
    except BridgeSetupFailed as exc:
        raise ConfigError(str(exc)) from None


# --- the Resource: the attributes that name this rank's series (no per-process attribute: those
# go on spans and logs) ---
def build_resource(config: Config, ident: Identity, gpu_attributes: Mapping[str, str]) -> Resource:
    from opentelemetry.sdk.resources import Resource

    attributes: dict[str, Any] = dict(config.resource_attributes)
    attributes.update(gpu_attributes)
    attributes.update(
        {
            "service.name": config.service_name,
            "service.instance.id": ident.instance_id,
            semconv.RUN_ID: ident.run_id,
            semconv.RANK: ident.rank,
            **role_attribute(ident),
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
    # a value may hold one too (`db.url=postgres://user:password@db`)
    return Resource(redact_attributes(kept), created.schema_url)


def role_attribute(ident: Identity) -> dict[str, str]:
    """The role resource/event attribute: none without a role (the identity is run id and rank alone)."""
    return {semconv.ROLE: ident.role} if ident.role else {}
