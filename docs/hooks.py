"""mkdocs hook: the configuration reference and the metric catalogue, generated from the code.

`reference/configuration.md` and `reference/metrics.md` hold a marker where the table goes; at
each build this hook writes the table from the settings table of `otel_train.config` (every field,
its environment variables, its default, its doc, its allowed values and whether `control.json` may
change it) and from `otel_train.semconv.CATALOGUE`, so a changed default, a new setting or a
renamed metric changes the page. A setting declared without a doc fails the build. The pages in
the repository carry the tables too (read on GitHub, or offline): `python docs/hooks.py` writes
them, and tests/test_docs.py says when they are stale.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SETTINGS_MARKER = "<!-- generated: settings -->"
METRICS_MARKER = "<!-- generated: metrics -->"


class DocsGenerationError(RuntimeError):
    """The code's tables and the docs' descriptions disagree; the message names the fix."""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def format_default(value: Any) -> str:
    """A default as the page shows it: unset for None, else the Python literal."""
    return "unset" if value is None else f"`{value!r}`"


def env_names(name: str, config_cls: type | None = None) -> list[str]:
    """The variables that set `name`: `OTEL_TRAIN_<NAME>`, then any standard OTel variable."""
    from otel_train import config

    cls = config.Config if config_cls is None else config_cls
    return [config.env_name(name), *config.declared(cls)[name].setting.env]


def load_meanings(config_cls: type | None = None) -> dict[str, str]:
    """Each setting's doc, as its `setting(doc=...)` declares it."""
    from otel_train import config

    cls = config.Config if config_cls is None else config_cls
    return {name: entry.setting.doc for name, entry in config.declared(cls).items() if entry.setting.doc}


def settings_table(config_cls: type | None = None, meanings: dict[str, str] | None = None) -> str:
    """The configuration reference table: one row per field of `config_cls` (`Config`), in order;
    `meanings` replaces the declared docs (a name `config_cls` lacks fails)."""
    from otel_train import config

    cls = config.Config if config_cls is None else config_cls
    table = config.declared(cls)
    meanings = load_meanings(cls) if meanings is None else meanings
    stale = sorted(set(meanings) - set(table))
    if stale:
        raise DocsGenerationError(
            f"descriptions of settings {cls.__name__} does not have: {stale}; remove or rename them"
        )
    rows = ["| setting | env | default | meaning |", "| --- | --- | --- | --- |"]
    for name, entry in table.items():
        meaning = meanings.get(name)
        if not meaning:
            raise DocsGenerationError(
                f'setting {name} has no description: declare it with setting(..., doc="...") in otel_train/config.py'
            )
        spec = entry.setting
        if any(rule is not None for rule in (spec.ge, spec.gt, spec.le, spec.lt)):
            meaning += f". Allowed: {config.allowed(name, cls)}"
        if spec.runtime:
            meaning += ". `control.json` may change it in a running job"
        env = ", ".join(f"`{e}`" for e in env_names(name, cls))
        rows.append(f"| `{name}` | {env} | {format_default(entry.default)} | {_cell(meaning)} |")
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
            # the job's series are rank 0's OTel instruments only: no bridge or run-dir row has them
            key = f"`{spec.key}`" if spec.scope == "rank" else "— (OTLP and pull endpoint only)"
            parts.append(
                f"| `{spec.name}` | {spec.kind.value} | `{spec.unit}` | {attrs} | "
                f"{series} | {key} | {_cell(spec.description)}{gpu} |"
            )
        parts.append("")
    parts += ["## Names `ot.record` maps onto the catalogue", ""]
    parts += ["| recorded name | metric |", "| --- | --- |"]
    parts += [f"| `{name}` | `{metric}` |" for name, metric in semconv.RECORD_ALIASES.items()]
    return "\n".join(parts)


def with_tables(markdown: str) -> str:
    """`markdown` with what follows its marker replaced by the table generated now."""
    for marker, table in ((SETTINGS_MARKER, settings_table), (METRICS_MARKER, metric_catalogue)):
        if marker in markdown:
            markdown = f"{markdown.split(marker, 1)[0]}{marker}\n\n{table()}\n"
    return markdown


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return with_tables(markdown)


PAGES = ("reference/configuration.md", "reference/metrics.md")


if __name__ == "__main__":  # python docs/hooks.py: the committed pages' tables, regenerated
    for name in PAGES:
        path = Path(__file__).parent / name
        path.write_text(with_tables(path.read_text(encoding="utf-8")), encoding="utf-8")
