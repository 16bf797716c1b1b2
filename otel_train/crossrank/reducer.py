"""The cross-rank flush listener: ONE exchange per flush, off the training thread.

`CrossRankReducer` packs this rank's interval into one row, runs the exchange on the telemetry
gloo group, and on rank 0 reduces the rows and publishes the verdicts; its answer carries them
to the other ranks one flush later; `RowPairing`: which rows it pairs at a flush.
Design: docs/design/crossrank.md#reducer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from otel_train import semconv
from otel_train.config import Config
from otel_train.core.buffer import Interval
from otel_train.crossrank import down_row, job_block, wire
from otel_train.crossrank.collective_lateness import LatenessTracker
from otel_train.crossrank.exchange import MAX_HELD, Exchanged, ExchangeFailed, StarExchange
from otel_train.crossrank.job_outputs import JobSeries
from otel_train.crossrank.merge import Bundle, TreeView, unpacked, widen_waiting
from otel_train.crossrank.replicas import ReplicaCheck, fsdp_in_use
from otel_train.crossrank.scores import (
    RankScores,
    StragglerGauges,
    StragglerReport,
    StragglerReporter,
    StragglerScorer,
)
from otel_train.crossrank.shape import ExchangeShape, shaped_exchange, telemetry_group
from otel_train.crossrank.timer_stats import Reduction, own_reductions, per_rank_timings, reduce_timings
from otel_train.crossrank.tree_exchange import TreeExchange
from otel_train.crossrank.up_row import (
    FLAG_SHARDED,
    RankRecord,
    TimerTable,
    is_keepalive,
    keepalive,
    local_record,
    pack,
    row_steps,
    unpack,
)
from otel_train.crossrank.verdicts import RankView, Settings, abstain_reason, assess
from otel_train.distributed import Identity, create_telemetry_group
from otel_train.health import EventChannel

logger = logging.getLogger("otel_train")

# A rank r > 0 that sent no row for this share of collective_timeout_s sends a keep-alive row
# (`keep_alive`): rank 0 takes a rank silent for the whole timeout for gone, and a rank that is
# alive but not flushing (idle, evaluating, in a rank-local pause) is not gone.
KEEPALIVE_SHARE = 0.25


class CrossRankReducer:
    """Flush listener: cross-rank timer stats and straggler verdicts. Construct it on EVERY rank at
    init (it may create the gloo telemetry `group`, a collective, when None and distributed);
    `exchange=False` (cross_rank=False): no exchange at all. `on_straggler(reports)` gets the same
    chronic list (at most `wire.MAX_CHRONIC`) on every rank at the same flush, one flush after rank
    0 found them, so a decision taken there is the same on all ranks. After each flush:
    `last_reductions` (across ranks on rank 0, this rank's own elsewhere; the step under "step"),
    `last_scores` (elsewhere than rank 0: those it sent down, one flush old), `last_reports` and, on
    rank 0, `abstain_reason` (docs/design/crossrank.md#reducer).
    """

    def __init__(
        self,
        identity: Identity,
        meter: Any | None,
        events: EventChannel | None,
        config: Config,
        *,
        group: Any | None = None,
        on_straggler: Callable[[list[StragglerReport]], None] | None = None,
        exchange: bool = True,
        shape: ExchangeShape | None = None,
        job_meter: Any | None = None,
    ) -> None:
        self.identity = identity
        self.events = events
        self.on_straggler = on_straggler
        self.option: str = config.timing_log_option
        self.timeout_s = config.collective_timeout_s
        self.keepalive_s = KEEPALIVE_SHARE * self.timeout_s
        self._sent_at = time.monotonic()  # rank r > 0: when its last row (or keep-alive) went up
        self.settings = Settings.from_config(config)
        self.scorer = StragglerScorer(self.settings)
        self.table = TimerTable()
        # Ranks other than 0: called with rank 0's flush schedule (interval, anchor step) from each
        # answer, and with (0, -1) when the exchange turns off (otel_train.core.cadence).
        self.on_cadence: Callable[[int, int], None] | None = None
        self.collectives = 0  # exchanges this rank's row went up in (tests and self-observability)
        self.pairing = RowPairing()  # rank 0: rows left out of a flush (other steps than its own)
        self.disabled_reason: str | None = None
        self.abstain_reason: str | None = None
        self.last_reductions: dict[str, Reduction] = {}
        self.last_scores: RankScores | None = None
        self.last_reports: list[StragglerReport] = []
        self._verdict: down_row.Verdict | None = None  # rank 0: sent down at the next flush
        self._reporter = StragglerReporter(events)
        self._gathered_flushes = 0
        self._sharded_seen = False
        self._prev_step = -1  # the last step of this rank's previous flush (rows carry their steps)
        self._expect: set[int] | None = None  # rank 0: peers whose rows to wait for (None: all)
        self._closed, self._lock = False, threading.Lock()
        # exchange=False (cross_rank=False: independent ranks): no group, this rank's own view only
        self.group, self._world = telemetry_group(
            identity, group if exchange else None, exchange, self.timeout_s
        )
        self.grace_s, fanin = config.exchange_grace_s, config.exchange_fanin
        self.exchange, self.fanin, unshaped = shaped_exchange(
            self.group, identity, self._world, self.timeout_s, self.grace_s, fanin, shape
        )
        if unshaped is not None:
            self._disable(unshaped)
        self.replicas = ReplicaCheck(identity.rank, meter, events)
        self.lateness = LatenessTracker.attach(identity.rank, self.exchange)
        self.gauges = StragglerGauges(meter, identity.rank == 0)
        self.job = JobSeries(job_meter if identity.rank == 0 else None)
        self._job_unsent: Any = None  # star, rank r > 0: the block of a row that could not go up
        self.job_row: dict[str, float] = {}  # rank 0: `_loss_row` of this flush's job blocks

    @property
    def left_out_rows(self) -> int:
        return self.pairing.left_out_rows

    @property
    def partial_flushes(self) -> int:
        return self.pairing.partial_flushes

    @property
    def distributed(self) -> bool:
        """True while this reducer issues one exchange per flush."""
        return (
            self.group is not None and self._world > 1 and self.disabled_reason is None and not self._closed
        )

    def on_flush(self, interval: Interval) -> None:
        if interval.final:
            # Shutdown flushes are not aligned across ranks (a peer may already be gone), so they
            # never issue an exchange; the last aligned flush already carried the cross-rank view.
            # Rank 0 reports the new chronic stragglers still held for the collective verdict.
            if self.identity.rank == 0 and self.distributed:
                with self._lock:
                    held = [r for r in self.last_reports if r.chronic]  # those reported are not again
                    self._reporter.report(held, interval.step, self.settings.threshold)
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

    def reform(self, group: Any | None = None) -> None:
        """The job formed a new process group (`group`; None: the new default group), e.g. among
        the ranks alive after a peer died: call it on every rank of it, as a collective (it creates
        the new telemetry group). The exchange re-forms on it, turned on again if it was off, and a
        `membership_change` event says so. Ranks in verdicts are then ranks of the new group."""
        with self._lock:
            _reform(self, group)

    def keep_alive(self) -> None:
        """The worker has no flush to run (`Worker.on_idle`): a keep-alive row, when due (`_keep_alive`)."""
        _keep_alive(self)

    def stop_waiting(self) -> None:
        """Shutting down (called before the worker is drained): no exchange waits for a peer."""
        self.exchange.stop_waiting()

    def set_threshold(self, threshold: float) -> None:
        """Runtime control: a new straggler_threshold, applied from the next flush on (verdicts are
        computed on rank 0 only, and every rank applies a control file at the same step)."""
        # No lock: the worker may hold it for a whole exchange; swapping a frozen object is atomic.
        self.settings = replace(self.settings, threshold=float(threshold))
        self.scorer.settings = self.settings

    def _disable(self, reason: str, gone: int = -1) -> None:
        if self.disabled_reason is None:
            self.disabled_reason = reason
            _report_disabled(self.identity.rank, self.events, reason, gone)
            if self.on_cadence is not None:
                self.on_cadence(0, -1)  # no more schedules from rank 0: every rank keeps its own

    def _flush(self, interval: Interval) -> None:
        self.job_row = {}  # (set again from this flush's job blocks on rank 0)
        if not self.distributed:
            self._flush_local(interval)
            return
        import torch

        from_step, self._prev_step = self._prev_step, interval.step
        # FSDP2 in use: looked for at each flush until seen (fully_shard may be applied after init)
        self._sharded_seen = self._sharded_seen or fsdp_in_use()
        flags = FLAG_SHARDED if self._sharded_seen else 0
        row = pack(interval, self.identity, self.table, flags=flags, from_step=from_step)
        job = job_block.encode(interval, self.identity.rank)
        tree = isinstance(self.exchange, TreeExchange)
        if not tree and self._job_unsent is not None:
            job = job_block.combine([job, self._job_unsent])
        # The star's rows carry the job block before the arrivals (whose last float is stamped);
        # the tree's bundles carry it summed in their header (merge.Bundle.job).
        blocks = [self.replicas.block(interval), *([] if tree else [job]), self.lateness.block()]
        row = torch.cat([row, *blocks])
        root = self.identity.rank == 0
        answers = None
        if root:
            schedule, anchor = interval.flush_interval, interval.flush_anchor
            read = self.lateness.wants_read()
            if tree:  # one row for every rank: O(1), not O(world)
                answers = down_row.tree_answer(schedule, self._verdict, anchor, read)
            else:
                answers = down_row.answers(self._world, schedule, self._verdict, anchor, read)
        try:
            # rank 0 waits (up to the grace) for a row that reaches its step from each expected peer
            current = lambda up: _reaches(up, interval.step)  # noqa: E731
            got = _run(self.exchange, row, answers, self._expected(root, tree, interval.step), current, job)
            down = down_row.decode(got.down, self.identity.rank) if got.down is not None else None
            records = got.records if tree else _checked_rows(got)  # the tree's are checked as they come
        except Exception as exc:  # torch.distributed/gloo mid-exchange: its state is unknown, so it turns off
            if isinstance(exc, wire.Mismatch) and isinstance(self.exchange, StarExchange) and root:
                self.exchange.abort_peers(answers)  # so the peers turn off at their next flush too
            self.collectives += 1
            self._disable(f"telemetry exchange failed at flush {interval.seq}: {exc}", _gone(exc))
            self._flush_local(interval)
            return
        self.collectives += int(got.sent)
        if got.sent:
            self._sent_at = time.monotonic()
        if not tree:
            self._job_unsent = None if got.sent else job
        if down is not None:
            _take_down(self, down, root)
        self.lateness.after_exchange(interval, down, got.stamps)
        if records is None:
            self.last_reductions = own_reductions(local_record(interval, self.identity))
            return
        self._reduce_rows(interval, records, from_step)
        self._publish_job(interval, records, tree)

    def _publish_job(self, interval: Interval, records: Any, tree: bool) -> None:
        """Rank 0: the job blocks of every row taken at this flush, whatever its steps (each row is
        taken once; the tree's bundle holds them, the star's rows each hold theirs)."""
        blocks = records.job if tree else records[:, _layout(self.exchange).span("job")].clone()
        self.job.publish(blocks, self.table.names, interval.elapsed_s)
        self.job_row = {} if interval.scalars.get(semconv.LOSS.name) else _loss_row(blocks)

    def _expected(self, root: bool, tree: bool, step: int) -> set[int] | None:
        """The peers rank 0 waits for (None: all): not one whose held row already reaches `step`
        (it has nothing more to send for this flush; the star's pairing, `Pairing.hold`)."""
        if not root or tree:
            return self._expect
        expect = set(range(1, self._world)) if self._expect is None else self._expect
        return expect - self.pairing.ready(step)

    def _reduce_rows(self, interval: Interval, rows: Any, from_step: int) -> None:
        """Rank 0: the rows that cover exactly its own steps make this flush's cross-rank view."""
        if isinstance(rows, Bundle):  # the tree's: rows of one of rank 0's flushes (tree_exchange)
            tree = unpacked(rows, wire.up().words)
            _learn_names(self.table, [*tree.exact, *tree.summary])  # the job series use them too
            rows, same, records = tree.rows, list(range(len(tree.exact))), tree.exact
            self.pairing.left_out_rows = getattr(self.exchange, "left_out_bundles", 0)
            self.pairing.note([], tree.ranks, self._world, from_step, interval.step)
            self._reduce_paired(interval, rows, same, records, tree)
            return
        rows = self.pairing.with_held(rows)
        records = unpack(rows[:, _layout(self.exchange).span("up")])
        _learn_names(self.table, records)  # of rows of other steps too: the job series use them
        # Wait next time for every peer whose row came now (a late one catches up in a flush or two).
        self._expect = {r.rank for r in records} - {0}
        rows, records = self.pairing.hold(rows, records, interval.step)
        same = self.pairing.same_steps(records, from_step, interval.step, self._world)
        self._reduce_paired(interval, rows, same, records)

    def _reduce_paired(
        self,
        interval: Interval,
        rows: Any,
        same: list[int],
        records: list[RankRecord],
        tree: TreeView | None = None,
    ) -> None:
        layout = _layout(self.exchange)
        if len(same) + (len(tree.summary) if tree else 0) < 2:
            self._verdict = None  # nothing to compare: no verdict rides the next answers
            self._flush_local(interval)
            return
        paired = [records[i] for i in same]
        if self.lateness.judgeable(unjudged(tree, self.exchange, self.identity.host) if tree else None):
            self.lateness.judge(rows[same, layout.span("arrivals")], paired, self.identity.host)
        self._reduce(interval, paired, tree)
        labels = interval.layer_param_norms[-1][1] if interval.layer_param_norms else ()
        sharded = any(r.flags & FLAG_SHARDED for r in paired)
        self.replicas.compare(rows[same, layout.span("replicas")], [r.rank for r in paired], sharded, labels)

    def _deliver(self, down: down_row.Down, root: bool) -> None:
        """The previous flush's verdicts from rank 0: this rank's scores (rank 0 published its own
        already) and the chronic list for `on_straggler`, the same on every rank."""
        if down.verdict_seq < 0:
            return
        if not root:
            self.last_scores = down.scores
            self.last_reports = down.chronic
            if down.scores is not None:
                self.gauges.set_scores(down.scores)
        if down.chronic and self.on_straggler is not None:
            try:
                self.on_straggler(down.chronic)
            except Exception as exc:  # the user's on_straggler callback
                logger.warning("otel_train: on_straggler callback failed: %s", exc)

    def _reduce(
        self, interval: Interval, records: Sequence[RankRecord], tree: TreeView | None = None
    ) -> None:
        """Rank 0: reductions, verdicts, gauges and events from the rows of one flush's steps
        (`tree`: the tree's summary rows join the verdicts as weighted ranks, `merge`)."""
        timings = per_rank_timings(records, self.table.names)
        self.last_reductions = reduce_timings({r.rank: t for r, t in zip(records, timings, strict=True)})
        views = [
            _view(r, self.table.names, tree.weight if r.rank < 0 and tree else 1.0)
            for r in [*records, *(tree.summary if tree else ())]
        ]
        self._note_abstain(views, records)
        # The first gathered interval holds warm-up (lazy init, first collectives, compilation), where
        # ranks are late by design: it counts for scores, never for one-off reports.
        first = self._gathered_flushes == 0
        self._gathered_flushes += 1
        assessments = assess(views, self.settings)
        if tree is not None:
            assessments = widen_waiting(assessments, tree)
        self.lateness.join(assessments, views)
        all_scores, reports = self.scorer.update(assessments, one_offs=not first)
        mine = next((s for s in all_scores if s.rank == self.identity.rank), None)
        self.last_scores = mine
        self.last_reports = reports
        self._verdict = down_row.Verdict(
            interval.seq, {s.rank: s for s in all_scores}, [r for r in reports if r.chronic]
        )
        if mine is not None:
            self.gauges.set_scores(mine)
        self.gauges.set_cross_rank(self.option, self.last_reductions)
        held = self.lateness.pending()  # new chronic ones: at a later flush, with the collective
        self._reporter.report(reports, interval.step, self.settings.threshold, hold_new_chronic=held)

    def _flush_local(self, interval: Interval) -> None:
        """Not distributed (or the exchange is off): this rank's timers and individual score."""
        record = local_record(interval, self.identity)
        # One process: it is the job (a job whose exchange is off has none). Its block is a torch
        # tensor, and torch is no dependency of a single-process run: without it, no job series.
        if self._world <= 1 and job_block.available():
            self.job.publish(
                job_block.encode(interval, self.identity.rank), record.announced, interval.elapsed_s
            )
        self.last_reductions = own_reductions(record)
        self.last_scores = self.scorer.update_local(self.identity.rank, record.step_stats)
        self.last_reports = []
        self.gauges.set_scores(self.last_scores)

    def _note_abstain(self, views: Sequence[RankView], records: Sequence[RankRecord]) -> None:
        names = sorted({n for r in records for n in r.named_timers(self.table.names)})
        reason = abstain_reason(views, names, sharded=any(r.flags & FLAG_SHARDED for r in records))
        reason = self.lateness.abstain(reason)
        if reason is not None and self.abstain_reason is None and self.identity.rank == 0:
            logger.warning("otel_train: straggler detection abstains: %s", reason)
        self.abstain_reason = reason


def _keep_alive(reducer: CrossRankReducer) -> None:
    """`CrossRankReducer.keep_alive`, on the worker thread while it has no flush to run. A rank r > 0 of
    the star that sent no row for `keepalive_s` (idle, evaluating, in a rank-local pause) sends a
    keep-alive row, so that rank 0 does not take it for gone; a rank that died or is frozen sends
    none, and rank 0 still finds it gone after `collective_timeout_s`. Ranks of the tree, and rank 0,
    send none (docs/design/crossrank.md#reducer)."""
    with reducer._lock:
        exchange = reducer.exchange
        if reducer.identity.rank == 0 or not reducer.distributed or not isinstance(exchange, StarExchange):
            return
        if time.monotonic() - reducer._sent_at < reducer.keepalive_s:
            return
        try:
            up = keepalive(reducer.identity, reducer._prev_step, _layout(exchange).words)
            answer = exchange.keep_alive(up)
            reducer._sent_at = time.monotonic()
            if answer is not None:
                _take_down(reducer, down_row.decode(answer, reducer.identity.rank), root=False)
        except Exception as exc:  # torch.distributed/gloo: its state is unknown, so it turns off
            reducer._disable(f"telemetry exchange failed while this rank was not flushing: {exc}", _gone(exc))


def _take_down(reducer: CrossRankReducer, down: down_row.Down, root: bool) -> None:
    """An answer from rank 0: its flush schedule (ranks other than 0 adopt it) and verdicts."""
    if not root and reducer.on_cadence is not None and down.flush_interval >= 1:
        reducer.on_cadence(down.flush_interval, down.flush_anchor)
    reducer._deliver(down, root)


def _report_disabled(rank: int, events: EventChannel | None, reason: str, gone: int) -> None:
    """The exchange turned off for good (`gone`: the rank found gone, -1: not known): a
    `cross_rank_disabled` event in this rank's events file (its echo the console's line)."""
    message = (
        f"cross-rank telemetry disabled on rank {rank}: {reason} (a peer died, hung or stopped flushing; "
        "this rank issues no more telemetry exchanges, per-rank telemetry goes on)"
    )
    if events is None:
        logger.error("otel_train: %s", message)
    else:
        events.emit("cross_rank_disabled", message, {"rank": rank, "gone_rank": gone}, severity="ERROR")


def _reaches(row: Any, step: int) -> bool:
    """Whether a peer's row reaches rank 0's flush of `step`; a keep-alive row reaches no step, so
    rank 0 goes on taking that peer's rows after it."""
    return not is_keepalive(row) and row_steps(row)[1] >= step


def _checked_rows(got: Exchanged) -> Any:
    """Rank 0 (star): the rows taken, each of this release's wire format (else `wire.Mismatch`),
    without the keep-alive rows (`keep_alive`): those only said that their rank is alive."""
    if got.records is None:
        return None
    versions = got.records[:, wire.up().at("version")].tolist()
    for version, rank in zip(versions, got.ranks, strict=True):
        wire.check(version, f"rank {rank}")
    keep = [i for i, row in enumerate(got.records) if not is_keepalive(row)]
    return got.records if len(keep) == len(got.records) else got.records[keep]


def _gone(exc: Exception) -> int:
    """The rank an exchange failure found gone (-1: not known)."""
    return exc.gone if isinstance(exc, ExchangeFailed) else -1


def _run(exchange: Any, row: Any, answers: Any, expect: set[int] | None, current: Any, job: Any) -> Any:
    """One exchange: the tree takes this rank's job block beside its row (the star's row holds it)."""
    if isinstance(exchange, TreeExchange):
        return exchange.run(row, answers, job=job)
    return exchange.run(row, answers, expect, current)


def _layout(exchange: Any) -> wire.Record:
    """This job's up message (`wire.row`): the star's rows hold the job block, the tree's do not."""
    return wire.row(job_words=0 if isinstance(exchange, TreeExchange) else job_block.JOB_LEN)


def _learn_names(table: TimerTable, records: Sequence[RankRecord]) -> None:
    for record in records:
        for ident, name in record.announced.items():
            table.names.setdefault(ident, name)


def _reform(reducer: CrossRankReducer, group: Any | None) -> None:
    """`CrossRankReducer.reform`, under its lock: a new telemetry group and exchange, a fresh view
    (the verdicts' state per rank is kept)."""
    import torch.distributed as dist

    before = reducer._world
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    identity = replace(reducer.identity, rank=rank, world_size=world)
    ranks = None if group is None else list(dist.get_process_group_ranks(group))
    telemetry = create_telemetry_group(identity, reducer.timeout_s, ranks)
    if telemetry is None:
        return
    reducer.identity, reducer.group, reducer._world = identity, telemetry, world
    reducer.exchange, reducer.fanin, unshaped = shaped_exchange(
        telemetry, identity, world, reducer.timeout_s, reducer.grace_s, reducer.fanin, None
    )
    reducer.lateness = LatenessTracker.attach(rank, reducer.exchange)
    reducer.disabled_reason, reducer._expect, reducer._verdict = unshaped, None, None
    reducer.pairing.forget_held()  # rows of the old group's ranks
    message = (
        f"cross-rank telemetry re-formed on a new process group: {world} rank(s), was {before}; "
        f"this rank is rank {rank} of it"
    )
    if reducer.events is None:
        logger.warning("otel_train: %s", message)
    else:
        attributes = {"rank": rank, "world_size": world, "world_size_before": before}
        reducer.events.emit("membership_change", message, attributes)


def _view(record: RankRecord, names: Mapping[int, str], weight: float) -> RankView:
    """One row as the straggler model sees it (`verdicts.RankView`): timers inside steps only."""
    timers = {n: t for n, t in record.named_timers(names).items() if t.arrival.count}
    return RankView(
        record.rank, record.host, record.local_rank, record.step_stats,
        {n: t.arrival for n, t in timers.items()}, weight, timers,
    )  # fmt: skip


def _loss_row(blocks: Any) -> dict[str, float]:
    """Rank 0's row values (bridge keys) from job blocks where it recorded no loss itself: the
    loss other ranks recorded (a pipeline's last stage; `job_block.loss_of`), or none. Rows only:
    rank 0's own series keep to what it recorded (the job's loss is `train.job.loss`)."""
    loss = job_block.loss_of(blocks)
    if loss is None:
        return {}
    return dict(zip((semconv.LOSS.key, semconv.LOSS_MIN.key, semconv.LOSS_MAX.key), loss, strict=True))


class RowPairing:
    """Rank 0 pairs only rows that cover exactly its own steps; the rest are left out, counted and
    warned about once, or (a star row that reaches past its flush) held for the flush that reaches
    them. Also whether a tree's rows let rank 0 judge arrivals at collectives (`unjudged`)."""

    def __init__(self) -> None:
        self.left_out_rows = 0  # rows taken that covered other steps than rank 0's own
        self.partial_flushes = 0  # flushes whose cross-rank view lacked a rank
        self._warned = False
        # Star rows that reach past rank 0's flush ([n, row] or None), and each one's (rank, last
        # step): held for the flush that reaches them (docs/design/crossrank.md#reducer).
        self._held: Any = None
        self._held_steps: list[tuple[int, int]] = []

    def ready(self, step: int) -> set[int]:
        """The peers whose held row already reaches `step`: rank 0 need not wait for them."""
        return {rank for rank, last in self._held_steps if last >= step}

    def with_held(self, rows: Any) -> Any:
        """Rank 0 (star): this flush's rows with the rows held for it, after its own row (so each
        peer's rows stay in the order they came)."""
        import torch

        return rows if self._held is None else torch.cat([rows[:1], self._held, rows[1:]])

    def hold(self, rows: Any, records: Sequence[RankRecord], step: int) -> tuple[Any, list[RankRecord]]:
        """Rank 0 (star): of `rows` (`with_held`'s) and their `records`, hold the peers' rows that
        end after `step` for a later flush; returns the others (this flush's), rank 0's first."""
        kept, later, held = [], [], dict[int, int]()
        for i, record in enumerate(records):
            if i == 0 or record.step <= step:
                kept.append(i)
            elif held.get(record.rank, 0) < MAX_HELD:
                held[record.rank] = held.get(record.rank, 0) + 1
                later.append(i)
            else:  # a peer this far ahead is not in lockstep with rank 0: never paired
                self.left_out_rows += 1
        self._held = rows[later].clone() if later else None
        self._held_steps = [(records[i].rank, records[i].step) for i in later]
        return rows[kept], [records[i] for i in kept]

    def forget_held(self) -> None:
        self._held, self._held_steps = None, []

    def same_steps(self, records: Sequence[RankRecord], from_step: int, step: int, world: int) -> list[int]:
        """The indexes of the rows that cover exactly (from_step, step]; the others are counted."""
        same = [i for i, r in enumerate(records) if (r.from_step, r.step) == (from_step, step)]
        self.note([r for i, r in enumerate(records) if i not in same], len(same), world, from_step, step)
        return same

    def note(
        self, left_out: Sequence[RankRecord], paired: int, world: int, from_step: int, step: int
    ) -> None:
        """Count the rows left out of a flush (and the flush, when it lacked a rank); warn once."""
        self.left_out_rows += len(left_out)
        if paired < world:
            self.partial_flushes += 1
        if left_out and not self._warned:
            self._warned = True
            logger.warning(
                "otel_train: rank(s) %s sent rows for other steps than rank 0's (after step %d up to %d; "
                "theirs: %s); a row is left out of a flush's cross-rank stats unless it covers the same "
                "steps (ranks not in lockstep, or a flush that came late)",
                [r.rank for r in left_out], from_step, step, [(r.from_step, r.step) for r in left_out],
            )  # fmt: skip


def unjudged(tree: TreeView, exchange: Any, host: str) -> str | None:
    """Why a tree's rows do not let rank 0 judge arrivals at collectives (None: they do). That
    needs every rank's row whole, and each one's clock offset to rank 0 (rank 0's host reads its
    clock; elsewhere a rank's offset is to its parent, so that parent must be rank 0)."""
    world, fanin = exchange.layout.world, exchange.layout.fanin
    keep = f"an exchange_fanin of at least {world - 1} keeps the exact star (every rank answers to rank 0)"
    if tree.summary:
        return (
            f"arrivals at collectives cannot be judged: rank 0 has {len(tree.exact)} of {world} ranks' "
            f"rows whole (the tree of exchange_fanin={fanin} summarizes the rest); {keep}"
        )
    parent = exchange.layout.parent
    far = sorted(r.rank for r in tree.exact if r.host != host and parent[r.rank] != 0)
    if not far:
        return None
    names = f"rank {far[0]}" if len(far) == 1 else f"ranks {', '.join(str(r) for r in far)}"
    return (
        f"arrivals at collectives cannot be judged: {names}, on another host than rank 0, answer(s) to "
        f"rank(s) {sorted({parent[r] for r in far})} in the tree of exchange_fanin={fanin}, so "
        f"{'its' if len(far) == 1 else 'their'} clock offset is known to that rank, not to rank 0; {keep}"
    )
