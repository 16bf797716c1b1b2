"""Real Prometheus and Alertmanager for tests, on loopback, with temp dirs.

    from helpers.promstack import alertmanager, prometheus, shorten_rules, wait_until

    rules = shorten_rules(RULE_FILES, tmp_path, for_="5s", scale=30)
    with alertmanager() as am, prometheus(
        targets=["127.0.0.1:9464"], rule_files=rules, alertmanager_url=am.url
    ) as prom:
        prom.query("up")                       # instant query: list of {"metric", "value"}
        firing = wait_until(lambda: am.alerts(alertname="TrainingStraggler"), timeout=60)

Binaries are the pinned versions (deploy/versions.env, fetched into .tools/ by `make tools`) found
by helpers.pinned.require_binary: a missing or wrong-version binary fails under CI and skips
locally. Only the standard library is used for HTTP.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from helpers.pinned import require_binary
from helpers.ports import free_port

T = TypeVar("T")

READY_TIMEOUT_S = 30.0
ALERTMANAGER_ASSETS = "alertmanager-debian-share-assets"


# --- helpers -----------------------------------------------------------------------------------------
def http_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read().decode())


def wait_until(fn: Callable[[], T], timeout: float = 30.0, interval: float = 0.5, what: str = "") -> T:
    """Call `fn` until it returns something truthy; return it, or raise TimeoutError after `timeout`."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while True:
        try:
            result = fn()
            if result:
                return result
        except (OSError, urllib.error.URLError, ValueError) as exc:  # not up yet / bad answer
            last_exc = exc
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_exc!r})" if last_exc else ""
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what or fn!r}{detail}")
        time.sleep(interval)


def tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "<no log>"


def _stop(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


def _start(
    argv_for_port: Callable[[int], list[str]], workdir: Path, name: str, ready_path: str = "/-/ready"
) -> tuple[subprocess.Popen[bytes], int]:
    """Start a server on a free loopback port and wait for `ready_path`; retry on a port race."""
    log = workdir / f"{name}.log"
    last_error = ""
    for _attempt in range(3):
        port = free_port()
        with log.open("ab") as out:
            proc = subprocess.Popen(argv_for_port(port), stdout=out, stderr=subprocess.STDOUT, cwd=workdir)
        url = f"http://127.0.0.1:{port}{ready_path}"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        return proc, port
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.2)
        _stop(proc)
        last_error = tail(log)
        if "address already in use" not in last_error:
            break
    raise RuntimeError(f"{name} did not become ready; log tail:\n{last_error}")


@contextmanager
def serve(
    argv_for_port: Callable[[int], list[str]], workdir: Path, name: str, ready_path: str = "/-/ready"
) -> Iterator[int]:
    """Run a server from `workdir` until the block ends, then stop it and remove `workdir` (also
    when it never became ready: the error carries its log tail). Yields its port."""
    try:
        proc, port = _start(argv_for_port, workdir, name, ready_path)
        try:
            yield port
        finally:
            _stop(proc)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def link_alertmanager_assets(binary: str, workdir: Path) -> None:
    """The pinned Debian builds read default.tmpl from ./alertmanager-debian-share-assets (see
    deploy/fetch-tools.sh); the servers run in `workdir`."""
    assets = Path(binary).parent / ALERTMANAGER_ASSETS
    if assets.exists():
        (workdir / ALERTMANAGER_ASSETS).symlink_to(assets.resolve())


# --- Alertmanager ----------------------------------------------------------------------------------
_DEFAULT_AM_CONFIG = {
    "route": {
        "receiver": "null",
        "group_by": ["alertname", "run_id"],
        "group_wait": "1s",
        "group_interval": "1s",
        "repeat_interval": "1h",
    },
    "receivers": [{"name": "null"}],
}


@dataclass
class Alertmanager:
    url: str
    workdir: Path

    def alerts(self, active_only: bool = True, **labels: str) -> list[dict[str, Any]]:
        """Alerts Alertmanager holds (/api/v2/alerts), optionally filtered by exact label values."""
        query = urllib.parse.urlencode({"active": "true"} if active_only else {})
        items = http_json(f"{self.url}/api/v2/alerts?{query}")
        return [a for a in items if all(a["labels"].get(k) == v for k, v in labels.items())]

    def log(self) -> str:
        return tail(self.workdir / "alertmanager.log", 200)


@contextmanager
def alertmanager(config: str | Path | dict[str, Any] | None = None) -> Iterator[Alertmanager]:
    """A real Alertmanager on 127.0.0.1 (no clustering); `config` is a path, a dict, or a null receiver."""
    binary = require_binary("prometheus-alertmanager")
    workdir = Path(tempfile.mkdtemp(prefix="otel_train_am_"))
    if config is None or isinstance(config, dict):
        config_path = workdir / "alertmanager.yml"
        config_path.write_text(yaml.safe_dump(config or _DEFAULT_AM_CONFIG))
    else:
        config_path = Path(config).resolve()
    (workdir / "data").mkdir()
    link_alertmanager_assets(binary, workdir)
    with serve(
        lambda port: [
            binary,
            f"--config.file={config_path}",
            f"--storage.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
            "--log.level=info",
        ],
        workdir,
        "alertmanager",
    ) as port:
        yield Alertmanager(url=f"http://127.0.0.1:{port}", workdir=workdir)


# --- Prometheus ------------------------------------------------------------------------------------
@dataclass
class Prometheus:
    url: str
    workdir: Path

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; returns the `result` list (vector: [{"metric": {...}, "value": [t, "v"]}])."""
        qs = urllib.parse.urlencode({"query": expr})
        body = http_json(f"{self.url}/api/v1/query?{qs}")
        if body.get("status") != "success":
            raise ValueError(f"query {expr!r} failed: {body}")
        return body["data"]["result"]

    def value(self, expr: str) -> float | None:
        """The single value of an instant query, or None when it returns nothing."""
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def alerts(self, state: str | None = None, **labels: str) -> list[dict[str, Any]]:
        """Prometheus' own view of its alerts (/api/v1/alerts): pending and firing."""
        items = http_json(f"{self.url}/api/v1/alerts")["data"]["alerts"]
        return [
            a
            for a in items
            if (state is None or a["state"] == state)
            and all(a["labels"].get(k) == v for k, v in labels.items())
        ]

    def targets_up(self) -> int:
        """Number of scrape targets currently up."""
        return int(self.value("count(up == 1)") or 0)

    def log(self) -> str:
        return tail(self.workdir / "prometheus.log", 200)


@contextmanager
def prometheus(
    targets: Sequence[str],
    rule_files: Iterable[str | Path] = (),
    alertmanager_url: str | None = None,
    scrape_interval: str = "1s",
    evaluation_interval: str = "1s",
    job: str = "otel_train",
    honor_labels: bool = False,
    metrics_path: str = "/metrics",
    extra_args: Sequence[str] = (),
) -> Iterator[Prometheus]:
    """A real Prometheus on 127.0.0.1 scraping `targets` ("host:port"), with `rule_files` loaded;
    `extra_args` are more command-line flags (e.g. `--enable-feature=...`)."""
    binary = require_binary("prometheus")
    workdir = Path(tempfile.mkdtemp(prefix="otel_train_prom_"))
    config: dict[str, Any] = {
        "global": {
            "scrape_interval": scrape_interval,
            "scrape_timeout": scrape_interval,
            "evaluation_interval": evaluation_interval,
        },
        "rule_files": [str(Path(p).resolve()) for p in rule_files],
        "scrape_configs": [
            {
                "job_name": job,
                "honor_labels": honor_labels,
                "metrics_path": metrics_path,
                "static_configs": [{"targets": list(targets)}],
            }
        ],
    }
    if alertmanager_url:
        parsed = urllib.parse.urlparse(alertmanager_url)
        config["alerting"] = {
            "alertmanagers": [
                {"scheme": parsed.scheme or "http", "static_configs": [{"targets": [parsed.netloc]}]}
            ]
        }
    config_path = workdir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    (workdir / "data").mkdir()
    link_alertmanager_assets(binary, workdir)
    with serve(
        lambda port: [
            binary,
            f"--config.file={config_path}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--rules.alert.resend-delay=1s",
            "--log.level=info",
            *extra_args,
        ],
        workdir,
        "prometheus",
    ) as port:
        yield Prometheus(url=f"http://127.0.0.1:{port}", workdir=workdir)


# --- rule files with short windows, for end-to-end tests -----------------------------------------------
_DURATION_RE = re.compile(r"(\d+)(ms|[smhdwy])")
_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
_RANGE_RE = re.compile(r"\[((?:\d+(?:ms|[smhdwy]))+)(?::((?:\d+(?:ms|[smhdwy]))+))?\]")
_OFFSET_RE = re.compile(r"\boffset\s+((?:\d+(?:ms|[smhdwy]))+)")


def duration_seconds(text: str) -> float:
    """Seconds in a Prometheus duration such as `5m`, `1h30m`, `250ms`."""
    if not re.fullmatch(r"(?:\d+(?:ms|[smhdwy]))+", text):
        raise ValueError(f"not a Prometheus duration: {text!r}")
    return sum(int(n) * _UNIT_S[u] for n, u in _DURATION_RE.findall(text))


def _scaled(text: str, scale: float, minimum_s: int) -> str:
    return f"{max(minimum_s, round(duration_seconds(text) / scale))}s"


def shorten_expr(expr: str, scale: float = 30, minimum_s: int = 5) -> str:
    """Divide every range `[d]`, subquery `[d:r]` and `offset d` in a PromQL expression by `scale`."""

    def rng(m: re.Match[str]) -> str:
        step = f":{_scaled(m.group(2), scale, 1)}" if m.group(2) else ""
        return f"[{_scaled(m.group(1), scale, minimum_s)}{step}]"

    expr = _RANGE_RE.sub(rng, expr)
    return _OFFSET_RE.sub(lambda m: f"offset {_scaled(m.group(1), scale, minimum_s)}", expr)


def shorten_rules(
    rule_files: Iterable[str | Path],
    dest_dir: str | Path,
    for_: str | None = "5s",
    scale: float = 30,
    minimum_s: int = 5,
) -> list[Path]:
    """Test-only copies of rule files with short `for:` (`for_`, or scaled when None) and windows.

    A 5m `rate` window becomes 10s at scale 30: with a 1s scrape interval the rules then behave as
    in production, only 30x faster. Group `interval:` overrides are dropped (the global 1s applies).
    """
    dest = Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    out: list[Path] = []
    for src in map(Path, rule_files):
        doc = yaml.safe_load(src.read_text())
        for group in doc.get("groups", []):
            group.pop("interval", None)
            for rule in group.get("rules", []):
                rule["expr"] = shorten_expr(str(rule["expr"]), scale, minimum_s)
                if "for" in rule:
                    rule["for"] = for_ if for_ is not None else _scaled(rule["for"], scale, 1)
        target = dest / f"short_{src.name}"
        target.write_text(yaml.safe_dump(doc, sort_keys=False))
        out.append(target)
    return out
