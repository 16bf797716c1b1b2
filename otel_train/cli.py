"""`otel-train`: doctor, diagnose (also `python -m otel_train`)."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from otel_train.config import Config


_DEMO_MOVED = (
    "otel-train demo: error: the demo is not part of the installed package; from a source checkout "
    "of otel_train run `make demo` (or `python -m examples.demo` from the repository root)"
)


def build_parser() -> argparse.ArgumentParser:
    from otel_train.version import __version__

    parser = argparse.ArgumentParser(
        prog="otel-train", description="OpenTelemetry-native observability for ML training."
    )
    parser.add_argument("--version", action="version", version=f"otel-train {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{doctor,diagnose}")
    sub.add_parser(
        "doctor",
        help="check configuration, endpoints, NVML and optional packages",
        description="Check what otel_train would do here: configuration (the OTEL_TRAIN_* and OTEL_* "
        "variables), the output directory, the OTLP endpoint, the pull port, the extras and NVML. "
        "Exit 1 when something would fail or lose data.",
    )
    diagnose_parser = sub.add_parser(
        "diagnose",
        help="name the rank a hung job waited for, from its run directory: RUN_DIR [--role ROLE]",
        description="Name the rank a hung job waited for, from the collectives.rank<k>.json files the "
        "ranks wrote at their stall (PyTorch's Flight Recorder on). Exit 0 with a verdict, 1 without.",
    )
    diagnose_parser.add_argument("run_dir", metavar="RUN_DIR", help="the job's run directory")
    diagnose_parser.add_argument(
        "--role", default="", help="the ranks' role, for a job whose ranks have one (ot.init(role=...))"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        return _run(argv)
    except BrokenPipeError:  # `otel-train doctor | head`: the reader left, which is no error to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # exit's flush would raise again
        return 1


def _run(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] == ["demo"]:  # argparse's "invalid choice" would not say where the demo went
        print(_DEMO_MOVED, file=sys.stderr)
        return 2
    args = parser.parse_args(argv)  # a usage error exits 2
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "doctor":
        return doctor()
    return diagnose(args.run_dir, args.role)


def diagnose(run_dir: str, role: str = "") -> int:
    """Print the hang verdict from the `collectives.rank<k>.json` files the ranks left at their
    stall; 1 when there is none to give, 2 when RUN_DIR is not a directory."""
    from otel_train.diagnostics import attribute, scan_summaries, summary_since, with_launch_hosts
    from otel_train.run_directory import RunFiles

    directory = Path(run_dir)
    if not directory.is_dir():
        what = "does not exist" if not directory.exists() else "is not a directory"
        print(f"otel-train diagnose: {run_dir} {what} (give the job's run directory)", file=sys.stderr)
        return 2
    summaries, skipped = scan_summaries(directory, role=role)
    for line in skipped:  # a rank whose file is damaged is not one that left none
        print(f"skipped {line}", file=sys.stderr)
    if summaries:  # the last stall only: a rank's file from an earlier, resolved stall is stale
        # from the newest stall summary: a busy rank's answer (`progressing`) comes a grace later
        stalled = [s for s in summaries.values() if s.get("progressing") is not True] or list(
            summaries.values()
        )
        latest = max(stalled, key=lambda s: float(s["written_at"]))
        newest = float(latest["written_at"])
        window = max(float(s.get("stall_timeout_s") or 0.0) for s in summaries.values())
        since = summary_since(RunFiles(directory, int(latest["rank"]), role).collectives, newest, window)
        summaries = scan_summaries(directory, since, role)[0]
    if not summaries:
        print(f"{run_dir}: {_no_summaries(directory, role)}")
        return 1
    world_size = max(int(s.get("world_size") or 0) for s in summaries.values())
    world_size = max(world_size, max(summaries) + 1)
    verdicts = attribute(summaries, world_size)
    print(f"{run_dir}: summaries from ranks {sorted(summaries)} of {world_size}")
    named = with_launch_hosts(summaries, directory, role)
    for verdict in verdicts:
        print(verdict.describe(named))
    absent = sorted(set(range(world_size)) - set(summaries))
    pending = any(
        g["last_completed"] < g["last_enqueued"] for s in summaries.values() for g in s["groups"].values()
    )
    if not verdicts and absent:
        where = "is in the same collective" if pending else "was inside no collective"
        print(
            f"no verdict: rank(s) {', '.join(map(str, absent))} left no readable summary, and every rank "
            f"that did {where} (read the stacks.rank<k>.*.txt files of those ranks)"
        )
    elif not verdicts and not pending:
        print(
            "no rank was inside a collective when it stalled: the stall is outside collectives (a data "
            "wait, an evaluation, the loop itself): read the stacks.rank<k>.*.txt files"
        )
    elif not verdicts:
        print("no rank behind the others: every rank that left a summary is in the same collective")
    went_on = _went_on_after(directory, newest, role)
    if went_on is not None:
        step, later_s = went_on
        print(
            f"the run went on after this stall: its last metrics row (step {step}) came {later_s:.0f} s "
            "later, so the stall resolved (a slow rank, not a hang)"
        )
    return 0 if verdicts else 1


def _went_on_after(directory: Path, stalled_at: float, role: str) -> tuple[int, float] | None:
    """(step, seconds after `stalled_at`) of the latest metrics row written after it, if any."""
    from otel_train.run_directory import RunFiles

    latest: tuple[int, float] | None = None
    for path in directory.glob(RunFiles(directory, role=role).metrics_glob):
        row = _last_row(path)
        if row is not None and _after(row, stalled_at, latest):
            latest = (int(row["step"]), float(row["time"]) - stalled_at)
    return latest


def _after(row: dict, stalled_at: float, latest: tuple[int, float] | None) -> bool:
    time_, step = row.get("time"), row.get("step")
    if not isinstance(time_, (int, float)) or not isinstance(step, int) or time_ <= stalled_at:
        return False
    return latest is None or time_ - stalled_at > latest[1]


def _last_row(path: Path) -> dict | None:
    """The last whole JSON line of a metrics file, read from its end (it may be large)."""
    from otel_train.run_directory import read_regular_file

    try:
        lines = read_regular_file(path, 65536, tail=True).splitlines()
        row = json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):  # unreadable, or a torn last line
        return None
    return row if isinstance(row, dict) else None


def _no_summaries(directory: Path, role: str) -> str:
    """Why there is no verdict: another role's files, or no rank stalled with the recorder on."""
    from otel_train.run_directory import RunFiles

    files = RunFiles(directory, role=role).collectives_glob
    pattern = files.replace("*", "<k>")
    if any(directory.glob(files)):
        return f"no readable {pattern}: every one was skipped (above)"
    named = (
        re.match(r"collectives\.(.+)\.rank\d+\.json$", p.name) for p in directory.glob("collectives.*.json")
    )
    roles = sorted({m.group(1) for m in named if m} - {role})
    if roles:
        return f"no readable {pattern}; there are files of role(s) {', '.join(roles)}: pass --role {roles[0]}"
    if role and any(directory.glob(RunFiles(directory).collectives_glob)):
        return f"no readable {pattern}; there are files of ranks without a role: leave out --role"
    config = RunFiles(directory, role=role).config
    if role and not config.is_file() and RunFiles(directory).config.is_file():
        return f"the run has no role {role!r} (its ranks have none): leave out --role"
    run_roles = sorted(p.name[len("config.") : -len(".json")] for p in directory.glob("config.*.json"))
    if not config.is_file() and run_roles:
        what = f"the run has no role {role!r}" if role else "the run's ranks have roles"
        return f"no readable {pattern}; {what} ({', '.join(run_roles)}): pass --role {run_roles[0]}"
    if not config.is_file():  # not a run directory: its parent, or elsewhere
        runs = sorted(p.parent.name for p in directory.glob(f"*/{config.name}"))
        inside = f"; the run directories in it: {', '.join(runs[:5])}{' ...' if len(runs) > 5 else ''}"
        return f"not a run directory (no {config.name}){inside if runs else ''}: give the job's run directory"
    return (
        f"no readable {pattern} (no rank stalled with PyTorch's Flight Recorder on: it is torch's "
        "default unless TORCH_FR_BUFFER_SIZE=0)"
    )


def doctor() -> int:
    """Print what otel_train would do here and whether each piece works; 1 when one would fail or
    lose data."""
    from importlib.util import find_spec

    from otel_train.config import ConfigError
    from otel_train.config_loading import load_config

    try:
        config = load_config()
    except ConfigError as exc:
        print(f"config: INVALID - {exc}")
        return 1
    print("config: ok")
    ok = _output_dir_ok(config) & _otlp_ok(config) & _pull_port_ok(config)  # `&`: every check prints
    from otel_train.bridges.table import BRIDGES

    for extra, modules in [(b.extra, b.import_names) for b in BRIDGES] + [("gpu", ("pynvml",))]:
        missing = [module for module in modules if find_spec(module) is None]
        # quoted as the README quotes it: zsh reads an unquoted [...] as a glob
        hint = f'missing: pip install "otel-train[{extra}]"'
        if missing == ["torch"]:  # not in the extra: the user picks its CPU or CUDA build
            hint = "missing: PyTorch, which writes the TensorBoard files (torch.utils.tensorboard)"
        print(f"extra [{extra}]: {'installed' if not missing else hint}")
    if find_spec("pynvml") is not None:
        try:
            import pynvml

            pynvml.nvmlInit()
            print(f"nvml: {pynvml.nvmlDeviceGetCount()} GPU(s), driver {pynvml.nvmlSystemGetDriverVersion()}")
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            print(f"nvml: unavailable ({exc}); no GPU metrics")
    return 0 if ok else 1


def _output_dir_ok(config: Config) -> bool:
    """Can init() make the run directory (under the nearest existing parent), as it resolves it?"""
    if not config.run_dir_enabled:
        print("output dir: off (run_dir_enabled=False)")
        return True
    output = Path(config.output_dir)  # as make_run_dir takes it: relative to here, no ~ expansion
    # os.path, not Path.exists(): before Python 3.13 that raises PermissionError under a directory
    # this user may not enter (OTEL_TRAIN_OUTPUT_DIR=/root/runs); here that is "NOT writable"
    existing = next((p for p in (output, *output.parents) if os.path.exists(p)), None)
    if existing is None or not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        print(f"output dir: {output} NOT writable; init() would fail: set OTEL_TRAIN_OUTPUT_DIR")
        return False
    print(f"output dir: {output} ({'exists' if os.path.exists(output) else 'created at init()'})")
    return True


OTLP_PROBE_S = 3.0  # the longest the doctor waits for the collector (an export and a connect each)


def _otlp_ok(config: Config) -> bool:
    """Does each collector init() pushes to take an OTLP export (`otlp_probes`)? A port that only
    accepts TCP is no collector."""
    from dataclasses import replace

    from otel_train.exporters import otlp_probes, quiet_sdk_exporter_logs

    probes = otlp_probes(config)
    if not probes:
        print("otlp: off (set OTEL_EXPORTER_OTLP_ENDPOINT, e.g. http://127.0.0.1:4318)")
        return True
    quiet_sdk_exporter_logs()  # its per-retry lines are not the doctor's verdict
    probing = replace(config, otlp_timeout_s=min(config.otlp_timeout_s, OTLP_PROBE_S))
    return all([_otlp_probe_ok(probing, signal, url) for signal, url in probes])


def _otlp_probe_ok(config: Config, signal: str, url: str) -> bool:
    from otel_train.config import ConfigError
    from otel_train.exporters import export_failure_cause, otlp_probe
    from otel_train.redaction import redact_url

    what = "otlp:" if signal == "metrics" else f"otlp {signal}:"
    own = url != config.otlp_endpoint  # the signal's own URL, not the base one
    variable = f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT" if own else "OTEL_EXPORTER_OTLP_ENDPOINT"
    try:
        accepted = otlp_probe(config, signal)
    except ConfigError as exc:  # a setting the exporter cannot take (the message holds no secret)
        print(f"{what} INVALID - {exc}")
        return False
    except Exception as exc:  # a bad URL or TLS file: the exporter raises rather than fails
        # Its type only: the message may quote the URL or a header, secrets included.
        accepted, cause = False, f"the exporter failed ({type(exc).__name__})"
    else:
        cause = "" if accepted else export_failure_cause(url, config.otlp_protocol, OTLP_PROBE_S, signal)
    endpoint = f"{redact_url(url)} ({config.otlp_protocol})"
    if accepted:
        print(f"{what} {endpoint} reachable (it accepted an empty OTLP export)")
        return True
    print(
        f"{what} {endpoint} NOT reachable: {cause}; training still runs, exports are dropped. Fix "
        f"{variable} (the collector's OTLP port: 4317 for grpc, 4318 for http/protobuf), "
        "OTEL_EXPORTER_OTLP_PROTOCOL to match it, or OTEL_EXPORTER_OTLP_HEADERS"
    )
    return False


def _pull_port_ok(config: Config) -> bool:
    """Is local rank 0's pull port free (a busy one is skipped at init(), with a warning)?"""
    if not config.prometheus_port:
        print("prometheus pull endpoint: off")
        return True
    where = f"{config.prometheus_host}:{config.prometheus_port}"
    try:  # the host's own address family: "::" is IPv6; a name that does not resolve raises
        family, kind, proto, _, address = socket.getaddrinfo(
            config.prometheus_host, config.prometheus_port, type=socket.SOCK_STREAM
        )[0]
        with socket.socket(family, kind, proto) as sock:
            busy = sock.connect_ex(address) == 0
    except (OSError, UnicodeError) as exc:  # UnicodeError: a host name label over 63 characters
        print(
            f"prometheus pull endpoint: {where} cannot be checked ({exc}); init() could not serve "
            "it: set OTEL_TRAIN_PROMETHEUS_HOST to an address of this machine"
        )
        return False
    state = (
        "BUSY (another job?): no endpoint for this job; set OTEL_TRAIN_PROMETHEUS_PORT" if busy else "free"
    )
    print(f"prometheus pull endpoint: {where}+local_rank ({state})")
    return not busy


if __name__ == "__main__":
    raise SystemExit(main())
