"""What the framework integrations share: the session's start and end, settings given as keyword
arguments or adopted from the framework, framework log names, steps begun and ended by hooks
(docs/design/integrations.md#common)."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter
from time import perf_counter_ns
from types import FrameType
from typing import Any, TypeVar

import otel_train as ot
from otel_train import adapters
from otel_train.config import CONFIG_FILE_ENV, FIELDS, env_name
from otel_train.config_loading import config_file_settings, unknown_setting

T = TypeVar("T")
EVAL_PREFIXES = ("eval_", "test_", "predict_")  # a framework's evaluation, test and prediction logs
LEFT_OUT = (str, bytes, bool, dict, list)  # what `scalar_logs` leaves out of a trainer's logs


def settings_from_kwargs(
    settings: Mapping[str, Any] | None, kwargs: dict[str, Any], owner: str
) -> dict[str, Any]:
    """`ot.init()` settings given to an integration's constructor: the `settings` mapping, then
    keyword arguments (which win), e.g. `OtelTrainCallback(run_name="x", tensorboard=True)`. A name
    that is not a `Config` field raises `ConfigError` naming it and the closest field, at
    construction, not later at the first step."""
    merged = {**dict(settings or {}), **kwargs}
    unknown = next((name for name in merged if name not in FIELDS), None)
    if unknown is not None:
        raise unknown_setting(owner, unknown, FIELDS)
    return merged


# What frameworks call their training precisions, as otel_train's compute_dtype (MFU's peak).
_PRECISIONS = {
    "bf16": "bf16", "bf16-mixed": "bf16", "bf16-true": "bf16", "16": "fp16", "16-mixed": "fp16",
    "16-true": "fp16", "fp16": "fp16", "transformer-engine": "fp8", "transformer-engine-float16": "fp8",
    "fp8": "fp8", "32": "fp32", "32-true": "fp32", "fp32": "fp32", "tf32": "tf32",
}  # fmt: skip


def with_precision(settings: Mapping[str, Any], framework_precision: str | None) -> dict[str, Any]:
    """`settings` plus `compute_dtype` from the precision the framework says it trains in, unless
    the user chose one: a keyword, `OTEL_TRAIN_COMPUTE_DTYPE`, or a config file (not read here, so
    with one the framework's word is left out). Unknown precisions leave `compute_dtype` alone."""
    out = dict(settings)
    dtype = _PRECISIONS.get(str(framework_precision).lower()) if framework_precision is not None else None
    user_chose = (
        "compute_dtype" in out or "OTEL_TRAIN_COMPUTE_DTYPE" in os.environ or CONFIG_FILE_ENV in os.environ
    )
    if dtype is not None and not user_chose:
        out["compute_dtype"] = dtype
    return out


def start_session(settings: Mapping[str, Any] | None) -> bool:
    """Start a session unless the user already has one. True when this call started it (the
    integration then also shuts it down); the user's own session is never replaced."""
    if adapters.current_run() is not None:
        return False
    ot.init(**dict(settings or {}))
    return True


def end_training(owns_session: bool) -> None:
    """Shut down the session the integration started; else the user's run outlives the training
    and idles: no stall while it does other work."""
    if owns_session:
        adapters.end_run()
    else:
        adapters.idle()


class HookStep:
    """A step that a framework's hooks begin and end, its phases timed back to back
    (docs/design/integrations.md#common)."""

    def __init__(self) -> None:
        self.open = False
        self.phase_start_ns = 0  # where the running phase started
        self._held: tuple[int | None, int | None] | None = None  # an ended step's counts, until release

    def begin(self, index: int, start_ns: int | None) -> bool:
        """Begin step `index` at `start_ns`; False when no session runs."""
        self.open = adapters.begin_step(index, start_ns=start_ns) is not None
        return self.open

    def end_phase(self, name: str) -> None:
        """Phase `name`, from the end of the one before to now (nothing outside the step)."""
        if self.open:
            ot.timer(name).start(at_ns=self.phase_start_ns).stop()
            self.phase_start_ns = perf_counter_ns()

    def end(self, tokens: int | None = None, samples: int | None = None, hold: bool = False) -> None:
        """End the step; `hold`: the framework logs it next (the HF Trainer's on_log comes after
        on_step_end), so it stays open until `release()`, and the log's values leave with its own
        flush (the console's line, the flush's row) rather than the next one's."""
        if self.open and hold:
            self._held = (tokens, samples)
        elif self.open:
            self.open = False
            adapters.end_step(tokens=tokens, samples=samples)

    @property
    def held(self) -> bool:
        return self._held is not None

    def release(self) -> None:
        """End a held step (its log came, or the next hook did)."""
        if self._held is not None:
            (tokens, samples), self._held = self._held, None
            self.end(tokens, samples)

    def fail(self) -> None:
        """The end hook never came: the open step ends as failed (out of step counts and durations).
        A held one is whole: it ends."""
        self.release()
        if self.open:
            self.open = False
            adapters.end_step(failed=True)


def logged_step(
    index: int,
    start_ns: int | None,
    values: Mapping[str, Any],
    stretches: Sequence[tuple[str | None, int]] = (),
) -> int:
    """Step `index` marked by a framework's log: begun at `start_ns`, ended now, with `values` as
    one row at that step (each log a point of its own, as the framework's own loggers write it;
    in a flush's statistics they would be averaged over `log_interval` logs). `stretches`: (span
    name, start) where training (None), an evaluation ("eval") or a save ("checkpoint") began inside
    it, each lasting to the next one's start or now; the evaluations and saves become spans inside
    the step (goodput's eval / checkpoint time, not productive). Returns its end, where the next
    one starts."""
    adapters.begin_step(index, start_ns=start_ns)
    for position, (span, begun) in enumerate(stretches):
        if span is not None:
            ended = stretches[position + 1][1] if position + 1 < len(stretches) else None
            ot.span(span).start(at_ns=begun).stop(at_ns=ended)
    adapters.end_step()
    ot.log_metrics(values, step=index)
    return perf_counter_ns()


def chosen(name: str, settings: Mapping[str, Any]) -> bool:
    """Whether the user gave otel_train setting `name`: a keyword, `OTEL_TRAIN_<NAME>` or the
    config file (read here only for its keys)."""
    if name in settings or os.environ.get(env_name(name), "").strip():
        return True
    path = os.environ.get(CONFIG_FILE_ENV) or ""
    return path != "" and name in config_file_settings(path)


def with_adopted(settings: Mapping[str, Any], adopted: Mapping[str, Any]) -> dict[str, Any]:
    """`settings` plus the `adopted` values (what the framework's own config says) of the settings
    the user did not choose (`chosen`)."""
    out = {name: value for name, value in adopted.items() if not chosen(name, settings)}
    out.update(settings)
    return out


def rank_share(total: int, rank: int, world: int) -> int:
    """This rank's even share of a job-wide count (the shares of all ranks sum to `total`)."""
    share, rest = divmod(total, world)
    return share + (1 if rank < rest else 0)


def distributed_world() -> int:
    """World size of an initialised torch.distributed job, else 1 (torch imported only if loaded)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return int(dist.get_world_size())


def scalar_logs(
    logs: Mapping[str, Any], skip: frozenset[str] = frozenset(), left_out: tuple[type, ...] = LEFT_OUT
) -> dict[str, Any]:
    """A framework's log dict as otel_train record names: `eval_loss` -> `eval/loss`, `loss`,
    `learning_rate`, `grad_norm` stay (they are catalogue aliases); values of the `left_out` types
    (by default strings, booleans and containers: a trainer's own bookkeeping) are left out, the
    others passed through untouched (tensors stay on device; `log_metrics` drops what is no number,
    counted and warned about)."""
    out: dict[str, Any] = {}
    for key, value in logs.items():
        if not isinstance(key, str) or key in skip or isinstance(value, left_out):
            continue
        prefix = next((p for p in EVAL_PREFIXES if key.startswith(p) and key != "eval_loss"), "")
        # NaN/Inf pass on: the worker counts them as non-finite
        out[f"{prefix[:-1]}/{key[len(prefix) :]}" if prefix else key] = value
    return out


def flattened(values: Mapping[Any, Any], prefix: str = "") -> dict[Any, Any]:
    """`values` with nested mappings as `outer/inner` names (W&B and TensorBoard keep them too)."""
    out: dict[Any, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}" if prefix else key
        if isinstance(value, Mapping):
            out.update(flattened(value, f"{name}/"))
        else:
            out[name] = value
    return out


def call_holding(
    kind: type[T], member: object, members: str, names: tuple[str, ...] = ("self",)
) -> tuple[T, dict[str, Any]] | None:
    """The `kind` object (a Trainer, an Accelerator) whose `members` list (a dotted attribute path)
    holds `member`, found in the callers' local variables `names`, and the local variables of the
    nearest call that has it (the arguments of, say, the `init_trackers` that starts a tracker):
    frameworks hand their loggers, callbacks and trackers no reference to it. None outside one."""
    held = attrgetter(members)
    frame: FrameType | None = sys._getframe(1)
    for _ in range(40):
        if frame is None:
            return None
        for name in names:
            candidate = frame.f_locals.get(name)
            if isinstance(candidate, kind) and any(m is member for m in held(candidate)):
                return candidate, frame.f_locals
        frame = frame.f_back
    return None


def spanned(call: Callable[..., Any], name: str) -> Callable[..., Any]:
    """`call` run inside `ot.span(name)`, for a framework's save or load that calls no hook of ours:
    goodput books its time, and during a checkpoint span the stall watchdog waits
    `checkpoint_timeout_s`."""

    def run(*args: Any, **kwargs: Any) -> Any:
        with ot.span(name):
            return call(*args, **kwargs)

    return run


def ending_on_error(call: Callable[..., Any], marker: str, *ends: Callable[[], None]) -> Callable[..., Any]:
    """`call` (a trainer's `train`), running `ends` when it raises: no framework hook says so. The
    wrapper carries the attribute `marker`, so that the same wrapping is not done twice."""

    @functools.wraps(call)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return call(*args, **kwargs)
        except BaseException:
            for end in ends:
                end()
            raise

    setattr(wrapper, marker, True)
    return wrapper
