"""Runnable examples of otel_train, outside the package (not in the wheel): run them from the
repository root, e.g. `python -m examples.demo`."""
