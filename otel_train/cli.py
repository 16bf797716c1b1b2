"""`otel-train`: demo, doctor, dashboards."""

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
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from otel_train.demo.train import main as demo_main

        return demo_main(rest)
    if command == "doctor":
        return doctor()
    parser.parse_args(argv)  # prints the usage error
    return 2


def doctor() -> int:
    """Print what otel_train would do here and whether each piece is reachable."""
    from importlib.util import find_spec

    from otel_train.config import ConfigError, load_config, redact_url

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
    for extra, module in (
        ("tensorboard", "tensorboard"),
        ("wandb", "wandb"),
        ("mlflow", "mlflow"),
        ("gpu", "pynvml"),
    ):
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
