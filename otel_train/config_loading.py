"""Where settings come from: `load_config` resolves a `Config` from kwargs > environment > YAML
file > defaults, each value coerced to its field's type, then checked (`config.validate`).

Standard OpenTelemetry variables are read as the spec says (`OTEL_EXPORTER_OTLP_HEADERS` as
percent-encoded `k=v` pairs, `OTEL_METRIC_EXPORT_INTERVAL` and `OTEL_EXPORTER_OTLP_TIMEOUT` in
milliseconds); `OTEL_TRAIN_<FIELD>` sets any field.
"""

from __future__ import annotations

import os
import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal

from otel_train.config import CONFIG_FILE_ENV, FIELDS, Config, ConfigError, env_name, validate
from otel_train.redaction import REDACTED, is_secret_key, redact_url

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
# An HTTP header name (RFC 9110 token); values are checked for control characters only.
_HEADER_KEY_RE = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_HINTS = typing.get_type_hints(Config)


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
        for name, value in config_file_settings(path).items():
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


def config_file_settings(path: str) -> dict[str, Any]:
    """The settings a YAML config file names, as written there (not yet coerced nor checked): an
    adapter asks it which settings the user chose. A missing or malformed file, or one naming an
    unknown setting, raises `ConfigError` naming the file and the fix."""
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


# Integer settings where None reads as "off": the value that turns them off, named in the error.
_OFF_VALUES = {"prometheus_port": " (0 turns the pull endpoint off)"}


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
        shown = REDACTED if is_secret_key(name) else repr(redact_url(value))
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
        if isinstance(value, bool) or value is None:
            raise bad("an integer" + _OFF_VALUES.get(name, ""))
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
    if origin in (dict, tuple):
        return _coerce_collection(name, value, source, origin, bad)
    return value


def _coerce_collection(
    name: str, value: Any, source: str, origin: Any, bad: Callable[[str], ConfigError]
) -> Any:
    """A dict setting from `k=v,...` or a mapping; a tuple setting from `a,b,...` or a list."""
    if origin is dict:
        if isinstance(value, str):
            return parse_key_values(value, source if "header" not in name else f"{source} (headers)")
        if not isinstance(value, Mapping):
            raise bad("a mapping of strings")
        mapping = {str(k): str(v) for k, v in value.items()}
        if "header" in name:
            check_headers(mapping, source)
        return mapping
    if isinstance(value, str):
        return tuple(v.strip() for v in value.split(",") if v.strip())
    if isinstance(value, (list, tuple)):
        return tuple(str(v) for v in value)
    raise bad("a list of strings")
