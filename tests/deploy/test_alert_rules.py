"""The alert pack (deploy/prometheus/rules): promtool checks, unit-test coverage, and naming.

Names are checked against otel_train.semconv (the catalogue), never against a list typed here:
every metric a rule reads must exist under that name on BOTH export paths (in-process pull
endpoint and OTel Collector), or be matched by a `{__name__=~"..."}` regex that covers both
spellings of one catalogue metric.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from helpers.pinned import require_binary
from helpers.promstack import duration_seconds, shorten_expr, shorten_rules

from dashboards.build import TIER_ESSENTIAL, TIER_FULL, expr_tier, in_essential_tier
from otel_train import semconv

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES_DIR = DEPLOY / "prometheus" / "rules"
RULE_FILES = sorted(RULES_DIR.glob("*.yml"))
RULE_TESTS = sorted((RULES_DIR / "tests").glob("*.yml"))

SEVERITIES = {"critical", "warning", "info"}
PROMQL_KEYWORDS = {
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "offset",
    "bool", "inf", "nan", "atan2",
}  # fmt: skip


def _rules() -> list[dict]:
    out = []
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                out.append({**rule, "_file": path.name})
    return out


def _alerts() -> list[dict]:
    return [r for r in _rules() if "alert" in r]


# --- naming helpers (derived from the catalogue) -------------------------------------------------
def _series_names(spec: semconv.MetricSpec, collector: bool) -> set[str]:
    base = spec.collector_prometheus_name if collector else spec.prometheus_name
    if spec.kind is semconv.Kind.HISTOGRAM:
        return {f"{base}_bucket", f"{base}_sum", f"{base}_count"}
    return {base}


PULL_NAMES = {n: s for s in semconv.CATALOGUE for n in _series_names(s, collector=False)}
COLLECTOR_NAMES = {n: s for s in semconv.CATALOGUE for n in _series_names(s, collector=True)}
BOTH_PATHS = set(PULL_NAMES) & set(COLLECTOR_NAMES)
ALL_NAMES = set(PULL_NAMES) | set(COLLECTOR_NAMES)


def _label(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


KNOWN_LABELS = (
    {_label(a) for s in semconv.CATALOGUE for a in s.attributes}
    | {_label(k) for k in semconv.LABEL_RESOURCE_KEYS}
    | {"__name__", "job", "instance"}
)

_NAME_MATCHER_RE = re.compile(r"__name__\s*(=~|=)\s*\"([^\"]*)\"")
_STRING_RE = re.compile(r"\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'")
_GROUPING_RE = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_IDENT_RE = re.compile(r"(?<![\w.:])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?")


def parse_expr(expr: str) -> tuple[set[str], set[str], set[str]]:
    """Crude PromQL scan: (metric names, `__name__` regexes/values, label names used)."""
    name_matchers = {m.group(2) for m in _NAME_MATCHER_RE.finditer(expr)}
    labels: set[str] = set()
    for block in re.findall(r"\{([^}]*)\}", _STRING_RE.sub('""', expr)):
        labels |= set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", block))
    text = _STRING_RE.sub('""', expr)
    for m in _GROUPING_RE.finditer(text):
        labels |= {x.strip() for x in m.group(2).split(",") if x.strip()}
    text = _GROUPING_RE.sub(" ", text)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\boffset\s+\w+", " ", text)
    names = set()
    for m in _IDENT_RE.finditer(text):
        ident, call = m.group(1), m.group(2)
        if call or ident in PROMQL_KEYWORDS:
            continue
        names.add(ident)
    return names, name_matchers, labels


def test_parse_expr_finds_names_and_labels() -> None:
    names, regexes, labels = parse_expr(
        'sum by (run_id, rank) (rate(a_total{x="1"}[5m])) / on (run_id) group_left () b:rec'
        ' > 0.5 and {__name__=~"c(_ratio)?", y=~"t.*"} offset 1h unless max(d) by (z)'
    )
    assert names == {"a_total", "b:rec", "d"}
    assert regexes == {"c(_ratio)?"}
    assert labels == {"run_id", "rank", "x", "y", "z", "__name__"}


# --- promtool ------------------------------------------------------------------------------------
def test_rule_files_exist() -> None:
    assert {p.name for p in RULE_FILES} >= {"training.yml", "gpu.yml"}
    assert RULE_TESTS, "no promtool unit tests in deploy/prometheus/rules/tests"


def test_promtool_check_rules() -> None:
    promtool = require_binary("promtool")
    proc = subprocess.run([promtool, "check", "rules", *map(str, RULE_FILES)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _promtool_test(files: list[Path], cwd: Path) -> subprocess.CompletedProcess[str]:
    promtool = require_binary("promtool")
    return subprocess.run(
        [promtool, "test", "rules", *map(str, files)], capture_output=True, text=True, cwd=cwd
    )


# --- series tiers (Config.rank_series) --------------------------------------------------------------
# promtool test groups that need rank_series="full", and what they read that the essential tier
# does not export. Every other group passes unchanged on the essential tier's share of its input.
FULL_ONLY_TESTS = {
    "phase_seconds_recording": "per-rank phase histograms (otel_train:phase_seconds:mean5m per phase)",
    "loss_spike_vs_average": "per-rank train_loss / train_loss_max (cross_rank=False: no job-level loss)",
    "throughput_drop_no_exchange": "per-rank train_tokens_total (cross_rank=False: no job-level tokens)",
    "goodput_rolling1h": "per-rank train_productive_duration_seconds_total and train_badput_duration_seconds_total",
}
_SERIES_RE = re.compile(r"^\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{.*\})?\s*$")


def essential_series(series: str) -> bool:
    """Whether the essential tier exports this input series (`name{labels}`): the catalogue's
    essential and job-level metrics (dashboards.build.in_essential_tier, the rule of
    otel_train/exporters/tiers.py), a per-rank histogram's `_bucket` only as `le="+Inf"`."""
    match = _SERIES_RE.match(series)
    assert match, series
    name, labels = match.group(1), match.group(2) or ""
    spec = PULL_NAMES.get(name) or COLLECTOR_NAMES.get(name)
    assert spec is not None, f"{name}: not a catalogue series"
    if spec.kind is semconv.Kind.HISTOGRAM and name.endswith("_bucket") and spec.scope != "job":
        return spec.essential and 'le="+Inf"' in labels
    return in_essential_tier(spec, name)


def essential_copies(tests: list[Path], dest: Path, groups: set[str] | None = None) -> list[Path]:
    """The rule tests as they run on the essential tier's series: each group's input series cut to
    what that tier exports; `groups`: keep only these (default: all but FULL_ONLY_TESTS)."""
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for path in tests:
        doc = yaml.safe_load(path.read_text())
        doc["rule_files"] = [str((path.parent / f).resolve()) for f in doc["rule_files"]]
        kept = []
        for group in doc["tests"]:
            if (group["name"] in FULL_ONLY_TESTS) if groups is None else (group["name"] not in groups):
                continue
            group["input_series"] = [
                s for s in group.get("input_series", []) if essential_series(s["series"])
            ]
            kept.append(group)
        if kept:
            doc["tests"] = kept
            target = dest / path.name
            target.write_text(yaml.safe_dump(doc, sort_keys=False))
            out.append(target)
    return out


@pytest.mark.parametrize("tier", ["full", "essential"])
def test_promtool_test_rules(tier: str, tmp_path: Path) -> None:
    """Every alert rule fires on its scenario and stays quiet on the look-alikes (see the yml
    files), in both series tiers: in `essential` on the share of the input that tier exports."""
    files = RULE_TESTS if tier == "full" else essential_copies(RULE_TESTS, tmp_path)
    proc = _promtool_test(files, RULES_DIR / "tests")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAILED" not in proc.stdout
    if tier == "essential":  # the cut removed per-rank series, and only the full-only groups are gone
        names = {g["name"] for f in files for g in yaml.safe_load(f.read_text())["tests"]}
        every = {g["name"] for f in RULE_TESTS for g in yaml.safe_load(f.read_text())["tests"]}
        assert names == every - set(FULL_ONLY_TESTS)


@pytest.mark.parametrize("group", sorted(FULL_ONLY_TESTS))
def test_full_only_rule_tests_fail_on_the_essential_series(group: str, tmp_path: Path) -> None:
    """A group listed as full-only really needs the full tier: on the essential share of its input
    its expectations fail (the list is the truth, and the cut removes what it should)."""
    files = essential_copies(RULE_TESTS, tmp_path, groups={group})
    assert len(files) == 1
    proc = _promtool_test(files, RULES_DIR / "tests")
    assert proc.returncode != 0 and "FAILED" in proc.stdout + proc.stderr, proc.stdout


def test_essential_series_follows_the_tiers() -> None:
    assert essential_series('train_steps_total{run_id="r",rank="0"}')
    assert essential_series('train_step_duration_seconds_bucket{run_id="r",le="+Inf"}')
    assert not essential_series('train_step_duration_seconds_bucket{run_id="r",le="0.5"}')
    assert essential_series('train_step_duration_seconds_count{run_id="r"}')
    assert not essential_series('train_phase_duration_seconds_count{run_id="r",train_phase="data"}')
    assert essential_series('train_job_phase_duration_seconds_bucket{run_id="r",le="0.5"}')
    assert essential_series('train_straggler_score_ratio{run_id="r"}')
    assert not essential_series('train_loss{run_id="r"}')


def test_every_alert_reads_series_both_tiers_export() -> None:
    """Alerts work in both tiers; the recording rules that need `full` are the ones training.yml
    says so for (no alert reads them)."""
    for rule in _alerts():
        assert expr_tier(rule["expr"]) == TIER_ESSENTIAL, rule["alert"]
    full = {r["record"] for r in _rules() if "record" in r and expr_tier(r["expr"]) == TIER_FULL}
    assert full == {"otel_train:phase_seconds:mean5m", "otel_train:goodput:rolling1h"}
    text = (RULES_DIR / "training.yml").read_text()
    assert text.count('rank_series="full"') >= 2 + 2  # the two recording rules, the two fallbacks
    for rule in _alerts():
        names, _, _ = parse_expr(rule["expr"])
        assert not names & {r for r in full}, rule["alert"]


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    fires: set[str] = set()
    silent: set[str] = set()
    tested_files: set[str] = set()
    for path in RULE_TESTS:
        doc = yaml.safe_load(path.read_text())
        tested_files |= {Path(f).name for f in doc["rule_files"]}
        for group in doc["tests"]:
            for case in group.get("alert_rule_test", []):
                (fires if case.get("exp_alerts") else silent).add(case["alertname"])
    alert_names = {a["alert"] for a in _alerts()}
    assert tested_files == {p.name for p in RULE_FILES}
    assert alert_names - fires == set(), "alerts without a case that fires"
    assert alert_names - silent == set(), "alerts without a case that must not fire"
    # each rule of a multi-detector alert fires in some case
    detectors = {(a["alert"], a.get("labels", {}).get("detector")) for a in _alerts()}
    fired_detectors = set()
    for path in RULE_TESTS:
        for group in yaml.safe_load(path.read_text())["tests"]:
            for case in group.get("alert_rule_test", []):
                for exp in case.get("exp_alerts") or []:
                    fired_detectors.add((case["alertname"], exp["exp_labels"].get("detector")))
    assert detectors - fired_detectors == set()


def test_the_pack_covers_the_required_alerts() -> None:
    assert {a["alert"] for a in _alerts()} >= {
        "TrainingStraggler", "TrainingRankStalled", "TrainingStalled", "TrainingRankMissing",
        "TrainingNonFiniteLoss", "TrainingLossSpike", "TrainingThroughputDrop",
        "GPUThermalThrottling", "GPUHighTemperature", "GPUMemoryNearLimit", "GPUErrors",
    }  # fmt: skip


# --- labels and annotations ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "rule", _alerts(), ids=lambda r: f"{r['alert']}-{r.get('labels', {}).get('detector', '')}"
)
def test_alert_labels_and_annotations(rule: dict) -> None:
    assert rule["labels"]["severity"] in SEVERITIES
    ann = rule["annotations"]
    assert {"summary", "description", "runbook"} <= set(ann)
    text = ann["summary"] + ann["description"]
    assert "$labels.run_id" in text
    _, _, labels = parse_expr(rule["expr"])
    if "rank" in labels:  # per-rank alerts say which rank on which host
        assert "$labels.rank" in text and "$labels.host_name" in text
    if rule["_file"] == "gpu.yml":
        assert "$labels.hw_id" in text
    if "for" in rule:
        assert duration_seconds(rule["for"]) >= 60, "production `for:` should be realistic"


# --- both namings ----------------------------------------------------------------------------------
def test_rules_use_catalogue_names_valid_on_both_paths() -> None:
    recorded = {r["record"] for r in _rules() if "record" in r}
    used: set[str] = set()
    for rule in _rules():
        names, regexes, _ = parse_expr(rule["expr"])
        for name in names:
            if ":" in name:
                assert name in recorded, f"{name}: recording rule not defined"
                continue
            used.add(name)
            assert name in ALL_NAMES, f"{name} in {rule.get('alert') or rule.get('record')} is not in semconv"
            spec = PULL_NAMES.get(name) or COLLECTOR_NAMES[name]
            assert name in BOTH_PATHS, (
                f"{name} exists only on the {'pull' if name in PULL_NAMES else 'collector'} path: "
                f'use {{__name__=~"{spec.prometheus_name}(_ratio)?"}}'
            )
        for pattern in regexes:
            hits = {n for n in ALL_NAMES if re.fullmatch(pattern, n)}
            specs = {PULL_NAMES.get(n) or COLLECTOR_NAMES[n] for n in hits}
            assert len(specs) == 1, (
                f"__name__ matcher {pattern!r} should select exactly one metric, got {hits}"
            )
            (spec,) = specs
            assert re.fullmatch(pattern, spec.prometheus_name), f"{pattern!r} misses the pull-endpoint name"
            assert re.fullmatch(pattern, spec.collector_prometheus_name), (
                f"{pattern!r} misses the collector name"
            )
            used.add(spec.prometheus_name)
    # the pack reads the metrics it is meant to read
    for spec in (semconv.STEPS, semconv.STEP_DURATION, semconv.PHASE_DURATION, semconv.NONFINITE_LOSS,
                 semconv.HEALTH_EVENTS, semconv.TOKENS, semconv.STRAGGLER_SCORE, semconv.GPU_THROTTLE,
                 semconv.GPU_TEMPERATURE, semconv.GPU_MEMORY_USAGE, semconv.GPU_ERRORS):  # fmt: skip
        assert used & (_series_names(spec, False) | {spec.prometheus_name}), spec.name


def test_unit_one_gauges_are_never_used_bare() -> None:
    """The one divergence between the paths: unit-"1" gauges must be matched with (_ratio)?."""
    divergent = {s for s in semconv.CATALOGUE if s.prometheus_name != s.collector_prometheus_name}
    assert semconv.STRAGGLER_SCORE in divergent and semconv.GPU_THROTTLE in divergent
    for rule in _rules():
        names, _, _ = parse_expr(rule["expr"])
        for spec in divergent:
            assert spec.prometheus_name not in names and spec.collector_prometheus_name not in names


def test_rules_use_known_labels_and_aggregate() -> None:
    """Labels come from the catalogue's attributes and the Resource; rules aggregate `by (...)`."""
    for rule in _rules():
        _, _, labels = parse_expr(rule["expr"])
        assert labels <= KNOWN_LABELS, (
            f"{rule.get('alert') or rule.get('record')}: unknown labels {labels - KNOWN_LABELS}"
        )
        assert "job" not in labels and "instance" not in labels, "job/instance differ between the paths"
        assert "run_id" in labels, "every rule must keep run_id"


# --- the test-only shortener ---------------------------------------------------------------------
def test_shorten_expr_scales_ranges_and_offsets() -> None:
    assert (
        shorten_expr("rate(x[5m]) < rate(x[30m] offset 10m)", scale=30)
        == "rate(x[10s]) < rate(x[60s] offset 20s)"
    )
    assert shorten_expr("max_over_time(x[1h30m:1m])", scale=30) == "max_over_time(x[180s:2s])"
    assert shorten_expr("rate(x[1m])", scale=30, minimum_s=5) == "rate(x[5s])"


def test_shorten_rules_rewrites_for(tmp_path: Path) -> None:
    (short,) = shorten_rules([RULES_DIR / "training.yml"], tmp_path, for_="5s")
    rules = [r for g in yaml.safe_load(short.read_text())["groups"] for r in g["rules"]]
    assert all(r["for"] == "5s" for r in rules if "for" in r)
    assert not any(re.search(r"\[\d+m\]", r["expr"]) for r in rules)
    promtool = require_binary("promtool")
    proc = subprocess.run([promtool, "check", "rules", str(short)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- label values: matched values must be ones the code emits -------------------------------------
VALUE_LABELS = {_label(a) for a in (semconv.EVENT, semconv.STRAGGLER_KIND, semconv.STAT, semconv.REASON)}
_MATCHER_RE = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|=)\s*\"([^\"]*)\"")


def _source_strings() -> set[str]:
    """Every string constant in otel_train's source: an emitted label value is written there."""
    import ast

    package = Path(semconv.__file__).parent
    found: set[str] = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.add(node.value)
    return found


def _dashboard_exprs() -> list[tuple[str, str]]:
    import json

    out: list[tuple[str, str]] = []

    def walk(node: object, where: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("expr", "query") and isinstance(value, str):
                    out.append((where, value))
                else:
                    walk(value, where)
        elif isinstance(node, list):
            for item in node:
                walk(item, where)

    for path in sorted((DEPLOY.parent / "dashboards" / "json").glob("*.json")):
        walk(json.loads(path.read_text()), path.name)
    return out


def test_matched_label_values_are_ones_the_code_emits() -> None:
    """A rule or panel matching `otel_train_event="nonfint_grad"` (or a renamed event, stat or
    straggler kind) would never fire or always be empty: every value matched on these labels is a
    string the library's source writes (alternations split; other regexes skipped)."""
    emitted = _source_strings()
    assert len(_dashboard_exprs()) > 50, "the dashboards' queries were not found"
    exprs = [(r.get("alert") or r.get("record") or "?", r["expr"]) for r in _rules()] + _dashboard_exprs()
    checked = set()
    for where, expr in exprs:
        for label, op, value in _MATCHER_RE.findall(expr):
            if label not in VALUE_LABELS or "$" in value:  # a dashboard variable
                continue
            if op == "=~" and not re.fullmatch(r"[a-z0-9_]+(\|[a-z0-9_]+)*", value):
                continue
            for one in value.split("|"):
                assert one in emitted, f"{where}: {label}={one!r} is never emitted by otel_train"
                checked.add((label, one))
    assert ("otel_train_event", "loss_spike") in checked and ("straggler_kind", "relative") in checked
