"""Diagnostics: what tells a person why a run is stuck, dying or misconfigured.
Design: docs/design/diagnostics.md#diagnostics. From outside, import only the names below
(tests/test_architecture.py: walled packages)."""

from otel_train.diagnostics.collectives import CollectiveMonitor, group_label, op_name, start_monitor
from otel_train.diagnostics.hang import HangWatchdog
from otel_train.diagnostics.hang_attribution import (
    HangReporter,
    attribute,
    read_summaries,
    scan_summaries,
    summary_since,
    with_launch_hosts,
)
from otel_train.diagnostics.launch_check import check_launch, local_facts
from otel_train.diagnostics.memory_dump import MemoryDumps

__all__ = [
    "CollectiveMonitor", "HangReporter", "HangWatchdog", "MemoryDumps", "attribute", "check_launch",
    "group_label", "local_facts", "op_name", "read_summaries", "scan_summaries", "start_monitor", "summary_since",
    "with_launch_hosts",
]  # fmt: skip
