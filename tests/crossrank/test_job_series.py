"""Job-level series (crossrank/job_block, job_outputs): on real gloo ranks, what rank 0 EXPORTED
for the job equals the sum of what every rank exported itself, bucket by bucket, in the star and
in the tree; the block's merge is exact at any depth; no rank label reaches a store."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch
from helpers.multirank import run_ranks

from otel_train import semconv
from otel_train.core.buffer import Interval
from otel_train.crossrank import job_block
from otel_train.crossrank.job_outputs import JobSeries

PHASES = ("data", "forward", "backward", "optimizer")
FLUSHES = 5
DRAIN = 4  # flushes without steps at the end: every late row is taken (each once)


def _interval(seq: int, rank: int, rng: random.Random) -> Interval:
    """Ten steps whose durations spread over the buckets, some exactly on a bound."""
    steps = 10 if seq < FLUSHES else 0
    bounds = list(semconv.PHASE_BUCKETS)
    phases = {
        name: [rng.choice(bounds) if rng.random() < 0.2 else rng.uniform(1e-4, 3.0) for _ in range(steps)]
        for name in PHASES[: 2 + rank % 3]  # ranks run different timer sets
    }
    step = [rng.uniform(0.001, 40.0) for _ in range(steps)]
    loss = {semconv.LOSS.name: [rng.uniform(0.5, 3.0) for _ in range(steps)]} if steps else {}
    samples, tokens = 8 * steps, 1024 * steps
    return Interval(seq, seq * 10 + 9, 0.0, 2.0, steps, tokens, samples, step, phases, scalars=loss)


def _points(reader: Any) -> dict[tuple[str, str], dict[str, Any]]:
    """(metric, phase) -> {buckets, count, sum} or {value}, from one collect of `reader`."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    data = reader.get_metrics_data()
    for resource_metrics in data.resource_metrics if data else ():
        for scope in resource_metrics.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    key = (metric.name, str(point.attributes.get(semconv.PHASE, "")))
                    if hasattr(point, "bucket_counts"):
                        out[key] = {
                            "buckets": list(point.bucket_counts),
                            "count": point.count,
                            "sum": point.sum,
                        }
                    else:
                        out[key] = {"value": point.value, "attributes": dict(point.attributes)}
    return out


def _rank(rank: int, world: int, fanin: int) -> dict[str, Any]:
    import torch.distributed as dist
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.resources import Resource

    from otel_train.config import Config
    from otel_train.core.instruments import record_durations
    from otel_train.crossrank.reducer import CrossRankReducer
    from otel_train.distributed import detect_identity

    own_reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[own_reader]).get_meter("rank")
    step_histogram, phase_histogram = (
        semconv.STEP_DURATION.create(meter),
        semconv.PHASE_DURATION.create(meter),
    )
    job_reader = InMemoryMetricReader()
    job_meter = MeterProvider(metric_readers=[job_reader], resource=Resource({"run_id": "r"})).get_meter(
        "job"
    )
    config = Config(exchange_fanin=fanin, exchange_grace_s=5.0)
    reducer = CrossRankReducer(detect_identity(None), meter, None, config, job_meter=job_meter)
    rng = random.Random(rank)
    samples = tokens = 0
    for seq in range(FLUSHES + DRAIN):
        interval = _interval(seq, rank, rng)
        # what the worker feeds this rank's own histograms (flush/worker.py _feed)
        record_durations(step_histogram, interval.step_durations, None, {}, {})
        for name, values in interval.phases.items():
            record_durations(phase_histogram, values, name, {semconv.PHASE: name}, {})
        samples, tokens = samples + interval.samples, tokens + interval.tokens
        dist.barrier()
        reducer.on_flush(interval)
    assert reducer.disabled_reason is None, reducer.disabled_reason
    return {
        "own": _points(own_reader),
        "job": _points(job_reader) if rank == 0 else {},
        "samples": samples,
        "tokens": tokens,
        "collectives": reducer.collectives,
        "tree": type(reducer.exchange).__name__,
    }


@pytest.mark.parametrize(("world", "fanin", "shape"), [(4, 16, "StarExchange"), (8, 2, "TreeExchange")])
def test_job_buckets_are_the_sum_of_every_ranks_own(world: int, fanin: int, shape: str) -> None:
    results = run_ranks(world, _rank, (fanin,), timeout=240)
    assert [r["tree"] for r in results] == [shape] * world
    # no collective of its own: one exchange per flush, as without the job block
    assert [r["collectives"] for r in results] == [FLUSHES + DRAIN] * world
    job = results[0]["job"]
    pairs = [
        (semconv.STEP_DURATION.name, "", semconv.JOB_STEP_DURATION.name, ""),
        *((semconv.PHASE_DURATION.name, p, semconv.JOB_PHASE_DURATION.name, p) for p in PHASES),
    ]
    for own_name, phase, job_name, job_phase in pairs:
        ranks = [r["own"][(own_name, phase)] for r in results if (own_name, phase) in r["own"]]
        assert ranks, (own_name, phase)
        summed = [sum(column) for column in zip(*(r["buckets"] for r in ranks), strict=True)]
        exported = job[(job_name, job_phase)]
        assert exported["buckets"] == summed, (job_name, job_phase)  # exact: integer counts
        assert exported["count"] == sum(r["count"] for r in ranks)
        assert exported["sum"] == pytest.approx(sum(r["sum"] for r in ranks), rel=1e-12)
    assert job[(semconv.JOB_SAMPLES.name, "")]["value"] == sum(r["samples"] for r in results)
    assert job[(semconv.JOB_TOKENS.name, "")]["value"] == sum(r["tokens"] for r in results)
    for (name, _), point in job.items():  # the job's series carry no rank attribute at all
        assert not set(point.get("attributes", {})) & {semconv.RANK, "local_rank", "host.name"}, name


def _block(rank: int, seq: int, rng: random.Random) -> Any:
    return job_block.encode(_interval(seq, rank, rng), rank)


def test_merging_in_any_grouping_is_exact() -> None:
    """A parent adds its children's blocks: any tree of merges gives the flat merge's counts."""
    rng = random.Random(7)
    blocks = [_block(rank, 0, rng) for rank in range(13)]
    flat = job_block.decode(job_block.combine(blocks))
    nested = job_block.combine(
        [
            job_block.combine(blocks[:2]),
            job_block.combine([job_block.combine(blocks[2:7]), *blocks[7:12]]),
            blocks[12],
        ]
    )
    tree = job_block.decode(nested)
    assert tree.rows == flat.rows == 13
    assert tree.timers.keys() == flat.timers.keys()
    for ident, timer in flat.timers.items():
        other = tree.timers[ident]
        assert other.buckets == timer.buckets and other.ranks == timer.ranks
        assert (other.low, other.high) == (timer.low, timer.high)
        assert (other.mean_min_rank, other.mean_max_rank) == (timer.mean_min_rank, timer.mean_max_rank)
        assert other.total == pytest.approx(timer.total, rel=1e-12)
    # against the values themselves: the step's buckets count every step of every rank
    rng = random.Random(7)
    steps = [v for rank in range(13) for v in _interval(0, rank, rng).step_durations]
    assert flat.timers[job_block.STEP_ID].count == len(steps)
    assert flat.timers[job_block.STEP_ID].high == max(steps)


def test_ties_name_the_lowest_rank_and_an_empty_block_adds_nothing() -> None:
    same = [Interval(1, 9, 0.0, 1.0, 2, 0, 0, [0.5, 0.5], {"forward": [0.1, 0.1]}) for _ in range(3)]
    blocks = [job_block.encode(interval, rank) for rank, interval in zip((5, 2, 9), same, strict=True)]
    merged = job_block.decode(job_block.combine([*blocks, job_block.empty()]))
    timer = merged.timers[job_block.STEP_ID]
    assert (timer.mean_min_rank, timer.mean_max_rank, timer.ranks, merged.rows) == (2, 2, 3, 3)


def test_timers_beyond_the_block_are_left_out_and_counted() -> None:
    many = {f"t{i}": [0.01] * (i + 1) for i in range(job_block.RECORDS + 2)}
    block = job_block.decode(job_block.encode(Interval(1, 9, 0.0, 1.0, 1, 0, 0, [0.2], many), 0))
    assert len(block.timers) == job_block.RECORDS and block.overflow == 3  # the three smallest


def test_a_name_rank_0_learns_late_keeps_its_counts() -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from otel_train.crossrank.up_row import name_id

    reader = InMemoryMetricReader()
    series = JobSeries(MeterProvider(metric_readers=[reader]).get_meter("job"))
    interval = Interval(1, 9, 0.0, 1.0, 1, 0, 0, [0.2], {"remote": [0.003, 0.004]})
    series.publish(job_block.encode(interval, 3), {}, 1.0)  # name not known yet: it waits
    assert (semconv.JOB_PHASE_DURATION.name, "remote") not in _points(reader)
    series.publish(job_block.encode(interval, 3), {name_id("remote"): "remote"}, 1.0)
    point = _points(reader)[(semconv.JOB_PHASE_DURATION.name, "remote")]
    assert point["count"] == 4 and not series.unexported


def test_a_row_that_could_not_go_up_counts_with_the_next() -> None:
    """Star, rank r > 0: a skipped row's block is added to the next row's (never lost)."""
    first = job_block.encode(Interval(1, 9, 0.0, 1.0, 1, 0, 8, [0.2]), 1)
    second = job_block.encode(Interval(2, 19, 0.0, 1.0, 1, 0, 8, [0.3]), 1)
    both = job_block.decode(job_block.combine([second, first]))
    assert both.samples == 16 and both.timers[job_block.STEP_ID].count == 2


def test_nonfinite_loss_never_reaches_the_block() -> None:
    interval = Interval(1, 9, 0.0, 1.0, 1, 0, 0, [math.inf, 0.2], scalars={semconv.LOSS.name: [2.0]})
    block = job_block.decode(job_block.encode(interval, 0))
    assert block.timers[job_block.STEP_ID].count == 1 and block.loss_sum == 2.0
    assert torch.isfinite(job_block.encode(interval, 0)[: job_block.HEAD_LEN - 2]).all()


def test_column_by_column_merge_is_the_merge_by_id() -> None:
    """Ranks with the same timers lay out their blocks alike and merge column by column: the same
    block as matching every record by id."""
    intervals = [
        Interval(1, 9, 0.0, 1.0, 3, 0, 8, [0.2, 0.3, 0.1 * r], {"f": [0.01 * r], "b": [0.02]})
        for r in range(1, 6)
    ]
    blocks = torch.stack([job_block.encode(interval, rank) for rank, interval in enumerate(intervals)])
    ids = blocks[:, job_block.HEAD_LEN :: job_block.REC_LEN][:, : job_block.RECORDS]
    assert bool((ids == ids[0]).all())  # the column-by-column path is the one taken
    assert torch.equal(job_block.combine(blocks), job_block._by_id(blocks))


def test_two_readers_each_see_every_count_once() -> None:
    """The pull endpoint and the OTLP push are two readers of the job's provider: whichever
    collects first merges the flushes, and both export the same cumulative counts."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    first, second = InMemoryMetricReader(), InMemoryMetricReader()
    series = JobSeries(MeterProvider(metric_readers=[first, second]).get_meter("job"))
    for seq in range(3):
        series.publish(
            torch.stack(
                [job_block.encode(Interval(seq, 9, 0.0, 1.0, 2, 4, 8, [0.2, 0.3]), r) for r in range(2)]
            ),
            {},
            1.0,
        )
        if seq == 1:
            _points(first)  # one reader collects in between
    step = (semconv.JOB_STEP_DURATION.name, "")
    a, b = _points(first), _points(second)
    assert a[step]["count"] == b[step]["count"] == 3 * 2 * 2
    samples = (semconv.JOB_SAMPLES.name, "")
    assert a[samples]["value"] == b[samples]["value"] == 3 * 2 * 8
    assert a[(semconv.JOB_RANKS.name, "")]["value"] == 2  # the latest flush's rows
