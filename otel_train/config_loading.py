"""Where settings come from: `load_config` resolves a `Config` from kwargs > environment > YAML
file > defaults, each value parsed by its field's type, then checked (`config.validate`). Standard
OpenTelemetry variables are read as the spec says (docs/reference/configuration.md).
"""

from __future__ import annotations

import difflib
import logging
import numbers
import os
import re
import typing
from collections.abc import Collection, Iterable, Mapping
from typing import Any, Literal

from otel_train.config import (
    CONFIG_FILE_ENV,
    Config,
    ConfigError,
    Declaration,
    allowed,
    declared,
    env_name,
    problem,
    validate,
)

log = logging.getLogger("otel_train")

# `OTEL_TRAIN_*` variables that are no setting: the config file, the Lightning switch
# (integrations.lightning.ENV_SWITCH) and the repository's pinned-tools folder (Makefile, tests).
NOT_SETTINGS_ENV = frozenset({CONFIG_FILE_ENV, "OTEL_TRAIN_LIGHTNING", "OTEL_TRAIN_TOOLS"})
_PREFIX = "OTEL_TRAIN_"
_warned_env: set[str] = set()  # each unknown variable is named once per process

# An HTTP header name (RFC 9110 token); values are checked for control characters only.
_HEADER_KEY_RE = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")


def load_config(
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    config_file: str | None = None,
    config_cls: type[Config] = Config,
) -> Config:
    """Resolve a `config_cls` (a Config): `overrides` (kwargs) > environment > YAML file > defaults."""
    environ = os.environ if environ is None else environ
    overrides = dict(overrides or {})
    table = declared(config_cls)
    warn_unknown_env(environ, config_cls)
    values: dict[str, tuple[Any, str]] = {}  # field -> (value, where it came from)

    for given in (config_file, overrides.get("config_file")):
        if given is not None and not isinstance(given, (str, os.PathLike)):
            raise TypeError(
                f"config_file={given!r} needs the path of a YAML file; settings are keyword arguments, "
                "e.g. ot.init(log_interval=10)"
            )
    path = config_file or overrides.pop("config_file", None) or environ.get(CONFIG_FILE_ENV)
    if path:
        for name, value in config_file_settings(os.fspath(path), config_cls).items():
            values[name] = (value, f"{path}:{name}")
    for name, entry in table.items():
        if name in overrides:
            continue  # a keyword wins: a malformed variable under it is never read
        # OTEL_TRAIN_<FIELD> over the standard variables, and of those the last (the more specific)
        for key in (env_name(name), *reversed(entry.setting.env)):
            if environ.get(key, "").strip() != "":
                raw = environ[key]
                values[name] = (
                    raw if key == env_name(name) else _from_standard_env(key, raw, name, config_cls),
                    key,
                )
                break
    for name, value in overrides.items():
        if name not in table:
            raise unknown_setting("init()", name, table)
        values[name] = (value, f"init({name}=...)")

    resolved = {name: _parse(name, value, source, table[name]) for name, (value, source) in values.items()}
    config = config_cls(**resolved)
    validate(config, {name: source for name, (_, source) in values.items()})
    return config


def warn_unknown_env(environ: Mapping[str, str], config_cls: type[Config] = Config) -> None:
    """Warn once about each `OTEL_TRAIN_*` variable that names no setting: a warning, since a stale
    variable left in a job script must not stop the job."""
    table = declared(config_cls)
    settings_env = {env_name(name) for name in table}
    known = settings_env | NOT_SETTINGS_ENV
    # Compared without their prefixes, which every candidate shares: EXPORT_INTERVAL is close to
    # OTEL_METRIC_EXPORT_INTERVAL's METRIC_EXPORT_INTERVAL; OTEL_TRAIN_ alone matches nothing.
    standard = [key for entry in table.values() for key in entry.setting.env]
    suggestions = {key.removeprefix("OTEL_"): key for key in standard}
    suggestions.update({key.removeprefix(_PREFIX): key for key in settings_env})
    for key in environ:
        if not key.upper().startswith(_PREFIX) or key in known or key in _warned_env:
            continue
        _warned_env.add(key)
        close = difflib.get_close_matches(key.upper().removeprefix(_PREFIX), list(suggestions), n=1)
        hint = f"did you mean {suggestions[close[0]]!r}? " if close else ""
        log.warning(
            "otel_train: environment variable %s is no otel_train setting and is ignored: %sthe "
            "settings' variables are OTEL_TRAIN_<FIELD> of the fields in docs/reference/configuration.md.",
            key, hint,
        )  # fmt: skip


def config_file_settings(path: str, config_cls: type[Config] = Config) -> dict[str, Any]:
    """The settings a YAML config file names, as written (an adapter asks which the user chose).
    A missing or malformed file, or an unknown setting, raises `ConfigError` naming the fix."""
    import yaml

    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
    except FileNotFoundError:
        raise ConfigError(
            f"config file {path!r} (from {CONFIG_FILE_ENV} or config_file=) does not exist. "
            "Fix the path or unset it."
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"config file {path!r} (from {CONFIG_FILE_ENV} or config_file=) cannot be read as a UTF-8 YAML "
            f"file: {exc}. Point it at the file."
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping of settings, got {type(data).__name__}.")
    known = declared(config_cls)
    unknown = sorted(set(data) - known.keys(), key=str)
    if unknown:
        hints = "".join(did_you_mean(name, known, about=True) for name in unknown)
        raise ConfigError(
            f"config file {path!r} has unknown settings {unknown}: {hints}Settings are otel_train.Config "
            f"fields (docs/reference/configuration.md): {', '.join(sorted(known))}."
        )
    return data


def unknown_setting(owner: str, name: str, known: Collection[str]) -> ConfigError:
    """The error for a setting that `owner` (`init()`, an integration) got and is no Config field."""
    return ConfigError(
        f"{owner} got an unknown setting {name!r}: {did_you_mean(name, known)}Settings are "
        f"otel_train.Config fields (docs/reference/configuration.md): {', '.join(sorted(known))}."
    )


def did_you_mean(name: object, known: Iterable[str], about: bool = False) -> str:
    """`did you mean 'tensorboard'? ` for a misspelt setting `name` (`about`: `for 'tensorbaord'`
    added, where several names are refused at once), or "" when no setting is close."""
    close = difflib.get_close_matches(str(name), list(known), n=1)
    return f"did you mean {close[0]!r}{f' for {name!r}' if about else ''}? " if close else ""


def _from_standard_env(env_key: str, raw: str, name: str, config_cls: type[Config]) -> Any:
    """A standard OpenTelemetry variable's value: milliseconds as seconds where the spec says so,
    checked here, so that an error shows the milliseconds the user wrote, not our seconds."""
    entry = declared(config_cls)[name]
    if not entry.setting.env_in_ms:
        return raw
    example = f"{entry.default * 1000:.0f}"  # env_in_ms settings are numbers of seconds
    try:
        millis = float(raw)
    except ValueError:
        raise ConfigError(
            f"{env_key}={raw!r} is not a number of milliseconds. Set it to e.g. {example} or unset it."
        ) from None
    if 0 < millis < 100:
        # Seconds written where the spec wants milliseconds (the Python SDK once read the timeout so).
        raise ConfigError(
            f"{env_key}={raw!r} is in milliseconds (the OpenTelemetry spec's unit), so this is "
            f"{millis:g} ms, surely meant as seconds. Set it to e.g. {example} ({entry.default:g} s) "
            "or unset it."
        )
    seconds = millis / 1000.0
    if problem(name, seconds, config_cls) is not None:
        raise ConfigError(
            f"{env_key}={raw!r} is invalid: it is in milliseconds (the OpenTelemetry spec's unit) and "
            f"sets {name} in seconds; use {allowed(name, config_cls, in_ms=True)}, e.g. {example}, or "
            "unset it."
        )
    return seconds


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
    return out


def check_headers(headers: Mapping[str, str], setting: str) -> None:
    """Reject what an HTTP/gRPC client would reject, naming the header but never its value."""
    for number, (key, value) in enumerate(headers.items(), start=1):
        if not _HEADER_KEY_RE.match(key):
            # its first word only: `Authorization: Basic <token>` (`:` for `=`) is all one "name"
            shown = re.split(r"[\s:]", key.strip(), maxsplit=1)[0][:40]
            raise ConfigError(
                f"{setting}: header #{number} has an invalid name (it starts {shown!r}; letters, digits "
                "and !#$%&'*+-.^_`|~ only). Write each header as name=value (not name: value); "
                "percent-encode the value if it has commas or spaces."
            )
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
            raise ConfigError(
                f"{setting}: the value of header {key!r} has a control character (newline?). Remove it."
            )


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _parse(name: str, value: Any, source: str, entry: Declaration) -> Any:
    """`value` as its field's type where it is text (environment, YAML) or a looser type of the same
    thing (a list for a tuple, an int for a float); anything else is left for `validate` to refuse."""
    hint, optional = entry.type, entry.optional
    text = value.strip() if isinstance(value, str) else None
    if optional and (value is None or (text is not None and text.lower() in ("", "none", "null"))):
        return None
    origin = typing.get_origin(hint)
    if origin is Literal and text is not None:  # `GRPC` is the choice `grpc`
        return next((c for c in typing.get_args(hint) if str(c).lower() == text.lower()), text)
    if hint in (int, float) and isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return hint(value)  # a numpy integer
    if hint is bool and text is not None and text.lower() in (*_TRUE, *_FALSE):
        return text.lower() in _TRUE
    if hint in (int, float) and text is not None:
        try:
            return hint(text)
        except ValueError:
            return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin is dict and (text is not None or isinstance(value, Mapping)):
        if text is not None:
            mapping = parse_key_values(value, source)
        else:
            mapping = {str(k): str(v) for k, v in value.items()}
        if "header" in name:
            check_headers(mapping, source)
        return mapping
    if origin is tuple and text is not None:
        return tuple(v.strip() for v in value.split(",") if v.strip())
    if origin is tuple and isinstance(value, (list, tuple)):
        return tuple(map(str, value))
    return value if text is None else text
