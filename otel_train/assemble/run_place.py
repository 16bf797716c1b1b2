"""Where this process runs: its identity in the job, the telemetry gloo group, and the one run
(name, directory, cadence) every rank agrees on at init. Design: docs/design/core.md#run-place.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otel_train.assemble.agreement import JobFacts, gather_job_facts, refuse_if_any
from otel_train.config import Config, RankSeries
from otel_train.crossrank import ExchangeShape
from otel_train.distributed import Agreement, Identity, agree_job, create_telemetry_group, detect_identity
from otel_train.run_directory import (
    avoid_live_owner,
    claim_run_dir,
    default_run_name,
    make_run_dir,
    run_dir_errors_as_config_errors,
)

logger = logging.getLogger("otel_train")


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
    # One run per job: every rank adopts rank 0's run id, run name (a generated name differs per
    # process) and log_interval, so all ranks write into one run directory and flush together.
    run_name = config.run_name or default_run_name()
    if identity.rank == 0 and config.run_dir_enabled:  # rank 0's choice is every rank's (agree_job)
        run_name = avoid_live_owner(Path(config.output_dir), run_name, identity.run_id, identity.role)
    agreed = agree_job(identity, group, run_name, config.log_interval, config.cross_rank)
    identity, run_name = agreed.identity, agreed.run_name
    run_dir = make_run_dir(config, run_name)
    resumed = False
    if run_dir is not None:
        rank, run_id = identity.rank, identity.run_id
        role = identity.role
        resumed = run_dir_errors_as_config_errors(
            lambda: claim_run_dir(run_dir, rank, run_id, run_name, role)
        )
    reporting = identity.rank == 0 or config.bridge_all_ranks
    from otel_train.exporters import resolve_rank_series

    # Rank 0's setting and the job's world size: every rank sends the same tier's series.
    asked_tier = facts.rank_series[0] if facts is not None else config.rank_series
    rank_series = resolve_rank_series(asked_tier, identity.world_size)
    notices = _job_notices(config, agreed, group, run_dir, facts)
    for _, message in notices:
        logger.warning("otel_train: %s", message)
    return RunPlace(
        identity,
        group,
        run_name,
        reporting,
        run_dir,
        resumed,
        agreed.log_interval,
        agreed.cross_rank,
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
    if ident.distributed and group is None and process_group_started():
        return (
            (
                "run_split",
                f"rank {ident.rank} could not join the other ranks' telemetry group within "
                f"collective_timeout_s={config.collective_timeout_s:g} s (a rank called ot.init() that "
                f"much later than another, or a peer is gone): it writes its own run directory "
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


def process_group_started() -> bool:
    try:
        import torch.distributed as dist

        return bool(dist.is_available() and dist.is_initialized())
    except ImportError:  # no torch
        return False
