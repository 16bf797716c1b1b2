from __future__ import annotations

from otel_train.demo.train import main

raise SystemExit(main())
