"""The session's shape: one class in one module, read top to bottom (docs/design/core.md#session)."""

from __future__ import annotations

import dataclasses

from otel_train.core.session import Session


def test_the_session_is_one_class_without_a_base_holding_part_of_it() -> None:
    """Its parts, steps, flush hand-off and close are in `Session` itself: no base class (a size
    split by inheritance) holds fields or methods of it."""
    assert Session.__mro__ == (Session, object)
    fields = {f.name for f in dataclasses.fields(Session)}
    assert {"config", "worker", "cadence", "watches"} <= fields  # the parts it opens with
    assert {"begin_step", "end_step", "flush", "shutdown"} <= set(vars(Session))  # its life, here
