"""The reference demo: a tiny character-level transformer trained on Python source, instrumented
with otel_train exactly as a user would do it. Run `python -m otel_train.demo --help`."""

from __future__ import annotations

from otel_train.demo.train import main

__all__ = ["main"]
