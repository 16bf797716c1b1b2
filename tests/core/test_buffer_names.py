"""record() names past max_metric_names: refused cheaply for the whole run (no pattern matching
per call), with a bounded cache of refusals, and spellings of a name already held still merged."""

from __future__ import annotations

import pytest

from otel_train import semconv
from otel_train.core import buffer as buffer_module
from otel_train.core.buffer import Buffer


def _full_buffer(max_names: int = 4) -> Buffer:
    buffer = Buffer(max_names, max_values=100)
    for k in range(max_names):
        buffer.add_scalar(f"mine.metric_{k}", 1.0)
    return buffer


def test_a_name_past_the_cap_never_runs_the_reserved_name_patterns(monkeypatch: pytest.MonkeyPatch) -> None:
    buffer = _full_buffer()
    calls: list[str] = []

    def counting(instrument: str) -> str | None:
        calls.append(instrument)
        return None

    monkeypatch.setattr(buffer_module.semconv, "reserved_by", counting)
    # more names than the refusal cache holds (max_names x 8), each seen twice: a name past the
    # cache costs a name mapping, not the ~100 regex matches of reserved_by
    names = [f"over{k}" for k in range(buffer.max_names * 8 * 3)]
    for _ in range(2):
        for name in names:
            buffer.add_scalar(name, 1.0)
    assert calls == []
    assert buffer.dropped["too_many_names"] == 2 * len(names)
    assert len(buffer._name_map) <= buffer.max_names + buffer.max_names * 8  # bounded


def test_names_repeated_within_the_refusal_cache_stay_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    buffer = _full_buffer()
    for k in range(buffer.max_names * 8 * 3):  # invented names fill and recycle the cache
        buffer.add_scalar(f"invented{k}", 1.0)
    mapped: list[str] = []
    real = semconv.instrument_name_for
    monkeypatch.setattr(buffer_module.semconv, "instrument_name_for", lambda n: mapped.append(n) or real(n))
    for _ in range(3):
        buffer.add_scalar("repeated", 1.0)
    assert mapped == ["repeated"]  # mapped once, then a dict lookup


def test_a_full_name_table_still_merges_a_spelling_of_a_held_name() -> None:
    buffer = _full_buffer()
    buffer.add_scalar("mine/metric_0", 2.0)  # mine.metric_0 itself
    buffer.add_scalar("mine.metric.1", 3.0)  # the Prometheus name (mine_metric_1) of mine.metric_1
    buffer.add_scalar("loss", 4.0)  # the catalogue's train.loss is never refused by the cap
    assert buffer.instrument_of("mine/metric_0") == "mine.metric_0"
    assert buffer.instrument_of("mine.metric.1") == "mine.metric_1"
    assert buffer.instrument_of("loss") == "train.loss"
    assert "invalid_name" not in buffer.dropped


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("my metric", "train.my_metric"),
        ("metric-dash", "train.metric_dash"),
        ("a.b", "a.b"),
        ("/lead/x", "lead.x"),
    ],
)
def test_names_are_made_metric_names_as_the_quickstart_says(name: str, key: str) -> None:
    assert semconv.instrument_name_for(name) == key


@pytest.mark.parametrize("name", ["损失", "val:acc", "a#b", "grad(layer[0])", "x" * 121])
def test_a_name_that_cannot_be_a_metric_name_is_dropped_saying_what_can(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    buffer = Buffer(8, max_values=100)
    with caplog.at_level("WARNING", logger="otel_train"):
        buffer.add_scalar(name, 1.0)
        buffer.add_scalar(name, 2.0)
    assert buffer.dropped["invalid_name"] == 2
    [warning] = [r.getMessage() for r in caplog.records]
    assert "(ASCII letters, digits, _ and /, at most 120 characters); dropped" in warning
