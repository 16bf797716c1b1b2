"""PyTorch Lightning integration: a `Logger` and a `Callback`, usable together or alone.

    trainer = Trainer(logger=OtelTrainLogger(), callbacks=[OtelTrainCallback()])

`OTEL_TRAIN_LIGHTNING=1` adds the callback to every Trainer of an unmodified script.
How it works: docs/design/integrations.md#lightning.
"""

from __future__ import annotations

import logging
import math
import os
import re
import weakref
from argparse import Namespace
from collections.abc import Callable, Mapping
from time import perf_counter_ns
from typing import Any, NamedTuple

from lightning.fabric.utilities.logger import _sanitize_callable_params
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.loggers import Logger

import otel_train as ot
from otel_train import adapters
from otel_train.config import ConfigError
from otel_train.config_loading import load_config
from otel_train.integrations._common import (
    HookStep,
    call_holding,
    chosen,
    flattened,
    logged_step,
    scalar_logs,
    settings_from_kwargs,
    start_session,
    with_precision,
)

__all__ = ["OtelTrainCallback", "OtelTrainLogger", "callbacks_factory"]

ENV_SWITCH = "OTEL_TRAIN_LIGHTNING"
# Lightning's conventional names onto otel_train's catalogue.
# (`self.log(..., on_step=True, on_epoch=True)` suffixes `_step` and `_epoch`: the per-step value is
# the loss the health checks read; the epoch's mean stays a series of its own.)
_RENAMES = {"train_loss": "loss", "train_loss_step": "loss", "val_loss": "eval_loss"}
_SKIPPED = frozenset({"epoch", "step"})
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")  # Config's run_name rule
_VERSION_DIR = re.compile(r"version_(\d+)")
log = logging.getLogger("otel_train")


def _lightning_scalars(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Lightning's names onto the catalogue's; a nested dict (Fabric's `log_dict`) flattened to
    `outer/inner`, as TensorBoardLogger keeps it; a value that is no number goes on to
    `log_metrics`, which drops, counts and warns."""
    flat = flattened(metrics)
    renamed = {_RENAMES.get(k, k): v for k, v in flat.items() if isinstance(k, str)}
    renamed = {(f"eval{k[3]}{k[4:]}" if k.startswith(("val_", "val/")) else k): v for k, v in renamed.items()}
    return scalar_logs(renamed, _SKIPPED, left_out=())


class _Place(NamedTuple):
    """Where a logger's run lives, fixed the first time anyone asks (see `OtelTrainLogger`)."""

    save_dir: str
    name: str
    version: str


# The run an OtelTrainLogger started (a `Run`: runs of one session compare equal), and that logger:
# a session the user (or the callback) started is never shut down by a logger. A weak reference:
# holding the logger alive for the module's life would keep its Trainer's objects too.
_owned_session: Any = None
_owner_ref: weakref.ref[OtelTrainLogger] | None = None
# The run an OtelTrainCallback without a logger started: it idles after each fit, validate or test
# (the next one on the Trainer is still part of it) until process exit, or until another callback
# or a logger starts its own.
_callback_run: Any = None


def _owner_of(session: Any) -> OtelTrainLogger | None:
    if session is None or session != _owned_session or _owner_ref is None:
        return None
    return _owner_ref()


def _version_name(version: int | str | None) -> str | None:
    """Lightning's `version=` as a run name: an int n is `version_n` (its log dir's name under
    TensorBoardLogger/CSVLogger), a str is used as is and must be a valid run name."""
    if version is None:
        return None
    if isinstance(version, bool) or not isinstance(version, (int, str)):
        raise ConfigError(
            f"OtelTrainLogger(version={version!r}): use an int (the run is named version_<n>) or a run "
            "name string, or leave it unset for the next free version_<n>"
        )
    text = f"version_{version}" if isinstance(version, int) else version
    if _RUN_NAME.match(text) is None:
        raise ConfigError(
            f"OtelTrainLogger(version={version!r}): the version is the otel_train run name; use letters, "
            "digits and _ . : - (max 128 characters)"
        )
    return text


def _next_version(root: str) -> str:
    """TensorBoardLogger's automatic versioning: one more than the highest `version_<n>` in root."""
    try:
        names = os.listdir(root)
    except OSError:  # not created yet: the first version
        return "version_0"
    highest = -1
    for name in names:
        match = _VERSION_DIR.fullmatch(name)
        if match is not None and os.path.isdir(os.path.join(root, name)):
            highest = max(highest, int(match.group(1)))
    return f"version_{highest + 1}"


def _trainer_on_stack(logger: OtelTrainLogger) -> Trainer | None:
    """The Trainer running this logger: its base dir (`default_root_dir`) and other otel_train
    pieces are the Trainer's, and Lightning hands a logger none."""
    found = call_holding(Trainer, logger, "loggers", ("trainer", "self"))
    return None if found is None else found[0]


class OtelTrainLogger(Logger):
    """`Trainer(logger=OtelTrainLogger(run_name="x"))`: every `self.log` value reaches otel_train at
    Lightning's step, on every rank. Keyword arguments are `ot.init()` settings (`Config` fields;
    a `settings={...}` mapping is accepted too), used when the logger starts the session;
    `name=` and `version=` are Lightning's, as TensorBoardLogger/CSVLogger take them. One logger is
    one otel_train run (docs/design/integrations.md#lightning-logger)."""

    def __init__(
        self,
        settings: Mapping[str, Any] | None = None,
        *,
        name: str | None = None,
        version: int | str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self._settings = settings_from_kwargs(settings, kwargs, type(self).__name__)
        if name is not None and not isinstance(name, str):
            raise ConfigError(f"OtelTrainLogger(name={name!r}): use a folder name string, or leave it unset")
        self._name_arg = name or ""
        self._version_arg = _version_name(version)
        self._place: _Place | None = None
        self._version_shown = False  # someone read the version: it may no longer change
        self._run_id: str | None = None  # of the run this logger started: a restart appends to it
        self._primary: OtelTrainLogger | None = None  # another OtelTrainLogger on our Trainer does the work
        self.marks_steps = True  # OtelTrainCallback on the same Trainer turns it off: it marks them
        self._last_step: int | None = None
        self._marked = -1  # the last step this logger marked (-1: none, as a fresh session's last step)
        self._mark_ns: int | None = None  # where the next logged step starts

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_primary"] = None  # found again from the Trainer where the copy runs
        return state

    # --- Lightning's names and directories --------------------------------------------------------
    @property
    def name(self) -> str:
        return self._place_now().name

    @property
    def version(self) -> str:
        place = self._place_now()
        self._version_shown = True
        return place.version

    @property
    def save_dir(self) -> str:
        return self._place_now().save_dir

    @property
    def root_dir(self) -> str:
        place = self._place_now()
        return os.path.join(place.save_dir, place.name) if place.name else place.save_dir

    @property
    def log_dir(self) -> str:
        return os.path.join(self.root_dir, self.version)

    @property
    def experiment(self) -> adapters.Run | None:
        """The otel_train run (`adapters.Run`), started here if need be: Lightning asks for it on every
        rank before the set-up hooks, so all ranks start the session at the same point."""
        trainer = _trainer_on_stack(self)
        if trainer is not None:
            self._join(trainer)
        self._ensure_session(trainer)
        # With a session running, init() only returns its run (no settings: nothing to compare).
        return ot.init() if ot.run_info() is not None else None

    def _place_now(self) -> _Place:
        return self._resolve(_trainer_on_stack(self) if self._place is None else None)

    def _resolve(self, trainer: Trainer | None) -> _Place:
        if self._place is not None:
            return self._place
        if self._primary is not None:
            self._place = self._primary._resolve(trainer)
            return self._place
        info, running = ot.run_info(), adapters.current_run()
        # The user's own session names the run (not a logger's, nor a callback's left idle).
        if info is not None and _owner_of(running) is None and running != _callback_run:
            self._place = _Place(str(info.output_dir), "", info.run_name)
            return self._place
        config = load_config(self._settings)
        save_dir = config.output_dir
        if not chosen("output_dir", self._settings) and trainer is not None:
            root = str(trainer.default_root_dir)
            # Lightning's default is the working directory: otel_train's "runs" goes there instead
            # of bare version_<n> folders. otel_train writes local files only: a remote base is left.
            if "://" not in root and os.path.abspath(root) != os.getcwd():
                save_dir = root
        name = self._name_arg
        root_dir = os.path.join(save_dir, name) if name else save_dir
        version = config.run_name or self._version_arg or _next_version(root_dir)
        self._place = _Place(save_dir, name, version)
        return self._place

    def _join(self, trainer: Trainer) -> None:
        """Settle what this logger does on `trainer`: the first OtelTrainLogger there works, the
        others share its run and send nothing (each step and value once); a Trainer without an
        OtelTrainCallback gets one."""
        ours = [lg for lg in trainer.loggers if isinstance(lg, OtelTrainLogger)]
        self._primary = ours[0] if ours and ours[0] is not self else None
        if self._primary is not None and self._place is None:
            self._place = self._primary._resolve(trainer)
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by its connector
        if not any(isinstance(cb, OtelTrainCallback) for cb in callbacks):
            # A logger alone sees only the steps logged at (docs/design/integrations.md#lightning-logger).
            # Before the checkpoint callbacks, as Lightning places a user's: a step ends before its save.
            at = next((i for i, cb in enumerate(callbacks) if isinstance(cb, Checkpoint)), len(callbacks))
            callbacks.insert(at, OtelTrainCallback())

    # --- the session ------------------------------------------------------------------------------
    def _ensure_session(self, trainer: Trainer | None = None) -> None:
        global _owned_session, _owner_ref
        if self._primary is not None:
            self._primary._ensure_session(trainer)
            return
        session = adapters.current_run()
        if session is not None:
            owner = _owner_of(session)
            if owner is self or (owner is None and session != _callback_run):
                return  # ours, or the user's session
            ot.shutdown()  # another logger's (or a callback's) run is over: this logger's run begins
        place = self._resolve(trainer)
        settings = self._session_settings(trainer, starting=True)
        settings["run_name"] = place.version
        settings["output_dir"] = os.path.join(place.save_dir, place.name) if place.name else place.save_dir
        if self._run_id is not None:
            settings.setdefault("run_id", self._run_id)  # this logger's run again: append to it
        ot.init(**settings)
        info = ot.run_info()
        if info is None:
            return
        _owned_session, _owner_ref = adapters.current_run(), weakref.ref(self)
        self._run_id = info.run_id
        if info.run_name != place.version:
            # Another rank (rank 0) chose the run name: take it unless this rank already gave ours out.
            if self._version_shown:
                log.warning(
                    "otel_train: this rank's OtelTrainLogger version %r differs from the run name %r "
                    "rank 0 chose (their output dirs differ); set run_name or version= to the same value "
                    "on every rank",
                    place.version,
                    info.run_name,
                )
            else:
                self._place = place._replace(version=info.run_name)
        self._mark_ns = None

    def _session_settings(self, trainer: Trainer | None, starting: bool = False) -> dict[str, Any]:
        """The logger's settings over those of the OtelTrainCallbacks on the same Trainer, with
        what the Trainer says (total steps, precision) where the user set neither (`starting`: the
        session starts with them, and a callback's run name or directory is said to go unused)."""
        if trainer is None:
            return dict(self._settings)
        settings: dict[str, Any] = {}
        for callback in getattr(trainer, "callbacks", ()):  # set by its connector, undeclared
            if isinstance(callback, OtelTrainCallback):
                settings.update(callback._settings)
                placed = sorted({"run_name", "output_dir"} & set(callback._settings))
                if placed and starting:
                    log.warning(
                        "otel_train: OtelTrainCallback(%s) is not used: the OtelTrainLogger on the Trainer "
                        "names the run and its directory. Give %s to OtelTrainLogger instead.",
                        ", ".join(f"{k}=..." for k in placed), " and ".join(placed),
                    )  # fmt: skip
        return _trainer_settings(trainer, {**settings, **self._settings})

    # --- what Lightning logs ----------------------------------------------------------------------
    def log_graph(self, model: Any, input_array: Any = None) -> None:
        # Lightning calls this on every logger once at fit start: the first logged step starts here.
        if self._primary is not None:
            return
        self._ensure_session()
        self._mark_ns = perf_counter_ns()

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if self._primary is not None:
            return  # the first OtelTrainLogger on the Trainer sent these
        self._ensure_session()
        values = _lightning_scalars(metrics)
        info = ot.run_info()
        if (
            self.marks_steps
            and info is not None
            and (info.open_step is not None or info.world_size > 1 or info.step != self._marked)
        ):
            # The loop marks steps itself (Fabric with ot.step), or a flush must pair across ranks:
            # this logger only files values, as Accelerate's tracker does.
            self.marks_steps = False
        if step is None and self.marks_steps:  # Fabric's log without a step: the next one
            step = self._marked + 1
        if step is not None and self.marks_steps and (self._last_step is None or step > self._last_step):
            self._mark_ns = logged_step(step, self._mark_ns, values)
            self._marked = step
            values = {}
        if step is not None:
            self._last_step = step if self._last_step is None else max(step, self._last_step)
        # With a step: filed under that step, with the next flush (see ot.log_metrics).
        ot.log_metrics(values, step=step)

    def log_hyperparams(self, params: Mapping[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        if self._primary is not None:
            return
        self._ensure_session()
        ot.log_hyperparams(_plain(params or {}))

    def finalize(self, status: str) -> None:
        # "success" ends one fit/validate/test/predict, not the run: a test after the fit belongs
        # to it, and until then the run idles (no stall). A failure or an interruption ends it now
        # (final flush), as process exit would.
        global _owned_session, _owner_ref
        if status == "success":
            adapters.idle()
        elif self._primary is None and _owner_of(adapters.current_run()) is self:
            _owned_session, _owner_ref = None, None
            adapters.end_run(failed=status == "failed")
        else:  # the user's run outlives the failed fit: no stall while the user handles it
            adapters.idle()


def _trainer_settings(trainer: Trainer, settings: Mapping[str, Any]) -> dict[str, Any]:
    """`settings` with what the Trainer says (total steps, precision) where the user chose neither
    (a keyword, `OTEL_TRAIN_<FIELD>`, the config file). Under manual optimization `max_steps`
    counts every optimizer's steps, several per batch (a GAN's two), so it is no step count."""
    out = dict(settings)
    manual = not getattr(trainer.lightning_module, "automatic_optimization", True)
    if trainer.max_steps and trainer.max_steps > 0 and not manual and not chosen("total_steps", out):
        out["total_steps"] = trainer.max_steps
    return with_precision(out, trainer.precision)


def _logging_step(trainer: Trainer) -> int:
    """The step Lightning's loggers file a training batch's values at: the batches that stepped
    the optimizers so far (one per batch however many optimizers it steps, unlike `global_step`)."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def _plain(value: Any) -> Any:
    """Hyperparameters as Lightning's own loggers take them (they flatten, then sanitize): a
    Namespace as a dict and a callable as its name, nested ones too; other values pass on to
    otel_train's writers."""
    if isinstance(value, Namespace):
        value = vars(value)
    if isinstance(value, Mapping):
        return _sanitize_callable_params({k: _plain(v) for k, v in value.items()})
    return value


class OtelTrainCallback(Callback):
    """Steps, phase timers, eval spans and (opt-in) `ot.watch` for a Lightning `Trainer`. Keyword
    arguments besides `watch_every`/`tokens` are `ot.init()` settings (`Config` fields)."""

    def __init__(
        self,
        settings: Mapping[str, Any] | None = None,
        watch_every: int = 0,
        tokens: Callable[[Any], int] | None = None,
        **kwargs: Any,
    ) -> None:
        self._settings = settings_from_kwargs(settings, kwargs, type(self).__name__)
        self._watch_every = watch_every
        self._tokens_of = tokens
        self._tokens = 0
        self._owns_session = False
        self._run: Any = None  # the session this callback started (it may idle between stages)
        self._unwrap: Callable[[], None] | None = None  # undoes the forwarding of logged values
        self._hook_step = HookStep()
        self._step_global = 0  # trainer.global_step when the open step began
        self._mark_ns: int | None = None  # end of the previous batch (or validation): data starts
        self._manual = False  # manual optimization: a step per batch, each optimizer step timed
        self._untime_optimizers: Callable[[], None] | None = None
        self._eval: Any = None  # the open eval span

    # --- lifecycle -----------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        global _callback_run
        ours = [lg for lg in trainer.loggers if isinstance(lg, OtelTrainLogger)]
        for logger in ours:
            logger.marks_steps = False  # the steps are ours (validate and test have none)
        if stage == "fit" or (not ours and adapters.current_run() is None):
            running = adapters.current_run()
            if running is not None and running == _callback_run and running != self._run:
                ot.shutdown()  # another callback's run, idle since its fit: this one's begins
            if start_session(_trainer_settings(trainer, self._settings)):
                self._run = _callback_run = adapters.current_run()
            self._owns_session = self._run is not None and adapters.current_run() == self._run
        if (
            stage == "fit"
            and ours
            and not self._owns_session
            and _owner_of(adapters.current_run()) is ours[0]
        ):
            # The logger's run goes on into this fit: its plan is this fit's max_steps.
            planned = ours[0]._session_settings(trainer).get("total_steps")
            if planned is not None:
                adapters.set_total_steps(planned)
        if not ours and self._unwrap is None:
            self._unwrap = _forward_logged_metrics(trainer)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._watch_every > 0:
            ot.watch(pl_module, every=self._watch_every)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._mark_ns = perf_counter_ns()  # after the sanity check: it is not the first step's data
        self._plan_by_the_data(trainer)
        self._manual = not getattr(pl_module, "automatic_optimization", True)
        if self._manual:
            self._untime_optimizers = _time_optimizer_steps(pl_module, self._hook_step)

    def _plan_by_the_data(self, trainer: Trainer) -> None:
        """`max_epochs` (or a short loader) can end the fit before `max_steps`, or no `max_steps` is
        set: Lightning's estimate of the optimizer steps is then the plan of a run this integration
        started, unless the user chose `total_steps` (under manual optimization the estimate counts
        every optimizer's steps: no plan then)."""
        owner = _owner_of(adapters.current_run())
        if not self._owns_session and owner is None:
            return  # the user's own run: its plan is theirs
        settings = {**self._settings, **(owner._settings if owner is not None else {})}
        if chosen("total_steps", settings) or not getattr(
            trainer.lightning_module, "automatic_optimization", True
        ):
            return
        planned = trainer.estimated_stepping_batches
        if math.isfinite(planned) and planned >= 1:
            adapters.set_total_steps(int(planned))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._hook_step.end(tokens=self._tokens or None)  # micro-batches that stepped no optimizer
        if trainer.should_stop and _logging_step(trainer) > 0:
            # Early stopping (or a callback) ended the fit before its plan: the steps run are the plan.
            adapters.set_total_steps(_logging_step(trainer))

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._release(end_run=False)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._hook_step.fail()
        self._release(end_run=True)

    def _release(self, end_run: bool) -> None:
        """Stop forwarding logged values (until the next stage's set-up); a failed stage (`end_run`)
        ends a session this callback started, else the run idles: no stall while it does other
        work, its last steps flushed, and a `test` after the fit is still part of it."""
        if self._unwrap is not None:
            self._unwrap()
            self._unwrap = None
        if self._untime_optimizers is not None:
            self._untime_optimizers()
            self._untime_optimizers = None
        if self._owns_session and end_run and adapters.current_run() == self._run:
            self._owns_session, self._run = False, None
            adapters.end_run(failed=True)
        else:
            adapters.idle()

    # --- one optimizer step (one or more micro-batches) ------------------------------------------
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if adapters.current_run() is None:
            return
        now = perf_counter_ns()
        start = self._mark_ns if self._mark_ns is not None else now
        if not self._hook_step.open:
            # Backdated to the previous batch's end: the data wait, and a rank slow to load, are this step's
            self._hook_step.begin(_logging_step(trainer), start)
            self._step_global = trainer.global_step
            self._tokens = 0
            # unsharded data (watched steps only): training_step need not pass the batch to forward
            adapters.watch_batch(batch)
        if self._tokens_of is not None:
            self._tokens += int(self._tokens_of(batch))
        if start < now:
            ot.timer("data").start(at_ns=start).stop()
        self._hook_step.phase_start_ns = now

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Any) -> None:
        self._hook_step.end_phase("forward")

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._hook_step.end_phase("backward")

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self._hook_step.phase_start_ns = perf_counter_ns()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._manual:  # a step per batch (as Lightning's loggers count them), its optimizers timed
            self._hook_step.end(tokens=self._tokens or None)
        elif self._hook_step.open and trainer.global_step == self._step_global:
            # a micro-batch that accumulated gradients: a step of many micro-batches is no stall
            adapters.heartbeat()
        elif self._hook_step.open:
            self._hook_step.end_phase("optimizer")
            self._hook_step.end(tokens=self._tokens or None)
        self._mark_ns = perf_counter_ns()

    # --- validation ------------------------------------------------------------------------------
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking and adapters.current_run() is not None:
            # the step its metrics are logged at (global_step counts each optimizer's steps)
            self._eval = ot.span("eval", {"train.step": _logging_step(trainer)}).start()

    def on_save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        adapters.saving_checkpoint()  # the file is written next: a long save is no stall

    def on_validation_batch_end(self, *args: Any, **kwargs: Any) -> None:
        adapters.heartbeat()  # a long validation is no stall

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._eval is None:
            return
        self._eval.stop()
        self._eval = None
        self._mark_ns = perf_counter_ns()


def _time_optimizer_steps(pl_module: LightningModule, hook_step: HookStep) -> Callable[[], None]:
    """Manual optimization: each `optimizer.step()` of the module's optimizers ends an "optimizer"
    phase as it returns (no Lightning hook follows a step; a GAN steps two per batch, and the first
    one's update would be timed as the second one's forward). Returns what undoes it."""
    optimizers = pl_module.optimizers()
    wrapped = optimizers if isinstance(optimizers, list) else [optimizers]
    for optimizer in wrapped:
        step = optimizer.step

        def timed_step(*args: Any, _step: Callable[..., Any] = step, **kwargs: Any) -> Any:
            try:
                return _step(*args, **kwargs)
            finally:
                hook_step.end_phase("optimizer")

        optimizer.step = timed_step  # type: ignore[method-assign]  # the instance's: its class keeps its own

    def untime() -> None:
        for optimizer in wrapped:
            optimizer.__dict__.pop("step", None)

    return untime


def _forward_logged_metrics(trainer: Trainer) -> Callable[[], None]:
    """Wrap this Trainer's `_logger_connector.log_metrics`: otel_train gets what the Trainer's
    loggers get, when and at the step they get it (docs/design/integrations.md#lightning).
    Returns what undoes it."""
    connector = trainer._logger_connector
    handed = connector.log_metrics  # the bound method

    def log_metrics(metrics: dict[str, Any], step: int | None = None) -> None:
        handed(metrics, step)
        if not metrics or adapters.current_run() is None:
            return
        values = dict(metrics)
        given = values.pop("step", None)  # Lightning's rule: a logged "step" value is the step
        if step is None:
            step = int(given) if given is not None else _logging_step(trainer)
        ot.log_metrics(_lightning_scalars(values), step=step)

    def unwrap() -> None:
        if connector.__dict__.get("log_metrics") is log_metrics:
            del connector.log_metrics

    connector.log_metrics = log_metrics  # type: ignore[method-assign]
    return unwrap


def callbacks_factory() -> list[Callback]:
    """Entry point `lightning.pytorch.callbacks_factory`: the callback when OTEL_TRAIN_LIGHTNING is
    set to 1/true/yes, nothing otherwise (installing otel_train alone changes no Trainer)."""
    if os.environ.get(ENV_SWITCH, "").strip().lower() in ("1", "true", "yes", "on"):
        return [OtelTrainCallback()]
    return []
