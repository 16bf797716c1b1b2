"""Diagnostics: what tells a person why a run is stuck, dying or misconfigured.

* ``hang``: the stall watchdog (no step for `stall_timeout_s`: a `stall` event and every thread's
  stack in the run directory; SIGUSR1 does the same on demand; `faulthandler` writes them from C
  when a call holds the GIL).
* ``collectives``: this rank's collectives read from PyTorch's Flight Recorder on the flush worker
  (`train.collective.*`, and `train.collective.last_seconds`, the hang signal that needs no step to
  end).
* ``hang_attribution``: at a stall, each rank writes where its collectives stood; the rank the
  others wait for is named in one `hang` event through the run directory (no collective needed),
  and `otel-train diagnose RUN_DIR` does the same offline.
* ``memory_dump``: the CUDA memory snapshot on an OOM or above the memory-pressure threshold.
* ``launch_check``: the launch doctor at `init()` (torchrun/SLURM variables, devices, NCCL
  settings), `launch_config` events with the fix named.

From outside, import only the names below (tests/test_architecture.py: walled packages).
"""

from otel_train.diagnostics.collectives import CollectiveMonitor, group_label, op_name, start_monitor
from otel_train.diagnostics.hang import HangWatchdog
from otel_train.diagnostics.hang_attribution import HangReporter, attribute, read_summaries, scan_summaries
from otel_train.diagnostics.launch_check import check_launch, local_facts
from otel_train.diagnostics.memory_dump import MemoryDumps

__all__ = [
    "CollectiveMonitor",
    "HangReporter",
    "HangWatchdog",
    "MemoryDumps",
    "attribute",
    "check_launch",
    "group_label",
    "local_facts",
    "op_name",
    "read_summaries",
    "scan_summaries",
    "start_monitor",
]
