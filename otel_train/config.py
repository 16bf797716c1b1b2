"""Config: one frozen dataclass, resolved from kwargs > environment > YAML file > defaults.

Standard OpenTelemetry variables are honoured (`OTEL_EXPORTER_OTLP_ENDPOINT`, `..._PROTOCOL`,
`..._HEADERS`, `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_METRIC_EXPORT_INTERVAL`);
every field also reads `OTEL_TRAIN_<FIELD>` (for example `OTEL_TRAIN_LOG_INTERVAL=50`).
Invalid settings raise `ConfigError` at `init()`, naming the setting, the bad value and the fix.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

OtlpProtocol = Literal["http/protobuf", "grpc"]
TimingLogOption = Literal["max", "minmax", "all"]
WatchAggregate = Literal["layer", "model"]
# The precision MFU's peak is taken for (otel_train.hardware.mfu); "auto": detected (see Config.compute_dtype).
ComputeDtype = Literal["auto", "fp8", "bf16", "fp16", "tf32", "fp32"]


class ConfigError(ValueError):
    """A setting is invalid. The message names the setting, the bad value and the fix."""


@dataclass(frozen=True)
class Config:
    # identity
    service_name: str = "otel-train"
    run_name: str | None = None  # default: <UTC date-time>-<4 hex>
    run_id: str | None = None  # default: scheduler job id (torchrun/SLURM) or a new uuid
    # this process's part in a single-controller job (controller, policy, generation, ...): joins
    # run_id and rank in the identity, so two roles' rank 0 never share a file or a series
    role: str = ""
    resource_attributes: dict[str, str] = field(default_factory=dict)
    # where local output goes: <output_dir>/<run_name>/
    output_dir: str = "runs"
    run_dir_enabled: bool = True
    # OTLP push (off unless an endpoint is set)
    otlp_endpoint: str | None = None
    # Metrics only, the full URL used as-is (the OTel spec's OTEL_EXPORTER_OTLP_METRICS_ENDPOINT),
    # e.g. a store's own OTLP path: http://victoriametrics:8428/opentelemetry/v1/metrics. Spans
    # and logs still go to otlp_endpoint (none when it is unset).
    otlp_metrics_endpoint: str | None = None
    otlp_protocol: OtlpProtocol = "http/protobuf"
    otlp_headers: dict[str, str] = field(default_factory=dict)
    otlp_timeout_s: float = 5.0
    otlp_insecure: bool = True
    metric_export_interval_s: float = 10.0
    # in-process Prometheus pull endpoint: http://<host>:<port + local_rank>/metrics; 0 disables
    prometheus_port: int = 9464
    prometheus_host: str = "127.0.0.1"
    console_exporter: bool = False  # print OTel metrics/spans to stdout (debugging)
    # flush cadence and hot-path bounds
    # flush every N steps; unset: adaptive (every 10 steps, but at most about once per
    # log_interval_min_s, rounded to 10/20/50/100/... steps, decided on rank 0 for every rank)
    log_interval: int | None = None
    log_interval_min_s: float = 1.0
    log_interval_s: float = 30.0  # ... or after this many seconds (single-process only)
    max_metric_names: int = 64  # distinct record() names; more are dropped and counted
    max_values_per_interval: int = 10_000  # per name, between flushes
    queue_size: int = 8  # flush batches waiting for the background worker
    shutdown_timeout_s: float = 2.0
    # timers and traces
    timing_log_level: int = 1  # timers with level > this cost ~nothing (Megatron semantics)
    timing_log_option: TimingLogOption = "minmax"
    traces: bool = True
    trace_first: int = 3  # sample the first N steps ...
    trace_every: int = 100  # ... then every N-th step
    # console
    verbosity: int = 1  # 0 quiet, 1 summary lines + final table, 2 also debug
    progress_bar: bool = True
    total_steps: int | None = None
    # health
    loss_spike_factor: float = 3.0  # loss > factor x recent EWMA mean is a spike
    stall_timeout_s: float = 300.0  # no completed step for this long: stall event + stack dump
    stack_dump_signal: str = "SIGUSR1"  # `kill -USR1 <pid>` dumps every thread's stack; "" turns it off
    # bridges
    tensorboard: bool = False
    wandb: bool = False
    mlflow: bool = False
    bridge_all_ranks: bool = False
    bridge_queue_size: int = 64
    wandb_project: str = "otel-train"
    wandb_entity: str | None = None
    wandb_group: str | None = None
    wandb_tags: tuple[str, ...] = ()
    wandb_mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    mlflow_tracking_uri: str | None = None  # default: file store under the run dir
    mlflow_experiment: str = "otel-train"
    samples_to_show: int = 4
    # hardware
    hardware: bool = True
    hardware_interval_s: float = 5.0
    peak_flops: float | None = None  # override the peak table (FLOP/s per GPU)
    # The precision the matmuls run in, whose peak MFU divides by. "auto": the torch.autocast dtype
    # active on the training thread at a flush, else bf16 (autocast around the forward pass only
    # cannot be seen from a flush); set it for fp8, fp16 without autocast, tf32 or fp32 training.
    compute_dtype: ComputeDtype = "auto"
    flops_per_token: float | None = None
    # Reset torch.cuda's peak memory stats at each flush (peak per interval). False leaves them to
    # your code (torch.cuda.max_memory_allocated() keeps working); the peak is then the run's.
    cuda_peak_per_interval: bool = True
    # ot.watch's statistics per layer group (up to its max_layers), or one group for the whole
    # model: on a huge job, ~2 series per rank (grad and param norm) instead of ~2 x 64, or 4 x 64
    # with activations, which are per layer only (README "Series budget").
    watch_aggregate: WatchAggregate = "layer"
    # distributed
    straggler_threshold: float = 0.9  # relative score: 1 - lateness / step time
    straggler_ewma: float = 0.5
    collective_timeout_s: float = 60.0
    # How long rank 0 waits at a flush for the rows of the ranks that were on time at the last one
    # (lockstep ranks come within milliseconds); a row that comes later is taken at a later flush.
    exchange_grace_s: float = 1.0
    # Children per rank in the exchange's reduction tree (per node first, then this fan-in). A
    # fan-in >= the world size is the star around rank 0 (crossrank/tree.py, README "Scale").
    exchange_fanin: int = 16
    # One exchange per flush with rank 0 (cross-rank stats, stragglers, one cadence): right for ranks
    # that train in lockstep (DDP, FSDP). False for independent ranks (evaluators, RL workers,
    # separate trials): they then meet only at init() and never wait for each other's flushes.
    cross_rank: bool = True


_SECRET_RE = re.compile(r"(key|token|secret|passw|auth|credential|header|cookie|bearer)", re.I)
REDACTED = "***"

# Standard OTel variables → field. Parsed specially; OTEL_TRAIN_<FIELD> is generic.
_STANDARD_ENV = {
    "OTEL_SERVICE_NAME": "service_name",
    "OTEL_EXPORTER_OTLP_ENDPOINT": "otlp_endpoint",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "otlp_metrics_endpoint",
    "OTEL_EXPORTER_OTLP_PROTOCOL": "otlp_protocol",
    "OTEL_EXPORTER_OTLP_HEADERS": "otlp_headers",
    "OTEL_RESOURCE_ATTRIBUTES": "resource_attributes",
    "OTEL_METRIC_EXPORT_INTERVAL": "metric_export_interval_s",  # milliseconds in the spec
    "OTEL_EXPORTER_OTLP_TIMEOUT": "otlp_timeout_s",  # milliseconds in the spec
}
_SIGNAL_PATH_RE = re.compile(r"/v1/(metrics|traces|logs)/?$")
# An HTTP header name (RFC 9110 token); values are checked for control characters only.
_HEADER_KEY_RE = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
CONFIG_FILE_ENV = "OTEL_TRAIN_CONFIG"

FIELDS: dict[str, dataclasses.Field[Any]] = {f.name: f for f in dataclasses.fields(Config)}
_HINTS = typing.get_type_hints(Config)


def env_name(field_name: str) -> str:
    return f"OTEL_TRAIN_{field_name.upper()}"


def load_config(
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    config_file: str | None = None,
) -> Config:
    """Resolve a Config: `overrides` (kwargs) > environment > YAML file > defaults."""
    environ = os.environ if environ is None else environ
    overrides = dict(overrides or {})
    values: dict[str, tuple[Any, str]] = {}  # field -> (value, where it came from)

    path = config_file or overrides.pop("config_file", None) or environ.get(CONFIG_FILE_ENV)
    if path:
        for name, value in _read_yaml(path).items():
            values[name] = (value, f"{path}:{name}")
    for env_key, name in _STANDARD_ENV.items():
        if env_key in environ and environ[env_key].strip() != "":
            values[name] = (_parse_standard_env(env_key, environ[env_key]), env_key)
    for name in FIELDS:
        key = env_name(name)
        if key in environ and environ[key].strip() != "":
            values[name] = (environ[key], key)
    for name, value in overrides.items():
        if name not in FIELDS:
            raise ConfigError(
                f"init() got an unknown setting {name!r}. Known settings: {', '.join(sorted(FIELDS))}."
            )
        values[name] = (value, f"init({name}=...)")

    resolved = {name: _coerce(name, value, source) for name, (value, source) in values.items()}
    config = Config(**resolved)
    validate(config, {name: source for name, (_, source) in values.items()})
    return config


def _read_yaml(path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
    except FileNotFoundError:
        raise ConfigError(
            f"config file {path!r} (from {CONFIG_FILE_ENV} or config_file=) does not exist. "
            "Fix the path or unset it."
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping of settings, got {type(data).__name__}.")
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise ConfigError(
            f"config file {path!r} has unknown settings {unknown}. Known: {', '.join(sorted(FIELDS))}."
        )
    return data


def _parse_standard_env(env_key: str, raw: str) -> Any:
    if env_key in ("OTEL_EXPORTER_OTLP_HEADERS", "OTEL_RESOURCE_ATTRIBUTES"):
        return parse_key_values(raw, env_key)
    if env_key in ("OTEL_METRIC_EXPORT_INTERVAL", "OTEL_EXPORTER_OTLP_TIMEOUT"):
        example = "10000" if env_key == "OTEL_METRIC_EXPORT_INTERVAL" else "5000"
        try:
            millis = float(raw)
        except ValueError:
            raise ConfigError(
                f"{env_key}={raw!r} is not a number of milliseconds. Set it to e.g. {example} or unset it."
            ) from None
        if env_key == "OTEL_EXPORTER_OTLP_TIMEOUT" and 0 < millis < 100:
            # The Python SDK once read this variable as seconds; a value that small is that mistake.
            raise ConfigError(
                f"{env_key}={raw!r} is in milliseconds (the OpenTelemetry spec's unit), so this is "
                f"{millis:g} ms, too short for an export. Set it to e.g. {example} (5 s) or unset it."
            )
        return millis / 1000.0
    return raw


def parse_key_values(raw: str, setting: str) -> dict[str, str]:
    """Parse the OTel `k1=v1,k2=v2` format (values may be percent-encoded)."""
    from urllib.parse import unquote

    out: dict[str, str] = {}
    for item in raw.split(","):
        if not item.strip():
            continue
        if "=" not in item:
            # Never echo the raw value: it may hold a header secret.
            raise ConfigError(
                f"{setting} has an entry without '=' (entry #{len(out) + 1}). Use the form key1=value1,key2=value2."
            )
        key, value = item.split("=", 1)
        out[unquote(key.strip())] = unquote(value.strip())
    if "HEADERS" in setting.upper():
        check_headers(out, setting)
    return out


def check_headers(headers: Mapping[str, str], setting: str) -> None:
    """Reject what an HTTP/gRPC client would reject, naming the header but never its value."""
    for number, (key, value) in enumerate(headers.items(), start=1):
        if not _HEADER_KEY_RE.match(key):
            raise ConfigError(
                f"{setting}: header #{number} has an invalid name {key[:40]!r} (letters, digits and "
                "!#$%&'*+-.^_`|~ only). Fix the name; percent-encode the value if it has commas or spaces."
            )
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
            raise ConfigError(
                f"{setting}: the value of header {key!r} has a control character (newline?). Remove it."
            )


def _coerce(name: str, value: Any, source: str) -> Any:
    hint = _HINTS[name]
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    optional = origin in (typing.Union, types.UnionType) and type(None) in args
    if optional:
        if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
            return None
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)

    def bad(expected: str) -> ConfigError:
        shown = REDACTED if _SECRET_RE.search(name) else repr(redact_url(value))
        return ConfigError(f"setting {name} (from {source}) = {shown} is invalid: expected {expected}.")

    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
            return False
        raise bad("true or false")
    if hint is int:
        if isinstance(value, bool):
            raise bad("an integer")
        try:
            return int(str(value).strip()) if not isinstance(value, int) else value
        except ValueError:
            raise bad("an integer") from None
    if hint is float:
        if isinstance(value, bool):
            raise bad("a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise bad("a number") from None
    if hint is str:
        if not isinstance(value, str):
            raise bad("a string")
        return value
    if origin is Literal:
        if value not in args:
            raise bad(f"one of {', '.join(map(repr, args))}")
        return value
    if origin is dict:
        if isinstance(value, str):
            return parse_key_values(value, source if "header" not in name else f"{source} (headers)")
        if not isinstance(value, Mapping):
            raise bad("a mapping of strings")
        mapping = {str(k): str(v) for k, v in value.items()}
        if "header" in name:
            check_headers(mapping, source)
        return mapping
    if origin is tuple:
        if isinstance(value, str):
            return tuple(v.strip() for v in value.split(",") if v.strip())
        if isinstance(value, (list, tuple)):
            return tuple(str(v) for v in value)
        raise bad("a list of strings")
    return value


def validate(config: Config, sources: Mapping[str, str] | None = None) -> None:
    """Check ranges; `sources` (field -> where the value came from) makes errors name the variable
    or file the user actually set, e.g. OTEL_EXPORTER_OTLP_TIMEOUT rather than OTEL_TRAIN_*."""
    sources = sources or {}

    def need(cond: bool, name: str, fix: str) -> None:
        if not cond:
            value = getattr(config, name)
            shown = REDACTED if _SECRET_RE.search(name) else repr(redact_url(value))
            source = sources.get(name)
            if source is None:
                where = f"env {env_name(name)}"
            elif source.startswith("OTEL_"):
                where = f"from {source}"
            else:
                where = f"from {source}; env {env_name(name)}"
            raise ConfigError(f"setting {name} = {shown} is invalid: {fix} ({where}).")

    need(
        config.log_interval is None or config.log_interval >= 1,
        "log_interval",
        "use a whole number of steps >= 1, or leave it unset for the adaptive cadence",
    )
    need(config.log_interval_min_s > 0, "log_interval_min_s", "use a positive number of seconds")
    need(config.log_interval_s > 0, "log_interval_s", "use a positive number of seconds")
    need(0 <= config.prometheus_port <= 65535, "prometheus_port", "use a TCP port 1-65535, or 0 to disable")
    need(config.metric_export_interval_s > 0, "metric_export_interval_s", "use a positive number of seconds")
    need(
        0 < config.otlp_timeout_s <= 60,
        "otlp_timeout_s",
        "use seconds in (0, 60]; OTEL_EXPORTER_OTLP_TIMEOUT is in milliseconds: (0, 60000]",
    )
    need(config.timing_log_level in (0, 1, 2), "timing_log_level", "use 0, 1 or 2")
    need(config.trace_first >= 0, "trace_first", "use an integer >= 0")
    need(config.trace_every >= 1, "trace_every", "use an integer >= 1")
    need(config.verbosity in (0, 1, 2), "verbosity", "use 0 (quiet), 1 or 2")
    need(config.max_metric_names >= 1, "max_metric_names", "use an integer >= 1")
    need(config.max_values_per_interval >= 1, "max_values_per_interval", "use an integer >= 1")
    need(config.queue_size >= 1, "queue_size", "use an integer >= 1")
    need(config.bridge_queue_size >= 1, "bridge_queue_size", "use an integer >= 1")
    need(0 < config.shutdown_timeout_s <= 60, "shutdown_timeout_s", "use seconds in (0, 60]")
    need(
        config.total_steps is None or config.total_steps >= 1,
        "total_steps",
        "use a positive integer or leave unset",
    )
    need(config.loss_spike_factor > 1, "loss_spike_factor", "use a factor > 1")
    need(config.stall_timeout_s > 0, "stall_timeout_s", "use a positive number of seconds")
    need(
        config.stack_dump_signal == "" or signal_number(config.stack_dump_signal) is not None,
        "stack_dump_signal",
        "use a signal name such as SIGUSR1 or SIGUSR2, or an empty string to turn signal dumps off",
    )
    need(config.hardware_interval_s > 0, "hardware_interval_s", "use a positive number of seconds")
    need(config.peak_flops is None or config.peak_flops > 0, "peak_flops", "use FLOP/s > 0 or leave unset")
    need(0 < config.straggler_threshold < 1, "straggler_threshold", "use a score in (0, 1), e.g. 0.9")
    need(0 < config.straggler_ewma <= 1, "straggler_ewma", "use a smoothing factor in (0, 1]")
    need(config.collective_timeout_s > 0, "collective_timeout_s", "use a positive number of seconds")
    need(config.exchange_grace_s > 0, "exchange_grace_s", "use a positive number of seconds")
    need(
        config.exchange_fanin >= 2, "exchange_fanin", "use a whole number of children per rank >= 2, e.g. 16"
    )
    need(bool(config.service_name.strip()), "service_name", "use a non-empty name")
    if config.otlp_endpoint is not None:
        endpoint = config.otlp_endpoint
        need(
            re.match(r"^https?://[^/\s]+", endpoint) is not None,
            "otlp_endpoint",
            "use a URL such as http://localhost:4318 (HTTP) or http://localhost:4317 (gRPC), or unset it",
        )
        need(
            _url_port_ok(endpoint),
            "otlp_endpoint",
            "the port must be a number in 1-65535, e.g. http://localhost:4318",
        )
        need(
            _SIGNAL_PATH_RE.search(endpoint.split("?", 1)[0]) is None,
            "otlp_endpoint",
            "give the base URL without /v1/metrics, /v1/traces or /v1/logs (otel_train appends the "
            "signal path itself), e.g. http://localhost:4318",
        )
    if config.otlp_metrics_endpoint is not None:
        need(
            re.match(r"^https?://[^/\s]+", config.otlp_metrics_endpoint) is not None
            and _url_port_ok(config.otlp_metrics_endpoint),
            "otlp_metrics_endpoint",
            "use the full metrics URL, e.g. http://localhost:8428/opentelemetry/v1/metrics "
            "(VictoriaMetrics) or http://localhost:4318/v1/metrics, or unset it",
        )
    need(
        re.match(r"^([A-Za-z0-9][A-Za-z0-9_-]{0,63})?$", config.role) is not None,
        "role",
        "use letters, digits, _ and - (max 64 characters, no dots: the role is part of file names), "
        "e.g. controller, policy, generation; or leave it empty",
    )
    for name in ("run_name", "run_id"):
        value = getattr(config, name)
        need(
            value is None or re.match(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$", value) is not None,
            name,
            "use letters, digits and _ . : - (max 128 characters)",
        )


def _url_port_ok(url: str) -> bool:
    from urllib.parse import urlsplit

    try:
        port = urlsplit(url).port
    except ValueError:
        return False
    return port is None or port >= 1


def signal_number(name: str) -> int | None:
    """`SIGUSR1` / `USR1` / `10` as a signal number, None if there is no such signal."""
    import signal

    text = name.strip().upper()
    if text.isdigit():
        number = int(text)
        return number if number in {s.value for s in signal.Signals} else None
    member = getattr(signal.Signals, text if text.startswith("SIG") else f"SIG{text}", None)
    return int(member) if member is not None else None


def is_secret_key(key: str) -> bool:
    return _SECRET_RE.search(key) is not None


def redact_url(value: Any) -> Any:
    """`scheme://user:password@host/...` -> `scheme://***@host/...`; other values unchanged."""
    if isinstance(value, str) and "@" in value and "://" in value:
        return re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]*@", rf"\1{REDACTED}@", value)
    return value


# Free text (ot.log_text, samples) is capped before it is queued: a megabyte string would hold the
# worker (and the GIL) while it is redacted and written, and it has no place in a JSONL line.
TEXT_LIMIT = 65_536  # characters per text and per sample prompt/output


def cap_text(text: str) -> str:
    """`text` cut to TEXT_LIMIT characters, saying so and how long it was."""
    if len(text) <= TEXT_LIMIT:
        return text
    return f"{text[:TEXT_LIMIT]} [... truncated by otel_train: {len(text)} characters in all]"


# A secret-looking name and its value inside free text: `api_key=...`, `password: ...`,
# `"api_key": "..."`, `api_key='...'` (argparse.Namespace, dict reprs), `export HF_TOKEN='...'`,
# `--hf-token ...`, `--api-key=...`, `['--hf-token', '...']`. Linear time, because this runs on
# text of any shape (a 100 kB base64 blob took 11 s with `\b[\w.-]*key[\w.-]*`: every start
# inside a long word rescanned the word): a name starts only where a word starts, and its parts
# around the keyword are bounded, so each word costs a bounded amount of backtracking; every
# value form is one loop over characters that cannot also end it. `tokens`/`tokenizer` are
# counts and model names, not secrets.
_SECRET_WORD = r"(?:key|token(?!s|iz)|secret|passw|auth|credential|cookie)"
_SECRET_IN_TEXT_RE = re.compile(
    r"(?i)(?<![\w.-])"
    rf"(?P<name>(?P<flag>--?)?[\w.-]{{0,64}}{_SECRET_WORD}[\w.-]{{0,64}})(?![\w.-])"
    # after the name: an optional closing quote, then `:` / `=`; a flag also takes a space or a
    # list separator (`'--hf-token', '...'`)
    r"(?P<sep>\\?[\"']?[ \t]*[:=][ \t]*|(?(flag)(?:[ \t]+|[\"'],[ \t]*)|(?!)))"
    r"(?:bearer[ \t]+|basic[ \t]+)?"
    r"(?P<value>\"(?:[^\"\\\n]|\\.)*\"?|'[^'\n]*'?|\\\"[^\"\\\n]*|(?!-)[^\s,;&'\"(){}\[\]<>\\]+)"
)
_BEARER_RE = re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{6,}")
_USERINFO_RE = re.compile(r"(?<=://)[^/@\s]+@")  # `scheme://user:password@host`


def _redacted_pair(match: re.Match[str]) -> str:
    value = match["value"]
    quote = next((q for q in ('\\"', '"', "'") if value.startswith(q)), "")
    closing = quote if quote and len(value) > len(quote) and value.endswith(quote) else ""
    return f"{match['name']}{match['sep']}{quote}{REDACTED}{closing}"


def redact_text(text: str) -> str:
    """Best effort for free text (ot.log_text, samples), in linear time: the values of
    secret-looking names (`key=value`, `key: value`, quoted, JSON, dict and Namespace reprs,
    `--flag value`), bearer tokens and URL userinfo become '***'."""
    text = _SECRET_IN_TEXT_RE.sub(_redacted_pair, text)
    text = _BEARER_RE.sub(lambda m: f"{m.group(1)} {REDACTED}", text)
    return _USERINFO_RE.sub(f"{REDACTED}@", text)


def redact(value: Any, key: str = "") -> Any:
    """Replace secret-looking values (by key name) with '***', recursively."""
    if key and is_secret_key(key):
        return REDACTED if value not in (None, "", {}, ()) else value
    if isinstance(value, Mapping):
        return {str(k): redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    # A string leaf may itself hold secrets (a nested config rendered with str(): `{'hf_token':
    # ...}`, a command line): the free-text redaction, which also covers URL userinfo.
    return redact_text(value) if isinstance(value, str) else value


def config_as_dict(config: Config) -> dict[str, Any]:
    """The resolved config with secrets redacted (for config.json, bridges, logs)."""
    return redact(dataclasses.asdict(config))
