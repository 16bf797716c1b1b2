"""Oumi: `otel_train.integrations.oumi.train(config)` in place of `oumi.train(config)`, or
`with instrument(...)` around code that calls `oumi.train`.

How it works: docs/design/integrations.md#oumi.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import otel_train as ot
from otel_train import adapters
from otel_train.integrations._common import spanned
from otel_train.integrations.transformers import OtelTrainCallback

__all__ = ["instrument", "train"]

_SEAM = "build_training_callbacks"  # the name oumi/train.py calls to build its callback list


@contextlib.contextmanager
def instrument(
    callback: OtelTrainCallback | None = None, settings: Mapping[str, Any] | None = None, **kwargs: Any
) -> Iterator[OtelTrainCallback]:
    """Inside the block, `oumi.train` runs with `callback` (default: a new `OtelTrainCallback`
    with these settings) after Oumi's own callbacks, and Oumi's own trainer (`OUMI`) evaluates
    and saves inside `eval` / `checkpoint` spans. A session the callback started ends with the
    block; if the block raises, the callback's open step ends as failed first."""
    # The module, not the function: `import oumi.train` would make `oumi.train` name the module.
    module = importlib.import_module("oumi.train")
    native = importlib.import_module("oumi.core.trainers.oumi_trainer").Trainer
    if callback is None:
        callback = OtelTrainCallback(settings, **kwargs)
    original = getattr(module, _SEAM)
    evaluate, save_state = native.evaluate, native.save_state

    def build_training_callbacks(config: Any, model: Any, profiler: Any) -> list[Any]:
        return [*original(config, model, profiler), callback]

    setattr(module, _SEAM, build_training_callbacks)
    native.evaluate, native.save_state = _evaluating(evaluate), spanned(save_state, "checkpoint")
    try:
        yield callback
        callback.close()  # oumi.train evaluated and saved inside the block: the run ends with it
    except BaseException:
        callback.close()
        raise
    finally:
        setattr(module, _SEAM, original)
        native.evaluate, native.save_state = evaluate, save_state


def _evaluating(evaluate: Callable[..., Any]) -> Callable[..., Any]:
    """`OumiTrainer.evaluate` in an `eval` span, each batch of its loader a heartbeat (it calls no
    callback: docs/design/integrations.md#oumi)."""

    def evaluating(self: Any, *args: Any, **kwargs: Any) -> Any:
        loader = self.eval_dataloader
        self.eval_dataloader = _Heartbeats(loader) if loader is not None else None
        try:
            with ot.span("eval"):
                return evaluate(self, *args, **kwargs)
        finally:
            self.eval_dataloader = loader

    return evaluating


class _Heartbeats:
    """A loader whose every batch, once the loop is done with it, is a heartbeat."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            yield batch
            adapters.heartbeat()


def train(config: Any, settings: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
    """`oumi.train(config)` with telemetry. Keyword arguments that are `ot.init()` settings
    configure the session (when the callback starts it); the others go to `oumi.train`
    (`additional_model_kwargs`, `additional_trainer_kwargs`, `verbose`)."""
    from otel_train.config import FIELDS

    ours = {k: v for k, v in kwargs.items() if k in FIELDS}
    theirs = {k: v for k, v in kwargs.items() if k not in FIELDS}
    with instrument(settings=settings, **ours):
        return importlib.import_module("oumi.train").train(config, **theirs)
