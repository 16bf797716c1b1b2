"""Before `init()` every scope is a no-op, but a wrong argument type raises the same TypeError as
with a session (docs/reliability.md#error-policy): a bug found on a laptop without telemetry is not
left for the cluster run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import otel_train as ot
from otel_train import adapters
from otel_train.testing import capture_metrics, current_session


def _step(index: Any) -> None:
    with ot.step(index):
        pass


BAD_CALLS: list[tuple[str, Callable[[], Any], str]] = [
    ("ot.step(3.5)", lambda: _step(3.5), r"ot.step\(index\) needs an int, got float 3.5"),
    ("ot.step('3')", lambda: _step("3"), r"ot.step\(index\) needs an int, got str '3'"),
    ("ot.step(True)", lambda: _step(True), r"ot.step\(index\) needs an int, got bool"),
    ("@ot.step(100)", lambda: ot.step(100)(_step), r"@ot.step\(100\) on '_step': .* takes no step number"),
    ("@ot.step(3.5)", lambda: ot.step(3.5)(_step), r"@ot.step\(3.5\) on '_step': .* takes no step number"),
    (
        "timer level='1'",
        lambda: ot.timer("x", level="1"),
        r"ot.timer\('x', level='1'\): the level must be an int",
    ),
    ("timer level=None", lambda: ot.timer("x", level=None), r"level=None\): the level must be an int"),  # type: ignore[arg-type]
    ("adapters.begin_step(3.5)", lambda: adapters.begin_step(3.5), r"ot.step\(index\) needs an int"),
    ("adapters.phase level='1'", lambda: adapters.phase("p", 0.1, level="1"), r"ot.phase\('p', level='1'\)"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(("label", "call", "fix"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_a_wrong_argument_type_raises_before_init_as_after(
    label: str, call: Callable[[], Any], fix: str
) -> None:
    assert current_session() is None
    with pytest.raises(TypeError, match=fix):
        call()
    with capture_metrics(log_interval=1, run_dir_enabled=False), pytest.raises(TypeError, match=fix):
        call()


def test_valid_arguments_stay_no_ops_before_init() -> None:
    assert current_session() is None
    for index in (None, 3, np.int64(4), 2**70):  # any integer type; a huge one is a value, not a type
        _step(index)
    assert adapters.begin_step(np.int32(5)) is None
    with ot.timer("x", level=2), ot.timer("y", level=np.int64(0)):
        adapters.phase("p", 0.1, level=1)
    ot.log_metrics({"a": 1.0}, step="3")  # the logger API's step= is a value (dropped once a session runs)
