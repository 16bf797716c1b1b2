"""The composition root: `build_session(config)` builds every part of a session and wires them.

`_runtime.init()` calls it once per session. The parts, each with one job:

* ``agreement``: what every rank decides together at init from the facts each reports: a refusal
  anywhere is every rank's, at once (`refuse_together` for a rank whose settings are invalid),
  and the exchange's shape.
* ``run_place``: who this process is in the job (identity, the telemetry gloo group) and the one
  run every rank agrees on at init: rank 0's run name, directory and cadence (`RunPlace`).
* ``resource``: the OpenTelemetry Resource that names this rank's metric series.
* ``sinks``: the metrics JSONL of every rank, and on the reporting rank the console and the bridge
  process with the switched-on bridges (`bridges/table`).
* ``build``: `build_session`, which builds these and every other part in order and wires them.

`Session` itself only runs the steps; nothing here runs on the training thread after init().
"""

from otel_train.assemble.agreement import refuse_together
from otel_train.assemble.build import build_session

__all__ = ["build_session", "refuse_together"]
