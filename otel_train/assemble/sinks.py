"""The sinks a session hands each flush's scalars to, built at init: every rank's metrics JSONL
(the local copy), and on the reporting rank (rank 0, or every rank with bridge_all_ranks) the
progress file, the console (rank 0) and the bridge process with the switched-on bridges.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from otel_train import semconv
from otel_train.assemble.run_place import RunPlace
from otel_train.bridges.base import Sink
from otel_train.bridges.console import ConsoleSink
from otel_train.bridges.rundir import RunDirSink
from otel_train.config import Config, ConfigError

if TYPE_CHECKING:
    from otel_train.bridges.process import BridgeProcess
    from otel_train.bridges.table import BridgeSpec
    from otel_train.flush import Instruments


def build_sinks(
    config: Config, place: RunPlace, instruments: Instruments
) -> tuple[list[Sink], ConsoleSink | None, BridgeProcess | None]:
    """Every rank keeps its own metrics JSONL (the local copy); progress, console and bridges
    are written by the reporting rank (rank 0, or every rank with bridge_all_ranks)."""
    sinks: list[Sink] = []
    if place.run_dir is not None:
        progress = place.is_reporting_rank
        ident = place.identity
        sinks.append(RunDirSink(place.run_dir, ident.rank, config.total_steps, progress, ident.role))
    if not place.is_reporting_rank:
        return sinks, None, None
    console = None
    if place.identity.rank == 0:
        console = ConsoleSink(config.verbosity, config.progress_bar, config.total_steps)
        sinks.append(console)
    bridges = _bridge_process(config, place, instruments)
    if bridges is not None:
        sinks.append(bridges)
    return sinks, console, bridges


def bridge_specs(config: Config, place: RunPlace) -> list[BridgeSpec]:
    """The switched-on bridges (`bridges/table`) as the bridge process builds them."""
    from otel_train.bridges.table import BridgePlace, specs

    return specs(
        config,
        BridgePlace(
            run_dir=place.run_dir or Path(config.output_dir) / place.run_name,
            run_name=place.run_name,
            run_id=place.identity.run_id,
            rank=place.identity.rank,
            role=place.identity.role,
            every_rank=config.bridge_all_ranks,
        ),
    )


def _bridge_process(config: Config, place: RunPlace, instruments: Instruments) -> BridgeProcess | None:
    """TensorBoard / W&B / MLflow in one child process (`bridges.process`), off this process's
    GIL. A missing package or an unwritable directory raises here, at
    init(), naming the extra or the path (the child reports its set-up before init() returns)."""
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
