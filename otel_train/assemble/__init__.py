"""The composition root: `build_session(config)` builds every part of a session and wires them
(`agreement`, `run_place`, `resource`, `sinks`, `build`). Design: docs/design/core.md#assemble.
"""

from otel_train.assemble.agreement import refuse_together
from otel_train.assemble.build import build_session

__all__ = ["build_session", "refuse_together"]
