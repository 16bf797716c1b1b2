"""`python -m otel_train`: the `otel-train` command."""

from otel_train.cli import main

if __name__ == "__main__":  # not when a documentation tool imports every module
    raise SystemExit(main())
