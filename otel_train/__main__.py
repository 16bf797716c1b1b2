"""`python -m otel_train`: the `otel-train` command."""

from otel_train.cli import main

raise SystemExit(main())
