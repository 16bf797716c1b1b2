"""Fixtures for every test: an isolated otel_train session. Shared helpers live in tests/helpers/."""

from __future__ import annotations

import os
from collections.abc import Iterator

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
