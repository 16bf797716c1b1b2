"""The options of the pinned OTel Collector (deploy/versions.env: otelcol-contrib 0.150.0), read
from its upstream source, and a key-by-key check of a collector config against them.

No collector binary exists here, so every collector config under deploy/ (deploy/otelcol.yaml,
the ConfigMaps in deploy/kubernetes/, deploy/slurm/otelcol-node.yaml) is checked with
`collector_config_errors` (unknown keys: the collector refuses to start on one) and
`pipeline_errors` (pipelines naming undefined components, processor order).
"""

from __future__ import annotations

import re
from typing import Any

# Options of the pinned collector (otel/opentelemetry-collector-contrib, OTELCOL_CONTRIB_VERSION in
# deploy/versions.env = 0.150.0) for every component the configs under deploy/ may use, from upstream
# source (the collector refuses to start on an unknown key, so an option missing here must not
# be used). A dict maps an option to its sub-options (None: a value, not checked further); a
# one-element list is a list of such dicts.
#
# Core components, open-telemetry/opentelemetry-collector at tag v0.150.0:
#   receiver/otlpreceiver/config.go; config/configgrpc/configgrpc.go (ServerConfig, ClientConfig);
#   config/confighttp/server.go (ServerConfig); config/confignet/confignet.go (AddrConfig);
#   config/configtls/configtls.go; internal/memorylimiter/config.go;
#   processor/batchprocessor/config.go; exporter/otlpexporter/config.go and metadata.yaml (type
#   `otlp_grpc`; `otlp` is only a deprecated alias there); exporter/debugexporter/config.go.
# Contrib components, open-telemetry/opentelemetry-collector-contrib: exporter/prometheusexporter/
#   config.go, processor/resourceprocessor/config.go, internal/coreinternal/attraction/attraction.go.
#   The v0.150.0 tag itself was not readable here, so these lists hold only options present both in
#   a snapshot before it (prometheusexporter/go.mod on v0.139 modules) and in a later one (which
#   adds `resource_constant_labels` and `without_scope_info`: NOT allowed here, they are later than
#   the pin's known option set).
#   extension/healthcheckextension/config.go: before the shared internal/healthcheck/config.go
#   (ServerConfig squashed, path, response_body, check_collector_pipeline) and after it (the same
#   keys squashed as http.LegacyConfig, plus v2 `http`/`grpc`/`component_health`, behind an alpha
#   feature gate: NOT allowed here).
_NET_ADDR = {"endpoint": None, "transport": None, "dialer": None}
_TLS = dict.fromkeys(
    ["ca_file", "ca_pem", "include_system_ca_certs_pool", "cert_file", "cert_pem", "key_file", "key_pem",
     "min_version", "max_version", "cipher_suites", "reload_interval", "curve_preferences", "tpm"]
)  # fmt: skip
_TLS_SERVER = {**_TLS, "client_ca_file": None, "client_ca_file_reload": None}
_TLS_CLIENT = {**_TLS, "insecure": None, "insecure_skip_verify": None, "server_name_override": None}
_GRPC_SERVER = {
    **_NET_ADDR, "tls": _TLS_SERVER, "max_recv_msg_size_mib": None, "max_concurrent_streams": None,
    "read_buffer_size": None, "write_buffer_size": None, "keepalive": None, "auth": None,
    "include_metadata": None, "middlewares": None,
}  # fmt: skip
_HTTP_SERVER = {
    **_NET_ADDR, "tls": _TLS_SERVER, "cors": None, "auth": None, "max_request_body_size": None,
    "include_metadata": None, "response_headers": None, "compression_algorithms": None,
    "read_timeout": None, "read_header_timeout": None, "write_timeout": None, "idle_timeout": None,
    "middlewares": None, "keep_alives_enabled": None,
}  # fmt: skip
_GRPC_CLIENT = {
    "endpoint": None, "compression": None, "tls": _TLS_CLIENT, "keepalive": None, "read_buffer_size": None,
    "write_buffer_size": None, "wait_for_ready": None, "headers": None, "balancer_name": None,
    "authority": None, "auth": None, "middlewares": None,
}  # fmt: skip
_ATTRIBUTE_ACTION = dict.fromkeys(
    ["key", "value", "pattern", "from_attribute", "from_context", "converted_type", "action"]
)
COLLECTOR_OPTIONS: dict[str, dict[str, Any]] = {
    "receivers": {
        "otlp": {
            "protocols": {
                "grpc": _GRPC_SERVER,
                "http": {
                    **_HTTP_SERVER,
                    "traces_url_path": None,
                    "metrics_url_path": None,
                    "logs_url_path": None,
                },
            }
        },
        # receiver/prometheusreceiver/config.go: `config` is a Prometheus configuration (its
        # scrape configs are checked by promtool in tests/deploy/test_static.py); only it is used.
        "prometheus": {"config": {"global": None, "scrape_configs": None}},
    },
    "processors": {
        "memory_limiter": dict.fromkeys(
            [
                "check_interval",
                "min_gc_interval_when_soft_limited",
                "min_gc_interval_when_hard_limited",
                "limit_mib",
                "spike_limit_mib",
                "limit_percentage",
                "spike_limit_percentage",
            ]
        ),
        "batch": dict.fromkeys(
            [
                "timeout",
                "send_batch_size",
                "send_batch_max_size",
                "metadata_keys",
                "metadata_cardinality_limit",
            ]
        ),
        "resource": {"attributes": [_ATTRIBUTE_ACTION]},
    },
    "extensions": {
        "health_check": {
            **_HTTP_SERVER,
            "path": None,
            "response_body": {"healthy": None, "unhealthy": None},
            "check_collector_pipeline": {
                "enabled": None,
                "interval": None,
                "exporter_failure_threshold": None,
            },
        },
    },
    "exporters": {
        "prometheus": {
            **_HTTP_SERVER,
            "sending_queue": None,
            "namespace": None,
            "const_labels": None,
            "send_timestamps": None,
            "metric_expiration": None,
            "resource_to_telemetry_conversion": {"enabled": None},
            "enable_open_metrics": None,
            "add_metric_suffixes": None,
            "translation_strategy": None,
        },
        "otlp_grpc": {**_GRPC_CLIENT, "timeout": None, "sending_queue": None, "retry_on_failure": None},
        "debug": dict.fromkeys(
            [
                "verbosity",
                "sampling_initial",
                "sampling_thereafter",
                "use_internal_logger",
                "output_paths",
                "sending_queue",
            ]
        ),
    },
}
_SERVICE_OPTIONS = {"extensions": None, "pipelines": None, "telemetry": None}
_PIPELINE_OPTIONS = {"receivers", "processors", "exporters"}


def _unknown_options(value: Any, options: Any, where: str) -> list[str]:
    if options is None:
        return []
    if isinstance(options, list):
        if not isinstance(value, list):
            return [f"{where}: expected a list"]
        return [
            e for i, item in enumerate(value) for e in _unknown_options(item, options[0], f"{where}[{i}]")
        ]
    if not isinstance(value, dict):
        return [f"{where}: expected a mapping"] if value is not None else []
    out = []
    for key, sub in value.items():
        if key not in options:
            out.append(f"{where}.{key}")
        else:
            out.extend(_unknown_options(sub, options[key], f"{where}.{key}"))
    return out


def collector_config_errors(config: dict[str, Any]) -> list[str]:
    """Every key of a collector config that the pinned collector does not know."""
    errors = [f"top-level {k}" for k in config if k not in {*COLLECTOR_OPTIONS, "connectors", "service"}]
    errors += [f"connectors.{name}: component not verified" for name in config.get("connectors") or {}]
    for kind, known in COLLECTOR_OPTIONS.items():
        for name, settings in (config.get(kind) or {}).items():
            ctype = name.split("/", 1)[0]
            if ctype not in known:
                errors.append(f"{kind}.{name}: component type {ctype!r} not verified at the pinned version")
                continue
            errors += _unknown_options(settings, known[ctype], f"{kind}.{name}")
    service = config.get("service") or {}
    errors += _unknown_options(service, _SERVICE_OPTIONS, "service")
    for pname, pipeline in (service.get("pipelines") or {}).items():
        errors += [f"service.pipelines.{pname}.{k}" for k in pipeline if k not in _PIPELINE_OPTIONS]
    return errors


def pipeline_errors(config: dict[str, Any]) -> list[str]:
    """Pipelines (and service extensions) naming components the config does not define; every
    pipeline must start with memory_limiter and end with batch."""
    service = config.get("service") or {}
    connectors = set(config.get("connectors") or {})
    errors = [
        f"extension {e}" for e in service.get("extensions", []) if e not in (config.get("extensions") or {})
    ]
    for name, pipeline in (service.get("pipelines") or {}).items():
        for kind in ("receivers", "processors", "exporters"):
            defined = set(config.get(kind) or {}) | (connectors if kind != "processors" else set())
            errors += [f"{name}: {kind} {c}" for c in pipeline.get(kind, []) if c not in defined]
        processors = pipeline.get("processors", [])
        if processors[:1] != ["memory_limiter"]:
            errors.append(f"{name}: memory_limiter must come first")
        if processors[-1:] != ["batch"]:
            errors.append(f"{name}: batch must come last")
    return errors


ENV_REFERENCE = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)(?::-[^}]*)?\}")


def env_references(text: str) -> set[str]:
    """Names of the environment variables a collector config reads (`${env:NAME}`)."""
    return set(ENV_REFERENCE.findall(text))
