"""Series load test: the OTLP of N simulated ranks into the pinned VictoriaMetrics (issue #47).

Two real torch.distributed (gloo) ranks train a short loop with the usual API (four timed phases,
loss, lr, grad norm, tokens, samples; a fake NVML GPU each with `--gpu`) and push their metrics over
OTLP to a local receiver: rank 0's and rank 1's export are the templates of a job's rank 0 and of
its other ranks. A resource without a `rank` attribute (series exported once per job) is a third
template, replayed once.

Each simulated rank then goes through the library's own export path: its Resource from
`assemble.resource.build_resource` (its own rank, local rank, node, host), its MeterProvider and
OTLP exporter from `exporters.build_telemetry` with the tier's `Config`, instruments made from the
catalogue (`MetricSpec.create`), the template's data points recorded into them, one export per
round. VictoriaMetrics' active series count (`/api/v1/series/count`, and `/api/v1/status/tsdb`
per metric name) must equal what the templates expand to: rank 0 + (N - 1) x another rank + the
job's own series; the 100,000-rank figure is that formula with the measured per-rank counts.

    python bench/bench_series_load.py --ranks 1000 --tier full --tier essential
    python bench/bench_series_load.py --ranks 1000 --gpu --rounds 5
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from helpers.multirank import run_ranks  # noqa: E402
from helpers.otlp_receiver import attributes, http_receiver  # noqa: E402
from helpers.vmstack import VictoriaMetrics, victoriametrics  # noqa: E402

RANKS_PER_HOST = 8
TEMPLATE_WORLD = 2
RESOURCE_KEYS = ("rank", "local_rank", "world_size", "node_rank", "host.name", "run_id", "role")


# --- templates: what one real rank pushes -----------------------------------------------------------
@dataclass(frozen=True)
class Point:
    """One OTLP data point as recorded: its attributes and value (histograms: bucket counts)."""

    attributes: tuple[tuple[str, Any], ...]
    value: float = 0.0
    bounds: tuple[float, ...] = ()
    counts: tuple[int, ...] = ()


@dataclass
class Metric:
    name: str
    kind: str  # the OTLP data field: sum | gauge | histogram
    monotonic: bool
    points: dict[tuple[tuple[str, Any], ...], Point] = field(default_factory=dict)

    def series(self) -> int:
        """Series this metric becomes in a Prometheus-naming store: 1 per point, a histogram
        point one per bucket (`+Inf` included) plus `_sum` and `_count`."""
        if self.kind == "histogram":
            return sum(len(p.bounds) + 3 for p in self.points.values())
        return len(self.points)


@dataclass
class Template:
    resource: dict[str, Any]
    metrics: dict[str, Metric] = field(default_factory=dict)

    def series(self) -> int:
        return sum(m.series() for m in self.metrics.values())

    def gpu_series(self) -> int:
        from otel_train import semconv

        return sum(
            m.series()
            for m in self.metrics.values()
            if (spec := semconv.BY_NAME.get(m.name)) is not None and spec.gpu_only
        )


def templates_from(requests: Iterable[Any]) -> dict[str, Template]:
    """Per resource (`rank0`, `rank1`, `job` for one without a rank), the union over every export
    of its metric points, each at its latest value: the series a store holds after the run."""
    out: dict[str, Template] = {}
    for request in requests:
        for rm in request.resource_metrics:
            resource = attributes(rm.resource.attributes)
            key = f"rank{resource['rank']}" if "rank" in resource else "job"
            template = out.setdefault(key, Template(resource))
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    kind = metric.WhichOneof("data")
                    data = getattr(metric, kind)
                    entry = template.metrics.setdefault(
                        metric.name, Metric(metric.name, kind, bool(getattr(data, "is_monotonic", False)))
                    )
                    for dp in data.data_points:
                        attrs = tuple(sorted(attributes(dp.attributes).items()))
                        if kind == "histogram":
                            point = Point(attrs, dp.sum, tuple(dp.explicit_bounds), tuple(dp.bucket_counts))
                        else:
                            number = dp.WhichOneof("value")
                            point = Point(attrs, float(getattr(dp, number)))
                        entry.points[attrs] = point
    return out


def _template_rank(rank: int, world: int, endpoint: str, tier: str, gpu: bool, steps: int) -> int:
    """One real rank of the template job (a spawned gloo process)."""
    if gpu:  # a fake NVML with one GPU per rank: the hardware sampler exports the per-GPU set
        from helpers.fake_nvml import FakeGpu, FakeNvml, gpu_uuid

        sys.modules["pynvml"] = FakeNvml([FakeGpu(uuid=gpu_uuid(i)) for i in range(world)])  # type: ignore[assignment]
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(world))
    import torch

    import otel_train as ot

    ot.init(
        otlp_metrics_endpoint=endpoint, metric_export_interval_s=1.0, prometheus_port=0,
        run_id="template", run_dir_enabled=False, verbosity=0, log_interval=2, hardware=gpu,
        hardware_interval_s=0.2, peak_flops=1e12, flops_per_token=1e6, rank_series=tier,
    )  # fmt: skip
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(steps):
        with ot.step(step, tokens=256, samples=8):
            with ot.timer("data"):
                x = torch.randn(4, 8)
            optimizer.zero_grad()
            with ot.timer("forward"):
                time.sleep(0.01 * (1 + rank))  # rank 1 arrives late: the straggler series have values
                loss = model(x).pow(2).mean()
            with ot.timer("backward"):
                loss.backward()
            with ot.timer("optimizer"):
                optimizer.step()
            ot.record("loss", loss)
            ot.record("lr", 1e-3)
            ot.record("grad_norm", 1.0)
    ot.shutdown()
    return steps


def capture_templates(tier: str, gpu: bool = False, steps: int = 12) -> dict[str, Template]:
    """The templates of a real 2-rank job in `tier`, from what its ranks pushed over OTLP."""
    with http_receiver() as (endpoint, received):
        # the Flight Recorder on, as the collective-hang alert needs (train.collective.* series)
        env = {"TORCH_FR_BUFFER_SIZE": "2000"}
        args = (f"{endpoint}/v1/metrics", tier, gpu, steps)
        run_ranks(TEMPLATE_WORLD, _template_rank, args, timeout=180, env=env)
        return templates_from(received.metrics)


# --- replay: one simulated rank through the library's export path ---------------------------------
def _record(meter: Any, metric: Metric, bump: float) -> Any:
    """Make `metric`'s instrument from the catalogue and record its template points (counters and
    histograms grown by `bump` so that successive rounds are new samples)."""
    from opentelemetry.metrics import Observation

    from otel_train import semconv

    spec = semconv.BY_NAME.get(metric.name)
    points = list(metric.points.values())
    if spec is None:  # a name outside the catalogue (ot.record of a user key): a plain gauge
        spec = semconv.MetricSpec(metric.name, semconv.Kind.GAUGE, "", "", metric.name)
    if spec.kind.value.startswith("observable"):
        return spec.create(
            meter, lambda _options: [Observation(p.value + bump, dict(p.attributes)) for p in points]
        )
    instrument = spec.create(meter)
    for p in points:
        attrs = dict(p.attributes)
        if spec.kind is semconv.Kind.COUNTER:
            instrument.add(max(p.value, 0.0) + bump, attrs)
        elif spec.kind is semconv.Kind.HISTOGRAM:
            _record_buckets(instrument, p, attrs)
        else:
            instrument.set(p.value, attrs)
    return instrument


def _record_buckets(instrument: Any, p: Point, attrs: Mapping[str, Any]) -> None:
    """Observations that fill the same buckets as the template point (at each bucket's upper
    bound; `+Inf` just above the last); an empty histogram still exports every bucket."""
    if not any(p.counts):
        instrument.record(p.bounds[0] if p.bounds else 0.0, attrs)
        return
    for i, count in enumerate(p.counts):
        value = p.bounds[i] if i < len(p.bounds) else (p.bounds[-1] * 2 if p.bounds else 1.0)
        for _ in range(count):
            instrument.record(value, attrs)


@dataclass(frozen=True)
class SimRank:
    rank: int  # -1: the job's own resource (no rank)
    world: int
    run_id: str

    @property
    def host(self) -> str:
        return f"node{self.rank // RANKS_PER_HOST:05d}"


def replay(sim: SimRank, template: Template, tier: str, endpoint: str, rounds: int) -> None:
    """Push `template` as rank `sim.rank` of `sim.world`, `rounds` exports, through the library's
    own Resource / MeterProvider / OTLP exporter setup."""
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.resources import Resource

    from otel_train.config import Config
    from otel_train.core.assemble import build_resource
    from otel_train.distributed import Identity
    from otel_train.exporters import build_telemetry

    config = Config(
        run_id=sim.run_id, otlp_metrics_endpoint=endpoint, metric_export_interval_s=3600.0,
        prometheus_port=0, run_dir_enabled=False, rank_series=tier,  # type: ignore[arg-type]
    )  # fmt: skip
    extra = {k: v for k, v in template.resource.items() if k.startswith("hw.") or k.startswith("gpu.")}
    if sim.rank < 0:
        job = {k: v for k, v in template.resource.items() if not k.startswith("telemetry.")}
        resource = Resource({**job, "run_id": sim.run_id})
        local_rank = 0
    else:
        local_rank = sim.rank % RANKS_PER_HOST
        ident = Identity(sim.run_id, sim.rank, local_rank, sim.world, sim.rank // RANKS_PER_HOST, sim.host)
        resource = build_resource(config, ident, {k: f"{v}-{sim.rank}" for k, v in extra.items()})
    telemetry = build_telemetry(config, resource, {}, InMemoryMetricReader(), local_rank)
    try:
        meter = telemetry.meter_provider.get_meter("otel_train")
        for round_ in range(rounds):
            # a fresh meter per round would be a new scope; the SDK returns the same instrument
            # for the same name, so a round re-records into it
            for metric in template.metrics.values():
                _record(meter, metric, float(round_))
            if not telemetry.meter_provider.force_flush(timeout_millis=30_000):
                raise RuntimeError(f"rank {sim.rank}: export to {endpoint} did not finish")
    finally:
        telemetry.shutdown(10.0)


def push_ranks(
    templates: Mapping[str, Template], world: int, tier: str, endpoint: str, rounds: int, workers: int = 2
) -> None:
    run_id = f"load-{tier}"
    other = templates[f"rank{TEMPLATE_WORLD - 1}"]
    jobs: list[tuple[SimRank, Template]] = [(SimRank(0, world, run_id), templates["rank0"])]
    jobs += [(SimRank(r, world, run_id), other) for r in range(1, world)]
    if "job" in templates:
        jobs.append((SimRank(-1, world, run_id), templates["job"]))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for future in [pool.submit(replay, sim, t, tier, endpoint, rounds) for sim, t in jobs]:
            future.result()


# --- read back ----------------------------------------------------------------------------------
def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=60) as response:
        body = response.read().decode()
    return json.loads(body) if body.lstrip().startswith(("{", "[")) else body


def series_count(vm: VictoriaMetrics) -> int:
    return int(_get(f"{vm.url}/api/v1/series/count")["data"][0])


def series_by_metric(vm: VictoriaMetrics) -> dict[str, int]:
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    data = _get(f"{vm.url}/api/v1/status/tsdb?topN=10000&date={today}")["data"]
    return {row["name"]: int(row["value"]) for row in data["seriesCountByMetricName"]}


def settled_count(vm: VictoriaMetrics, expected: int, timeout_s: float = 60.0) -> int:
    """The active series count once ingestion has settled: VictoriaMetrics makes new rows
    searchable within about a second of the force flush; stop at `expected` or when it no longer
    moves (a count that never reaches `expected` is returned as it is, for the caller to judge)."""
    deadline = time.monotonic() + timeout_s
    last, stable = -1, 0
    while True:
        _get(f"{vm.url}/internal/force_flush")
        count = series_count(vm)
        if count == expected or time.monotonic() > deadline:
            return count
        stable = stable + 1 if count == last else 0
        if stable >= 5:
            return count
        last = count
        time.sleep(0.5)


def store_bytes(vm: VictoriaMetrics) -> dict[str, int]:
    """On-disk bytes of the index and of the samples (VictoriaMetrics' own vm_data_size_bytes)."""
    _get(f"{vm.url}/internal/force_flush")
    text = _get(f"{vm.url}/metrics")
    out = {"index": 0, "data": 0}
    for line in str(text).splitlines():
        if line.startswith("vm_data_size_bytes{"):
            kind = line.split('type="', 1)[1].split('"', 1)[0]
            out["index" if kind.startswith("indexdb") else "data"] += int(float(line.rsplit(" ", 1)[1]))
    return out


# --- the whole measurement --------------------------------------------------------------------------
@dataclass
class LoadResult:
    tier: str
    ranks: int
    rounds: int
    rank0: int  # series of the job's rank 0
    per_rank: int  # series of every other rank
    per_rank_gpu: int  # of which per-GPU (hardware) series
    job: int  # series exported once per job (no rank label)
    expected: int
    measured: int
    by_metric: dict[str, int]
    index_bytes: int
    data_bytes: int
    push_s: float

    def model(self, ranks: int) -> int:
        """Series of a job of `ranks` ranks, from the measured per-rank counts."""
        return self.rank0 + (ranks - 1) * self.per_rank + self.job

    def index_per_series(self) -> float:
        return self.index_bytes / max(self.measured, 1)

    def bytes_per_sample(self) -> float:
        """Compressed bytes per stored sample of this load (its values barely change between
        rounds, like most of a training job's series between two exports)."""
        return self.data_bytes / max(self.measured * self.rounds, 1)


def measure(
    tier: str,
    ranks: int,
    rounds: int = 2,
    gpu: bool = False,
    templates: Mapping[str, Template] | None = None,
    log: Callable[[str], None] = print,
) -> LoadResult:
    templates = templates if templates is not None else capture_templates(tier, gpu)
    rank0, other = templates["rank0"], templates[f"rank{TEMPLATE_WORLD - 1}"]
    job = templates["job"].series() if "job" in templates else 0
    expected = rank0.series() + (ranks - 1) * other.series() + job
    log(f"[{tier}] templates: rank 0 {rank0.series()}, other ranks {other.series()} "
        f"(GPU {other.gpu_series()}), job {job}: {ranks} ranks -> {expected} series")  # fmt: skip
    with victoriametrics() as vm:
        start = time.perf_counter()
        push_ranks(templates, ranks, tier, vm.otlp_metrics_url, rounds)
        push_s = time.perf_counter() - start
        measured = settled_count(vm, expected)
        by_metric = series_by_metric(vm)
        sizes = store_bytes(vm)
    result = LoadResult(tier, ranks, rounds, rank0.series(), other.series(), other.gpu_series(), job,
                        expected, measured, by_metric, sizes["index"], sizes["data"], push_s)  # fmt: skip
    log(f"[{tier}] VictoriaMetrics: {measured} active series (expected {expected}); "
        f"store {sizes['index'] / 1e6:.1f} MB index + {sizes['data'] / 1e6:.1f} MB data after "
        f"{rounds} export(s) per rank; push {push_s:.1f} s")  # fmt: skip
    return result


SAMPLES_PER_DAY = 86_400 // 10  # one sample per series per export, at the default 10 s interval


def table(results: Sequence[LoadResult], sizes: Sequence[int] = (1_000, 10_000, 100_000)) -> str:
    """Markdown: series and store size per tier at each job size (measured where run, else the
    model: the measured per-rank counts, the measured index bytes per series and bytes per sample)."""
    lines = [
        "| tier | ranks | series | index | samples per day (10 s export) | source |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in results:
        for n in sizes:
            series = r.measured if n == r.ranks else r.model(n)
            source = "measured" if n == r.ranks else f"model: {r.rank0} + (N-1) x {r.per_rank} + {r.job}"
            index = series * r.index_per_series()
            day = series * SAMPLES_PER_DAY * r.bytes_per_sample()
            lines.append(
                f"| {r.tier} | {n:,} | {series:,} | {index / 1e6:,.0f} MB | {day / 1e9:,.1f} GB | {source} |"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1000)
    parser.add_argument("--tier", action="append", choices=("full", "essential"))
    parser.add_argument("--rounds", type=int, default=2, help="exports per simulated rank")
    parser.add_argument("--gpu", action="store_true", help="a fake NVML GPU per rank (the per-GPU set)")
    args = parser.parse_args(argv)
    results = [measure(tier, args.ranks, args.rounds, args.gpu) for tier in args.tier or ["full"]]
    for r in results:
        print(f"[{r.tier}] {r.index_per_series():.0f} index bytes per series, "
              f"{r.bytes_per_sample():.2f} bytes per sample over {r.rounds} export(s)")  # fmt: skip
    print(table(results))
    return 0 if all(r.measured == r.expected for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
