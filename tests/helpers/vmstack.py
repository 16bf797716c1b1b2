"""Real VictoriaMetrics (single node) and vmalert for tests, on loopback, with temp dirs.

    from helpers.vmstack import victoriametrics, vmalert

    with victoriametrics() as vm, vmalert(vm.url, rule_files, notifier_url=am.url) as alerts:
        ot.init(otlp_metrics_endpoint=vm.otlp_metrics_url, ...)   # the library pushes OTLP into it
        vm.query("train_steps_total")                            # the Prometheus query API
        alerts.alerts()                                           # vmalert's view (/api/v1/alerts)

Both binaries come from the pinned Debian package victoria-metrics (deploy/versions.env, fetched
into .tools/ by `make tools`), found by helpers.pinned.require_binary: missing fails under CI, skips
locally. The flags are the ones deploy/docker-compose.victoriametrics.yml uses (OTLP ingestion with
Prometheus naming), plus short delays so that a test sees data within seconds.
"""

from __future__ import annotations

import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helpers.pinned import require_binary
from helpers.promstack import Prometheus, http_json, serve, tail

# What the compose variant passes to VictoriaMetrics for OTLP (checked there by
# tests/deploy/test_static.py): Prometheus-style names and labels (train_steps_total, host_name).
OTLP_FLAGS = ("-opentelemetry.usePrometheusNaming",)
# Test-only: data is queryable at once (default 30 s, for late scrapes), no response cache.
FAST_QUERY_FLAGS = ("-search.latencyOffset=0s", "-search.disableCache")


@dataclass
class VictoriaMetrics(Prometheus):
    """The Prometheus query API of Prometheus applies (query, value); plus where OTLP goes."""

    @property
    def otlp_metrics_url(self) -> str:
        return f"{self.url}/opentelemetry/v1/metrics"

    def series(self, match: str) -> list[dict[str, str]]:
        """Label sets of the series matching a selector (/api/v1/series, last hour)."""
        start = int(time.time()) - 3600
        query = urllib.parse.urlencode({"match[]": match, "start": start})
        return list(http_json(f"{self.url}/api/v1/series?{query}")["data"])

    def log(self) -> str:
        return tail(self.workdir / "victoria-metrics.log", 200)


@contextmanager
def victoriametrics(extra_args: Sequence[str] = ()) -> Iterator[VictoriaMetrics]:
    """A real single-node VictoriaMetrics on 127.0.0.1 ingesting OTLP at /opentelemetry/v1/metrics."""
    binary = require_binary("victoria-metrics")
    workdir = Path(tempfile.mkdtemp(prefix="otel_train_vm_"))
    with serve(
        lambda port: [
            binary,
            f"-storageDataPath={workdir / 'data'}",
            f"-httpListenAddr=127.0.0.1:{port}",
            *OTLP_FLAGS,
            *FAST_QUERY_FLAGS,
            *extra_args,
        ],
        workdir,
        "victoria-metrics",
        "/health",
    ) as port:
        yield VictoriaMetrics(url=f"http://127.0.0.1:{port}", workdir=workdir)


@dataclass
class VmAlert:
    url: str
    workdir: Path

    def alerts(self, state: str | None = None, **labels: str) -> list[dict[str, Any]]:
        """vmalert's active alerts (/api/v1/alerts): pending and firing."""
        items = http_json(f"{self.url}/api/v1/alerts")["data"]["alerts"]
        return [
            a
            for a in items
            if (state is None or a["state"] == state)
            and all(a["labels"].get(k) == v for k, v in labels.items())
        ]

    def rule_groups(self) -> list[dict[str, Any]]:
        return list(http_json(f"{self.url}/api/v1/rules")["data"]["groups"])

    def log(self) -> str:
        return tail(self.workdir / "vmalert.log", 200)


@contextmanager
def vmalert(
    datasource_url: str,
    rule_files: Iterable[str | Path],
    notifier_url: str | None = None,
    evaluation_interval: str = "1s",
) -> Iterator[VmAlert]:
    """A real vmalert evaluating `rule_files` (Prometheus rule format, as they are) against
    `datasource_url`, writing recording-rule results and alert state back there (remote write) and
    sending alerts to `notifier_url` (an Alertmanager)."""
    binary = require_binary("vmalert")
    workdir = Path(tempfile.mkdtemp(prefix="otel_train_vmalert_"))
    notifier = [f"-notifier.url={notifier_url}"] if notifier_url else ["-notifier.blackhole"]
    with serve(
        lambda port: [
            binary,
            *[f"-rule={Path(p).resolve()}" for p in rule_files],
            f"-datasource.url={datasource_url}",
            f"-remoteWrite.url={datasource_url}",
            f"-remoteRead.url={datasource_url}",
            *notifier,
            f"-evaluationInterval={evaluation_interval}",
            "-rule.evalDelay=0s",  # test-only, as -search.latencyOffset=0s on the store
            f"-httpListenAddr=127.0.0.1:{port}",
        ],
        workdir,
        "vmalert",
        "/health",
    ) as port:
        yield VmAlert(url=f"http://127.0.0.1:{port}", workdir=workdir)
