"""Evaluate every generated dashboard query against a live Prometheus.

Reusable outside the fake-endpoint test: point `assert_all_queries_return_data` at a Prometheus that
scrapes a real training run (pull endpoint or Collector) to prove that every panel shows data.

    from helpers.dashboard_queries import assert_all_queries_return_data
    assert_all_queries_return_data("http://127.0.0.1:9090", exclude_gpu=True, variables={"run_id": "r42"})
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Collection, Mapping
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:  # `dashboards` is a top-level folder, not an installed package
    sys.path.insert(0, str(_ROOT))

from dashboards.build import DashboardQuery, all_queries  # noqa: E402

# Grafana's built-in interval variables, as a dashboard would resolve them at a 1 s-15 s scrape interval.
BUILTINS: dict[str, str] = {"__rate_interval": "1m", "__interval": "1m", "__range": "5m"}
_VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")


def substitute_variables(expr: str, variables: Mapping[str, str] | None = None) -> str:
    """Resolve `$var` / `${var}` as Grafana would; dashboard variables default to `.*` (All)."""
    values = {**BUILTINS, **(variables or {})}

    def repl(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name.startswith("__") and name not in values:
            raise KeyError(f"unknown Grafana built-in ${name} in {expr!r}")
        return values.get(name, ".*")

    return _VARIABLE.sub(repl, expr)


def instant_query(prom_url: str, expr: str, timeout_s: float = 10.0) -> list[dict]:
    """Result vector of an instant query via `/api/v1/query`; raises on an API error."""
    url = f"{prom_url.rstrip('/')}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as exc:  # 400 on a PromQL syntax error: surface Prometheus' reason
        body = json.loads(exc.read() or b"{}")
        raise AssertionError(f"{expr!r}: HTTP {exc.code}: {body.get('error')}") from exc
    if body.get("status") != "success":
        raise AssertionError(f"{expr!r}: {body.get('errorType')}: {body.get('error')}")
    result = body["data"]["result"]
    return result if isinstance(result, list) else [{"value": result}]


def _has_value(result: list[dict]) -> bool:
    """At least one sample with a real number (a 0/0 mean is NaN: no data to plot)."""
    for sample in result:
        value = float(sample["value"][1])
        if not math.isnan(value):
            return True
    return False


def query_failures(
    prom_url: str,
    queries: list[DashboardQuery] | None = None,
    *,
    exclude_gpu: bool = True,
    variables: Mapping[str, str] | None = None,
    skip_titles: Collection[str] = (),
    exclude_deepspeed: bool = True,
) -> list[tuple[DashboardQuery, str]]:
    """(query, reason) for every query that errors or returns no (non-NaN) data."""
    failures = []
    for q in all_queries() if queries is None else queries:
        if (exclude_gpu and q.gpu_only) or (exclude_deepspeed and q.deepspeed_only) or q.title in skip_titles:
            continue
        expr = substitute_variables(q.expr, variables)
        try:
            if not _has_value(instant_query(prom_url, expr)):
                failures.append((q, f"{q.uid} / {q.title}: no data for {expr}"))
        except (AssertionError, OSError) as exc:
            failures.append((q, f"{q.uid} / {q.title}: {exc}"))
    return failures


def assert_all_queries_return_data(
    prom_url: str,
    exclude_gpu: bool = True,
    *,
    variables: Mapping[str, str] | None = None,
    skip_titles: Collection[str] = (),
    wait_s: float = 0.0,
    poll_s: float = 1.0,
    exclude_deepspeed: bool = True,
) -> int:
    """Assert that every dashboard query (GPU-only and DeepSpeed-only ones excluded by default: the
    stacks here train plain gloo ranks) returns data.

    `variables` sets dashboard variables (`run_id`, `host`, `rank`; default `.*`, i.e. All).
    `wait_s` keeps retrying failing queries that long (data still arriving).  Returns the number of
    queries checked.
    """
    queries = [
        q
        for q in all_queries()
        if not (exclude_gpu and q.gpu_only)
        and not (exclude_deepspeed and q.deepspeed_only)
        and q.title not in skip_titles
    ]
    deadline = time.monotonic() + wait_s
    pending = queries
    while True:
        failures = query_failures(
            prom_url,
            pending,
            exclude_gpu=exclude_gpu,
            variables=variables,
            exclude_deepspeed=exclude_deepspeed,
        )
        if not failures or time.monotonic() >= deadline:
            break
        pending = [q for q, _ in failures]
        time.sleep(poll_s)
    lines = [reason for _, reason in failures]
    assert not lines, f"{len(lines)} of {len(queries)} dashboard queries failed:\n" + "\n".join(lines)
    return len(queries)
