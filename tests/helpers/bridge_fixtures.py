"""Bridges for the bridge-process tests; the bridge process imports them as
`helpers.bridge_fixtures` (tests/ on its PYTHONPATH)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from otel_train.bridges.base import Sink


class Recording(Sink):
    """Appends every call, in order, as one JSON line to `path` (flushed at once)."""

    name = "recording"

    def __init__(self, path: str, note_policy: bool = False) -> None:
        self._file = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
        self._note_policy = note_policy  # the scheduling policy at the set-up and at each scalars call
        if note_policy:
            self._log("setup_policy", os.sched_getscheduler(0))

    def _log(self, *call: Any) -> None:
        self._file.write(json.dumps(call) + "\n")

    def write_scalars(self, step: int, wall_time: float, scalars: Mapping[str, float]) -> None:
        if self._note_policy:
            self._log("policy", os.sched_getscheduler(0))
        self._log("scalars", step, dict(scalars))

    def write_text(self, key: str, text: str, step: int) -> None:
        self._log("text", key, text, step)

    def write_samples(self, key: str, rows: Sequence[tuple[str, str]], step: int) -> None:
        self._log("samples", key, [list(r) for r in rows], step)

    def write_histogram(self, key: str, values: Sequence[float], step: int) -> None:
        self._log("histogram", key, list(values), step)

    def write_hparams(self, params: Mapping[str, Any]) -> None:
        self._log("hparams", dict(params))

    def close(self, final_scalars: Mapping[str, float], failed: bool = False) -> None:
        self._log("close", dict(final_scalars))
        self._file.close()


class Hanging(Sink):
    """Every write and the close block forever (a hung wandb.log, a dead NFS mount)."""

    name = "hanging"

    def write_scalars(self, step: int, wall_time: float, scalars: Mapping[str, float]) -> None:
        threading.Event().wait()

    def close(self, final_scalars: Mapping[str, float], failed: bool = False) -> None:
        threading.Event().wait()


class Slow(Sink):
    """The first write takes `seconds`; calls queued meanwhile beyond the bridge queue are dropped."""

    name = "slow"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def write_scalars(self, step: int, wall_time: float, scalars: Mapping[str, float]) -> None:
        if self.seconds:
            time.sleep(self.seconds)
            self.seconds = 0.0
