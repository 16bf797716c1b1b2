"""What leaves the process is cleaned first: secret-looking values redacted (by key name, in URLs,
in free text) and free text capped in length.

Used for config.json, hyperparameters, resource attributes, ot.log_text and samples, and every
setting an error message shows.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
import operator
import re
from collections.abc import Mapping
from typing import Any

# `tokens`/`tokenizer` are counts and model names, not secrets (`max_new_tokens`, `tokenizer_name`).
_SECRET_RE = re.compile(r"(key|token(?!s|iz)|secret|passw|auth|credential|header|cookie|bearer)", re.I)
REDACTED = "***"


def is_secret_key(key: str) -> bool:
    return _SECRET_RE.search(key) is not None


def redact_url(value: Any) -> Any:
    """`scheme://user:password@host/...?api_key=...` -> `scheme://***@host/...?api_key=***` (the
    userinfo and secret-looking query parameters); other values unchanged."""
    if not isinstance(value, str) or "://" not in value:
        return value
    return _SECRET_IN_TEXT_RE.sub(_redacted_pair, _USERINFO_RE.sub(f"{REDACTED}@", value))


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
    """Best effort for free text, in linear time: the values of secret-looking names (`k=v`, `k: v`,
    quoted, JSON, reprs, `--flag value`), bearer tokens and URL userinfo become '***'."""
    text = _SECRET_IN_TEXT_RE.sub(_redacted_pair, text)
    text = _BEARER_RE.sub(lambda m: f"{m.group(1)} {REDACTED}", text)
    return _USERINFO_RE.sub(f"{REDACTED}@", text)


def redact_attributes(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """Flat attributes (a health event's, a log record's): a str under a secret-looking name becomes
    '***', every other str gets the free-text redaction; numbers and bools are kept."""
    out: dict[str, Any] = {}
    for key, value in attributes.items():
        if isinstance(value, str):
            value = REDACTED if value and is_secret_key(str(key)) else redact_text(value)
        out[str(key)] = value
    return out


def redact(value: Any, key: str = "") -> Any:
    """Replace secret-looking values (by key name) with '***', recursively. A number or a bool is
    kept whatever its name: `num_key_value_heads: 8` and `flops_per_token: 6e9` are no secrets."""
    if key and is_secret_key(key) and not isinstance(value, (int, float)):
        return REDACTED if value not in (None, "", {}, ()) else value
    if isinstance(value, Mapping):
        return {str(k): redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return _redact_sequence(value)
    if value is None or isinstance(value, numbers.Number) or hasattr(value, "dtype"):
        return value  # numpy's and torch's numbers too: each writer keeps their kind (plain())
    # A string may itself hold secrets (a nested config rendered with str(): `{'hf_token': ...}`, a
    # command line): the free-text redaction, which also covers URL userinfo.
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, argparse.Namespace) or (
        dataclasses.is_dataclass(value) and not isinstance(value, type)
    ):
        return redact(vars(value) if isinstance(value, argparse.Namespace) else _fields(value))
    # Any other object is written as its text (an Enum, a Path, a class of the user's): redacted.
    shown = plain_value(value)
    return redact_text(shown) if isinstance(shown, str) else value


def _fields(instance: Any) -> dict[str, Any]:
    return {field.name: getattr(instance, field.name) for field in dataclasses.fields(instance)}


_SECRET_FLAG_RE = re.compile(rf"(?i)--?[\w.-]{{0,64}}{_SECRET_WORD}[\w.-]{{0,64}}")


def _redact_sequence(items: list[Any] | tuple[Any, ...]) -> list[Any]:
    """Each item redacted; a command line's secret-looking flag hides the item after it
    (`["--hf-token", "hf_..."]`)."""
    out: list[Any] = []
    for item in items:
        follows_flag = bool(out) and isinstance(out[-1], str) and _SECRET_FLAG_RE.fullmatch(out[-1])
        out.append(REDACTED if follows_flag and isinstance(item, str) else redact(item))
    return out


def plain_value(value: Any) -> Any:
    """A value JSON has no form for, as a number (numpy scalars, 0-dim tensors) or as text, so one
    odd value never empties a file (json.dumps's `default=`)."""
    try:
        if str(getattr(value, "dtype", "")) in ("bool", "torch.bool"):
            return bool(value)  # numpy's and torch's: a bool, not the number 1
        try:
            return operator.index(value)  # numpy integers, integer 0-dim tensors
        except TypeError:  # not an integer: a float, or text
            pass
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            return str(value)
        return number if math.isfinite(number) else None
    except Exception:  # the value's own __index__, __float__ or __str__: any code at all
        return f"<{type(value).__name__}>"
