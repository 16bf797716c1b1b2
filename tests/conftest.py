"""Fixtures for every test: an isolated otel_train session. Shared helpers live in tests/helpers/."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def _isolated_session(tmp_path, monkeypatch) -> Iterator[None]:
    """Every test starts with no otel_train session and writes run dirs under its tmp dir."""
    for key in list(os.environ):
        # OTEL_TRAIN_TOOLS is where the pinned real components are (tests/helpers/pinned.py), not a
        # library setting: it stays.
        if key.startswith(("OTEL_", "WANDB_")) and key != "OTEL_TRAIN_TOOLS":
            monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("OTEL_TRAIN_OUTPUT_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield
    try:
        from otel_train import testing
    except ImportError:
        return
    testing.reset()


@pytest.fixture
def quiet_session() -> Iterator[Any]:
    """A running session (no run dir, no pull endpoint, no hardware, a flush every step): the
    internals `current_session()` returns, for tests of the worker and the session's parts."""
    import otel_train as ot
    from otel_train.testing import current_session

    ot.init(prometheus_port=0, verbosity=0, run_dir_enabled=False, hardware=False, log_interval=1)
    running = current_session()
    assert running is not None
    yield running
    ot.shutdown()
