from __future__ import annotations

from examples.demo.train import main

raise SystemExit(main())
