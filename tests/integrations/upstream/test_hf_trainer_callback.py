"""The Trainer's callback contract, with OtelTrainCallback in the flows.

The cases follow huggingface/transformers, tests/trainer/test_trainer_callback.py (commit
020a37d2264e60dc7beb9634c3e87ad870073e2c; the tag of the installed transformers, 5.24.0, could not
be fetched): default and custom callbacks registered, the event order of six training flows, a
callback stopping training, and callback state restored from a checkpoint. The helpers, the model,
the data and the expected event sequence are written here from the Trainer's callback flow (log,
then evaluate, then save after each optimizer step and at each epoch end, as its settings ask; an
evaluation and a save at the last step) and checked against the installed Trainer. Every flow runs
once with the Trainer's own callbacks alone (the control) and once with OtelTrainCallback added, and
must see the same events and outcomes. Additions for otel_train are marked `# otel_train:`.

Left out: callback registration by name, TrainerState/TrainerControl unit tests and the SwanLab,
Kubeflow and notebook callback tests (no training flow for our callback to join); nothing needs a
GPU, the Hub or the network.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch
import transformers.trainer as hf_trainer
from torch import nn
from transformers import (
    EarlyStoppingCallback,
    PreTrainedConfig,
    PreTrainedModel,
    PrinterCallback,
    ProgressCallback,
    Trainer,
    TrainerCallback,
    TrainerState,
    TrainingArguments,
)
from transformers.trainer_callback import ExportableState

import otel_train as ot
from otel_train.integrations.transformers import OtelTrainCallback
from otel_train.testing import current_session

# otel_train: the two arms of every flow, the Trainer's callbacks alone and with ours added
ARMS = ["upstream", "with_otel_train"]

# Row counts chosen so that the flows cross epoch boundaries, end on a step that is not a multiple
# of eval_steps, and end each evaluation on a short batch: 56 rows / 8 = 7 updates an epoch,
# 21 in the default 3 epochs; 20 eval rows = 3 batches of 8, 8 and 4.
TRAIN_ROWS, EVAL_ROWS = 56, 20


# --- model and data: a two-feature linear fit ----------------------------------------------------
class LineData(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Rows of two features with target 1.5*f0 - 0.5*f1 + 2 plus a little noise."""

    def __init__(self, rows: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.features = torch.randn(rows, 2, generator=gen)
        noise = torch.randn(rows, generator=gen) * 0.05
        self.targets = self.features @ torch.tensor([1.5, -0.5]) + 2.0 + noise

    def __len__(self) -> int:
        return self.features.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"features": self.features[index], "labels": self.targets[index]}


class LineConfig(PreTrainedConfig):
    model_type = "otel_train_line"

    def __init__(self, n_features: int = 2, **kwargs: Any) -> None:
        self.n_features = n_features
        super().__init__(**kwargs)


class LineModel(PreTrainedModel):
    """One linear layer; returns the mean squared error when given labels."""

    config_class = LineConfig
    base_model_prefix = "line"

    def __init__(self, config: LineConfig) -> None:
        super().__init__(config)
        self.proj = nn.Linear(config.n_features, 1)
        self.post_init()

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None, **_: Any) -> Any:
        predicted = self.proj(features).squeeze(-1)
        out: dict[str, torch.Tensor] = {"logits": predicted}
        if labels is not None:
            out["loss"] = torch.mean((predicted - labels) ** 2)
        return out


# --- callbacks ------------------------------------------------------------------------------------
class EventLog(TrainerCallback):
    """Appends the name of every callback event it receives, in the order received."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def __getattribute__(self, name: str) -> Any:
        if name in _EVENTS:
            return lambda args, state, control, **kwargs: self.events.append(name)
        return super().__getattribute__(name)


_EVENTS = frozenset(
    name
    for name in vars(TrainerCallback)
    if name.startswith("on_") and callable(getattr(TrainerCallback, name))
)


class Remembers(TrainerCallback, ExportableState):
    """A callback whose one setting is written into checkpoints and handed back on restore."""

    def __init__(self, tag: str = "unset") -> None:
        self.tag = tag

    def state(self) -> dict[str, Any]:
        return {"args": {"tag": self.tag}, "attributes": {}}


class StopAt(TrainerCallback):
    """Asks the Trainer to stop once `global_step` reaches `limit`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        control.should_training_stop = control.should_training_stop or state.global_step >= self.limit
        return control


# --- harness --------------------------------------------------------------------------------------
def _names(callbacks: list[Any]) -> list[str]:
    return sorted(c.__name__ if isinstance(c, type) else type(c).__name__ for c in callbacks)


def _ours(arm: str) -> list[Any]:
    # otel_train: our callback, its run under the suite's tmp dir, no pull endpoint, quiet
    if arm == "upstream":
        return []
    return [OtelTrainCallback(verbosity=0, hardware=False, prometheus_port=0)]


def _create_trainer(
    out: Path, callbacks: list[Any] | None = None, model: Any = None, **kwargs: Any
) -> Trainer:
    settings: dict[str, Any] = {"disable_tqdm": False, "report_to": "none", "use_cpu": True}
    settings.update(kwargs)
    return Trainer(
        model if model is not None else LineModel(LineConfig()),
        TrainingArguments(str(out), **settings),
        train_dataset=LineData(TRAIN_ROWS, seed=1),
        eval_dataset=LineData(EVAL_ROWS, seed=2),
        callbacks=callbacks,
    )


def _get_callback(trainer: Trainer, callback_class: type) -> Any:
    return next((c for c in trainer.callback_handler.callbacks if isinstance(c, callback_class)), None)


def _run_steps(tmp_path: Path) -> list[int]:
    """otel_train: the steps each otel_train run counted, one entry per run directory, in order
    (the last run idles after its train(), until process exit: ended here first)."""
    ot.shutdown()
    runs = tmp_path / "runs"
    dirs = sorted(runs.iterdir(), key=lambda d: d.stat().st_mtime_ns) if runs.exists() else []
    out = []
    for run_dir in dirs:
        rows = [json.loads(line) for line in (run_dir / "metrics.rank0.jsonl").read_text().splitlines()]
        out.append(sum(r.get("train/steps", 0) for r in rows))
    return out


ONE_UPDATE = ["on_step_begin", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end"]


def _expected_events(trainer: Trainer) -> list[str]:
    """The callback events a whole `trainer.train()` fires, derived from the Trainer's arguments.

    After every optimizer update, and again after every epoch, the Trainer may log, then evaluate
    (one prediction step per eval batch, then a log of the metrics, then on_evaluate), then save;
    which of the three happens is decided by the *_strategy / *_steps settings. The last update also
    evaluates under a step strategy (unless that step evaluates anyway) and always saves under a
    step save strategy. The run closes with the log of the training summary.
    """
    args = trainer.args
    updates_per_epoch = len(trainer.get_train_dataloader()) // args.gradient_accumulation_steps
    by_epochs = math.ceil(args.num_train_epochs * updates_per_epoch)
    total = args.max_steps if args.max_steps > 0 else by_epochs
    log_every = args.logging_steps
    eval_every = args.eval_steps or log_every
    evaluation = [*["on_prediction_step"] * len(trainer.get_eval_dataloader()), "on_log", "on_evaluate"]

    def after(log: bool, evaluate: bool, save: bool) -> list[str]:
        return ["on_log"] * log + evaluation * evaluate + ["on_save"] * save

    events = ["on_init_end", "on_train_begin"]
    done = 0
    epoch = 0
    while done < total:
        epoch += 1
        events.append("on_epoch_begin")
        for step in range(done + 1, min(done + updates_per_epoch, total) + 1):
            by_step_eval = args.eval_strategy == "steps" and args.eval_delay <= step
            events += ONE_UPDATE + after(
                log=(args.logging_strategy == "steps" and step % log_every == 0)
                or (step == 1 and args.logging_first_step),
                evaluate=by_step_eval and (step % eval_every == 0 or step == total),
                save=args.save_strategy == "steps" and (step % args.save_steps == 0 or step == total),
            )
        done = min(done + updates_per_epoch, total)
        events.append("on_epoch_end")
        events += after(
            log=args.logging_strategy == "epoch",
            evaluate=args.eval_strategy == "epoch" and args.eval_delay <= epoch,
            save=args.save_strategy == "epoch",
        )
    return [*events, "on_log", "on_train_end"]


# --- registration ---------------------------------------------------------------------------------
@pytest.mark.parametrize("arm", ARMS)
def test_default_and_custom_callbacks_are_present(tmp_path: Path, arm: str) -> None:
    ours = _ours(arm)
    trainer = _create_trainer(tmp_path / "out", callbacks=[EventLog, *ours])
    expected = [*hf_trainer.DEFAULT_CALLBACKS, ProgressCallback, EventLog, *ours]
    assert _names(trainer.callback_handler.callbacks) == _names(expected)
    trainer = _create_trainer(tmp_path / "out", callbacks=ours, disable_tqdm=True)
    assert _names(trainer.callback_handler.callbacks) == _names(
        [*hf_trainer.DEFAULT_CALLBACKS, PrinterCallback, *ours]
    )


# --- event flow -----------------------------------------------------------------------------------
FLOWS: dict[str, dict[str, Any]] = {
    "default": {},
    "logging_steps": {"logging_steps": 5},
    "save_steps": {"save_steps": 5},
    "eval_steps": {"eval_steps": 5, "eval_strategy": "steps"},
    "eval_epoch": {"eval_strategy": "epoch"},
    "everything": {"logging_steps": 3, "save_steps": 10, "eval_steps": 5, "eval_strategy": "steps"},
}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("arm", ARMS)
@pytest.mark.parametrize("flow", FLOWS)
def test_event_flow(tmp_path: Path, flow: str, arm: str) -> None:
    trainer = _create_trainer(tmp_path / "out", callbacks=[EventLog, *_ours(arm)], **FLOWS[flow])
    trainer.train()
    events = _get_callback(trainer, EventLog).events
    assert events == _expected_events(trainer)
    if arm != "upstream":  # otel_train: one step per optimizer step; its run idles after train()
        assert current_session() is not None
        assert _run_steps(tmp_path) == [trainer.state.global_step]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("arm", ARMS)
def test_callback_can_stop_training(tmp_path: Path, arm: str) -> None:
    trainer = _create_trainer(
        tmp_path / "out", callbacks=[StopAt(1), *_ours(arm)],
        max_steps=10, logging_steps=1, save_strategy="no",
    )  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 1
    if arm != "upstream":
        assert _run_steps(tmp_path) == [1]


# --- stateful callbacks across a checkpoint -------------------------------------------------------
# Two updates, evaluated and saved at step 2, so checkpoint-2 holds the callbacks' states.
_CHECKPOINTED: dict[str, Any] = {
    "max_steps": 2,
    "eval_strategy": "steps",
    "eval_steps": 2,
    "save_strategy": "steps",
    "save_steps": 2,
    "load_best_model_at_end": True,
}


@pytest.mark.parametrize("arm", ARMS)
def test_early_stopping_state_persists(tmp_path: Path, arm: str) -> None:
    saved_cb = EarlyStoppingCallback(early_stopping_patience=5, early_stopping_threshold=0.2)
    _create_trainer(tmp_path / "out", callbacks=[saved_cb, *_ours(arm)], **_CHECKPOINTED).train()
    trainer = _create_trainer(
        tmp_path / "out", callbacks=[EarlyStoppingCallback(), *_ours(arm)],
        restore_callback_states_from_checkpoint=True, **_CHECKPOINTED,
    )  # fmt: skip
    trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    restored = _get_callback(trainer, EarlyStoppingCallback)
    assert (restored.early_stopping_patience, restored.early_stopping_threshold) == (5, 0.2)
    if arm != "upstream":  # otel_train: each run counts the optimizer steps of its own train()
        assert _run_steps(tmp_path) == [2, trainer.state.global_step - 2]


@pytest.mark.parametrize("arm", ARMS)
def test_mixed_and_multiple_stateful_callbacks(tmp_path: Path, arm: str) -> None:
    first = [EventLog(), Remembers("first"), Remembers("second"), *_ours(arm)]
    _create_trainer(tmp_path / "out", callbacks=first, **_CHECKPOINTED).train()
    trainer = _create_trainer(
        tmp_path / "out", callbacks=[Remembers(), EventLog(), Remembers(), *_ours(arm)],
        restore_callback_states_from_checkpoint=True, **_CHECKPOINTED,
    )  # fmt: skip
    trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    restored = [c for c in trainer.callback_handler.callbacks if isinstance(c, Remembers)]
    assert [c.tag for c in restored] == ["first", "second"]
    # otel_train: our callback keeps no state in the checkpoint (it is not an ExportableState)
    saved = TrainerState.load_from_json(
        str(tmp_path / "out" / "checkpoint-2" / hf_trainer.TRAINER_STATE_NAME)
    )
    assert set(saved.stateful_callbacks) == {"Remembers", "TrainerControl"}


@pytest.mark.parametrize("arm", ARMS)
def test_missing_stateful_callback_warning(
    tmp_path: Path, arm: str, caplog: pytest.LogCaptureFixture
) -> None:
    _create_trainer(
        tmp_path / "out", callbacks=[EarlyStoppingCallback(), *_ours(arm)], **_CHECKPOINTED
    ).train()
    without_best = {k: v for k, v in _CHECKPOINTED.items() if k != "load_best_model_at_end"}
    trainer = _create_trainer(
        tmp_path / "out", callbacks=_ours(arm), restore_callback_states_from_checkpoint=True, **without_best
    )
    with caplog.at_level(logging.WARNING, logger="transformers.trainer"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    warned = [r.getMessage() for r in caplog.records if r.name == "transformers.trainer"]
    assert any("EarlyStoppingCallback" in m for m in warned), warned
    assert not any("OtelTrainCallback" in m for m in warned)  # otel_train: ours is never missing


# --- resume from a checkpoint with steps left -----------------------------------------------------
@pytest.mark.parametrize("arm", ARMS)
def test_resume_from_checkpoint_trains_the_remaining_steps(tmp_path: Path, arm: str) -> None:
    """otel_train: not in upstream's file (its resumes have no step left): stop at step 2 of 4,
    resume from checkpoint-2; the events of the resumed run are those of steps 3 and 4."""
    kwargs: dict[str, Any] = {"max_steps": 4, "save_steps": 2, "logging_steps": 1, "disable_tqdm": True}
    first = _create_trainer(tmp_path / "out", callbacks=[StopAt(2), *_ours(arm)], **kwargs)
    first.train()
    recorder = EventLog()
    trainer = _create_trainer(tmp_path / "out", callbacks=[recorder, *_ours(arm)], **kwargs)
    trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert trainer.state.global_step == 4 and recorder.events.count("on_step_end") == 2
    if arm != "upstream":
        assert _run_steps(tmp_path) == [2, 2]


# --- auto_find_batch_size: the training loop re-entered after an out-of-memory error --------------
class _OomAt(LineModel):
    """Runs out of memory (accelerate matches the text) for batches of `oom_rows` rows."""

    oom_rows = 8

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if self.training and features.shape[0] == self.oom_rows:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().forward(features, labels, **kwargs)


@pytest.mark.parametrize("arm", ARMS)
def test_auto_find_batch_size_event_flow(tmp_path: Path, arm: str) -> None:
    """otel_train: not in upstream's file. The first attempt fails in its first step; the
    retry's events are a whole run's, after a second on_train_begin; ours sees the same."""
    recorder = EventLog()
    trainer = _create_trainer(
        tmp_path / "out", callbacks=[recorder, *_ours(arm)], model=_OomAt(LineConfig()),
        auto_find_batch_size=True, per_device_train_batch_size=8, max_steps=3, logging_steps=1,
        save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    trainer.train()
    assert trainer._train_batch_size == 7
    failed = ["on_train_begin", "on_epoch_begin", "on_step_begin"]
    assert recorder.events[: 1 + len(failed)] == ["on_init_end", *failed]
    step = [*ONE_UPDATE, "on_log"]
    retry = ["on_train_begin", "on_epoch_begin", *step * 3, "on_epoch_end", "on_log", "on_train_end"]
    assert recorder.events[1 + len(failed) :] == retry
    if arm != "upstream":  # one run, the failed step left out; it idles after train()
        assert current_session() is not None
        assert _run_steps(tmp_path) == [3]
