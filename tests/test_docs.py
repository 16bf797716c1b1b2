"""The documentation: the site builds strictly, its configuration reference and metric catalogue
are generated from the code (a changed default changes the page), and the README is a front door
whose quickstart runs and whose links lead to pages that exist."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from otel_train import semconv
from otel_train.config import Config, env_name

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _hooks() -> ModuleType:
    """docs/hooks.py, which mkdocs loads by path: loaded the same way here."""
    spec = importlib.util.spec_from_file_location("otel_train_docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(table: str, setting: str) -> str:
    rows = [line for line in table.splitlines() if line.startswith(f"| `{setting}` |")]
    assert len(rows) == 1, f"{setting}: {len(rows)} rows"
    return rows[0]


def test_site_builds_strictly(tmp_path) -> None:
    """`mkdocs build --strict`: any warning (a broken link, a missing anchor, a page left out of
    the navigation, a docstring mkdocstrings cannot read) fails. The generated pages hold every
    setting and every metric, and the API pages the public names."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    configuration = (site / "reference" / "configuration" / "index.html").read_text()
    for field in dataclasses.fields(Config):
        assert f"<code>{field.name}</code>" in configuration, field.name
        assert env_name(field.name) in configuration, field.name
    metrics = (site / "reference" / "metrics" / "index.html").read_text()
    for spec in semconv.CATALOGUE:
        assert f"<code>{spec.name}</code>" in metrics, spec.name
    api = (site / "reference" / "api" / "index.html").read_text()
    for name in ("init", "step", "timer", "record", "log_metrics", "watch", "shutdown"):
        assert f'id="otel_train.{name}"' in api, name
    integrations = (site / "reference" / "integrations" / "index.html").read_text()
    for module in ("transformers", "lightning", "accelerate", "megatron", "trl", "ray", "nemo_rl", "oumi"):
        assert f'id="otel_train.integrations.{module}"' in integrations, module


def test_every_setting_has_a_row_with_its_default_and_variables() -> None:
    """Every Config field is a row of the reference with its own default and `OTEL_TRAIN_<FIELD>`
    (and the standard OTel variable where there is one); the meaning is never empty."""
    table = _hooks().settings_table()
    for field in dataclasses.fields(Config):
        row = _row(table, field.name)
        assert f"`{env_name(field.name)}`" in row
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()  # type: ignore[misc]
        assert (" unset " if default is None else f"`{default!r}`") in row, row
        assert row.rstrip(" |").split(" | ")[-1].strip(), f"{field.name} has no meaning"
    assert "`OTEL_EXPORTER_OTLP_ENDPOINT`" in _row(table, "otlp_endpoint")
    assert "`OTEL_METRIC_EXPORT_INTERVAL`" in _row(table, "metric_export_interval_s")


def test_changing_a_config_default_changes_the_page() -> None:
    """The page is the code's table: a Config whose default differs gives a different row."""
    hooks = _hooks()

    @dataclasses.dataclass(frozen=True)
    class Changed(Config):
        log_interval_s: float = 45.0
        wandb_project: str = "my-project"

    before, after = hooks.settings_table(), hooks.settings_table(config_cls=Changed)
    assert "`30.0`" in _row(before, "log_interval_s")
    assert "`45.0`" in _row(after, "log_interval_s") and "`30.0`" not in _row(after, "log_interval_s")
    assert "`'my-project'`" in _row(after, "wandb_project")
    assert _row(before, "queue_size") == _row(after, "queue_size")


def test_a_setting_without_a_description_or_a_stale_description_fails_the_build() -> None:
    """A new field declared without a doc (`setting(..., doc=...)` in config.py), or a description
    of a setting that does not exist, stops the build."""
    hooks = _hooks()

    @dataclasses.dataclass(frozen=True)
    class WithNew(Config):
        brand_new_setting: int = 3

    with pytest.raises(hooks.DocsGenerationError, match="brand_new_setting"):
        hooks.settings_table(config_cls=WithNew)
    meanings = {**hooks.load_meanings(), "brand_new_setting": "what it does"}
    described = hooks.settings_table(config_cls=WithNew, meanings=meanings)
    assert "| `brand_new_setting` | `OTEL_TRAIN_BRAND_NEW_SETTING` | `3` | what it does |" in described
    with pytest.raises(hooks.DocsGenerationError, match="removed_setting"):
        hooks.settings_table(meanings={**hooks.load_meanings(), "removed_setting": "gone"})


def test_metric_catalogue_is_the_code_table() -> None:
    hooks = _hooks()
    page = hooks.metric_catalogue()
    for spec in semconv.CATALOGUE:
        rows = [line for line in page.splitlines() if line.startswith(f"| `{spec.name}` |")]
        assert len(rows) == 1, spec.name
        # the job's series are rank 0's instruments alone: no bridge or run-dir row has them
        key = f"`{spec.key}`" if spec.scope == "rank" else "— (OTLP and pull endpoint only)"
        assert key in rows[0] and f"`{spec.collector_prometheus_name}`" in rows[0]
    renamed = dataclasses.replace(semconv.LOSS, name="train.loss.renamed", description="A new meaning.")
    changed = hooks.metric_catalogue((renamed,))
    names = [line.split(" | ")[0] for line in changed.splitlines() if line.startswith("| `train.")]
    assert names == ["| `train.loss.renamed`"] and "A new meaning." in changed


# --- the README ------------------------------------------------------------------------------------
def test_every_event_the_docs_name_is_one_the_library_emits() -> None:
    """An `on_event` filter written from the docs must match: a page naming the straggler event by
    its module's name (`crossrank/reducer`) gave a filter that never fired."""
    source = "".join(p.read_text(encoding="utf-8") for p in (ROOT / "otel_train").rglob("*.py"))
    pages = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    named = {
        (page.name, name)
        for page in pages
        if page.name != "changelog.md"  # history names what no longer exists
        for name in re.findall(r"`([\w/.-]+)` (?:health )?event\b", page.read_text(encoding="utf-8"))
    }
    assert len(named) > 20
    assert [(page, name) for page, name in sorted(named) if f'"{name}"' not in source] == []


def test_readme_is_a_front_door() -> None:
    """At most 250 lines; shows the install line and the two set-up commands; every relative link
    leads to a file of the repository (the docs pages)."""
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    for shown in ("pip install otel-train", "make demo", "make test"):
        assert shown in text, shown
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if not re.match(r"^[a-z]+://", link)]
    assert len(local) > 10
    missing = [link for link in local if not (ROOT / link).is_file()]
    assert not missing, missing


# The docs site's home page is the README as the site shows it: without the README's pointer to the
# site, links relative to docs/, and the developer's part (the two commands, the license) as one line.
INDEX = ROOT / "docs" / "index.md"
_SITE_POINTER = "**Documentation: [docs/](docs/index.md)** (build the site with `make docs`).\n\n"
_DEVELOPER_PART = "## Two commands\n"
_INDEX_END = (
    "Working on otel_train itself (`make demo`, `make test`, `make docs`): [Development](development.md).\n"
)


def readme_as_index(readme: str) -> str:
    """docs/index.md as it must be for `readme` (README.md)."""
    assert _SITE_POINTER in readme and _DEVELOPER_PART in readme, "the README's layout changed: update this"
    front = readme.replace(_SITE_POINTER, "").split(_DEVELOPER_PART, 1)[0]
    return front.replace("](docs/", "](") + _INDEX_END


def test_the_docs_home_page_is_the_readme() -> None:
    """docs/index.md once fell behind the README (an extra, an integration and a section missing):
    it is the README, its links made relative to docs/. Fix it by writing `readme_as_index()`."""
    expected = readme_as_index(README.read_text(encoding="utf-8"))
    assert INDEX.read_text(encoding="utf-8") == expected, (
        "docs/index.md differs from README.md; regenerate it"
    )


def test_the_api_page_lists_every_adapter_name() -> None:
    """docs/reference/api.md names each member of `otel_train.adapters.__all__` for mkdocstrings
    (`Run` has a section of its own): a new adapter call is documented, not left out."""
    from otel_train import adapters

    page = (ROOT / "docs" / "reference" / "api.md").read_text(encoding="utf-8")
    section = page.split("::: otel_train.adapters", 1)[1]
    listed = re.findall(r"^ {8}- (\w+)$", section.split("members:", 1)[1], re.M)
    assert sorted(listed) == sorted(set(adapters.__all__) - {"Run"})
    assert "::: otel_train.core.runtime.Run" in page


def _readme_quickstart() -> str:
    section = README.read_text().split("## Quickstart", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block, "the README's Quickstart lost its code"
    return block.group(1)


def run_quickstart(python: str, cwd: Path, env: dict[str, str]) -> Path:
    """Runs the README's quickstart with `python`; returns the run directory it printed, whose
    metrics file must hold the recorded loss."""
    script = cwd / "quickstart.py"
    script.write_text(_readme_quickstart())
    env = {**env, "OTEL_TRAIN_PROMETHEUS_PORT": "0", "OTEL_TRAIN_HARDWARE": "0"}
    result = subprocess.run(
        [python, str(script)], cwd=cwd, capture_output=True, text=True, env=env, timeout=240
    )
    assert result.returncode == 0, result.stdout + result.stderr
    match = re.search(r"^run directory: (.+)$", result.stdout, re.M)
    assert match, result.stdout
    run_dir = Path(cwd, match.group(1))
    rows = [json.loads(line) for line in (run_dir / "metrics.rank0.jsonl").read_text().splitlines()]
    assert rows and rows[-1]["step"] == 199
    assert all(isinstance(row["train/loss"], float) for row in rows)
    assert json.loads((run_dir / "hparams.json").read_text())["lr"] == 1e-3
    return run_dir


def test_readme_quickstart_runs(tmp_path) -> None:
    run_dir = run_quickstart(sys.executable, tmp_path, dict(os.environ))
    assert run_dir.is_relative_to(tmp_path)


@pytest.mark.parametrize("page", ["reference/configuration.md", "reference/metrics.md"])
def test_the_committed_reference_tables_are_fresh(page: str) -> None:
    """The reference pages carry their generated tables in the repository too (a reader on GitHub,
    the README's links): the table after the marker is the one the code makes now."""
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    assert text == _hooks().with_tables(text), f"docs/{page} is stale: run `python docs/hooks.py`"


def test_the_quickstart_pages_first_example_runs(tmp_path: Path) -> None:
    """docs/quickstart.md's first code block, as a reader copies it: it runs and its run directory
    holds the loss and the tokens of every step."""
    page = (ROOT / "docs" / "quickstart.md").read_text(encoding="utf-8")
    block = re.search(r"```python\n(.*?)```", page, re.S)
    assert block, "the quickstart page lost its first example"
    script = tmp_path / "train.py"
    script.write_text(block.group(1))
    env = {
        **os.environ,
        "OTEL_TRAIN_PROMETHEUS_PORT": "0",
        "OTEL_TRAIN_HARDWARE": "0",
        "OTEL_TRAIN_RUN_NAME": "qs",
    }
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, env=env,
                            timeout=240)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [
        json.loads(line)
        for line in (tmp_path / "runs" / "qs" / "metrics.rank0.jsonl").read_text().splitlines()
    ]
    assert rows[-1]["step"] == 49 and all(isinstance(row.get("train/loss"), float) for row in rows)
    assert sum(row.get("throughput/tokens", 0) for row in rows) == 50 * 8 * 64
