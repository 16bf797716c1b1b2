"""Accelerate integration: `Accelerator(log_with=[OtelTrainTracker()])`, or by name after
`accelerate.tracking.register_tracker_class(OtelTrainTracker)`: `Accelerator(log_with="otel_train")`.

How it works (steps, multi-process jobs): docs/design/integrations.md#accelerate.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Mapping
from time import perf_counter_ns
from typing import Any

from accelerate import Accelerator
from accelerate.tracking import GeneralTracker

import otel_train as ot
from otel_train import adapters
from otel_train.config import default_run_name
from otel_train.integrations._common import (
    call_holding,
    distributed_world,
    end_training,
    flattened,
    logged_step,
    scalar_logs,
    settings_from_kwargs,
    start_session,
    with_adopted,
    with_precision,
)

__all__ = ["OtelTrainTracker"]

log = logging.getLogger("otel_train")

# Settings a project name stands for, unless the user chose them.
_PROJECT_SETTINGS = ("wandb_project", "mlflow_experiment")


class OtelTrainTracker(GeneralTracker):
    """An Accelerate tracker writing into otel_train. The first positional argument is the project
    name, as Accelerate passes it to a tracker it creates by name (`cls(project_name, **kwargs)`);
    keyword arguments are `ot.init()` settings."""

    name = "otel_train"
    requires_logging_directory = False  # the run directory is otel_train's output_dir/run_name
    # Accelerate gates only trackers' @on_main_process methods with this; ours run where called
    # (Accelerator.log and init_trackers are main-process only themselves), and `finish` must run
    # on every rank that started a session.
    main_process_only = False

    def __init__(
        self,
        project_name: str | Mapping[str, Any] | None = None,
        /,
        settings: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if isinstance(project_name, Mapping):  # the OtelTrainTracker({...}) form: settings as a mapping
            if settings is not None:
                raise TypeError(
                    "OtelTrainTracker got two settings mappings: pass the project name first "
                    "(OtelTrainTracker('project', settings={...})) or only one mapping."
                )
            project_name, settings = None, project_name
        if project_name is not None and not isinstance(project_name, str):
            raise TypeError(
                f"OtelTrainTracker's first argument is the project name (a str), got "
                f"{type(project_name).__name__}: pass settings as keywords or settings={{...}}."
            )
        self.project_name = project_name or None
        self._settings = settings_from_kwargs(settings, kwargs, type(self).__name__)
        self._owns_session = False
        self._warned = False  # that it records nothing (no session in a multi-process job, or ended)
        self._fed: Accelerator | None = None  # the Accelerator whose calls feed the stall watchdog
        self._save_hook: Any = None
        self._ended = False  # end_training() shut down the run this tracker started (until a new start)
        self._new_run()

    def _new_run(self) -> None:
        """What one run (`init_trackers` to `end_training`) learns: an instance given to a second
        Accelerator starts again as a new one would."""
        self._marks_steps = True  # until the loop marks a step itself (or the job is multi-rank)
        self._marked = -1  # the last step this tracker marked; -1: none (a fresh session's last step)
        # logs of a new step (or of none) in a multi-process job that has marked no step yet
        self._unmarked_logs, self._unmarked_step = 0, -1
        self._mark_ns: int | None = None  # where the next marked step starts
        # Since the last logged step, where its calls said training (None), an evaluation ("eval")
        # or a save ("checkpoint") began: (span name, perf_counter_ns), an entry when it changes.
        self._stretches: list[tuple[str | None, int]] = []
        self._run_project: str | None = None  # init_trackers' project_name
        self._run_settings: dict[str, Any] = {}  # init_trackers' init_kwargs["otel_train"]
        self._accelerator_settings: dict[str, Any] = {}  # what the Accelerator's own settings stand for
        self._precision: str | None = None  # the Accelerator's mixed_precision

    @property
    def tracker(self) -> Any:
        """The running otel_train `Run` (Accelerate's handle to the underlying tracker), or None."""
        return adapters.current_run()

    def start(self) -> None:
        # Accelerate hands an instance given in `log_with` neither its Accelerator nor init_trackers'
        # project_name and init_kwargs: they come from the init_trackers call that starts it.
        found = call_holding(Accelerator, self, "trackers")
        accelerator, call = found if found is not None else (None, {})
        project, init_kwargs = call.get("project_name"), call.get("init_kwargs")
        self._ended = False
        if isinstance(project, str) and project:
            self._run_project = project
        if isinstance(init_kwargs, Mapping):
            self._run_settings = settings_from_kwargs(
                init_kwargs.get(self.name), {}, f"init_trackers(init_kwargs={{{self.name!r}: ...}})"
            )
        if accelerator is not None:
            # "no" is no precision: the model's own dtype may be bf16 (compute_dtype's auto then)
            self._precision = accelerator.mixed_precision if accelerator.mixed_precision != "no" else None
            if accelerator.logging_dir:  # ProjectConfiguration(logging_dir=...): beside its other trackers
                self._accelerator_settings["output_dir"] = str(accelerator.logging_dir)
        if self._ready():
            self._mark_ns = perf_counter_ns()  # the first logged step starts at init_trackers
            if accelerator is not None and self._fed is None:
                # A tracker hears of the loop only when it logs: micro-batches, eval batches and
                # saves tell the stall watchdog the loop is alive (docs/design/integrations.md#accelerate).
                # They also mark where an evaluation or a save began inside a step this tracker
                # marks from the logs, so that goodput books them as such, not as training.
                accelerator.backward = _noting(accelerator.backward, lambda: self._began(None))
                gather = accelerator.gather_for_metrics
                accelerator.gather_for_metrics = _noting(
                    gather, lambda: self._began(_evaluating(accelerator))
                )
                self._save_hook = accelerator.register_save_state_pre_hook(self._saving)
                self._fed = accelerator

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        if self._ready():
            ot.log_hyperparams(values)

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        # **kwargs: Accelerate passes each tracker its own `log_kwargs` entry; none apply here.
        if not self._ready():
            return
        info = ot.run_info()
        if info is None:
            return
        # Nested dicts flattened, strings as text: as Accelerate's TensorBoard and W&B trackers keep
        # them; anything else that is no number is dropped by log_metrics, counted and warned about.
        # A bool is an int to Accelerate (its log contract) and its TensorBoard tracker: 0 or 1.
        flat = {name: int(v) if isinstance(v, bool) else v for name, v in flattened(values).items()}
        scalars = scalar_logs(flat, left_out=(str,))
        if self._marks_steps and (
            info.open_step is not None or info.world_size > 1 or info.step != self._marked
        ):
            # The loop marks steps (or a step's flush must pair across ranks): only file values.
            self._marks_steps = False
        number = _step_number(step)
        if info.world_size > 1 and info.step < 0 and info.open_step is None:
            self._warn_unmarked(number, info.world_size)
        if step is None and self._marks_steps:
            # Accelerate's step is optional: a log without one is the step after the last logged
            number = self._marked + 1
        for name, text in flat.items():
            if isinstance(name, str) and isinstance(text, str):
                ot.log_text(name, text, step=number)
        if self._marks_steps and number is not None and number > self._marked:
            self._mark_ns = logged_step(number, self._mark_ns, scalars, self._stretches)
            self._marked = number
            self._stretches = []
        elif number is not None and number == info.open_step:
            # the step open now: its values, like ot.record's, leave with the flush (a row of
            # their own per log would be a bridge write per step)
            ot.log_metrics(scalars)
        else:
            # under step N, an earlier one too; a step that is no number is counted and warned there
            ot.log_metrics(scalars, step=step if number is None else number)

    def finish(self) -> None:
        accelerator, self._fed = self._fed, None
        if accelerator is not None:  # the stall watchdog is no longer fed
            del accelerator.backward, accelerator.gather_for_metrics  # the class's methods again
            self._save_hook.remove()
        owns_session, self._owns_session = self._owns_session, False
        end_training(owns_session)
        self._new_run()
        # its run is over: a later log starts no other (also after a second end_training())
        self._ended = self._ended or owns_session

    def _began(self, span: str | None) -> None:
        """Training (None), an evaluation ("eval") or a save ("checkpoint") goes on from now."""
        stretches = self._stretches
        if self._marks_steps and (not stretches or stretches[-1][0] != span) and len(stretches) < 256:
            stretches.append((span, perf_counter_ns()))

    def _saving(self, *_: Any) -> None:
        """`save_state`'s pre-hook: the save begins."""
        adapters.saving_checkpoint()
        self._began("checkpoint")

    def _warn_unmarked(self, step: int | None, world_size: int) -> None:
        """Once, at the second step logged while the job has marked none (a log without a step is
        a new one): a value logged before training is no sign yet."""
        if step is not None and step == self._unmarked_step:
            return
        self._unmarked_logs += 1
        self._unmarked_step = step if step is not None else -1
        if self._unmarked_logs == 2:
            log.warning(
                "otel_train: this %d-process job marks no steps, so steps, throughput, goodput and "
                "stragglers stay empty: wrap each training step in `with ot.step(step):` on every "
                "rank. Accelerate calls trackers on the main process only, so OtelTrainTracker "
                "cannot mark steps that every rank agrees on.",
                world_size,
            )

    def _ready(self) -> bool:
        if adapters.current_run() is not None:
            return True
        if self._ended:
            if not self._warned:
                self._warned = True
                log.warning(
                    "otel_train: a log to OtelTrainTracker after accelerator.end_training(), which "
                    "ended its run: not recorded. Log before end_training(), or call init_trackers() "
                    "again for a new run."
                )
            return False
        if distributed_world() > 1:
            if not self._warned:
                self._warned = True
                log.warning(
                    "otel_train: OtelTrainTracker found no session in a %d-process job and records "
                    "nothing: call ot.init() on every rank after creating the Accelerator.",
                    distributed_world(),
                )
            return False
        self._owns_session = start_session(self._session_settings())
        self._mark_ns = perf_counter_ns()
        return True

    def _session_settings(self) -> dict[str, Any]:
        """`init_trackers`' `init_kwargs["otel_train"]` under the constructor's settings, plus what
        the project name (the constructor's, else init_trackers') stands for where the user chose
        nothing (docs/design/integrations.md#accelerate)."""
        settings = {**self._run_settings, **self._settings}
        project = self.project_name or self._run_project
        adopted = dict(self._accelerator_settings)
        if project is not None:
            adopted.update(dict.fromkeys(_PROJECT_SETTINGS, project), run_name=default_run_name(project))
        return with_precision(with_adopted(settings, adopted), self._precision)


def _noting(call: Callable[..., Any], note: Callable[[], None]) -> Callable[..., Any]:
    """`call` (a micro-batch's backward, an eval batch's gather), `note()` before and a heartbeat
    after it."""

    def fed(*args: Any, **kwargs: Any) -> Any:
        note()
        result = call(*args, **kwargs)
        adapters.heartbeat()
        return result

    return fed


def _evaluating(accelerator: Accelerator) -> str | None:
    """`"eval"` when every model the Accelerator prepared is in eval mode (`model.eval()`), else
    None (training: a loop that gathers its training metrics)."""
    models = getattr(accelerator, "_models", None) or []
    return "eval" if models and not any(getattr(model, "training", True) for model in models) else None


def _step_number(step: Any) -> int | None:
    """`step` as an int (a numpy or 0-d tensor integer, an integral float); None for no step or
    none that is a number (True included)."""
    if step is None or isinstance(step, bool) or str(getattr(step, "dtype", "")) in ("bool", "torch.bool"):
        return None
    try:
        number = operator.index(step)
    except TypeError:
        try:
            as_float = float(step)
        except (TypeError, ValueError, OverflowError):
            return None
        if not as_float.is_integer():
            return None
        number = int(as_float)
    return number if -(2**63) <= number < 2**63 else None
