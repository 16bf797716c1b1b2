"""The reference demo: a tiny character-level transformer trained on Python source, instrumented
with otel_train exactly as a user would do it. Not part of the wheel: run it from a source checkout
with `make demo` or, from the repository root, `python -m examples.demo --help`."""

from __future__ import annotations

from examples.demo.train import main

__all__ = ["main"]
