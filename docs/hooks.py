"""mkdocs hook: the configuration reference and the metric catalogue, generated from the code.

`reference/configuration.md` and `reference/metrics.md` hold a marker where the table goes; at
each build this hook writes the table from `otel_train.config.Config` (every field, its default,
its environment variables) and from `otel_train.semconv.CATALOGUE`, so a changed default, a new
setting or a renamed metric changes the page. What a setting means is written in
`docs/reference/settings.yml` (or, failing that, the field's own comment in `config.py`); a setting
with neither, or a description of a setting that does not exist, fails the build.
"""

from __future__ import annotations

import dataclasses
import io
import re
import tokenize
from pathlib import Path
from typing import Any

import yaml

SETTINGS_MARKER = "<!-- generated: settings -->"
METRICS_MARKER = "<!-- generated: metrics -->"
MEANINGS_FILE = Path(__file__).resolve().parent / "reference" / "settings.yml"


class DocsGenerationError(RuntimeError):
    """The code's tables and the docs' descriptions disagree; the message names the fix."""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    raise DocsGenerationError(f"Config.{field.name} has no default; every setting needs one")


def format_default(value: Any) -> str:
    """A default as the page shows it: unset for None, else the Python literal."""
    return "unset" if value is None else f"`{value!r}`"


def env_names(name: str) -> list[str]:
    """The variables that set `name`: `OTEL_TRAIN_<NAME>`, then any standard OTel variable."""
    from otel_train import config_loading
    from otel_train.config import env_name

    # The standard OpenTelemetry variables and the fields they set: config_loading's own table.
    standard: dict[str, str] = config_loading._STANDARD_ENV
    return [env_name(name), *(key for key, field in standard.items() if field == name)]


def field_comments(source: str, class_name: str = "Config") -> dict[str, str]:
    """Each field's inline comment in `class_name`'s body (`name: type = default  # comment`)."""
    comments: dict[str, str] = {}
    in_class = False
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    for token in tokens:
        line = token.line
        if token.type == tokenize.NAME and token.string == "class" and token.start[1] == 0:
            in_class = line.startswith(f"class {class_name}")
        if in_class and token.type == tokenize.COMMENT:
            match = re.match(r"^    (\w+)\s*:", line)
            if match and line.index("#") > line.index(":"):
                comments[match.group(1)] = token.string.lstrip("#").strip()
    return comments


def load_meanings(path: Path = MEANINGS_FILE) -> dict[str, str]:
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise DocsGenerationError(f"{path} must map each setting's name to its description")
    return {str(k): str(v) for k, v in data.items()}


def settings_table(config_cls: type | None = None, meanings: dict[str, str] | None = None) -> str:
    """The configuration reference table: one row per `Config` field, in the class's order."""
    import otel_train.config

    cls = otel_train.config.Config if config_cls is None else config_cls
    meanings = load_meanings() if meanings is None else meanings
    comments = field_comments(Path(otel_train.config.__file__).read_text())
    fields = dataclasses.fields(cls)
    names = {f.name for f in fields}
    stale = sorted(set(meanings) - names)
    if stale:
        raise DocsGenerationError(
            f"docs/reference/settings.yml describes settings Config does not have: {stale}; "
            "remove or rename them"
        )
    rows = ["| setting | env | default | meaning |", "| --- | --- | --- | --- |"]
    for f in fields:
        meaning = meanings.get(f.name) or comments.get(f.name)
        if not meaning:
            raise DocsGenerationError(
                f"setting {f.name} has no description: add `{f.name}: ...` to "
                "docs/reference/settings.yml (or an inline comment on the field in config.py)"
            )
        env = ", ".join(f"`{e}`" for e in env_names(f.name))
        rows.append(f"| `{f.name}` | {env} | {format_default(_default(f))} | {_cell(meaning)} |")
    return "\n".join(rows)


def metric_catalogue(catalogue: tuple[Any, ...] | None = None) -> str:
    """The metric catalogue: one table per namespace, one row per `semconv.CATALOGUE` entry."""
    from otel_train import semconv

    specs = semconv.CATALOGUE if catalogue is None else catalogue
    groups: dict[str, list[Any]] = {}
    for spec in specs:
        groups.setdefault(spec.name.split(".")[0], []).append(spec)
    parts: list[str] = []
    for namespace, members in groups.items():
        parts += [f"## `{namespace}.*`", ""]
        parts += [
            "| metric | kind | unit | attributes | Prometheus series | bridge key | description |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for spec in members:
            attrs = ", ".join(f"`{a}`" for a in spec.attributes) or "—"
            gpu = " (GPU only)" if spec.gpu_only else ""
            series = f"`{spec.collector_prometheus_name}`"
            if spec.prometheus_name != spec.collector_prometheus_name:
                series += f" (pull endpoint: `{spec.prometheus_name}`)"
            parts.append(
                f"| `{spec.name}` | {spec.kind.value} | `{spec.unit}` | {attrs} | "
                f"{series} | `{spec.key}` | {_cell(spec.description)}{gpu} |"
            )
        parts.append("")
    parts += ["## Names `ot.record` maps onto the catalogue", ""]
    parts += ["| recorded name | metric |", "| --- | --- |"]
    parts += [f"| `{name}` | `{metric}` |" for name, metric in semconv.RECORD_ALIASES.items()]
    return "\n".join(parts)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if SETTINGS_MARKER in markdown:
        markdown = markdown.replace(SETTINGS_MARKER, settings_table())
    if METRICS_MARKER in markdown:
        markdown = markdown.replace(METRICS_MARKER, metric_catalogue())
    return markdown
