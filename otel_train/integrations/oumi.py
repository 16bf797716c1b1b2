"""Oumi: `otel_train.integrations.oumi.train(config)` in place of `oumi.train(config)`.

`oumi.train()` takes no callbacks (`additional_trainer_kwargs={"callbacks": ...}` collides with the
`callbacks=` it passes itself), and builds its list with `oumi.builders.build_training_callbacks`,
which `oumi/train.py` imports by name. So `instrument()` replaces that one name in the `oumi.train`
module for the duration of a `with` block, appending an `OtelTrainCallback`; the original is put
back when the block ends, also on error. Every trainer type gets the callback: the Hugging Face
ones (`TRL_SFT`, `HF`, `TRL_DPO`, ...) through `Trainer`'s callback list, `OUMI` through its own
calls (`state=None`, no `on_train_begin`: see `otel_train.integrations.transformers`).

    from otel_train.integrations.oumi import train
    train(config)                                  # = oumi.train(config), instrumented
    train(config, run_name="sft", tensorboard=True)   # settings: ot.init() settings by name

    with instrument(run_name="sft") as callback:   # or around any code that calls oumi.train
        oumi.train(config)
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Mapping
from typing import Any

from otel_train.integrations.transformers import OtelTrainCallback

__all__ = ["instrument", "train"]

_SEAM = "build_training_callbacks"  # the name oumi/train.py calls to build its callback list


@contextlib.contextmanager
def instrument(
    callback: OtelTrainCallback | None = None, settings: Mapping[str, Any] | None = None, **kwargs: Any
) -> Iterator[OtelTrainCallback]:
    """Inside the block, `oumi.train` runs with `callback` (default: a new `OtelTrainCallback`
    with these settings) after Oumi's own callbacks. If the block raises, the callback's open
    step ends as failed and a session it started is shut down."""
    # The module, not the function: `import oumi.train` would make `oumi.train` name the module.
    module = importlib.import_module("oumi.train")
    if callback is None:
        callback = OtelTrainCallback(settings, **kwargs)
    original = getattr(module, _SEAM)

    def build_training_callbacks(config: Any, model: Any, profiler: Any) -> list[Any]:
        return [*original(config, model, profiler), callback]

    setattr(module, _SEAM, build_training_callbacks)
    try:
        yield callback
    except BaseException:
        callback.close()
        raise
    finally:
        setattr(module, _SEAM, original)


def train(config: Any, settings: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
    """`oumi.train(config)` with telemetry. Keyword arguments that are `ot.init()` settings
    configure the session (when the callback starts it); the others go to `oumi.train`
    (`additional_model_kwargs`, `additional_trainer_kwargs`, `verbose`)."""
    from otel_train.config import FIELDS

    ours = {k: v for k, v in kwargs.items() if k in FIELDS}
    theirs = {k: v for k, v in kwargs.items() if k not in FIELDS}
    with instrument(settings=settings, **ours):
        return importlib.import_module("oumi.train").train(config, **theirs)
