"""env.json: what ran where (Python, packages, host, CPUs/GPUs, git commit). No environment dump."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from importlib import metadata
from typing import Any

# The bridges' packages come from the bridge table (bridges/table.py).
_PACKAGES = (
    "otel-train", "torch", "numpy", "opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http",
    "opentelemetry-exporter-prometheus", "prometheus-client", "nvidia-ml-py",
)  # fmt: skip
# Environment variables that describe placement; values are not secrets. Nothing else is recorded.
_PLACEMENT_ENV = (
    "CUDA_VISIBLE_DEVICES", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
    "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NODEID", "SLURM_NTASKS",
)  # fmt: skip


def collect_env() -> dict[str, Any]:
    from otel_train.bridges.table import BRIDGES

    packages = {}
    for name in _PACKAGES + tuple(b.distribution for b in BRIDGES):
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return {
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "gpus": _gpus(),
        "packages": packages,
        "git_commit": _git_commit(),
        "placement_env": {k: os.environ[k] for k in _PLACEMENT_ENV if k in os.environ},
        "argv": [os.path.basename(sys.argv[0])] if sys.argv else [],
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _gpus() -> list[dict[str, Any]]:
    torch = sys.modules.get("torch")  # never import torch just for this
    if torch is None or not torch.cuda.is_available():
        return []
    devices = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    return [{"index": i, "name": p.name, "memory_bytes": p.total_memory} for i, p in enumerate(devices)]


def _git_commit() -> str | None:
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=2, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() or None if result.returncode == 0 else None
