"""`otel-train`: demo, doctor, diagnose, dashboards."""

from __future__ import annotations

import argparse
import socket
import sys
from urllib.parse import urlparse


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="otel-train", description="OpenTelemetry-native observability for ML training."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "demo",
        help="train a tiny char-level transformer, fully instrumented (--help for flags)",
        add_help=False,
    )
    sub.add_parser("doctor", help="check configuration, endpoints, NVML and optional packages")
    sub.add_parser(
        "diagnose",
        help="name the rank a hung job waited for, from its run directory: RUN_DIR [--role ROLE]",
    )
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from otel_train.demo.train import main as demo_main

        return demo_main(rest)
    if command == "doctor":
        return doctor()
    if command == "diagnose" and len(rest) in (1, 3) and rest[1:2] in ([], ["--role"]):
        return diagnose(rest[0], rest[2] if len(rest) == 3 else "")
    parser.parse_args(argv)  # prints the usage error
    return 2


def diagnose(run_dir: str, role: str = "") -> int:
    """Print the hang verdict from the `collectives.rank<k>.json` files the ranks left at their stall
    (see otel_train/diagnostics/hang_attribution.py); 1 when there is none to give."""
    from pathlib import Path

    from otel_train.diagnostics import attribute, read_summaries

    summaries = read_summaries(Path(run_dir), role=role)
    if summaries:  # the last stall only: a rank's file from an earlier, resolved stall is stale
        newest = max(float(s["written_at"]) for s in summaries.values())
        window = max(float(s.get("stall_timeout_s", 0.0)) for s in summaries.values())
        summaries = read_summaries(Path(run_dir), newest - window, role)
    if not summaries:
        print(
            f"{run_dir}: no collectives.rank<k>.json (no rank stalled with PyTorch's Flight Recorder "
            "on: set TORCH_FR_BUFFER_SIZE before init_process_group)"
        )
        return 1
    world_size = max(int(s.get("world_size", 0)) for s in summaries.values())
    verdicts = attribute(summaries, world_size)
    print(f"{run_dir}: summaries from ranks {sorted(summaries)} of {world_size}")
    for verdict in verdicts:
        print(verdict.describe(summaries))
    if not verdicts:
        print("no rank behind the others: every rank that left a summary is in the same collective")
    return 0 if verdicts else 1


def doctor() -> int:
    """Print what otel_train would do here and whether each piece is reachable."""
    from importlib.util import find_spec

    from otel_train.config import ConfigError
    from otel_train.config_loading import load_config
    from otel_train.redaction import redact_url

    ok = True
    try:
        config = load_config()
    except ConfigError as exc:
        print(f"config: INVALID - {exc}")
        return 1
    print("config: ok")
    if config.otlp_endpoint:
        parsed = urlparse(config.otlp_endpoint)
        port = parsed.port or (4317 if config.otlp_protocol == "grpc" else 4318)
        try:
            with socket.create_connection((parsed.hostname or "localhost", port), timeout=2):
                print(f"otlp: {redact_url(config.otlp_endpoint)} ({config.otlp_protocol}) reachable")
        except OSError as exc:
            ok = False
            print(
                f"otlp: {redact_url(config.otlp_endpoint)} NOT reachable ({exc}); training still runs, exports are dropped"
            )
    else:
        print("otlp: off (set OTEL_EXPORTER_OTLP_ENDPOINT, e.g. http://127.0.0.1:4318)")
    if config.prometheus_port:
        with socket.socket() as sock:
            busy = sock.connect_ex((config.prometheus_host, config.prometheus_port)) == 0
        state = "BUSY (another job?)" if busy else "free"
        print(
            f"prometheus pull endpoint: {config.prometheus_host}:{config.prometheus_port}+local_rank ({state})"
        )
    from otel_train.bridges.table import BRIDGES

    for extra, module in [(b.extra, b.import_name) for b in BRIDGES] + [("gpu", "pynvml")]:
        present = find_spec(module) is not None
        print(
            f"extra [{extra}]: {'installed' if present else 'missing: pip install otel-train[' + extra + ']'}"
        )
    if find_spec("pynvml") is not None:
        try:
            import pynvml

            pynvml.nvmlInit()
            print(f"nvml: {pynvml.nvmlDeviceGetCount()} GPU(s), driver {pynvml.nvmlSystemGetDriverVersion()}")
            pynvml.nvmlShutdown()
        except Exception as exc:
            print(f"nvml: unavailable ({exc}); no GPU metrics")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
