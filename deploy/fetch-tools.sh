#!/usr/bin/env bash
# Fetch the exact Prometheus/promtool, Alertmanager/amtool, Docker Compose and
# VictoriaMetrics/vmalert versions that deploy/versions.env pins into a project-local tools folder
# (default: .tools/ at the repo root, git-ignored), for the tests and `make check-deploy`.
#
#   deploy/fetch-tools.sh            # idempotent: does nothing when the pinned versions are there
#   OTEL_TRAIN_TOOLS=/elsewhere deploy/fetch-tools.sh
#
# How: `apt-get download` from Debian's archive with a private sources list, lists directory and
# cache (nothing is added to the system's apt configuration, nothing is installed system-wide),
# then `dpkg-deb -x` into <tools>/root. The binaries are linked from <tools>/bin.
# The archive's address is taken from this machine's own apt configuration (override with
# DEBIAN_MIRROR=<uri>); only the suites are added.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(dirname "$here")"
versions="$here/versions.env"
tools="${OTEL_TRAIN_TOOLS:-$repo/.tools}"
# shellcheck source=versions.env
. "$versions"

upstream() { local v="${1%%+*}"; echo "${v%-*}"; }
PROMETHEUS_VERSION="$(upstream "$PROMETHEUS_DEB")"
ALERTMANAGER_VERSION="$(upstream "$ALERTMANAGER_DEB")"
DOCKER_COMPOSE_VERSION="$(upstream "$DOCKER_COMPOSE_DEB")"
VICTORIAMETRICS_VERSION="$(upstream "$VICTORIAMETRICS_DEB")"

# name in bin/ -> path inside the unpacked packages
links=(
  "prometheus:usr/bin/prometheus"
  "promtool:usr/bin/promtool"
  "amtool:usr/bin/amtool"
  "docker-compose:usr/libexec/docker/cli-plugins/docker-compose"
  "victoria-metrics:usr/bin/victoria-metrics"
  "vmalert:usr/bin/vmalert"
)
# Debian's alertmanager reads its notification templates (default.tmpl) and UI from the absolute
# directory /usr/share/prometheus/alertmanager (upstream embeds them), which an unpacked package
# does not have. bin/prometheus-alertmanager is a copy with that one path string replaced by a
# relative one of the same length: run it in a directory holding a link of that name to
# root/usr/share/prometheus/alertmanager (bin/ has one; tests/helpers/promstack.py makes one).
AM_ASSETS_SYSTEM=/usr/share/prometheus/alertmanager
AM_ASSETS_LOCAL=./alertmanager-debian-share-assets
# Bump when the layout of <tools> changes, so that an older .tools is rebuilt.
LAYOUT="# fetch-tools layout 3"
stamp() { cat "$versions"; echo "$LAYOUT"; }

# Debian builds VictoriaMetrics without its version string (`-version` prints an empty line), so
# its version is the one in the unpacked package's own changelog (tests/helpers/pinned.py reads it too).
debian_package_version() {
  gzip -dc "$tools/root/usr/share/doc/$1/changelog.Debian.gz" 2>/dev/null | head -n1 | sed -E 's/^[^ ]+ \(([^)]*)\).*/\1/'
}

# Every binary reports its pinned upstream version (VictoriaMetrics: its package does).
check_versions() {
  "$tools/bin/prometheus" --version 2>&1 | grep -q "version $PROMETHEUS_VERSION" &&
    "$tools/bin/promtool" --version 2>&1 | grep -q "version $PROMETHEUS_VERSION" &&
    "$tools/bin/prometheus-alertmanager" --version 2>&1 | grep -q "version $ALERTMANAGER_VERSION" &&
    "$tools/bin/amtool" --version 2>&1 | grep -q "version $ALERTMANAGER_VERSION" &&
    "$tools/bin/docker-compose" version 2>&1 | grep -q "version $DOCKER_COMPOSE_VERSION" &&
    "$tools/bin/victoria-metrics" -version >/dev/null 2>&1 &&
    "$tools/bin/vmalert" -version >/dev/null 2>&1 &&
    [ "$(upstream "$(debian_package_version victoria-metrics)")" = "$VICTORIAMETRICS_VERSION" ]
}

if [ "$(stamp)" = "$(cat "$tools/stamp" 2>/dev/null)" ] && check_versions 2>/dev/null; then
  echo "pinned tools present in $tools/bin (prometheus $PROMETHEUS_VERSION, alertmanager $ALERTMANAGER_VERSION, docker-compose $DOCKER_COMPOSE_VERSION, victoria-metrics $VICTORIAMETRICS_VERSION)"
  exit 0
fi

for cmd in apt-get apt-cache dpkg-deb perl; do
  if ! command -v "$cmd" >/dev/null; then
    echo "fetch-tools: $cmd not found: the pinned tools come from Debian's archive (a Debian/Ubuntu machine)," >&2
    echo "  or put prometheus $PROMETHEUS_VERSION, promtool, alertmanager $ALERTMANAGER_VERSION, amtool, docker-compose $DOCKER_COMPOSE_VERSION, victoria-metrics $VICTORIAMETRICS_VERSION and vmalert into $tools/bin yourself." >&2
    exit 1
  fi
done

# The Debian archive this machine already uses (first non-security entry).
mirror="${DEBIAN_MIRROR:-}"
if [ -z "$mirror" ]; then
  mirror="$(
    {
      cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk 'tolower($1)=="uris:" {for (i=2;i<=NF;i++) print $i}'
      cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null |
        sed -E 's/\[[^]]*\]//' | awk '$1=="deb" {print $2}'
    } | grep -v -e security -e '^$' | grep -E '/debian/?$' | head -n1
  )" || true
fi
if [ -z "$mirror" ]; then
  echo "fetch-tools: no Debian archive found in /etc/apt; set DEBIAN_MIRROR=<uri of a Debian mirror>" >&2
  exit 1
fi
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
if [ ! -r "$keyring" ]; then
  echo "fetch-tools: $keyring missing (Debian package debian-archive-keyring)" >&2
  exit 1
fi

apt_dir="$tools/apt"
mkdir -p "$apt_dir/lists/partial" "$apt_dir/archives/partial" "$apt_dir/cache"
{
  for suite in $(printf '%s\n' "$PROMETHEUS_SUITE" "$ALERTMANAGER_SUITE" "$DOCKER_COMPOSE_SUITE" "$VICTORIAMETRICS_SUITE" | sort -u); do
    echo "deb [signed-by=$keyring] $mirror $suite main"
  done
} >"$apt_dir/sources.list"
apt_opts=(
  -o "Dir::Etc::SourceList=$apt_dir/sources.list"
  -o "Dir::Etc::SourceParts=/nonexistent"
  -o "Dir::State::Lists=$apt_dir/lists"
  -o "Dir::Cache=$apt_dir/cache"
  -o "Dir::Cache::Archives=$apt_dir/archives"
  -o "Debug::NoLocking=1"
  -o "APT::Sandbox::User=$(id -un)"
  -q
)
echo "fetch-tools: apt-get update (private lists in $apt_dir; suites of $mirror)"
apt-get "${apt_opts[@]}" update >"$apt_dir/update.log" 2>&1 || {
  cat "$apt_dir/update.log" >&2
  exit 1
}
# The pinned Debian version if the archive still has it; else another Debian revision of the same
# upstream version (sid replaces revisions over time; the upstream version is what is pinned).
pick_version() {
  local pkg="$1" wanted="$2" up available other
  up="$(upstream "$wanted")"
  available="$(apt-cache "${apt_opts[@]}" madison "$pkg" | awk -F'|' '{gsub(/ /, "", $2); print $2}')"
  if grep -qxF "$wanted" <<<"$available"; then
    echo "$wanted"
    return
  fi
  other="$(while read -r v; do [ -n "$v" ] && [ "$(upstream "$v")" = "$up" ] && echo "$v"; done <<<"$available" | head -n1)"
  if [ -n "$other" ]; then
    echo "fetch-tools: $pkg=$wanted is no longer in the archive; using $other (same upstream $up)" >&2
    echo "$other"
    return
  fi
  echo "fetch-tools: $pkg $up is not in the archive (it has: $(echo $available)); update deploy/versions.env" >&2
  return 1
}
prometheus_deb="$(pick_version prometheus "$PROMETHEUS_DEB")"
promtool_deb="$(pick_version promtool "$PROMETHEUS_DEB")"
alertmanager_deb="$(pick_version prometheus-alertmanager "$ALERTMANAGER_DEB")"
compose_deb="$(pick_version docker-compose "$DOCKER_COMPOSE_DEB")"
victoriametrics_deb="$(pick_version victoria-metrics "$VICTORIAMETRICS_DEB")"

debs_dir="$tools/debs"
rm -rf "$debs_dir" "$tools/root" "$tools/bin" "$tools/stamp"
mkdir -p "$debs_dir" "$tools/root" "$tools/bin"
pkgs=("prometheus=$prometheus_deb" "promtool=$promtool_deb" "prometheus-alertmanager=$alertmanager_deb" "docker-compose=$compose_deb" "victoria-metrics=$victoriametrics_deb")
echo "fetch-tools: apt-get download ${pkgs[*]}"
(cd "$debs_dir" && apt-get "${apt_opts[@]}" download "${pkgs[@]}")
for deb in "$debs_dir"/*.deb; do
  dpkg-deb -x "$deb" "$tools/root"
done
for link in "${links[@]}"; do
  ln -sfn "../root/${link#*:}" "$tools/bin/${link%%:*}"
done
[ "${#AM_ASSETS_SYSTEM}" = "${#AM_ASSETS_LOCAL}" ] # same length, or the binary breaks
perl -0777 -pe "s{\Q$AM_ASSETS_SYSTEM\E}{$AM_ASSETS_LOCAL}g" \
  "$tools/root/usr/bin/prometheus-alertmanager" >"$tools/bin/prometheus-alertmanager"
chmod +x "$tools/bin/prometheus-alertmanager"
ln -sfn prometheus-alertmanager "$tools/bin/alertmanager"
ln -sfn "../root$AM_ASSETS_SYSTEM" "$tools/bin/${AM_ASSETS_LOCAL#./}"
if ! check_versions; then
  echo "fetch-tools: the unpacked binaries do not report the pinned versions:" >&2
  for b in prometheus promtool prometheus-alertmanager amtool; do "$tools/bin/$b" --version 2>&1 | head -n1 >&2; done
  "$tools/bin/docker-compose" version >&2 || true
  echo "victoria-metrics package: $(debian_package_version victoria-metrics)" >&2
  exit 1
fi
stamp >"$tools/stamp"
rm -rf "$debs_dir" "$apt_dir/archives"
echo "fetch-tools: ready in $tools/bin (prometheus $PROMETHEUS_VERSION, alertmanager $ALERTMANAGER_VERSION, docker-compose $DOCKER_COMPOSE_VERSION, victoria-metrics $VICTORIAMETRICS_VERSION)"
