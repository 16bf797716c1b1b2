"""Generated Grafana dashboards: fresh, catalogue-derived, well-formed, and every query returns data.

The integration test starts a real Prometheus that scrapes a fake pull endpoint serving every
non-GPU catalogue metric for two runs, one with the in-process pull endpoint's names and one with
the OTel Collector's (`_ratio` on unit-"1" gauges), and evaluates every non-GPU dashboard query
against each run through `/api/v1/query`.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from helpers.dashboard_queries import (
    DashboardQuery,
    all_queries,
    assert_all_queries_return_data,
    instant_query,
    query_failures,
    substitute_variables,
)
from helpers.pinned import require_binary
from helpers.ports import free_port

from dashboards import build
from otel_train import semconv as sc
from otel_train.semconv import Kind, MetricSpec

JSON_DIR = Path(build.__file__).resolve().parent / "json"
REQUIRED_VARIABLES = {"datasource", "run_id", "rank", "host"}


def _committed() -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(JSON_DIR.glob("*.json"))}


def _dashboards() -> dict[str, dict]:
    return {name: json.loads(data) for name, data in _committed().items()}


def _panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # collapsed rows nest their panels


# --- (a) staleness ---------------------------------------------------------------------------------
def test_committed_json_is_fresh(tmp_path: Path) -> None:
    build.generate(tmp_path)
    fresh = {p.name: p.read_bytes() for p in sorted(tmp_path.glob("*.json"))}
    committed = _committed()
    stale = sorted(set(fresh) ^ set(committed) | {n for n in fresh if fresh[n] != committed.get(n)})
    assert not stale, f"dashboards/json is stale ({', '.join(stale)}): run `make dashboards`"


def test_generation_is_deterministic(tmp_path: Path) -> None:
    first = {p.name: p.read_bytes() for p in build.generate(tmp_path / "a")}
    second = {p.name: p.read_bytes() for p in build.generate(tmp_path / "b")}
    assert first == second


# --- (b) every metric name is catalogue-derived ------------------------------------------------------
_FUNCTIONS = {
    "rate", "increase", "irate", "delta", "histogram_quantile", "time", "vector", "abs", "clamp_min",
    "clamp_max", "sum", "avg", "min", "max", "count", "topk", "bottomk", "quantile", "stddev",
    "label_values",
}  # fmt: skip
_KEYWORDS = {"and", "or", "unless", "bool", "offset"}
_AGGREGATIONS = ("sum", "avg", "min", "max", "count", "quantile", "stddev", "stdvar", "group")


def _catalogue_names() -> dict[str, MetricSpec]:
    names: dict[str, MetricSpec] = {}
    for spec in sc.CATALOGUE:
        bases = {spec.prometheus_name, spec.collector_prometheus_name}
        for base in bases:
            suffixes = ("_bucket", "_sum", "_count") if spec.kind is Kind.HISTOGRAM else ("",)
            for suffix in suffixes:
                names[base + suffix] = spec
    return names


CATALOGUE_NAMES = _catalogue_names()
TWO_NAMED = {s.name for s in sc.CATALOGUE if s.prometheus_name != s.collector_prometheus_name}


def parse_metric_names(expr: str) -> tuple[list[str], list[str]]:
    """(bare metric names, `__name__=~` regexes) referenced by a PromQL expression."""
    regexes = re.findall(r'__name__\s*=~\s*"([^"]*)"', expr)
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors
    text = re.sub(r"\boffset\s+-?\w+", " ", text)  # offset modifiers (`offset 1h`)
    text = re.sub(r"\{[^}]*\}", "{}", text)  # label matchers
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"(?<![\w.])\d+(\.\d+)?([eE][+-]?\d+)?", " ", text)  # numbers
    names = []
    for match in re.finditer(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\()?", text):
        token, call = match.group(1), match.group(2)
        if token in _KEYWORDS:  # `x or (y)`: a binary operator before a parenthesis, not a call
            continue
        if call:
            assert token in _FUNCTIONS, f"unknown PromQL function {token!r} in {expr!r}"
        else:
            names.append(token)
    return names, regexes


def _check_names(expr: str) -> None:
    names, regexes = parse_metric_names(expr)
    assert names or regexes, f"no metric in {expr!r}"
    for name in names:
        if name == build.ALERTS:
            continue
        assert name in CATALOGUE_NAMES, f"{name!r} is not a catalogue-derived series name ({expr!r})"
        spec = CATALOGUE_NAMES[name]
        assert spec.name not in TWO_NAMED, (
            f"{name!r} (unit-1 gauge) differs between export paths; use "
            f'{{__name__=~"{spec.prometheus_name}(_ratio)?"}} ({expr!r})'
        )
    for regex in regexes:
        matched = {spec.name for n, spec in CATALOGUE_NAMES.items() if re.fullmatch(regex, n)}
        assert len(matched) == 1, f"__name__ regex {regex!r} must match exactly one metric, got {matched}"
        spec = sc.BY_NAME[matched.pop()]
        assert spec.name in TWO_NAMED, f"{regex!r}: {spec.name} has one name; select it by name"
        assert regex == f"{spec.prometheus_name}(_ratio)?", regex
        assert re.fullmatch(regex, spec.prometheus_name) and re.fullmatch(
            regex, spec.collector_prometheus_name
        )


def _all_json_exprs() -> list[tuple[str, str, str]]:
    out = []
    for file_name, dash in _dashboards().items():
        for panel in _panels(dash):
            for target in panel.get("targets", []):
                out.append((file_name, panel["title"], target["expr"]))
    return out


def test_every_metric_name_is_catalogue_derived() -> None:
    exprs = [expr for _, _, expr in _all_json_exprs()] + [q.expr for q in all_queries()]
    assert len(exprs) >= 100
    for expr in exprs:
        _check_names(expr)


def test_variable_queries_are_catalogue_derived() -> None:
    for dash in _dashboards().values():
        for var in dash["templating"]["list"]:
            if var["type"] == "query":
                match = re.fullmatch(r"label_values\((.*), (\w+)\)", var["query"])
                assert match, var["query"]
                _check_names(match.group(1))


def test_queries_aggregate_explicitly() -> None:
    for _, title, expr in _all_json_exprs():
        assert " by (" in expr, f"{title}: aggregate with an explicit `by (...)`: {expr}"
        bare = re.search(rf"\b({'|'.join(_AGGREGATIONS)})\s*\(", expr)
        assert bare is None, f"{title}: aggregation without `by (...)`: {expr}"


def test_unit_one_gauges_use_the_alternation() -> None:
    assert {
        s.name for s in sc.CATALOGUE if s.unit == "1" and s.kind in (Kind.GAUGE, Kind.OBSERVABLE_GAUGE)
    } == TWO_NAMED
    for spec in sc.CATALOGUE:
        sel = build.selector(spec)
        if spec.name in TWO_NAMED:
            assert sel.startswith(f'{{__name__=~"{spec.prometheus_name}(_ratio)?", ')
        else:
            assert sel.startswith(spec.prometheus_name + "{")


def test_every_catalogue_metric_has_a_panel() -> None:
    used = {spec.name for q in all_queries() for spec in build.specs_in(q.expr)}
    missing = sorted({s.name for s in sc.CATALOGUE} - used)
    assert not missing, f"catalogue metrics without a dashboard panel: {missing}"


def test_gpu_only_marking_follows_the_catalogue() -> None:
    for q in all_queries():
        specs = build.specs_in(q.expr)
        panel_specs = [
            s for p in all_queries() if (p.uid, p.title) == (q.uid, q.title) for s in build.specs_in(p.expr)
        ]
        assert q.gpu_only == any(s.gpu_only for s in panel_specs), (q.title, [s.name for s in specs])
    assert any(q.gpu_only for q in all_queries()) and not all(q.gpu_only for q in all_queries())


# --- (c) well-formed JSON ----------------------------------------------------------------------------
def test_dashboards_are_well_formed() -> None:
    dashboards = _dashboards()
    assert len(dashboards) == 4
    uids = [d["uid"] for d in dashboards.values()]
    assert len(set(uids)) == len(uids)
    for file_name, dash in dashboards.items():
        assert file_name == f"{dash['uid']}.json"
        assert "apiVersion" not in dash and "spec" not in dash, "plain dashboard JSON, not a k8s Manifest"
        variables = {v["name"]: v for v in dash["templating"]["list"]}
        assert set(variables) >= REQUIRED_VARIABLES, f"{file_name}: variables {sorted(variables)}"
        assert variables["run_id"]["multi"] and variables["run_id"]["includeAll"]
        assert variables["datasource"]["query"] == "prometheus"
        ids, titles = [], []
        for panel in _panels(dash):
            ids.append(panel["id"])
            if panel["type"] == "row":
                continue
            titles.append(panel["title"])
            assert panel["datasource"]["uid"] == "${datasource}"
            targets = panel.get("targets") or []
            assert targets, f"{file_name}: panel {panel['title']!r} has no target"
            for target in targets:
                assert target["expr"].strip(), f"{file_name}: {panel['title']!r} has an empty expr"
                assert target["datasource"]["uid"] == "${datasource}"
            assert len({t["refId"] for t in targets}) == len(targets)
        assert len(set(ids)) == len(ids), f"{file_name}: duplicate panel ids"
        assert len(set(titles)) == len(titles), f"{file_name}: duplicate panel titles"


def test_latency_panels_request_exemplars() -> None:
    """Step- and phase-latency panels over histogram buckets ask Prometheus for exemplars (trace ids
    of sampled steps, linked to Tempo by the Prometheus datasource); other queries do not."""
    buckets = {f"{sc.STEP_DURATION.prometheus_name}_bucket", f"{sc.PHASE_DURATION.prometheus_name}_bucket"}
    with_exemplars: dict[str, set[str]] = {}
    for file_name, dash in _dashboards().items():
        for panel in _panels(dash):
            for target in panel.get("targets", []):
                reads_buckets = bool(buckets & set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", target["expr"])))
                if target.get("exemplar"):
                    assert reads_buckets and panel["type"] == "timeseries", (file_name, panel["title"])
                    with_exemplars.setdefault(file_name, set()).add(target["expr"])
    overview = with_exemplars.get("otel-train-overview.json", set())
    assert any(f"{sc.STEP_DURATION.prometheus_name}_bucket" in e for e in overview), with_exemplars
    assert any(f"{sc.PHASE_DURATION.prometheus_name}_bucket" in e for e in overview), with_exemplars
    assert with_exemplars.get("otel-train-ranks.json"), with_exemplars
    datasources = (
        Path(__file__).resolve().parents[2] / "deploy/grafana/provisioning/datasources/otel_train.yaml"
    )
    (prom,) = [d for d in yaml.safe_load(datasources.read_text())["datasources"] if d["type"] == "prometheus"]
    # the label the collector's OpenMetrics exemplars carry
    assert prom["jsonData"]["exemplarTraceIdDestinations"] == [{"name": "trace_id", "datasourceUid": "tempo"}]


def test_sdk_decodes_the_json() -> None:
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models.dashboard import Dashboard

    register_default_plugins()
    for file_name, dash in _dashboards().items():
        model = Dashboard.from_json(dash)
        assert model.uid == dash["uid"] and len(model.panels or []) == len(dash["panels"]), file_name


def test_all_queries_matches_the_json() -> None:
    from_json = sorted((f.removesuffix(".json"), title, expr) for f, title, expr in _all_json_exprs())
    exported = sorted((q.uid, q.title, q.expr) for q in all_queries())
    assert from_json == exported


def test_substitute_variables() -> None:
    expr = 'rate(x{run_id=~"$run_id", rank=~"${rank}"}[$__rate_interval]) / y[$__range]'
    assert substitute_variables(expr, {"run_id": "r1"}) == 'rate(x{run_id=~"r1", rank=~".*"}[1m]) / y[5m]'


# --- (d) every non-GPU query returns data from a real Prometheus -------------------------------------
RUNS = {"run-pull": False, "run-collector": True}  # run id -> Collector naming
RANKS = (0, 1, 2, 3)
ATTRIBUTE_VALUES: dict[str, tuple[str, ...]] = {
    sc.PHASE: ("data", "forward", "backward", "optimizer"),
    sc.STRAGGLER_KIND: ("relative", "individual"),
    sc.STAT: ("min", "max", "mean", "median", "argmin_rank", "argmax_rank"),
    sc.EVENT: ("loss_spike", "straggler"),
    sc.REASON: ("queue_full", "bad_value"),
    sc.MEMORY_STATE: ("used", "free"),
}
OPTIONAL_ATTRIBUTES = {sc.ERROR_TYPE}  # only present on errors


class FakeTrainingEndpoint:
    """A prometheus_client collector that serves every catalogue metric for 2 runs x 4 ranks.

    Generated from the catalogue (kind, unit, attributes, buckets), so a new metric is covered as
    soon as it is added.  Rank 3 is a straggler (1.5x slower).  Counters grow with wall time.
    Job-level metrics (`scope="job"`) come once per run, without rank labels, as rank 0 exports them.
    `tier="essential"` serves what that series tier exports: the essential and job-level metrics,
    an essential per-rank histogram as its `+Inf` bucket, sum and count.
    """

    def __init__(self, tier: str = build.TIER_FULL) -> None:
        self.start = time.time()
        self.tier = tier

    def collect(self):  # type: ignore[no-untyped-def]
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
            Metric,
        )

        now = time.time()
        elapsed = now - self.start + 1.0
        for spec in sc.CATALOGUE:
            if self.tier == build.TIER_ESSENTIAL and not build.in_essential_tier(spec):
                continue
            job = spec.scope == "job"
            attrs = [a for a in spec.attributes if a not in OPTIONAL_ATTRIBUTES]
            for run_id, collector in RUNS.items():
                name = spec.collector_prometheus_name if collector else spec.prometheus_name
                labels = [build.label(k) for k in (*sc.LABEL_RESOURCE_KEYS, *attrs)]
                family: Metric
                if spec.kind is Kind.HISTOGRAM:
                    family = HistogramMetricFamily(name, spec.description, labels=labels)
                elif spec.kind in (Kind.COUNTER, Kind.OBSERVABLE_COUNTER):
                    family = CounterMetricFamily(name.removesuffix("_total"), spec.description, labels=labels)
                else:
                    family = GaugeMetricFamily(name, spec.description, labels=labels)
                for rank in RANKS[:1] if job else RANKS:
                    for combo in _combinations([ATTRIBUTE_VALUES.get(a, ("other",)) for a in attrs]):
                        identity = {
                            sc.RUN_ID: run_id,
                            sc.RANK: "" if job else str(rank),
                            "local_rank": "" if job else str(rank % 2),
                            "host.name": "" if job else f"node-{rank // 2}",
                        }
                        values = [*(identity.get(k, "other") for k in sc.LABEL_RESOURCE_KEYS), *combo]
                        self._add(
                            family, spec, rank, dict(zip(attrs, combo, strict=True)), values, now, elapsed
                        )
                yield family

    def _add(
        self, family, spec: MetricSpec, rank: int, attrs: dict[str, str], values, now: float, elapsed: float
    ):  # type: ignore[no-untyped-def]
        slow = 1.5 if rank == 3 else 1.0
        if spec.kind is Kind.HISTOGRAM:
            assert spec.buckets, spec.name
            phase = attrs.get(sc.PHASE)
            mean = slow * (0.2 if phase is None else 0.01 * (1 + ATTRIBUTE_VALUES[sc.PHASE].index(phase)))
            count = 1.0 + 5.0 * elapsed
            buckets = [
                (str(le), count * (0.0 if le < mean else 0.5 if le < 1.5 * mean else 1.0))
                for le in spec.buckets
                if self.tier == build.TIER_FULL or spec.scope == "job"
            ]
            family.add_metric(values, [*buckets, ("+Inf", count)], sum_value=count * 1.25 * mean)
        elif spec.kind in (Kind.COUNTER, Kind.OBSERVABLE_COUNTER):
            family.add_metric(values, elapsed * (4096.0 if spec is sc.TOKENS else 2.0))
        elif spec is sc.LAST_STEP_TIME:
            family.add_metric(values, now - 0.2 * slow)
        elif spec is sc.STRAGGLER_SCORE:
            family.add_metric(values, 1.0 / slow)
        elif spec in (sc.PHASE_CROSS_RANK, sc.JOB_PHASE_CROSS_RANK):
            stats = {"min": 0.1, "max": 0.15, "argmin_rank": 0.0, "argmax_rank": float(RANKS[-1])}
            family.add_metric(values, stats.get(attrs[sc.STAT], 0.11))
        elif spec.unit == "1":
            family.add_metric(values, 0.4)
        else:
            family.add_metric(values, 100.0 + rank)


def _combinations(value_lists: list[tuple[str, ...]]) -> Iterator[tuple[str, ...]]:
    if not value_lists:
        yield ()
        return
    for head in value_lists[0]:
        for tail in _combinations(value_lists[1:]):
            yield (head, *tail)


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"prometheus exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError("prometheus did not become ready")


@pytest.fixture(scope="module")
def prometheus_with_fake_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Prometheus scraping the fake endpoint every second, with rate() data and a firing alert."""
    with _prometheus_scraping(FakeTrainingEndpoint(), tmp_path_factory.mktemp("prometheus")) as url:
        yield url


@contextmanager
def _prometheus_scraping(endpoint: FakeTrainingEndpoint, tmp_path: Path) -> Iterator[str]:
    binary = require_binary("prometheus")
    from prometheus_client import CollectorRegistry, generate_latest, start_http_server

    registry = CollectorRegistry()
    registry.register(endpoint)
    assert generate_latest(registry)  # a broken fake endpoint fails here, not as "no data"
    target_port = free_port()
    server, thread = start_http_server(target_port, addr="127.0.0.1", registry=registry)

    steps = sc.STEPS.prometheus_name
    (tmp_path / "rules.yml").write_text(
        "groups:\n"
        "  - name: dashboard_test\n"
        "    rules:\n"
        "      - alert: OtelTrainDashboardTest\n"
        f"        expr: max by (run_id, rank) ({steps}) > 0\n"
        "        labels: {severity: info}\n"
    )
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "rule_files: [rules.yml]\n"
        "scrape_configs:\n"
        "  - job_name: otel_train\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{target_port}']}}]\n"
    )
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc)
        # A few scrapes so that rate() over 1m has two samples, and one rule evaluation for ALERTS.
        deadline = time.monotonic() + 30
        while not (
            instant_query(url, f"rate({steps}[1m])") and instant_query(url, 'ALERTS{alertstate="firing"}')
        ):
            assert time.monotonic() < deadline, "prometheus scraped no data from the fake endpoint"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


QUERIES = all_queries()


@pytest.mark.integration
@pytest.mark.parametrize("run_id", list(RUNS))
@pytest.mark.parametrize("query", QUERIES, ids=[f"{q.uid}:{q.title}:{i}" for i, q in enumerate(QUERIES)])
def test_query_returns_data(prometheus_with_fake_run: str, query: DashboardQuery, run_id: str) -> None:
    """Each query has data on both namings (run-pull: pull endpoint, run-collector: Collector)."""
    variables = {"run_id": run_id}
    failures = query_failures(prometheus_with_fake_run, [query], variables=variables, exclude_gpu=False)
    assert not failures, failures[0][1]


@pytest.mark.integration
def test_assert_all_queries_return_data(prometheus_with_fake_run: str) -> None:
    """The reusable check, with every dashboard variable set to one value."""
    variables = {"run_id": "run-collector", "host": "node-1", "rank": "3"}
    checked = assert_all_queries_return_data(
        prometheus_with_fake_run, exclude_gpu=False, variables=variables, exclude_deepspeed=False
    )  # the fake run has every catalogue metric, GPUs' and DeepSpeed's included
    assert checked == len(QUERIES) > 40
    with pytest.raises(AssertionError, match="no data"):
        assert_all_queries_return_data(prometheus_with_fake_run, variables={"run_id": "no-such-run"})


def test_deepspeed_only_marking_follows_the_catalogue() -> None:
    """The e2e stacks (plain gloo ranks) skip exactly the panels that read only DeepSpeed's own
    metrics; every other query must still have data there."""
    for q in all_queries():
        panel_specs = [
            s for p in all_queries() if (p.uid, p.title) == (q.uid, q.title) for s in build.specs_in(p.expr)
        ]
        expected = bool(panel_specs) and all(s.name.startswith("deepspeed.") for s in panel_specs)
        assert q.deepspeed_only == expected, q.title
    assert any(q.deepspeed_only for q in all_queries()) and not all(q.deepspeed_only for q in all_queries())


# --- (e) series tiers (Config.rank_series) -----------------------------------------------------------
@pytest.fixture(scope="module")
def prometheus_with_essential_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The fake runs as the essential tier exports them."""
    endpoint = FakeTrainingEndpoint(tier=build.TIER_ESSENTIAL)
    with _prometheus_scraping(endpoint, tmp_path_factory.mktemp("prometheus-essential")) as url:
        yield url


def _panels_of(queries: list[DashboardQuery]) -> set[tuple[str, str]]:
    return {(q.uid, q.title) for q in queries}


@pytest.mark.integration
@pytest.mark.parametrize("run_id", list(RUNS))
def test_panels_have_data_in_the_tier_they_say_they_need(
    prometheus_with_essential_run: str, run_id: str
) -> None:
    """In the essential tier every panel marked for it has data, and every panel marked full has an
    empty query (so the tier each panel names is the truth, both ways)."""
    variables = {"run_id": run_id}
    failures = query_failures(
        prometheus_with_essential_run,
        QUERIES,
        variables=variables,
        exclude_gpu=False,
        exclude_deepspeed=False,
    )
    full = _panels_of([q for q in QUERIES if q.tier == build.TIER_FULL])
    assert _panels_of([q for q, _ in failures]) == full
    assert len(full) > 10 and len(_panels_of(QUERIES)) - len(full) > 20


def test_full_tier_panels_say_so_in_their_description() -> None:
    for file_name, dash in _dashboards().items():
        for panel in _panels(dash):
            if panel["type"] == "row":
                continue
            tier = {q.tier for q in QUERIES if (q.uid, q.title) == (dash["uid"], panel["title"])}
            says = 'Needs rank_series="full"' in panel.get("description", "")
            assert says == (tier == {build.TIER_FULL}), (file_name, panel["title"])


def test_job_level_distributions_serve_both_tiers() -> None:
    """The panels of a job-wide distribution (step and phase time, throughput, loss, cross-rank
    statistics) read the job-level series, with no rank or host matcher on them: one query in
    either tier."""
    job_specs = {s.name for s in sc.CATALOGUE if s.scope == "job"}
    read = {s.name for q in QUERIES for s in build.specs_in(q.expr) if s.scope == "job"}
    assert read == job_specs
    for q in QUERIES:
        for selector in re.findall(r"train_job_\w+\{[^}]*\}", q.expr):
            assert "rank=" not in selector and "host_name" not in selector, (q.title, selector)
    titles = {q.title for q in QUERIES if q.tier == build.TIER_ESSENTIAL}
    assert {
        "Step time p50 / p95 / p99", "Step time distribution", "Phase time p95 by phase", "Tokens/s",
        "Samples/s", "Training loss (interval mean over the ranks; the steps' min and max)",
        "Cross-rank min / max of phase time",
    } <= titles  # fmt: skip


def test_tier_marking_agrees_with_the_export_filter() -> None:
    """The tier the panels and rules are marked with (build.in_essential_tier) is what the library's
    essential-tier filter (otel_train/exporters/tiers.py) lets through: every catalogue metric
    recorded once on a real SDK pipeline, then filtered."""
    from opentelemetry.metrics import Observation
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from otel_train.exporters.tiers import essential_only

    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("tiers")
    for spec in sc.CATALOGUE:
        if spec.kind.value.startswith("observable"):
            spec.create(meter, lambda _options: [Observation(1.0)])
            continue
        instrument = spec.create(meter)
        if spec.kind is Kind.COUNTER:
            instrument.add(1.0)
        elif spec.kind is Kind.HISTOGRAM:
            instrument.record(1.0)
        else:
            instrument.set(1.0)
    data = essential_only(reader.get_metrics_data())  # type: ignore[arg-type]
    kept = {m.name: m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert len(kept) > 20
    for spec in sc.CATALOGUE:
        assert (sc.otel_name(spec.name) in kept) == build.in_essential_tier(spec), spec.name
        if spec.kind is Kind.HISTOGRAM and spec.name in kept:
            (point,) = kept[spec.name].data.data_points
            bucket = f"{spec.prometheus_name}_bucket"
            assert bool(point.explicit_bounds) == build.in_essential_tier(spec, bucket), spec.name


@pytest.mark.integration
def test_the_role_variable_filters_every_query(prometheus_with_fake_run: str) -> None:
    """Every selector carries the role, the job-level series' too: with a role no series has, no
    panel has data (a panel ignoring it would merge an RL job's roles into one line). The firing
    alerts keep the run's alerts that have no role (TrainingStalled is one per run)."""
    variables = {"run_id": "run-pull", "role": "no-such-role"}
    empty = {q for q, _ in query_failures(prometheus_with_fake_run, variables=variables, exclude_gpu=False,
                                          exclude_deepspeed=False)}  # fmt: skip
    shown = [f"{q.uid} / {q.title}" for q in QUERIES if q not in empty]
    assert shown == ["otel-train-health / Firing alerts"]


@pytest.mark.integration
def test_collectives_per_second_are_one_ranks_not_the_sum_over_ranks(prometheus_with_fake_run: str) -> None:
    """Every rank calls each collective once: four ranks each completing n a second is a job
    running n a second, not 4n (the panel against the per-rank rates, at one evaluation time)."""
    [query] = [q for q in QUERIES if q.title == "Collectives per second by process group and op"]
    panel = substitute_variables(query.expr, {"run_id": "run-pull"})
    per_rank = f'rate({sc.COLLECTIVE_COUNT.prometheus_name}{{run_id="run-pull"}}[1m])'
    at = time.time()

    def value(expr: str) -> float:
        url = f"{prometheus_with_fake_run}/api/v1/query?" + urllib.parse.urlencode(
            {"query": expr, "time": at}
        )
        with urllib.request.urlopen(url, timeout=10) as response:
            [sample] = json.loads(response.read())["data"]["result"]
        return float(sample["value"][1])

    assert (
        value(panel)
        == pytest.approx(value(f"max({per_rank})"))
        == pytest.approx(value(f"sum({per_rank})") / 4)
    )
