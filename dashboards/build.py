"""Generate otel_train's Grafana dashboards from the metric catalogue (`otel_train/semconv.py`).

    python -m dashboards.build            # (re)write dashboards/json/<uid>.json
    python -m dashboards.build --check    # exit 1 when the committed JSON is stale
    python -m dashboards.build --out DIR  # write somewhere else (tests)

Every metric name comes from a `MetricSpec`; nothing here retypes one.  Every query works on both
export paths: the in-process pull endpoint (opentelemetry-exporter-prometheus) and the OTel
Collector's prometheus exporter.  They differ only for unit-"1" gauges, which the Collector names
`<name>_ratio`; those are selected with `{__name__=~"<name>(_ratio)?", ...}` (see `selector`), and
every query aggregates with an explicit `by (...)` so that the label sets of the two paths (scope
labels, job/instance) never matter.

The output is plain dashboard JSON for Grafana file provisioning, with sorted keys and stable panel
ids, so that regeneration is byte-identical.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

if __package__ in (None, ""):  # run as `python dashboards/build.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from grafana_foundation_sdk.builders.common import ReduceDataOptions
from grafana_foundation_sdk.builders.dashboard import (
    Dashboard,
    DashboardLink,
    DatasourceVariable,
    QueryVariable,
    Row,
    ThresholdsConfig,
)
from grafana_foundation_sdk.builders.heatmap import Panel as HeatmapPanel
from grafana_foundation_sdk.builders.heatmap import RowsHeatmapOptions, YAxisConfig
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.builders.stat import Panel as StatPanel
from grafana_foundation_sdk.builders.table import Panel as TablePanel
from grafana_foundation_sdk.builders.timeseries import Panel as TimeseriesPanel
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import BigValueGraphMode, HeatmapCellLayout
from grafana_foundation_sdk.models.dashboard import (
    DashboardLinkType,
    DataSourceRef,
    Threshold,
    ThresholdsMode,
    VariableOption,
    VariableRefresh,
    VariableSort,
)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from otel_train import semconv as sc
from otel_train.semconv import Kind, MetricSpec

JSON_DIR = Path(__file__).resolve().parent / "json"
TAGS = ["otel_train", "generated"]
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"
RANGE = "$__range"
GPU_NOTE = "GPU-only: empty on runs without NVIDIA GPUs."

_GAUGE_KINDS = (Kind.GAUGE, Kind.OBSERVABLE_GAUGE)
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


# --- labels (attribute keys as Prometheus label names) ---------------------------------------------
def label(key: str) -> str:
    """Prometheus label name of an OTel attribute key (`train.phase` -> `train_phase`)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


_HOST_KEY = "host.name"
assert _HOST_KEY in sc.LABEL_RESOURCE_KEYS
RUN = label(sc.RUN_ID)
RANK = label(sc.RANK)
ROLE = label(sc.ROLE)
_RUN = f"{RUN}, {ROLE}"  # a run's series: one per role (an RL job's policy and generation)
HOST = label(_HOST_KEY)
PHASE = label(sc.PHASE)
STRAGGLER_KIND = label(sc.STRAGGLER_KIND)
STAT = label(sc.STAT)
EVENT = label(sc.EVENT)
REASON = label(sc.REASON)
COLL_GROUP = label(sc.PROCESS_GROUP)
COLL_OP = label(sc.COLLECTIVE_OP)
HW_ID = label(sc.HW_ID)
HW_NAME = label(sc.HW_NAME)
THROTTLE_REASON = label(sc.THROTTLE_REASON)
DIRECTION = label(sc.DIRECTION)
MEMORY_STATE = label(sc.MEMORY_STATE)
ERROR_TYPE = label(sc.ERROR_TYPE)
LAYER = label(sc.LAYER)

# Dashboard variables: (name, label shown in Grafana, label name filtered on).
# Role: the part of a single-controller job (controller, policy, ...); ranks are numbered per
# role, so every per-rank query groups by role too. A job without roles has no role label, which
# the variable's "All" (`.*`) still matches.
VAR_RUN, VAR_HOST, VAR_ROLE, VAR_RANK = "run_id", "host", "role", "rank"
VARIABLES: tuple[tuple[str, str, str], ...] = (
    (VAR_RUN, "Run", RUN),
    (VAR_HOST, "Host", HOST),
    (VAR_ROLE, "Role", ROLE),
    (VAR_RANK, "Rank", RANK),
)

# Prometheus' own alert series (not an otel_train metric).
ALERTS = "ALERTS"


# --- selectors ------------------------------------------------------------------------------------
def has_two_names(spec: MetricSpec) -> bool:
    """True when the pull endpoint and the Collector name `spec` differently (unit-"1" gauges)."""
    return spec.prometheus_name != spec.collector_prometheus_name


def name_regex(spec: MetricSpec) -> str:
    """`__name__` regex matching the series name of `spec` on both export paths."""
    pull, collector = spec.prometheus_name, spec.collector_prometheus_name
    if pull == collector:
        return pull
    if not collector.startswith(pull):
        raise ValueError(f"cannot build a suffix alternation for {pull!r} / {collector!r}")
    return f"{pull}({collector[len(pull) :]})?"


def selector(
    spec: MetricSpec, suffix: str = "", *, rank: bool = True, host: bool = True, **extra: str
) -> str:
    """Series selector for `spec`, filtered by the dashboard variables.

    `suffix` is `_bucket`/`_sum`/`_count` for histograms.  `extra` adds label matchers; a value
    starting with `~` is a regex match (`stat="~min|max"`).  Unit-"1" gauges are selected with
    a `__name__` alternation so that both namings match.
    """
    if suffix and (spec.kind is not Kind.HISTOGRAM or suffix not in _HISTOGRAM_SUFFIXES):
        raise ValueError(f"suffix {suffix!r} does not apply to {spec.name}")
    # the role on every selector: a job-level series (no rank, no host) carries its role too
    matchers = [f'{RUN}=~"${VAR_RUN}"', f'{ROLE}=~"${VAR_ROLE}"']
    if host:
        matchers.append(f'{HOST}=~"${VAR_HOST}"')
    if rank:
        matchers.append(f'{RANK}=~"${VAR_RANK}"')
    for key, value in extra.items():
        op, value = ("=~", value[1:]) if value.startswith("~") else ("=", value)
        matchers.append(f'{key}{op}"{value}"')
    if has_two_names(spec):
        if suffix:
            raise ValueError(f"{spec.name}: histogram names never differ between paths")
        return "{" + ", ".join([f'__name__=~"{name_regex(spec)}"', *matchers]) + "}"
    return f"{spec.prometheus_name}{suffix}{{{', '.join(matchers)}}}"


def rate(spec: MetricSpec, suffix: str = "", window: str = RATE, fn: str = "rate", **kw: object) -> str:
    return f"{fn}({selector(spec, suffix, **kw)}[{window}])"  # type: ignore[arg-type]


def agg(op: str, by: str, inner: str) -> str:
    return f"{op} by ({by}) ({inner})"


def quantile(q: float, spec: MetricSpec, by: str, window: str = RATE) -> str:
    """A quantile of the per-rank buckets; `>= 0` leaves out the NaN of a series with no count in
    the window, or only the +Inf bucket (the essential tier's per-rank histograms)."""
    return f"histogram_quantile({q}, {agg('sum', f'le, {by}', rate(spec, '_bucket', window))}) >= 0"


def mean(spec: MetricSpec, by: str, window: str = RATE) -> str:
    """Mean of a histogram over the window: rate(sum) / rate(count), for the series with a count in
    it (a phase that did not run, a stalled rank: no value rather than 0/0 = NaN)."""
    return (
        f"{agg('sum', by, rate(spec, '_sum', window))} / ({agg('sum', by, rate(spec, '_count', window))} > 0)"
    )


def job_or_ranks(job: str, ranks: str) -> str:
    """The job-level series (rank 0 exports them once per job, in both tiers: every distributed job
    whose ranks exchange, and a single process), or, for a run without them (ranks whose exchange is
    off, cross_rank=False), the same figure from the per-rank series. `or` keeps the left side's
    series for each label set both sides have, so a run is never counted twice."""
    return f"({job}) or ({ranks})"


def job_quantile(q: float, job: MetricSpec, ranks: MetricSpec, by: str, window: str = RATE) -> str:
    """Quantile of the job's histogram (bucket counts summed over the ranks by rank 0), falling
    back to the per-rank buckets summed here."""
    job_buckets = agg("sum", f"le, {by}", rate(job, "_bucket", window, rank=False, host=False))
    rank_buckets = agg("sum", f"le, {by}", rate(ranks, "_bucket", window))
    return f"histogram_quantile({q}, {job_or_ranks(job_buckets, rank_buckets)})"


def job_mean(job: MetricSpec, ranks: MetricSpec, by: str, window: str = RATE) -> str:
    job_kw: dict[str, object] = {"rank": False, "host": False}
    return job_or_ranks(
        f"{agg('sum', by, rate(job, '_sum', window, **job_kw))} / ({agg('sum', by, rate(job, '_count', window, **job_kw))} > 0)",
        mean(ranks, by, window),
    )


def job_rate(job: MetricSpec, ranks: MetricSpec, by: str = _RUN) -> str:
    """Rate of a job-level counter (the sum over the ranks), or the per-rank counters' summed."""
    return job_or_ranks(agg("sum", by, rate(job, rank=False, host=False)), agg("sum", by, rate(ranks)))


# --- panel model ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    expr: str
    legend: str = ""
    instant: bool = False
    fmt: PromQueryFormat = PromQueryFormat.TIME_SERIES
    # Also fetch exemplars: histogram buckets of sampled steps carry their trace id (collector
    # `enable_open_metrics`, Prometheus `exemplar-storage`); Grafana links them to Tempo.
    exemplar: bool = False


@dataclass(frozen=True)
class PanelDef:
    title: str
    targets: tuple[Target, ...]
    viz: str = "timeseries"  # timeseries | stat | table | heatmap
    unit: str = "short"
    width: int = 12
    height: int = 8
    description: str = ""
    thresholds: tuple[tuple[float | None, str], ...] = ()
    min_val: float | None = None


@dataclass(frozen=True)
class DashboardDef:
    uid: str
    title: str
    description: str
    rows: tuple[tuple[str, tuple[PanelDef, ...]], ...] = field(default_factory=tuple)

    def panels(self) -> Iterable[PanelDef]:
        for _, panels in self.rows:
            yield from panels


def ts(title: str, *targets: Target, **kw: object) -> PanelDef:
    return PanelDef(title, targets, "timeseries", **kw)  # type: ignore[arg-type]


def stat(title: str, *targets: Target, **kw: object) -> PanelDef:
    return PanelDef(title, targets, "stat", width=6, height=5, **kw)  # type: ignore[arg-type]


def table(title: str, *targets: Target, **kw: object) -> PanelDef:
    instant = tuple(Target(t.expr, t.legend, True, PromQueryFormat.TABLE) for t in targets)
    return PanelDef(title, instant, "table", **kw)  # type: ignore[arg-type]


def T(expr: str, legend: str = "") -> Target:
    return Target(expr, legend)


def TX(expr: str, legend: str = "") -> Target:
    """A latency target over histogram buckets that also requests exemplars (trace links)."""
    return Target(expr, legend, exemplar=True)


# --- which catalogue metrics an expression reads --------------------------------------------------
def _names_to_specs() -> dict[str, MetricSpec]:
    names: dict[str, MetricSpec] = {}
    for spec in sc.CATALOGUE:
        for base in {spec.prometheus_name, spec.collector_prometheus_name}:
            names[base] = spec
            if spec.kind is Kind.HISTOGRAM:
                for suffix in _HISTOGRAM_SUFFIXES:
                    names[base + suffix] = spec
    return names


_NAMES = _names_to_specs()
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def specs_in(expr: str) -> tuple[MetricSpec, ...]:
    """Catalogue specs an expression reads (by series name, either naming)."""
    found = {_NAMES[tok].name: _NAMES[tok] for tok in _IDENT.findall(expr) if tok in _NAMES}
    return tuple(found[name] for name in sorted(found))


# --- series tiers (Config.rank_series) -------------------------------------------------------------
# "essential" exports per rank only the catalogue's `essential` specs, each per-rank histogram as its
# sum and count (`_bucket` keeps `le="+Inf"` alone), plus the job-level specs (`scope="job"`, once per
# job from rank 0, no rank label); "full" exports everything.
TIER_ESSENTIAL, TIER_FULL = "essential", "full"


def in_essential_tier(spec: MetricSpec, series: str = "") -> bool:
    """True when the essential tier exports `spec` as the series `series` (one of its names)."""
    if spec.scope == "job":
        return True
    bucket = spec.kind is Kind.HISTOGRAM and series.endswith("_bucket")
    return spec.essential and not bucket


def expr_tier(expr: str) -> str:
    """The tier an expression needs: "full" when it reads a series the essential tier leaves out,
    unless it also reads a job-level one. The queries here that read both are
    `<job-level> or <per-rank sum>`: the job's series serve every job in either tier (a single
    process exports them too), the per-rank sum ranks whose exchange is off (cross_rank=False: no
    job-level series)."""
    tokens = [tok for tok in _IDENT.findall(expr) if tok in _NAMES]
    if any(_NAMES[tok].scope == "job" for tok in tokens):
        return TIER_ESSENTIAL
    if all(in_essential_tier(_NAMES[tok], tok) for tok in tokens):
        return TIER_ESSENTIAL
    return TIER_FULL


def panel_tier(panel: PanelDef) -> str:
    return TIER_FULL if any(expr_tier(t.expr) == TIER_FULL for t in panel.targets) else TIER_ESSENTIAL


def _full_only_names(panel: PanelDef) -> list[str]:
    """Series of a full-tier panel that the essential tier does not export (for its description)."""
    names = {
        tok
        for t in panel.targets
        if expr_tier(t.expr) == TIER_FULL
        for tok in _IDENT.findall(t.expr)
        if tok in _NAMES and not in_essential_tier(_NAMES[tok], tok)
    }
    return sorted(names)


def panel_gpu_only(panel: PanelDef) -> bool:
    return any(spec.gpu_only for t in panel.targets for spec in specs_in(t.expr))


def panel_deepspeed_only(panel: PanelDef) -> bool:
    """A panel only a DeepSpeed job (integrations/deepspeed.py) fills."""
    specs = [spec for t in panel.targets for spec in specs_in(t.expr)]
    return bool(specs) and all(spec.name.startswith("deepspeed.") for spec in specs)


# --- the four dashboards --------------------------------------------------------------------------
_R = f"{RUN}, {ROLE}, {RANK}"
_GPU_BY = f"{RUN}, {ROLE}, {HOST}, {HW_ID}, {HW_NAME}"
_GPU_LEGEND = f"{{{{{HOST}}}}} {{{{{HW_ID}}}}}"


def _interval_targets(spec: MetricSpec) -> tuple[Target, ...]:
    """A per-step value's interval mean (averaged over ranks) and its steps' min, max and last."""
    stats = sc.INTERVAL_STAT_SPECS[spec.name]
    return (
        T(agg("avg", _RUN, selector(spec)), _lg(suffix=" mean")),
        T(agg("min", _RUN, selector(stats["min"])), _lg(suffix=" min")),
        T(agg("max", _RUN, selector(stats["max"])), _lg(suffix=" max")),
        T(agg("avg", _RUN, selector(stats["last"])), _lg(suffix=" last")),
    )


def _goodput_rolling_1h() -> str:
    """Each rank's share of the run's own time in the last hour spent in productive steps, as
    otel_train:goodput:rolling1h computes it: productive seconds in the hour over the hour, or over
    the run id's whole time (productive + badput) when that is shorter."""
    own = " + ".join(agg("sum", _R, selector(spec)) for spec in (sc.PRODUCTIVE_DURATION, sc.BADPUT_DURATION))
    productive = agg("sum", _R, rate(sc.PRODUCTIVE_DURATION, window="1h", fn="increase"))
    return f"clamp_max({productive} / (clamp_max({own}, 3600) > 0), 1)"


def _loss_targets() -> tuple[Target, ...]:
    """The job's loss (mean over every rank's values of the interval) and the smallest and largest
    step loss any rank recorded; per-rank series for a run without job-level ones."""
    stats = sc.INTERVAL_STAT_SPECS[sc.LOSS.name]
    job: dict[str, object] = {"rank": False, "host": False}
    return (
        T(job_or_ranks(agg("avg", _RUN, selector(sc.JOB_LOSS, **job)), agg("avg", _RUN, selector(sc.LOSS))),
          _lg(suffix=" mean")),
        T(job_or_ranks(agg("min", _RUN, selector(sc.JOB_LOSS_MIN, **job)), agg("min", _RUN, selector(stats["min"]))),
          _lg(suffix=" min")),
        T(job_or_ranks(agg("max", _RUN, selector(sc.JOB_LOSS_MAX, **job)), agg("max", _RUN, selector(stats["max"]))),
          _lg(suffix=" max")),
    )  # fmt: skip


def _lg(*labels: str, prefix: str = "", suffix: str = "") -> str:
    """Legend format such as `{{run_id}} {{role}}` or `{{run_id}} {{role}} rank {{rank}}` (the role
    is empty in a run without roles)."""
    parts = [f"{{{{{RUN}}}}}"] if RANK in labels else [f"{{{{{RUN}}}}} {{{{{ROLE}}}}}"]
    for name in labels:
        parts.append(f"{{{{{ROLE}}}}} rank {{{{{RANK}}}}}" if name == RANK else f"{{{{{name}}}}}")
    text = " ".join(parts)
    return f"{prefix}{text}{suffix}"


def overview() -> DashboardDef:
    step, job_step = sc.STEP_DURATION, sc.JOB_STEP_DURATION
    return DashboardDef(
        "otel-train-overview",
        "otel_train / Training overview",
        "Loss, evaluation, learning rate, throughput, MFU and step time of one or more runs.",
        (
            (
                "Progress",
                (
                    stat("Current step", T(agg("max", _RUN, selector(sc.CURRENT_STEP)), _lg()), unit="none"),
                    stat(
                        "Progress",
                        T(
                            f"{agg('max', _RUN, selector(sc.CURRENT_STEP))} / {agg('max', _RUN, selector(sc.TOTAL_STEPS))}",
                            _lg(),
                        ),
                        unit="percentunit",
                    ),
                    stat("ETA", T(agg("max", _RUN, selector(sc.ETA)), _lg()), unit="dtdurations"),
                    stat(
                        "Tokens/s (all ranks)",
                        T(
                            job_or_ranks(
                                agg("max", _RUN, selector(sc.JOB_TOKENS_RATE, rank=False, host=False)),
                                agg("sum", _RUN, rate(sc.TOKENS)),
                            ),
                            _lg(),
                        ),
                        unit="short",
                        description="Over rank 0's latest flush interval (job-level series).",
                    ),
                    stat(
                        "Ranks reporting",
                        T(
                            job_or_ranks(
                                agg("max", _RUN, selector(sc.JOB_RANKS, rank=False, host=False)),
                                agg("count", _RUN, agg("max", _R, selector(sc.STEPS))),
                            ),
                            _lg(),
                        ),
                        unit="none",
                        description="Ranks whose rows rank 0's latest flush took into the job-level "
                        "series (a distributed job; fewer than the world size: some ranks were late); for "
                        "ranks that do not exchange (cross_rank=False), the ranks whose step counters report.",
                    ),
                ),
            ),
            (
                "Loss and optimizer",
                (
                    ts(
                        "Training loss (interval mean over the ranks; the steps' min and max)",
                        *_loss_targets(),
                    ),
                    ts("Learning rate", T(agg("max", _RUN, selector(sc.LEARNING_RATE)), _lg())),
                    ts(
                        "Gradient norm (interval mean; its steps' min, max, last)",
                        *_interval_targets(sc.GRAD_NORM),
                    ),
                    ts("Eval loss", T(agg("avg", _RUN, selector(sc.EVAL_LOSS)), _lg())),
                    ts("Eval perplexity", T(agg("avg", _RUN, selector(sc.EVAL_PERPLEXITY)), _lg())),
                    ts(
                        "Eval accuracy",
                        T(agg("avg", _RUN, selector(sc.EVAL_ACCURACY)), _lg()),
                        unit="percentunit",
                    ),
                ),
            ),
            (
                "Throughput and efficiency",
                (
                    ts(
                        "Tokens/s",
                        T(job_rate(sc.JOB_TOKENS, sc.TOKENS), _lg()),
                        T(
                            agg("max", _RUN, selector(sc.JOB_TOKENS_RATE, rank=False, host=False)),
                            _lg(suffix=" (rank 0's flush interval)"),
                        ),
                    ),
                    ts(
                        "Samples/s",
                        T(job_rate(sc.JOB_SAMPLES, sc.SAMPLES), _lg()),
                        T(
                            agg("max", _RUN, selector(sc.JOB_SAMPLES_RATE, rank=False, host=False)),
                            _lg(suffix=" (rank 0's flush interval)"),
                        ),
                    ),
                    ts("Steps/s", T(agg("avg", _RUN, rate(sc.STEPS)), _lg())),
                    ts("MFU", T(agg("avg", _RUN, selector(sc.MFU)), _lg()), unit="percentunit", min_val=0),
                    ts(
                        "Achieved FLOP/s per GPU",
                        T(agg("avg", _RUN, selector(sc.FLOPS)), _lg()),
                        unit="flops",
                    ),
                    ts("ETA over time", T(agg("max", _RUN, selector(sc.ETA)), _lg()), unit="s"),
                ),
            ),
            (
                "Goodput",
                (
                    ts(
                        "Goodput",
                        T(agg("min", _RUN, selector(sc.GOODPUT)), _lg(suffix=" (worst rank)")),
                        unit="percentunit",
                        min_val=0,
                        description="Share of the job's wall time (all restarts of the run id) spent in "
                        "training steps; the rest is badput, broken down on the right.",
                    ),
                    ts(
                        "Badput by cause",
                        T(
                            agg("max", f"{RUN}, {ROLE}, {label(sc.BADPUT_CAUSE)}", rate(sc.BADPUT_DURATION)),
                            _lg(label(sc.BADPUT_CAUSE)),
                        ),
                        unit="percentunit",
                        description="Seconds of badput per second of wall time, per cause (worst rank): "
                        "startup, eval, checkpoint_save, checkpoint_restore, data, wasted_progress "
                        "(steps re-run after a restart), stall, restart, other.",
                    ),
                    ts(
                        "Goodput, rolling 1h",
                        T(agg("min", _RUN, _goodput_rolling_1h()), _lg(suffix=" (worst rank)")),
                        unit="percentunit",
                        min_val=0,
                        description="Share of the run's own time in the last hour spent in training "
                        "steps (the recording rule otel_train:goodput:rolling1h, computed here so the "
                        "panel works without it): productive step seconds in the hour over the hour, "
                        "or over the run's whole time for a run younger than that. A restart's gap "
                        "shows in the hour after it.",
                    ),
                    ts(
                        "Interruptions",
                        T(agg("max", _RUN, selector(sc.INTERRUPTIONS)), _lg()),
                        description="Restarts of the run id so far (job-wide count, kept across restarts).",
                    ),
                    ts(
                        "Step-time deviation",
                        T(agg("max", _R, selector(sc.STEP_DEVIATION)), _lg(RANK)),
                        unit="percentunit",
                        description="Each rank's mean step time of the interval against its typical one "
                        "(median of the last 100 intervals), minus 1: 0 = as usual, 0.25 = 25 % slower.",
                    ),
                ),
            ),
            (
                "Mixed precision and profiling",
                (
                    ts(
                        "Loss scale",
                        T(agg("min", _RUN, selector(sc.LOSS_SCALE)), _lg()),
                        description="GradScaler's loss scale (ot.watch(model, scaler=...)); it halves on every skipped step.",
                    ),
                    ts(
                        "Skipped optimizer steps",
                        T(agg("sum", _RUN, rate(sc.SKIPPED_STEPS, fn="increase")), _lg()),
                        description="Steps GradScaler skipped for inf/NaN gradients (ot.watch(model, scaler=...)).",
                    ),
                    ts(
                        "Profiled steps",
                        T(agg("sum", _RUN, rate(sc.PROFILED_STEPS, fn="increase")), _lg()),
                        description="Steps inside a run.profile window: step times there are skewed by the profiler.",
                    ),
                ),
            ),
            (
                "Model (ot.watch)",
                (
                    ts(
                        "Gradient norm by layer",
                        T(agg("max", f"{RUN}, {ROLE}, {LAYER}", selector(sc.LAYER_GRAD_NORM)), _lg(LAYER)),
                        description="Per-layer gradient L2 norm on watched steps (max over the selected ranks).",
                    ),
                    ts(
                        "Parameter norm by layer",
                        T(agg("max", f"{RUN}, {ROLE}, {LAYER}", selector(sc.LAYER_PARAM_NORM)), _lg(LAYER)),
                    ),
                    ts(
                        "Activation RMS by layer",
                        T(
                            agg("max", f"{RUN}, {ROLE}, {LAYER}", selector(sc.LAYER_ACTIVATION_RMS)),
                            _lg(LAYER),
                        ),
                        description="Only with ot.watch(model, activations=True).",
                    ),
                    ts(
                        "Activation abs-max by layer",
                        T(
                            agg("max", f"{RUN}, {ROLE}, {LAYER}", selector(sc.LAYER_ACTIVATION_ABSMAX)),
                            _lg(LAYER),
                        ),
                        description="Only with ot.watch(model, activations=True); watch for overflow in low precision.",
                    ),
                    ts("Parameter norm", T(agg("max", _RUN, selector(sc.PARAM_NORM)), _lg())),
                    ts(
                        "Data-parallel replicas",
                        T(
                            agg("max", _RUN, selector(sc.DATA_DUPLICATE_RANKS, rank=False)),
                            _lg(suffix=" ranks on duplicate batches"),
                        ),
                        T(
                            agg("max", _RUN, selector(sc.REPLICA_DIVERGENCE, rank=False)),
                            _lg(suffix=" replica divergence"),
                        ),
                        description="From ot.watch on every rank, compared by rank 0: ranks training on identical "
                        "batches (0 = data sharded) and the largest relative parameter-norm difference between "
                        "replicas (0 under healthy DDP; above 1e-4 a gradient sync failed).",
                    ),
                ),
            ),
            (
                "Step time",
                (
                    ts(
                        "Step time p50 / p95 / p99",
                        TX(job_quantile(0.5, job_step, step, _RUN), _lg(suffix=" p50")),
                        TX(job_quantile(0.95, job_step, step, _RUN), _lg(suffix=" p95")),
                        TX(job_quantile(0.99, job_step, step, _RUN), _lg(suffix=" p99")),
                        T(job_mean(job_step, step, _RUN), _lg(suffix=" mean")),
                        unit="s",
                        description="Every rank's steps (the job-level histogram). Dots are exemplars "
                        '(per-rank buckets, rank_series="full"): click one to open that sampled step\'s '
                        "trace in Tempo.",
                    ),
                    PanelDef(
                        "Step time distribution",
                        (
                            Target(
                                job_or_ranks(
                                    agg(
                                        "sum",
                                        "le",
                                        rate(job_step, "_bucket", fn="increase", rank=False, host=False),
                                    ),
                                    agg("sum", "le", rate(step, "_bucket", fn="increase")),
                                ),
                                "{{le}}",
                                fmt=PromQueryFormat.HEATMAP,
                            ),
                        ),
                        "heatmap",
                        unit="s",
                    ),
                    ts(
                        "Phase time p95 by phase",
                        TX(
                            job_quantile(
                                0.95, sc.JOB_PHASE_DURATION, sc.PHASE_DURATION, f"{RUN}, {ROLE}, {PHASE}"
                            ),
                            _lg(PHASE, suffix=" p95"),
                        ),
                        unit="s",
                        width=24,
                        description="Every rank's phases (the job-level histograms). Dots are exemplars "
                        '(per-rank buckets, rank_series="full"): click one to open the trace of a sampled step.',
                    ),
                ),
            ),
        ),
    )


def ranks() -> DashboardDef:
    step, phase, score, cross = sc.STEP_DURATION, sc.PHASE_DURATION, sc.STRAGGLER_SCORE, sc.PHASE_CROSS_RANK
    late, wait = sc.STRAGGLER_LATENESS, sc.STRAGGLER_WAIT
    slow_by = f"{RUN}, {HOST}, {ROLE}, {RANK}"
    score_by = f"{RUN}, {HOST}, {ROLE}, {RANK}, {STRAGGLER_KIND}"
    return DashboardDef(
        "otel-train-ranks",
        "otel_train / Ranks and stragglers",
        "Per-rank step and phase times, straggler scores and cross-rank spread.",
        (
            (
                "Per-rank times",
                (
                    ts("Mean step time by rank", T(mean(step, _R), _lg(RANK)), unit="s"),
                    ts("Step time p95 by rank", TX(quantile(0.95, step, _R), _lg(RANK)), unit="s"),
                    ts(
                        "Mean phase time by rank",
                        T(mean(phase, f"{_R}, {PHASE}"), _lg(RANK, PHASE)),
                        unit="s",
                        width=24,
                    ),
                    PanelDef(
                        "Mean step time per rank (heatmap)",
                        (Target(mean(step, f"{ROLE}, {RANK}"), f"{{{{{ROLE}}}}} {{{{{RANK}}}}}"),),
                        "heatmap",
                        unit="s",
                        width=24,
                        description="One row per rank; a straggler shows as a hot row.",
                    ),
                ),
            ),
            (
                "Stragglers",
                (
                    ts(
                        "Lateness by rank (the rank the others wait for is the high one)",
                        T(agg("max", _R, selector(late)), _lg(RANK)),
                        unit="s",
                        min_val=0,
                        description=(
                            "Per step, how much later than the other ranks this rank reaches the end of "
                            "its latest phase (median over the flush interval). Waiting ranks are on time: "
                            "0. Under DDP/FSDP the step and backward times of all ranks are equal or longer "
                            "on the waiters, so only lateness shows the culprit."
                        ),
                    ),
                    ts(
                        "Wait by rank (time per step spent waiting for the late rank)",
                        T(agg("max", _R, selector(wait)), _lg(RANK)),
                        unit="s",
                        min_val=0,
                        description="The cost of the straggler: what the other ranks lose per step.",
                    ),
                    ts(
                        "Straggler score (1 = healthy, lower = slower)",
                        T(
                            agg("min", f"{_R}, {STRAGGLER_KIND}", selector(score)),
                            _lg(RANK, STRAGGLER_KIND),
                        ),
                        unit="none",
                        min_val=0,
                        description=(
                            "relative = 1 - lateness / step time (1 for every rank that is on time, "
                            "waiters included); individual = own best / own time now (waiting excluded)."
                        ),
                    ),
                    table(
                        "Latest ranks (lateness per step)",
                        T(f"topk(8, {agg('max', slow_by, selector(late))})"),
                        unit="s",
                    ),
                    table(
                        "Lowest straggler scores",
                        T(f"bottomk(8, {agg('min', score_by, selector(score))})"),
                        unit="none",
                    ),
                ),
            ),
            (
                "Cross-rank statistics",
                (
                    ts(
                        "Cross-rank min / max of phase time",
                        T(_cross_rank(f"{RUN}, {ROLE}, {PHASE}, {STAT}", "~min|max"), _lg(PHASE, STAT)),
                        unit="s",
                    ),
                    ts(
                        "Cross-rank spread (max / min)",
                        T(
                            job_or_ranks(
                                f"{_stat(sc.JOB_PHASE_CROSS_RANK, 'max')} / {_stat(sc.JOB_PHASE_CROSS_RANK, 'min')}",
                                f"{_stat(cross, 'max')} / {_stat(cross, 'min')}",
                            ),
                            _lg(PHASE),
                        ),
                        unit="none",
                        description="1 = all ranks equally fast; 1.5 = the slowest rank takes 50% longer.",
                    ),
                    table(
                        "Slowest and fastest rank per phase",
                        T(_cross_rank(f"{RUN}, {ROLE}, {PHASE}, {STAT}", "~argmax_rank|argmin_rank")),
                        unit="none",
                        width=24,
                        description="Rank index with the longest (argmax_rank) and shortest (argmin_rank) mean phase time.",
                    ),
                ),
            ),
            _deepspeed_row(),
        ),
    )


def _stat(spec: MetricSpec, stat_value: str) -> str:
    return agg("max", f"{RUN}, {ROLE}, {PHASE}", selector(spec, rank=False, host=False, **{STAT: stat_value}))


def _cross_rank(by: str, stats: str) -> str:
    """Rank 0's cross-rank statistics of the phase times: the job-level series, or the per-rank
    exporter's (rank 0's, in the full tier) for a run without them."""
    return job_or_ranks(
        agg("max", by, selector(sc.JOB_PHASE_CROSS_RANK, rank=False, host=False, **{STAT: stats})),
        agg("max", by, selector(sc.PHASE_CROSS_RANK, rank=False, host=False, **{STAT: stats})),
    )


def _deepspeed_row() -> tuple[str, tuple[PanelDef, ...]]:
    """DeepSpeed jobs (integrations/deepspeed.py): each rank's ZeRO share, checked across ranks by
    the zero_partition health event, and DeepSpeed's comms logger when the user enabled it."""
    by_op = f"{RUN}, {ROLE}, {RANK}, {COLL_OP}"
    ds_size = label(sc.DS_COMM_SIZE)
    return (
        "DeepSpeed ZeRO and communication",
        (
            table(
                "ZeRO per rank",
                T(agg("max", _R, selector(sc.ZERO_STAGE)), "stage"),
                T(agg("max", _R, selector(sc.ZERO_DP_SIZE)), "dp size"),
                T(agg("max", _R, selector(sc.ZERO_MODEL_NUMEL)), "model elements"),
                T(agg("max", _R, selector(sc.ZERO_PARTITION_NUMEL)), "partition elements"),
                T(agg("max", _R, selector(sc.ZERO_PARAM_SHARD_NUMEL)), "ZeRO-3 shard elements"),
                width=24,
                description="Each rank should hold about model / dp size (a zero_partition event names the rank that does not).",
            ),
            ts(
                "Optimizer state per rank",
                T(agg("max", _R, selector(sc.ZERO_OPTIMIZER_STATE_BYTES)), _lg(RANK)),
                unit="bytes",
                description="Under ZeRO stage >= 1 each rank holds its share; one holding the whole state is a fault.",
            ),
            ts(
                "Collective latency by op (comms logger)",
                T(
                    f"{agg('sum', by_op, rate(sc.DS_COMM_TIME))} / {agg('sum', by_op, rate(sc.DS_COMM_COUNT))}",
                    _lg(RANK, COLL_OP),
                ),
                unit="s",
                description="Mean latency DeepSpeed measured per collective (its comms logger syncs after each op).",
            ),
            ts(
                "Collectives/s by op (comms logger)",
                T(agg("sum", by_op, rate(sc.DS_COMM_COUNT)), _lg(RANK, COLL_OP)),
            ),
            ts(
                "Message bytes/s by size class (comms logger)",
                T(
                    agg("sum", f"{RUN}, {ROLE}, {COLL_OP}, {ds_size}", rate(sc.DS_COMM_BYTES)),
                    _lg(COLL_OP, ds_size),
                ),
                unit="Bps",
            ),
            ts(
                "Bus bandwidth by op (comms logger)",
                T(agg("avg", by_op, selector(sc.DS_COMM_BUSBW)), _lg(RANK, COLL_OP)),
                unit="Gbits",
            ),
        ),
    )


def gpus_host() -> DashboardDef:
    host_by = f"{RUN}, {HOST}, {ROLE}, {RANK}"
    return DashboardDef(
        "otel-train-gpus-host",
        "otel_train / GPUs and host",
        "GPU utilization, memory, temperature, power, energy, throttling, clocks; host CPU and memory.",
        (
            (
                "GPU",
                (
                    ts(
                        "GPU utilization",
                        T(agg("max", _GPU_BY, selector(sc.GPU_UTILIZATION)), _GPU_LEGEND),
                        unit="percentunit",
                        min_val=0,
                    ),
                    ts(
                        "GPU memory controller busy",
                        T(agg("max", _GPU_BY, selector(sc.GPU_MEMORY_CONTROLLER)), _GPU_LEGEND),
                        unit="percentunit",
                        min_val=0,
                        description="Fraction of time the memory controller was busy (NVML; an "
                        "otel_train extension). Not memory use: that is the next panels.",
                    ),
                    ts(
                        "GPU memory used",
                        T(agg("max", _GPU_BY, selector(sc.GPU_MEMORY_USAGE)), _GPU_LEGEND),
                        T(agg("max", _GPU_BY, selector(sc.GPU_MEMORY_LIMIT)), f"{_GPU_LEGEND} total"),
                        unit="bytes",
                    ),
                    ts(
                        "GPU memory used (fraction of total)",
                        T(agg("max", _GPU_BY, selector(sc.GPU_MEMORY_UTILIZATION)), _GPU_LEGEND),
                        unit="percentunit",
                        min_val=0,
                        description="hw.gpu.memory.utilization: memory used / memory total.",
                    ),
                    ts(
                        "GPU temperature",
                        T(agg("max", _GPU_BY, selector(sc.GPU_TEMPERATURE)), _GPU_LEGEND),
                        unit="celsius",
                    ),
                    ts("GPU power", T(agg("max", _GPU_BY, selector(sc.GPU_POWER)), _GPU_LEGEND), unit="watt"),
                    ts(
                        "GPU energy rate",
                        T(agg("max", _GPU_BY, rate(sc.GPU_ENERGY)), _GPU_LEGEND),
                        unit="watt",
                        description="Rate of the driver's energy counter (average power).",
                    ),
                    ts(
                        "GPU throttle / clock-event reasons",
                        T(
                            agg("max", f"{_GPU_BY}, {THROTTLE_REASON}", selector(sc.GPU_THROTTLE)),
                            f"{_GPU_LEGEND} {{{{{THROTTLE_REASON}}}}}",
                        ),
                        unit="none",
                    ),
                    ts(
                        "GPU clocks",
                        T(agg("max", _GPU_BY, selector(sc.GPU_CLOCK_SM)), f"{_GPU_LEGEND} SM"),
                        T(agg("max", _GPU_BY, selector(sc.GPU_CLOCK_MEMORY)), f"{_GPU_LEGEND} memory"),
                        unit="hertz",
                    ),
                    ts(
                        "PCIe throughput",
                        T(
                            agg("max", f"{_GPU_BY}, {DIRECTION}", rate(sc.GPU_IO)),
                            f"{_GPU_LEGEND} {{{{{DIRECTION}}}}}",
                        ),
                        unit="Bps",
                        description="Rate of hw.gpu.io (bytes over PCIe, integrated from NVML's "
                        "throughput samples).",
                    ),
                    ts(
                        "GPU errors",
                        T(
                            agg("sum", f"{_GPU_BY}, {ERROR_TYPE}", rate(sc.GPU_ERRORS, fn="increase")),
                            f"{_GPU_LEGEND} {{{{{ERROR_TYPE}}}}}",
                        ),
                        unit="short",
                    ),
                ),
            ),
            (
                "Energy",
                (
                    ts(
                        "Energy per token",
                        T(agg("avg", _RUN, selector(sc.ENERGY_PER_TOKEN)), _lg()),
                        unit="joule",
                    ),
                    ts(
                        "Energy per step",
                        T(agg("avg", _RUN, selector(sc.ENERGY_PER_STEP)), _lg()),
                        unit="joule",
                    ),
                    ts(
                        "Average GPU power by rank",
                        T(agg("max", _R, selector(sc.POWER_AVERAGE)), _lg(RANK)),
                        unit="watt",
                    ),
                ),
            ),
            (
                "CUDA allocator",
                (
                    ts(
                        "CUDA memory by rank",
                        T(agg("max", _R, selector(sc.CUDA_MEMORY_ALLOCATED)), _lg(RANK, suffix=" allocated")),
                        T(agg("max", _R, selector(sc.CUDA_MEMORY_RESERVED)), _lg(RANK, suffix=" reserved")),
                        T(agg("max", _R, selector(sc.CUDA_MEMORY_PEAK)), _lg(RANK, suffix=" peak")),
                        unit="bytes",
                    ),
                    ts(
                        "CUDA allocator retries and OOMs",
                        T(
                            agg("sum", _R, rate(sc.CUDA_ALLOC_RETRIES, fn="increase")),
                            _lg(RANK, suffix=" retries"),
                        ),
                        T(agg("sum", _R, rate(sc.CUDA_OOMS, fn="increase")), _lg(RANK, suffix=" OOMs")),
                        unit="short",
                    ),
                    ts(
                        "MPS memory by rank (Apple silicon)",
                        T(agg("max", _R, selector(sc.MPS_MEMORY_ALLOCATED)), _lg(RANK, suffix=" allocated")),
                        T(agg("max", _R, selector(sc.MPS_MEMORY_DRIVER)), _lg(RANK, suffix=" driver")),
                        T(
                            agg("max", _R, selector(sc.MPS_MEMORY_LIMIT)),
                            _lg(RANK, suffix=" recommended max"),
                        ),
                        unit="bytes",
                    ),
                ),
            ),
            (
                "Host",
                (
                    ts(
                        "Process CPU (share of its CPUs)",
                        T(agg("max", host_by, selector(sc.PROCESS_CPU_UTILIZATION)), _lg(HOST, RANK)),
                        unit="percentunit",
                        min_val=0,
                        width=8,
                    ),
                    ts(
                        "Process resident memory",
                        T(agg("max", host_by, selector(sc.PROCESS_MEMORY_USAGE)), _lg(HOST, RANK)),
                        unit="bytes",
                        width=8,
                    ),
                    ts(
                        "Host memory by state",
                        T(
                            agg(
                                "max",
                                f"{RUN}, {ROLE}, {HOST}, {MEMORY_STATE}",
                                selector(sc.SYSTEM_MEMORY_USAGE, rank=False),
                            ),
                            _lg(HOST, MEMORY_STATE),
                        ),
                        unit="bytes",
                        width=8,
                    ),
                ),
            ),
        ),
    )


def health() -> DashboardDef:
    stale = ((None, "green"), (120.0, "orange"), (600.0, "red"))
    return DashboardDef(
        "otel-train-health",
        "otel_train / Health",
        "Stalls, non-finite losses, loss spikes and other health events, dropped measurements, firing alerts.",
        (
            (
                "Liveness",
                (
                    stat(
                        "Time since last step (slowest rank)",
                        T(f"time() - {agg('min', _RUN, selector(sc.LAST_STEP_TIME))}", _lg()),
                        unit="s",
                        thresholds=stale,
                    ),
                    stat(
                        "Non-finite losses in range",
                        T(agg("sum", _RUN, rate(sc.NONFINITE_LOSS, window=RANGE, fn="increase")), _lg()),
                        unit="short",
                        thresholds=((None, "green"), (1.0, "red")),
                    ),
                    stat(
                        "Health events in range",
                        T(agg("sum", _RUN, rate(sc.HEALTH_EVENTS, window=RANGE, fn="increase")), _lg()),
                        unit="short",
                        thresholds=((None, "green"), (1.0, "orange")),
                    ),
                    stat(
                        "Dropped measurements in range",
                        T(agg("sum", _RUN, rate(sc.DROPPED, window=RANGE, fn="increase")), _lg()),
                        unit="short",
                        thresholds=((None, "green"), (1.0, "orange")),
                    ),
                    ts(
                        "Time since last step by rank (stall)",
                        T(f"time() - {agg('max', _R, selector(sc.LAST_STEP_TIME))}", _lg(RANK)),
                        unit="s",
                        thresholds=stale,
                    ),
                    ts(
                        "Step rate by rank (0 = stalled)",
                        T(agg("sum", _R, rate(sc.STEPS)), _lg(RANK)),
                        unit="short",
                    ),
                    ts(
                        "Stalled for, by rank (0 = progressing, evaluating, saving or paused)",
                        T(agg("max", _R, selector(sc.STALL_DURATION)), _lg(RANK)),
                        unit="s",
                        thresholds=((None, "green"), (1.0, "red")),
                        description="The rank's watchdog: no step or eval batch for stall_timeout_s "
                        "(checkpoint_timeout_s in a save). TrainingRankStalled and TrainingStalled read it.",
                    ),
                ),
            ),
            (
                "Numerics and events",
                (
                    ts(
                        "Non-finite losses by rank",
                        T(agg("sum", _R, rate(sc.NONFINITE_LOSS, fn="increase")), _lg(RANK)),
                        unit="short",
                    ),
                    ts(
                        "Training loss by rank",
                        T(agg("max", _R, selector(sc.LOSS)), _lg(RANK, suffix=" interval mean")),
                        T(
                            agg("max", _R, selector(sc.INTERVAL_STAT_SPECS[sc.LOSS.name]["last"])),
                            _lg(RANK, suffix=" last step"),
                        ),
                    ),
                    ts(
                        "Health events by kind (loss spikes, stalls, stragglers, ...)",
                        T(
                            agg("sum", f"{RUN}, {ROLE}, {EVENT}", rate(sc.HEALTH_EVENTS, fn="increase")),
                            _lg(EVENT),
                        ),
                        unit="short",
                    ),
                    table(
                        "Health events in range by rank",
                        T(agg("sum", f"{_R}, {EVENT}", rate(sc.HEALTH_EVENTS, window=RANGE, fn="increase"))),
                        unit="short",
                    ),
                ),
            ),
            (
                "Collectives (PyTorch Flight Recorder: TORCH_FR_BUFFER_SIZE)",
                (
                    ts(
                        "Seconds since last collective by rank, while waiting in one or stalled",
                        T(agg("max", _R, selector(sc.COLLECTIVE_LAST)), _lg(RANK)),
                        unit="s",
                        thresholds=((None, "green"), (60.0, "orange"), (300.0, "red")),
                        description="Since this rank last enqueued or completed a collective, while one "
                        "is pending or the rank is stalled (else 0); the `hang` event and `otel-train "
                        "diagnose` name the rank the others wait for.",
                    ),
                    ts(
                        "Collectives per second by process group and op",
                        T(
                            agg("max", f"{RUN}, {ROLE}, {COLL_GROUP}, {COLL_OP}", rate(sc.COLLECTIVE_COUNT)),
                            _lg(COLL_GROUP, COLL_OP),
                        ),
                        unit="short",
                    ),
                    ts(
                        "Collective input bytes per second by rank",
                        T(agg("sum", _R, rate(sc.COLLECTIVE_SIZE)), _lg(RANK)),
                        unit="Bps",
                    ),
                    ts(
                        "Share of time in collectives by rank (NCCL timing)",
                        T(agg("sum", _R, rate(sc.COLLECTIVE_TIME)), _lg(RANK)),
                        unit="percentunit",
                        description="Needs TORCH_NCCL_ENABLE_TIMING=1; gloo records no durations.",
                    ),
                ),
            ),
            (
                "Telemetry and alerts",
                (
                    ts(
                        "Dropped measurements by reason",
                        T(agg("sum", f"{_R}, {REASON}", rate(sc.DROPPED, fn="increase")), _lg(RANK, REASON)),
                        unit="short",
                    ),
                    table(
                        "Firing alerts",
                        T(
                            agg(
                                "max",
                                f"alertname, severity, {RUN}, {HOST}, {ROLE}, {RANK}",
                                f'{ALERTS}{{alertstate="firing", {RUN}=~"${VAR_RUN}"}}',
                            )
                        ),
                        description="Prometheus' ALERTS series (otel_train alert rules and any others carrying run_id).",
                    ),
                ),
            ),
        ),
    )


DASHBOARDS = (overview, ranks, gpus_host, health)


# --- rendering ------------------------------------------------------------------------------------
def _variable(
    name: str, text: str, label_name: str, previous: Sequence[tuple[str, str, str]]
) -> QueryVariable:
    # The steps counter exists on every rank of every run, on both export paths.
    filters = ", ".join(f'{lbl}=~"${var}"' for var, _, lbl in previous)
    source = sc.STEPS.prometheus_name + (f"{{{filters}}}" if filters else "")
    sort = VariableSort.NUMERICAL_ASC if name == VAR_RANK else VariableSort.ALPHABETICAL_ASC
    return (
        QueryVariable(name)
        .label(text)
        .query(f"label_values({source}, {label_name})")
        .datasource(DS)
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(sort)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(VariableOption(selected=True, text="All", value="$__all"))
    )


def _description(panel: PanelDef) -> str:
    specs = [s for t in panel.targets for s in specs_in(t.expr)]
    seen: dict[str, MetricSpec] = {s.name: s for s in specs}
    lines = [panel.description] if panel.description else []
    lines += [f"`{s.name}`: {s.description}" for s in seen.values()]
    if panel_gpu_only(panel):
        lines.append(GPU_NOTE)
    if panel_tier(panel) == TIER_FULL:
        names = ", ".join(f"`{n}`" for n in _full_only_names(panel))
        lines.append(
            f'Needs rank_series="full": empty in the essential tier, which exports no {names} per rank.'
        )
    return "\n".join(lines)


def _render_panel(panel: PanelDef, panel_id: int) -> object:
    if panel.viz == "timeseries":
        builder: object = TimeseriesPanel()
    elif panel.viz == "stat":
        builder = (
            StatPanel()
            .graph_mode(BigValueGraphMode.AREA)
            .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]))
        )
    elif panel.viz == "table":
        builder = TablePanel()
    elif panel.viz == "heatmap":
        builder = HeatmapPanel().calculate(False)
        if all(t.fmt is not PromQueryFormat.HEATMAP for t in panel.targets):  # one row per series
            # the y axis names the series (ranks); the unit is the cells' (the panel's unit)
            builder = builder.rows_frame(RowsHeatmapOptions().layout(HeatmapCellLayout.UNKNOWN))
        else:  # one row per bucket: the y axis is the buckets' bounds, in the panel's unit
            builder = builder.y_axis(YAxisConfig().unit(panel.unit))
    else:
        raise ValueError(panel.viz)
    b = builder  # type: ignore[assignment]
    b = (
        b.id(panel_id)  # type: ignore[attr-defined]
        .title(panel.title)
        .description(_description(panel))
        .datasource(DS)
        .unit(panel.unit)
        .span(panel.width)
        .height(panel.height)
    )
    if panel.min_val is not None:
        b = b.min(panel.min_val)
    if panel.thresholds:
        steps = [Threshold(value=v, color=c) for v, c in panel.thresholds]
        b = b.thresholds(ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps(steps))
    for i, target in enumerate(panel.targets):
        q = Dataquery().expr(target.expr).ref_id(chr(ord("A") + i)).datasource(DS).format(target.fmt)
        q = q.legend_format(target.legend) if target.legend else q
        q = q.exemplar(True) if target.exemplar else q
        q = q.instant() if target.instant else q.range()
        b = b.with_target(q)
    return b


def build_dashboard(spec: DashboardDef) -> object:
    dash = (
        Dashboard(spec.title)
        .uid(spec.uid)
        .description(spec.description)
        .tags(TAGS)
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .links(
            [
                DashboardLink("otel_train")
                .type(DashboardLinkType.DASHBOARDS)
                .tags(["otel_train"])
                .as_dropdown(True)
                .include_vars(True)
                .keep_time(True)
            ]
        )
        .with_variable(DatasourceVariable("datasource").label("Data source").type("prometheus"))
    )
    for i, (name, text, lbl) in enumerate(VARIABLES):
        dash = dash.with_variable(_variable(name, text, lbl, VARIABLES[:i]))
    panel_id = 0
    for row_title, panels in spec.rows:
        panel_id += 1
        dash = dash.with_row(Row(row_title).id(panel_id))
        for panel in panels:
            panel_id += 1
            dash = dash.with_panel(_render_panel(panel, panel_id))  # type: ignore[arg-type]
    return dash.build()


def render(spec: DashboardDef) -> str:
    return JSONEncoder(sort_keys=True, indent=2).encode(build_dashboard(spec)) + "\n"


def dashboard_defs() -> list[DashboardDef]:
    return [make() for make in DASHBOARDS]


class DashboardQuery(NamedTuple):
    uid: str
    title: str
    expr: str
    gpu_only: bool
    deepspeed_only: bool = False
    tier: str = TIER_ESSENTIAL  # the series tier the panel needs (TIER_ESSENTIAL: both)


def all_queries() -> list[DashboardQuery]:
    """Every (dashboard uid, panel title, PromQL expr, gpu_only, deepspeed_only, tier) in the
    generated dashboards."""
    return [
        DashboardQuery(d.uid, p.title, t.expr, panel_gpu_only(p), panel_deepspeed_only(p), panel_tier(p))
        for d in dashboard_defs()
        for p in d.panels()
        for t in p.targets
    ]


def generate(out_dir: Path) -> dict[Path, str]:
    """Write every dashboard to `out_dir/<uid>.json`; returns {path: text}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for spec in dashboard_defs():
        path = out_dir / f"{spec.uid}.json"
        text = render(spec)
        path.write_text(text, encoding="utf-8")
        written[path] = text
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=JSON_DIR, help="output directory (default: dashboards/json)"
    )
    parser.add_argument("--check", action="store_true", help="fail when the JSON in --out is stale")
    args = parser.parse_args(argv)
    expected = {f"{d.uid}.json": render(d) for d in dashboard_defs()}
    if args.check:
        present = {p.name: p.read_text(encoding="utf-8") for p in sorted(args.out.glob("*.json"))}
        if present != expected:
            stale = sorted(
                set(present) ^ set(expected) | {k for k in expected if present.get(k) != expected[k]}
            )
            print(
                f"stale dashboards in {args.out}: {', '.join(stale)}; run `make dashboards`", file=sys.stderr
            )
            return 1
        return 0
    for path in args.out.glob("*.json"):  # drop dashboards that no longer exist
        if path.name not in expected:
            path.unlink()
    written = generate(args.out)
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
