"""The pinned versions of the stack's real components (deploy/versions.env) and their binaries.

`deploy/fetch-tools.sh` (run by `make test`) unpacks Debian's packages of exactly these versions
into `.tools/` (or $OTEL_TRAIN_TOOLS); `binary(name)` finds a binary there first, then on PATH,
and accepts it only when it reports the pinned version, so a test never passes on the wrong
Prometheus. `require_binary(name)` is what a test calls: the path, or a failure under CI and a
skip elsewhere.
"""

from __future__ import annotations

import functools
import gzip
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VERSIONS_FILE = REPO / "deploy" / "versions.env"


def tools_bin() -> Path:
    return Path(os.environ.get("OTEL_TRAIN_TOOLS") or REPO / ".tools") / "bin"


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of a dotenv/shell file (comments and blank lines skipped)."""
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition("=")
        out[key.strip()] = value.strip().strip("'\"")
    return out


def upstream_version(debian_version: str) -> str:
    """`3.5.3+ds1-6` -> `3.5.3`, `2.40.3-3` -> `2.40.3` (what the binary itself reports)."""
    return debian_version.split("+", 1)[0].rsplit("-", 1)[0]


@functools.cache
def pinned() -> dict[str, str]:
    """Component -> upstream version: prometheus, alertmanager, docker-compose, victoria-metrics,
    otelcol-contrib."""
    env = read_env_file(VERSIONS_FILE)
    return {
        "prometheus": upstream_version(env["PROMETHEUS_DEB"]),
        "alertmanager": upstream_version(env["ALERTMANAGER_DEB"]),
        "docker-compose": upstream_version(env["DOCKER_COMPOSE_DEB"]),
        "victoria-metrics": upstream_version(env["VICTORIAMETRICS_DEB"]),
        "otelcol-contrib": env["OTELCOL_CONTRIB_VERSION"],
    }


# binary name -> (component whose version it must report, argv to print that version)
VERSION_COMMANDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "prometheus": ("prometheus", ("--version",)),
    "promtool": ("prometheus", ("--version",)),
    "prometheus-alertmanager": ("alertmanager", ("--version",)),
    "alertmanager": ("alertmanager", ("--version",)),
    "amtool": ("alertmanager", ("--version",)),
    "docker-compose": ("docker-compose", ("version",)),
    "victoria-metrics": ("victoria-metrics", ("-version",)),
    "vmalert": ("victoria-metrics", ("-version",)),
}
# Debian builds these without their version string (`-version` prints an empty line): their
# version is the one in the Debian package they came from (its changelog, next to the binary).
DEBIAN_PACKAGE_OF = {"victoria-metrics": "victoria-metrics", "vmalert": "victoria-metrics"}


@functools.cache
def reported_version(path: str, name: str) -> str:
    """First line the binary prints for its version command ('' when it does not run)."""
    _, argv = VERSION_COMMANDS[name]
    try:
        proc = subprocess.run([path, *argv], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    if lines and lines[0].strip():
        return lines[0]
    package = DEBIAN_PACKAGE_OF.get(name)
    if proc.returncode != 0 or package is None:
        return ""
    return debian_package_line(Path(path), package)


def debian_package_line(binary: Path, package: str) -> str:
    """'<package> (Debian package), version <v>' from the changelog of the package that holds
    `binary` (<prefix>/usr/bin/x -> <prefix>/usr/share/doc/<package>/changelog.Debian.gz)."""
    changelog = binary.resolve().parent.parent / "share" / "doc" / package / "changelog.Debian.gz"
    try:
        with gzip.open(changelog, "rt") as f:
            first = f.readline()
    except OSError:
        return ""
    match = re.match(r"\S+ \(([^)]+)\)", first)
    return f"{package} (Debian package), version {upstream_version(match[1])}" if match else ""


def is_pinned(line: str, version: str) -> bool:
    return re.search(rf"version v?{re.escape(version)}(?![\d.])", line) is not None


def find(name: str) -> tuple[str | None, str]:
    """(path of `name` at the pinned version or None, explanation of what was found instead)."""
    component, _ = VERSION_COMMANDS[name]
    version = pinned()[component]
    seen: list[str] = []
    candidates = [tools_bin() / name, shutil.which(name)]
    for candidate in candidates:
        if candidate is None or not Path(candidate).exists():
            continue
        line = reported_version(str(candidate), name)
        if is_pinned(line, version):
            return str(candidate), ""
        seen.append(f"{candidate}: {line or 'does not run'}")
    found = "; found " + ", ".join(seen) if seen else ""
    return None, (
        f"{name} {version} (pinned in deploy/versions.env) not found in {tools_bin()} or on PATH{found}. "
        "Run `make tools` (deploy/fetch-tools.sh)."
    )


def require_binary(name: str) -> str:
    """Path of a real component (prometheus, promtool, prometheus-alertmanager, amtool,
    docker-compose) at the version deploy/versions.env pins: from `.tools/bin` (filled by
    `make tools`), else from PATH when that one reports the pinned version.

    Under CI (the CI variable set) a missing or wrong-version component is a failure, never a
    silent skip.
    """
    path, message = find(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"CI requires real components: {message}")
        pytest.skip(message)
    return path
