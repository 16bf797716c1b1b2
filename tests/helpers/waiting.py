"""Polling for something a background thread or another process writes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """`predicate()`'s first truthy value, polled every 50 ms; AssertionError naming `what` after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def process_gone(pid: int, guard_s: float) -> bool:
    """Whether process `pid` exited (a zombie counts: its pipes are closed) within `guard_s`
    seconds; the guard only ends a wait that never would."""
    import psutil

    deadline = time.monotonic() + guard_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False
