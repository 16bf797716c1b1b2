"""A stand-in for the otelcol-contrib binary, for running deploy/slurm/otel-train.sbatch here.

`python tests/helpers/fake_otelcol.py --config=PATH` (tests/ on PYTHONPATH) reads the collector
config as the real collector does (`${env:NAME}` resolved from the environment, a missing variable
is an error), serves OTLP/HTTP on its otlp receiver's http endpoint (decoded by
tests/helpers/otlp_receiver.py), and on SIGTERM writes the metric names and resource attributes it
received to $FAKE_OTELCOL_REPORT as JSON, then exits 0. Its pid goes to $FAKE_OTELCOL_REPORT.pid,
so a test can stop one the job script failed to stop.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import threading
from pathlib import Path
from typing import Any

import yaml

from helpers.otlp_receiver import http_receiver


def resolve_env(text: str) -> str:
    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in os.environ:
            raise SystemExit(f"fake otelcol: ${{env:{name}}} is not set")
        return os.environ[name]

    return re.sub(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}", value, text)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    config: dict[str, Any] = yaml.safe_load(resolve_env(Path(parser.parse_args().config).read_text()))
    host, port = config["receivers"]["otlp"]["protocols"]["http"]["endpoint"].rsplit(":", 1)
    assert host == "127.0.0.1", host
    report_path = Path(os.environ["FAKE_OTELCOL_REPORT"])
    Path(f"{report_path}.pid").write_text(str(os.getpid()))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with http_receiver(int(port)) as (_url, received):
        stop.wait()
        report = {
            "config": config,
            "metrics": sorted(received.metric_points()),
            "resources": [res for points in received.metric_points().values() for res, _m, _u in points],
        }
    report_path.write_text(json.dumps(report, default=str))


if __name__ == "__main__":
    main()
