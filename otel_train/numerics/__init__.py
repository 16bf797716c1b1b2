"""The model's own numbers (opt-in: `ot.watch`, with `scaler=` for a GradScaler), which say a
training run is going wrong before its loss does. Design: docs/design/hardware-and-numerics.md#numerics.

`model_watch`'s names are loaded on first use (PEP 562): it imports torch, and `import otel_train`
must not. From outside, import only the names below (tests/test_architecture.py: walled packages).
"""

from typing import TYPE_CHECKING, Any

from otel_train.numerics.amp import ScalerWatch
from otel_train.numerics.gradient_flow import GradientFlowMonitor

if TYPE_CHECKING:
    from otel_train.numerics.model_watch import ModelWatch, NullWatch, check_watch_args

__all__ = ["GradientFlowMonitor", "ModelWatch", "NullWatch", "ScalerWatch", "check_watch_args"]


def __getattr__(name: str) -> Any:
    if name not in ("ModelWatch", "NullWatch", "check_watch_args"):
        raise AttributeError(f"module 'otel_train.numerics' has no attribute {name!r}")
    from otel_train.numerics import model_watch

    return getattr(model_watch, name)
