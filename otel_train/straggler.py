"""Cross-rank timer reductions and straggler scores: one all_gather per flush, off the training thread.

`CrossRankReducer` is a flush listener. At every flush, on the background worker, it packs this
rank's interval (per-timer mean and count, step time, host) into ONE fixed-size float64 tensor and
issues ONE `all_gather` on a dedicated gloo group (`distributed.create_telemetry_group`), never on
the training's own (maybe NCCL) group and never on the training thread. Every rank then holds the
same table, so every rank computes the same reductions and the same straggler scores; rank 0
publishes the cross-rank gauges and the straggler events, every rank publishes its own scores.

Packing (why it never misaligns, and needs no agreement on names):
    Each timer name gets a stable 48-bit id (blake2b of the UTF-8 name; exact in float64). A rank
    keeps its own name -> slot table (first-seen order, at most `max_timers` = 64 names), and every
    slot carries the id next to its values, so receivers match timers by id, never by position:
    ranks with different timer sets, or that first saw a timer at different flushes, reduce
    correctly. Two names with the same id on one rank: the later one is dropped (warned once),
    never merged. Names travel once: each rank announces up to `ANNOUNCE_SLOTS` new (id, name)
    pairs per flush in a fixed region of the same tensor, so rank 0 learns the name of a timer it
    never ran (a timer seen only elsewhere is reported from the flush after its announcement).
    The tensor size depends only on constants, so all ranks always issue the same collective.

    layout: [header (HEADER_LEN)] [max_timers x (id, count, mean)] [ANNOUNCE_SLOTS x (id, name...)]

Scores (NVRx semantics: reference time / this rank's time, 1 = healthy, lower = slower):
    relative   = sum of cross-rank medians / sum of this rank's means, over the non-communication
                 phases (waiting in a collective is the symptom on the *fast* ranks, so it is left
                 out); the step time when there are no phases. Per phase: median / own.
    individual = this rank's best interval / this interval (step time; per phase likewise).
    Both are EWMA-smoothed (`straggler_ewma`, prior 1.0), so one slow interval is a "one-off" and
    only a chronic slowdown goes below `straggler_threshold` and is flagged. Attribution: the
    phase with the largest excess time over the median (robust against noisy tiny phases), and its
    category (data | compute | communication | other).

Failure: the group's timeout is `collective_timeout_s`. A failed or timed-out collective (a peer died
or stopped flushing) disables the reducer for good (logged once): it never retries a collective
that a peer would not issue.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from otel_train import semconv
from otel_train.distributed import Identity, create_telemetry_group
from otel_train.interval import Interval

logger = logging.getLogger("otel_train")

TimingOption = Literal["max", "minmax", "all"]
Category = Literal["data", "compute", "communication", "other"]

STEP_PHASE = "step"  # reduction key of the step time (unless a timer is itself named "step")
OVERALL_PHASE = "all"  # train.phase of the overall straggler score
KIND_RELATIVE = "relative"
KIND_INDIVIDUAL = "individual"

PACK_VERSION = 1.0
MAX_REPORTS_PER_FLUSH = 5  # rank 0 logs and emits at most this many new stragglers per flush (slowest first)
MAX_TIMERS = 64
ANNOUNCE_SLOTS = 4
NAME_FLOATS = 8  # 6 bytes per float64 (exact below 2**53): names up to 48 UTF-8 bytes travel
NAME_BYTES = 6 * NAME_FLOATS
HOST_FLOATS = 8
# header: version, rank, seq, step, step_count, step_mean, node_rank, n_timers, host..., flush_interval
_H_VERSION, _H_RANK, _H_SEQ, _H_STEP, _H_STEP_COUNT, _H_STEP_MEAN, _H_NODE, _H_NTIMERS = range(8)
_H_HOST = 8
# The adaptive flush cadence (otel_train.cadence) rides here: rank 0's value is adopted by every rank.
_H_FLUSH_INTERVAL = _H_HOST + HOST_FLOATS
HEADER_LEN = _H_FLUSH_INTERVAL + 1
SLOT_LEN = 3  # id, count, mean
ANNOUNCE_LEN = 1 + NAME_FLOATS


def pack_len(max_timers: int = MAX_TIMERS) -> int:
    return HEADER_LEN + max_timers * SLOT_LEN + ANNOUNCE_SLOTS * ANNOUNCE_LEN


# --- names and categories ----------------------------------------------------------------------------


def name_id(name: str) -> int:
    """Stable 48-bit id of a timer name (same on every rank and across restarts); never 0."""
    value = int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=6).digest(), "big")
    return value or 1


def _encode_text(text: str, floats: int) -> list[float]:
    raw = text.encode("utf-8")[: 6 * floats]
    raw = raw + b"\x00" * (6 * floats - len(raw))
    return [float(int.from_bytes(raw[i : i + 6], "big")) for i in range(0, 6 * floats, 6)]


def _decode_text(values: Iterable[float]) -> str:
    raw = b"".join(int(v).to_bytes(6, "big") for v in values)
    return raw.rstrip(b"\x00").decode("utf-8", errors="ignore")


_COMM = {"allreduce", "all_reduce", "allgather", "all_gather", "reduce_scatter", "reducescatter", "comm"}
_COMM |= {"communication", "collective", "collectives", "nccl", "p2p", "send", "recv", "barrier", "sync"}
_COMM |= {"grad_sync", "gradsync", "broadcast", "alltoall", "all2all"}
_DATA = {"data", "dataloader", "data_wait", "datawait", "data_loading", "batch", "get_batch", "input"}
_DATA |= {"inputs", "load", "loading", "loader", "fetch", "prefetch", "io"}
_COMPUTE = {"forward", "fwd", "backward", "bwd", "compute", "optimizer", "optim", "opt", "loss", "model"}
_COMPUTE |= {"forward_backward", "fwd_bwd", "train_step", "zero_grad", "clip", "clip_grad", "update"}


def phase_category(name: str) -> Category:
    """data (data/dataloader/data_wait...), compute (forward/backward/optimizer...),
    communication (allreduce/comm...), else other. Matched on the name and its word pieces."""
    lower = name.lower()
    pieces = {lower, *[p for p in re.split(r"[^a-z0-9]+", lower) if p]}
    pieces |= {lower.replace("-", "_").replace(".", "_").replace("/", "_")}
    if pieces & _COMM:
        return "communication"
    if pieces & _DATA:
        return "data"
    if pieces & _COMPUTE:
        return "compute"
    return "other"


# --- pure reductions ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reduction:
    min: float
    max: float
    mean: float
    median: float
    argmin: int  # rank with the smallest value (lowest rank on ties)
    argmax: int  # rank with the largest value (lowest rank on ties)
    n: int  # ranks that ran the timer
    values: tuple[float | None, ...] = ()  # per rank (None: that rank did not run it)


def _median(sorted_values: Sequence[float]) -> float:
    n = len(sorted_values)
    mid = n // 2
    return sorted_values[mid] if n % 2 else (sorted_values[mid - 1] + sorted_values[mid]) / 2.0


def reduce_timings(per_rank: Sequence[Mapping[str, float | None]]) -> dict[str, Reduction]:
    """Reduce per-rank timer values (index = rank) by NAME: min/max/mean/median/argmin/argmax over the
    ranks that ran each timer. Missing names, None and non-finite values mean "did not run"."""
    names: dict[str, None] = {}
    for timings in per_rank:
        for name in timings:
            names.setdefault(name, None)
    out: dict[str, Reduction] = {}
    for name in names:
        values: list[float | None] = []
        for timings in per_rank:
            v = timings.get(name)
            values.append(float(v) if v is not None and math.isfinite(v) else None)
        present = [(v, r) for r, v in enumerate(values) if v is not None]
        if not present:
            continue
        vmin, amin = min(present, key=lambda t: (t[0], t[1]))
        vmax, amax = max(present, key=lambda t: (t[0], -t[1]))
        ordered = sorted(v for v, _ in present)
        out[name] = Reduction(
            min=vmin,
            max=vmax,
            mean=sum(ordered) / len(ordered),
            median=_median(ordered),
            argmin=amin,
            argmax=amax,
            n=len(present),
            values=tuple(values),
        )
    return out


def stats_for_option(option: str) -> tuple[str, ...]:
    """Cross-rank gauge stats published for a `timing_log_option` (`stat` attribute values)."""
    if option == "max":
        return ("max", "argmax_rank")
    if option == "minmax":
        return ("min", "max", "argmin_rank", "argmax_rank")
    return ("min", "max", "mean", "median", "argmin_rank", "argmax_rank")


def format_timers(reductions: Mapping[str, Reduction], option: str = "minmax", unit: str = "ms") -> str:
    """Console text for cross-rank timers, Megatron `Timers.log` semantics:

    max    -> `name ....: 12.34 (rank 3)`               max over ranks, with the rank
    minmax -> `name ....: (12.00, 12.34) (ranks 0, 3)`  (min, max) with their ranks
    all    -> one line per timer with every rank's time (`-` for a rank that did not run it)
    """
    if not reductions:
        return ""
    scale = 1000.0 if unit == "ms" else 1.0
    width = max(len(n) for n in reductions) + 4
    if option == "max":
        lines = [f"(max) time across ranks ({unit}):"]
        for name, red in reductions.items():
            lines.append(f"    {name} {'.' * (width - len(name))}: {red.max * scale:.2f} (rank {red.argmax})")
    elif option == "minmax":
        lines = [f"(min, max) time across ranks ({unit}):"]
        for name, red in reductions.items():
            lines.append(
                f"    {name} {'.' * (width - len(name))}: ({red.min * scale:.2f}, {red.max * scale:.2f})"
                f" (ranks {red.argmin}, {red.argmax})"
            )
    else:
        lines = [f"times across ranks ({unit}):"]
        for name, red in reductions.items():
            cells = ", ".join("-" if v is None else f"{v * scale:.2f}" for v in red.values)
            lines.append(f"    {name} {'.' * (width - len(name))}: [{cells}]")
    return "\n".join(lines)


# --- packing -----------------------------------------------------------------------------------------


class TimerTable:
    """This rank's stable name -> slot table (first-seen order, bounded) and name announcements."""

    def __init__(self, capacity: int = MAX_TIMERS, hash_fn: Callable[[str], int] = name_id) -> None:
        self.capacity = capacity
        self.hash_fn = hash_fn
        self.slots: dict[str, int] = {}
        self.ids: dict[str, int] = {}
        self.names: dict[int, str] = {}  # every id -> name this rank knows (own + announced by peers)
        self.dropped: set[str] = set()
        self._unannounced: list[str] = []

    def add(self, name: str) -> bool:
        """Give `name` a slot; False (and warned once) when full or its id collides with another name."""
        if name in self.slots:
            return True
        if name in self.dropped:
            return False
        ident = self.hash_fn(name) or 1
        other = self.names.get(ident)
        if other is not None and other != name and other in self.slots:  # a peer's name may be truncated
            self.dropped.add(name)
            logger.warning(
                "otel_train: timer %r collides with %r (same id); it is left out of cross-rank stats",
                name,
                other,
            )
            return False
        if len(self.slots) >= self.capacity:
            self.dropped.add(name)
            logger.warning(
                "otel_train: more than %d timers; %r is left out of cross-rank stats", self.capacity, name
            )
            return False
        self.slots[name] = len(self.slots)
        self.ids[name] = ident
        self.names[ident] = name
        self._unannounced.append(name)
        return True

    def take_announcements(self, limit: int = ANNOUNCE_SLOTS) -> list[str]:
        out, self._unannounced = self._unannounced[:limit], self._unannounced[limit:]
        return out


@dataclass
class RankRecord:
    """One rank's row of the gathered tensor, unpacked."""

    rank: int
    seq: int
    step: int
    node_rank: int
    host: str
    step_count: int
    step_mean: float | None
    flush_interval: int = 0  # proposed steps per flush (adaptive cadence); rank 0's is adopted
    timers: dict[int, tuple[int, float]] = field(default_factory=dict)  # id -> (count, mean)
    announced: dict[int, str] = field(default_factory=dict)  # id -> name


def pack(
    interval: Interval,
    identity: Identity,
    table: TimerTable,
    out: Any | None = None,
) -> Any:
    """This rank's interval as one float64 tensor of `pack_len(table.capacity)` (see module doc)."""
    import torch

    row = [0.0] * pack_len(table.capacity)
    row[_H_VERSION] = PACK_VERSION
    row[_H_RANK] = float(identity.rank)
    row[_H_SEQ] = float(interval.seq)
    row[_H_STEP] = float(interval.step)
    steps = [d for d in interval.step_durations if math.isfinite(d)]
    row[_H_STEP_COUNT] = float(len(steps))
    row[_H_STEP_MEAN] = sum(steps) / len(steps) if steps else math.nan
    row[_H_NODE] = float(identity.node_rank)
    row[_H_HOST : _H_HOST + HOST_FLOATS] = _encode_text(identity.host, HOST_FLOATS)
    row[_H_FLUSH_INTERVAL] = float(interval.flush_interval)
    n = 0
    for name, durations in interval.phases.items():
        finite = [d for d in durations if math.isfinite(d)]
        if not finite or not table.add(name):
            continue
        base = HEADER_LEN + table.slots[name] * SLOT_LEN
        row[base : base + SLOT_LEN] = [float(table.ids[name]), float(len(finite)), sum(finite) / len(finite)]
        n += 1
    row[_H_NTIMERS] = float(n)
    base = HEADER_LEN + table.capacity * SLOT_LEN
    for i, name in enumerate(table.take_announcements()):
        at = base + i * ANNOUNCE_LEN
        row[at] = float(table.ids[name])
        row[at + 1 : at + ANNOUNCE_LEN] = _encode_text(name, NAME_FLOATS)
    tensor = torch.tensor(row, dtype=torch.float64)
    if out is not None:
        out.copy_(tensor)
        return out
    return tensor


def unpack(gathered: Any, capacity: int = MAX_TIMERS) -> list[RankRecord]:
    """Rows of an all-gathered tensor (shape [world * pack_len] or [world, pack_len]) -> records."""
    length = pack_len(capacity)
    flat = gathered.reshape(-1, length).tolist()
    records: list[RankRecord] = []
    for row in flat:
        count = int(row[_H_STEP_COUNT])
        record = RankRecord(
            rank=int(row[_H_RANK]),
            seq=int(row[_H_SEQ]),
            step=int(row[_H_STEP]),
            node_rank=int(row[_H_NODE]),
            host=_decode_text(row[_H_HOST : _H_HOST + HOST_FLOATS]),
            step_count=count,
            step_mean=row[_H_STEP_MEAN] if count > 0 and math.isfinite(row[_H_STEP_MEAN]) else None,
            flush_interval=int(row[_H_FLUSH_INTERVAL]),
        )
        for slot in range(capacity):
            base = HEADER_LEN + slot * SLOT_LEN
            ident = int(row[base])
            if ident:
                record.timers[ident] = (int(row[base + 1]), row[base + 2])
        base = HEADER_LEN + capacity * SLOT_LEN
        for i in range(ANNOUNCE_SLOTS):
            at = base + i * ANNOUNCE_LEN
            ident = int(row[at])
            if ident:
                record.announced[ident] = _decode_text(row[at + 1 : at + ANNOUNCE_LEN])
        records.append(record)
    return records


def per_rank_timings(
    records: Sequence[RankRecord], names: Mapping[int, str]
) -> list[dict[str, float | None]]:
    """Per-rank {name: mean} (index = rank) from unpacked records; ids without a known name are
    skipped, and the step time is added under STEP_PHASE unless a timer already has that name."""
    has_step_timer = STEP_PHASE in names.values()
    out: list[dict[str, float | None]] = []
    for record in records:
        timings: dict[str, float | None] = {}
        for ident, (count, mean) in record.timers.items():
            name = names.get(ident)
            if name is not None and count > 0:
                timings[name] = mean
        if not has_step_timer and record.step_mean is not None:
            timings[STEP_PHASE] = record.step_mean
        out.append(timings)
    return out


# --- straggler scoring -------------------------------------------------------------------------------


@dataclass(frozen=True)
class StragglerReport:
    """A rank whose smoothed score is below the threshold (or a one-off: raw below, smoothed not)."""

    rank: int
    host: str
    kind: str  # relative | individual
    score: float  # EWMA-smoothed overall score
    raw_score: float  # this interval's overall score
    phase: str  # the phase that explains it (largest excess over the median / own best)
    category: Category
    phase_score: float | None  # that phase's raw score
    chronic: bool  # smoothed score below the threshold (a one-off has only the raw score below)


@dataclass
class RankScores:
    rank: int
    relative: dict[str, float] = field(default_factory=dict)  # phase (incl. OVERALL_PHASE) -> EWMA
    individual: dict[str, float] = field(default_factory=dict)
    raw_relative: dict[str, float] = field(default_factory=dict)
    raw_individual: dict[str, float] = field(default_factory=dict)
    reports: list[StragglerReport] = field(default_factory=list)


class StragglerScorer:
    """Relative and individual scores for every rank from the same reductions (so every rank
    computes identical results), EWMA-smoothed with prior 1.0."""

    def __init__(self, threshold: float = 0.8, alpha: float = 0.3) -> None:
        self.threshold = threshold
        self.alpha = alpha
        self._ewma: dict[tuple[int, str, str], float] = {}
        self._best: dict[tuple[int, str], float] = {}

    def _smooth(self, key: tuple[int, str, str], raw: float) -> float:
        prev = self._ewma.get(key, 1.0)
        value = self.alpha * raw + (1.0 - self.alpha) * prev
        self._ewma[key] = value
        return value

    def update(
        self,
        reductions: Mapping[str, Reduction],
        world_size: int,
        hosts: Sequence[str] = (),
        relative: bool = True,
        rank_ids: Sequence[int] | None = None,
    ) -> list[RankScores]:
        """Scores for every index of the reductions' `values`; `rank_ids` maps an index to the rank
        the EWMA/best-so-far state is kept under (default: the index itself)."""
        out: list[RankScores] = []
        for index in range(world_size):
            rank = rank_ids[index] if rank_ids is not None else index
            scores = RankScores(rank)
            host = hosts[index] if index < len(hosts) else ""
            own: dict[str, float] = {}
            for name, red in reductions.items():
                v = red.values[index] if index < len(red.values) else None
                if v is not None and v > 0 and name != STEP_PHASE and phase_category(name) != "communication":
                    own[name] = v
            step_red = reductions.get(STEP_PHASE)
            own_step = (
                step_red.values[index] if step_red is not None and index < len(step_red.values) else None
            )
            if relative:
                self._relative(rank, host, own, reductions, own_step, scores)
            self._individual(rank, host, own, own_step, scores, report=relative)
            out.append(scores)
        return out

    def _relative(
        self,
        rank: int,
        host: str,
        own: Mapping[str, float],
        reductions: Mapping[str, Reduction],
        own_step: float | None,
        scores: RankScores,
    ) -> None:
        shared = {n: v for n, v in own.items() if reductions[n].n >= 2}
        for name, v in shared.items():
            raw = reductions[name].median / v
            scores.raw_relative[name] = raw
            scores.relative[name] = self._smooth((rank, KIND_RELATIVE, name), raw)
        if shared:
            overall = sum(reductions[n].median for n in shared) / sum(shared.values())
            excess = {n: v - reductions[n].median for n, v in shared.items()}
            phase = max(excess, key=lambda n: excess[n])
        elif own_step is not None and own_step > 0 and reductions[STEP_PHASE].n >= 2:
            overall = reductions[STEP_PHASE].median / own_step
            phase = STEP_PHASE
        else:
            return
        scores.raw_relative[OVERALL_PHASE] = overall
        smoothed = self._smooth((rank, KIND_RELATIVE, OVERALL_PHASE), overall)
        scores.relative[OVERALL_PHASE] = smoothed
        self._maybe_report(scores, rank, host, KIND_RELATIVE, smoothed, overall, phase, scores.raw_relative)

    def _individual(
        self,
        rank: int,
        host: str,
        own: Mapping[str, float],
        own_step: float | None,
        scores: RankScores,
        report: bool,
    ) -> None:
        for name, v in own.items():
            best = min(self._best.get((rank, name), v), v)
            self._best[(rank, name)] = best
            raw = best / v
            scores.raw_individual[name] = raw
            scores.individual[name] = self._smooth((rank, KIND_INDIVIDUAL, name), raw)
        total = own_step if own_step is not None and own_step > 0 else (sum(own.values()) if own else None)
        if not total:
            return
        best = min(self._best.get((rank, OVERALL_PHASE), total), total)
        self._best[(rank, OVERALL_PHASE)] = best
        overall = best / total
        scores.raw_individual[OVERALL_PHASE] = overall
        smoothed = self._smooth((rank, KIND_INDIVIDUAL, OVERALL_PHASE), overall)
        scores.individual[OVERALL_PHASE] = smoothed
        if report:
            excess = {n: v - self._best[(rank, n)] for n, v in own.items()}
            phase = max(excess, key=lambda n: excess[n]) if excess else STEP_PHASE
            self._maybe_report(
                scores, rank, host, KIND_INDIVIDUAL, smoothed, overall, phase, scores.raw_individual
            )

    def _maybe_report(
        self,
        scores: RankScores,
        rank: int,
        host: str,
        kind: str,
        smoothed: float,
        raw: float,
        phase: str,
        raw_by_phase: Mapping[str, float],
    ) -> None:
        chronic = smoothed < self.threshold
        if not chronic and raw >= self.threshold:
            return
        category: Category = phase_category(phase) if phase != STEP_PHASE else "other"
        scores.reports.append(
            StragglerReport(
                rank, host, kind, smoothed, raw, phase, category, raw_by_phase.get(phase), chronic
            )
        )


# --- the flush listener ------------------------------------------------------------------------------


class HealthEvents(Protocol):
    def emit(
        self, event: str, message: str, attributes: Mapping[str, str | int | float] | None = None
    ) -> None: ...


class _Gauge(Protocol):
    def set(self, amount: float, attributes: Mapping[str, Any] | None = None) -> None: ...


def _create_gauge(meter: Any, spec: semconv.MetricSpec) -> _Gauge | None:
    if meter is None:
        return None
    gauge: _Gauge = meter.create_gauge(spec.name, unit=spec.unit, description=spec.description)
    return gauge


def _all_gather_fn() -> Callable[..., Any]:
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None)  # torch >= 2.13 (all_gather_into_tensor deprecated)
    return fn if fn is not None else dist.all_gather_into_tensor


class CrossRankReducer:
    """Flush listener: cross-rank timer stats and straggler scores (see the module doc).

    Construct it on EVERY rank at init (it may create the dedicated gloo group, a collective).
    `group`: the telemetry group from `distributed.create_telemetry_group` (created here when None
    and distributed). `on_straggler(reports)`: called on every rank with the same list of chronic
    stragglers at each flush where there are any (every rank sees the same data, so a decision taken
    there, such as stopping, is the same on all ranks).

    After each flush, `last_reductions` (name -> Reduction, including the step time under "step")
    and `last_scores` (this rank's RankScores) are available for the console and the bridges.
    """

    def __init__(
        self,
        identity: Identity,
        meter: Any | None,
        events: HealthEvents | None,
        config: Any,
        *,
        group: Any | None = None,
        on_straggler: Callable[[list[StragglerReport]], None] | None = None,
        max_timers: int = MAX_TIMERS,
    ) -> None:
        self.identity = identity
        self.events = events
        self.on_straggler = on_straggler
        self.option: str = getattr(config, "timing_log_option", "minmax")
        self.timeout_s = float(getattr(config, "collective_timeout_s", 60.0))
        self.scorer = StragglerScorer(
            float(getattr(config, "straggler_threshold", 0.8)), float(getattr(config, "straggler_ewma", 0.3))
        )
        self.table = TimerTable(max_timers)
        # Called after each flush's collective with (flush seq, rank 0's flush_interval), 0 when no
        # collective ran: the adaptive cadence (otel_train.cadence) every rank adopts from rank 0.
        self.on_cadence: Callable[[int, int], None] | None = None
        self.collectives = 0  # collectives issued (tests and self-observability)
        self.disabled_reason: str | None = None
        self.last_reductions: dict[str, Reduction] = {}
        self.last_scores: RankScores | None = None
        self._flagged: set[tuple[int, str]] = set()
        self._seq_warned = False
        self._closed = False
        self._lock = threading.Lock()
        self._world = identity.world_size
        self.group = group
        if group is None and identity.distributed:
            self.group = create_telemetry_group(identity, self.timeout_s)
        if self.group is not None:
            import torch.distributed as dist

            self._world = int(dist.get_world_size(self.group))
        self._score_gauge = _create_gauge(meter, semconv.STRAGGLER_SCORE)
        self._cross_gauge = _create_gauge(meter, semconv.PHASE_CROSS_RANK) if identity.rank == 0 else None

    @property
    def distributed(self) -> bool:
        """True while this reducer issues one collective per flush."""
        return (
            self.group is not None and self._world > 1 and self.disabled_reason is None and not self._closed
        )

    def on_flush(self, interval: Interval) -> None:
        if interval.final:
            # Shutdown flushes are not aligned across ranks (a peer may already be gone), so they
            # never issue a collective; the last aligned flush already carried the cross-rank view.
            return
        with self._lock:
            if self._closed:
                return
            try:
                self._flush(interval)
            except Exception as exc:  # telemetry never breaks training
                logger.warning("otel_train: cross-rank reduction failed: %s", exc, exc_info=True)

    def close(self) -> None:
        self._closed = True

    def _disable(self, reason: str) -> None:
        if self.disabled_reason is None:
            self.disabled_reason = reason
            logger.error(
                "otel_train: cross-rank telemetry disabled on rank %d: %s (a peer died, hung or stopped "
                "flushing; this rank issues no more telemetry collectives)",
                self.identity.rank,
                reason,
            )

    def _gather(self, interval: Interval) -> list[RankRecord] | None:
        import torch

        row = pack(interval, self.identity, self.table)
        out = torch.empty(self._world * row.numel(), dtype=torch.float64)
        self.collectives += 1
        try:
            _all_gather_fn()(out, row, group=self.group)
        except Exception as exc:
            self._disable(f"all_gather failed at flush {interval.seq}: {exc}")
            return None
        return unpack(out, self.table.capacity)

    def _adopt_cadence(self, seq: int, records: Sequence[RankRecord] | None) -> None:
        """Hand rank 0's flush interval to the cadence, right after the gather and before anything
        that could raise, so every rank adopts the same value at the same flush."""
        if self.on_cadence is None or not self.identity.distributed:
            return
        lead = next((r for r in records or () if r.rank == 0), None)
        self.on_cadence(seq, lead.flush_interval if lead is not None else 0)

    def _flush(self, interval: Interval) -> None:
        if not self.distributed:
            self._adopt_cadence(interval.seq, None)  # disabled: every rank keeps its interval
        if self.distributed:
            records = self._gather(interval)
            self._adopt_cadence(interval.seq, records)
            if records is None:
                return
            seqs = {r.seq for r in records}
            if len(seqs) > 1 and not self._seq_warned:
                self._seq_warned = True
                logger.warning(
                    "otel_train: ranks flushed out of step (flush numbers %s); cross-rank stats may mix intervals",
                    sorted(seqs),
                )
            for record in records:
                for ident, name in record.announced.items():
                    self.table.names.setdefault(ident, name)
            hosts = [r.host for r in records]
            reductions = reduce_timings(per_rank_timings(records, self.table.names))
            all_scores = self.scorer.update(reductions, len(records), hosts, relative=True)
            mine = all_scores[self.identity.rank] if self.identity.rank < len(all_scores) else None
        else:
            own = {n: sum(d) / len(d) for n, d in interval.phases.items() if d}
            steps = [d for d in interval.step_durations if math.isfinite(d)]
            if steps and STEP_PHASE not in own:
                own[STEP_PHASE] = sum(steps) / len(steps)
            reductions = reduce_timings([own])
            all_scores = self.scorer.update(
                reductions, 1, [self.identity.host], relative=False, rank_ids=[self.identity.rank]
            )
            mine = all_scores[0]
            all_scores = []
        self.last_reductions = reductions
        self.last_scores = mine
        if mine is not None:
            self._set_scores(mine)
        if all_scores:
            if self._cross_gauge is not None:
                self._set_cross_rank(reductions)
            self._report(all_scores, interval)

    def _set_scores(self, scores: RankScores) -> None:
        if self._score_gauge is None:
            return
        for kind, by_phase in ((KIND_RELATIVE, scores.relative), (KIND_INDIVIDUAL, scores.individual)):
            for phase, value in by_phase.items():
                self._score_gauge.set(value, {semconv.STRAGGLER_KIND: kind, semconv.PHASE: phase})

    def _set_cross_rank(self, reductions: Mapping[str, Reduction]) -> None:
        assert self._cross_gauge is not None
        for name, red in reductions.items():
            for stat in stats_for_option(self.option):
                value = float(
                    red.argmax
                    if stat == "argmax_rank"
                    else red.argmin
                    if stat == "argmin_rank"
                    else getattr(red, stat)
                )
                self._cross_gauge.set(value, {semconv.PHASE: name, semconv.STAT: stat})

    def _report(self, all_scores: Sequence[RankScores], interval: Interval) -> None:
        chronic = [r for s in all_scores for r in s.reports if r.chronic]
        now = {(r.rank, r.kind) for r in chronic}
        if self.identity.rank == 0:
            new = sorted((r for r in chronic if (r.rank, r.kind) not in self._flagged), key=lambda r: r.score)
            if len(new) > MAX_REPORTS_PER_FLUSH:
                logger.warning(
                    "otel_train: %d new stragglers at step %d; reporting the %d slowest (%s)",
                    len(new),
                    interval.step,
                    MAX_REPORTS_PER_FLUSH,
                    ", ".join(f"rank {r.rank} {r.kind} {r.score:.2f}" for r in new[:MAX_REPORTS_PER_FLUSH]),
                )
            for report in new[:MAX_REPORTS_PER_FLUSH]:
                message = (
                    f"straggler: rank {report.rank} ({report.host}) {report.kind} score {report.score:.2f} "
                    f"(this interval {report.raw_score:.2f}, threshold {self.scorer.threshold}); "
                    f"slowest phase {report.phase!r} ({report.category}) at step {interval.step}"
                )
                logger.warning("otel_train: %s", message)
                if self.events is not None:
                    try:
                        self.events.emit(
                            "straggler",
                            message,
                            {
                                "rank": report.rank,
                                "host.name": report.host,
                                semconv.PHASE: report.phase,
                                "category": report.category,
                                semconv.STRAGGLER_KIND: report.kind,
                                "score": round(report.score, 4),
                                "step": interval.step,
                            },
                        )
                    except Exception as exc:
                        logger.warning("otel_train: straggler event failed: %s", exc)
            for rank, kind in sorted(self._flagged - now):
                logger.info("otel_train: rank %d is no longer a %s straggler", rank, kind)
        self._flagged = now
        if chronic and self.on_straggler is not None:
            try:
                self.on_straggler(chronic)
            except Exception as exc:
                logger.warning("otel_train: on_straggler callback failed: %s", exc)
