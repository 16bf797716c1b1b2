"""Cross-rank timer reductions (min / max / mean / median and the ranks holding them) and their
console text, Megatron `Timers.log` style. Pure functions over per-rank values; no process group."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from statistics import median

from otel_train.crossrank.up_row import RankRecord

STEP_PHASE = "step"  # reduction key of the step time (unless a timer is itself named "step")
_STATS = {"max": ("max", "argmax_rank"), "minmax": ("min", "max", "argmin_rank", "argmax_rank")}


@dataclass(frozen=True)
class Reduction:
    min: float
    max: float
    mean: float
    median: float
    argmin: int  # rank with the smallest value (lowest rank on ties)
    argmax: int  # rank with the largest value (lowest rank on ties)
    n: int  # ranks that ran the timer
    values: Mapping[int, float] = field(default_factory=dict)  # by rank, of the ranks that ran it


def reduce_timings(
    per_rank: Mapping[int, Mapping[str, float | None]] | Sequence[Mapping[str, float | None]],
) -> dict[str, Reduction]:
    """Reduce per-rank timer values ({rank: timings}, or a list indexed by rank) by NAME:
    min/max/mean/median/argmin/argmax over the ranks that ran each timer. Missing names, None and
    non-finite values mean "did not run". O(ranks given), whatever the world size (rank 0 of a tree
    passes only the ranks it holds whole)."""
    by_rank = per_rank if isinstance(per_rank, Mapping) else dict(enumerate(per_rank))
    ranks = sorted(by_rank.items())
    out: dict[str, Reduction] = {}
    for name in dict.fromkeys(n for _, timings in ranks for n in timings):
        present = [
            (float(v), rank)
            for rank, timings in ranks
            if (v := timings.get(name)) is not None and math.isfinite(v)
        ]
        if not present:
            continue
        vmin, amin = min(present, key=lambda t: (t[0], t[1]))
        vmax, amax = max(present, key=lambda t: (t[0], -t[1]))
        ordered = sorted(v for v, _ in present)
        values = {rank: v for v, rank in present}
        mean = sum(ordered) / len(ordered)
        out[name] = Reduction(vmin, vmax, mean, median(ordered), amin, amax, len(present), values)
    return out


def stats_for_option(option: str) -> tuple[str, ...]:
    """Cross-rank gauge stats published for a `timing_log_option` (`stat` attribute values)."""
    return _STATS.get(option, ("min", "max", "mean", "median", "argmin_rank", "argmax_rank"))


def per_rank_timings(
    records: Sequence[RankRecord], names: Mapping[int, str]
) -> list[dict[str, float | None]]:
    """{name: mean duration} per record (in the records' order) from unpacked records; ids without a known name
    are skipped, and the step time (its lower median) is added under STEP_PHASE unless a timer
    already has that name."""
    has_step_timer = STEP_PHASE in names.values()
    out: list[dict[str, float | None]] = []
    for record in records:
        timings: dict[str, float | None] = {n: s.mean for n, s in record.named_timers(names).items()}
        if not has_step_timer and record.step_stats.count:
            # The row carries the step time's lower median (the verdicts' robust statistic), not
            # its mean: the cross-rank step series is over it (semconv.PHASE_CROSS_RANK says so).
            timings[STEP_PHASE] = record.step_stats.median
        out.append(timings)
    return out


def own_reductions(record: RankRecord) -> dict[str, Reduction]:
    """One rank's own timers as one-rank reductions (its view when no rows are compared)."""
    return reduce_timings({record.rank: per_rank_timings([record], record.announced)[0]})
