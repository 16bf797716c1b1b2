"""The Trainer's callback contract, with OtelTrainCallback in the flows.

From huggingface/transformers, tests/trainer/test_trainer_callback.py (and the regression helpers of
tests/trainer/trainer_test_utils.py), at the stored commit 020a37d2264e60dc7beb9634c3e87ad870073e2c:
the tag of the installed transformers (5.24.0) could not be fetched (the repository is over the
fetch limit), so the flows are those of that commit, checked here against the installed version.
The flows and their assertions are upstream's, re-expressed as pytest functions: every flow runs
once with upstream's own callbacks alone (the control) and once with OtelTrainCallback added, and
must see the same events and outcomes. Changes from upstream are marked `# otel_train:`.

Left out: callback registration by name, TrainerState/TrainerControl unit tests and the SwanLab,
Kubeflow and notebook callback tests (no training flow for our callback to join); nothing needs a
GPU, the Hub or the network.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch
from torch import nn
from transformers import (
    EarlyStoppingCallback,
    IntervalStrategy,
    PreTrainedConfig,
    PreTrainedModel,
    PrinterCallback,
    ProgressCallback,
    Trainer,
    TrainerCallback,
    TrainerState,
    TrainingArguments,
)
from transformers.trainer import DEFAULT_CALLBACKS, TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState

from otel_train.integrations.transformers import OtelTrainCallback
from otel_train.testing import current_session

# otel_train: the two arms of every flow, upstream's callbacks alone and with ours added
ARMS = ["upstream", "with_otel_train"]


# --- helpers (trainer_test_utils.py: y = a * x + b regression) -------------------------------------
class RegressionDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, a: float = 2, b: float = 3, length: int = 64, seed: int = 42) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(length, generator=generator)
        self.ys = a * self.x + b + 0.1 * torch.randn(length, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_x": self.x[i], "labels": self.ys[i]}


class RegressionModelConfig(PreTrainedConfig):
    def __init__(self, a: float = 0, b: float = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.a, self.b = a, b


class RegressionPreTrainedModel(PreTrainedModel):
    config_class = RegressionModelConfig
    base_model_prefix = "regression"

    def __init__(self, config: RegressionModelConfig) -> None:
        super().__init__(config)
        self.a = nn.Parameter(torch.tensor(config.a).float())
        self.b = nn.Parameter(torch.tensor(config.b).float())
        self.post_init()

    def forward(self, input_x: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        y = input_x * self.a + self.b
        if labels is None:
            return (y,)
        return (nn.functional.mse_loss(y, labels), y)


class EventRecorderCallback(TrainerCallback):
    """Records every event it receives, in order."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def __getattribute__(self, name: str) -> Any:
        # (upstream spells out one method per event; the same list, recorded the same way)
        if name.startswith("on_") and name in _EVENTS:
            return lambda args, state, control, **kwargs: self.events.append(name)
        return super().__getattribute__(name)


_EVENTS = frozenset(
    [
        "on_init_end",
        "on_train_begin",
        "on_train_end",
        "on_epoch_begin",
        "on_epoch_end",
        "on_step_begin",
        "on_pre_optimizer_step",
        "on_optimizer_step",
        "on_substep_end",
        "on_step_end",
        "on_evaluate",
        "on_predict",
        "on_save",
        "on_log",
        "on_prediction_step",
        "on_push_begin",
    ]
)


class StatefulTestCallback(TrainerCallback, ExportableState):
    def __init__(self, my_value: str = "default") -> None:
        self.my_value = my_value

    def state(self) -> dict[str, Any]:
        return {"args": {"my_value": self.my_value}, "attributes": {}}


class StopTrainingCallback(TrainerCallback):
    def __init__(self, stop_after_steps: int = 1) -> None:
        self.stop_after_steps = stop_after_steps

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step >= self.stop_after_steps:
            control.should_training_stop = True
        return control


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
    kwargs.setdefault("disable_tqdm", False)
    kwargs.setdefault("report_to", "none")
    kwargs.setdefault("use_cpu", True)  # otel_train: CPU only
    args = TrainingArguments(str(out), **kwargs)
    return Trainer(
        model if model is not None else RegressionPreTrainedModel(RegressionModelConfig(a=0, b=0)),
        args,
        train_dataset=RegressionDataset(length=64),
        eval_dataset=RegressionDataset(length=64),
        callbacks=callbacks,
    )


def _get_callback(trainer: Trainer, callback_class: type) -> Any:
    return next((c for c in trainer.callback_handler.callbacks if isinstance(c, callback_class)), None)


def _run_steps(tmp_path: Path) -> list[int]:
    """otel_train: the steps each otel_train run counted, one entry per run directory, in order."""
    runs = tmp_path / "runs"
    dirs = sorted(runs.iterdir(), key=lambda d: d.stat().st_mtime_ns) if runs.exists() else []
    out = []
    for run_dir in dirs:
        rows = [json.loads(line) for line in (run_dir / "metrics.rank0.jsonl").read_text().splitlines()]
        out.append(sum(r.get("train/steps", 0) for r in rows))
    return out


def _expected_events(trainer: Trainer) -> list[str]:
    """The exact event sequence of a training run (upstream's _get_expected_events)."""
    expected = ["on_init_end", "on_train_begin"]
    step = 0
    train_dl_len = len(trainer.get_eval_dataloader())
    evaluation = ["on_prediction_step"] * len(trainer.get_eval_dataloader()) + ["on_log", "on_evaluate"]
    args = trainer.args
    for _ in range(trainer.state.num_train_epochs):
        expected.append("on_epoch_begin")
        for _ in range(train_dl_len):
            step += 1
            expected += ["on_step_begin", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end"]
            if step % args.logging_steps == 0:
                expected.append("on_log")
            if args.eval_strategy == IntervalStrategy.STEPS and step % args.eval_steps == 0:
                expected += evaluation
            if (
                step == trainer.state.max_steps
                and args.eval_strategy == IntervalStrategy.STEPS
                and step % args.eval_steps != 0
                and args.eval_delay <= step
            ):
                expected += evaluation
            if step % args.save_steps == 0 or step == trainer.state.max_steps:
                expected.append("on_save")
        expected.append("on_epoch_end")
        if args.eval_strategy == IntervalStrategy.EPOCH:
            expected += evaluation
    return [*expected, "on_log", "on_train_end"]


# --- registration ---------------------------------------------------------------------------------
@pytest.mark.parametrize("arm", ARMS)
def test_default_and_custom_callbacks_are_present(tmp_path: Path, arm: str) -> None:
    ours = _ours(arm)
    trainer = _create_trainer(tmp_path / "out", callbacks=[EventRecorderCallback, *ours])
    expected = [*DEFAULT_CALLBACKS, ProgressCallback, EventRecorderCallback, *ours]
    assert _names(trainer.callback_handler.callbacks) == _names(expected)
    trainer = _create_trainer(tmp_path / "out", callbacks=ours, disable_tqdm=True)
    assert _names(trainer.callback_handler.callbacks) == _names([*DEFAULT_CALLBACKS, PrinterCallback, *ours])


# --- event flow -----------------------------------------------------------------------------------
FLOWS = {
    "default": {},
    "logging_steps": {"logging_steps": 5},
    "save_steps": {"save_steps": 5},
    "eval_steps": {"eval_steps": 5, "eval_strategy": "steps"},
    "eval_epoch": {"eval_strategy": "epoch"},
    "everything": {"logging_steps": 3, "save_steps": 10, "eval_steps": 5, "eval_strategy": "steps"},
}


@pytest.mark.parametrize("arm", ARMS)
@pytest.mark.parametrize("flow", FLOWS)
def test_event_flow(tmp_path: Path, flow: str, arm: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter(action="ignore", category=UserWarning)
        trainer = _create_trainer(
            tmp_path / "out", callbacks=[EventRecorderCallback, *_ours(arm)], **FLOWS[flow]
        )
        trainer.train()
    events = _get_callback(trainer, EventRecorderCallback).events
    assert events == _expected_events(trainer)
    if arm != "upstream":  # otel_train: one step per optimizer step, and its session ended
        assert _run_steps(tmp_path) == [trainer.state.global_step]
        assert current_session() is None


@pytest.mark.parametrize("arm", ARMS)
def test_callback_can_stop_training(tmp_path: Path, arm: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter(action="ignore", category=UserWarning)
        trainer = _create_trainer(
            tmp_path / "out", callbacks=[StopTrainingCallback(stop_after_steps=1), *_ours(arm)],
            max_steps=10, logging_steps=1, save_strategy="no",
        )  # fmt: skip
        trainer.train()
    assert trainer.state.global_step == 1
    if arm != "upstream":
        assert _run_steps(tmp_path) == [1]


# --- stateful callbacks across a checkpoint -------------------------------------------------------
_CHECKPOINTED = dict(
    load_best_model_at_end=True,
    save_strategy="steps",
    eval_strategy="steps",
    save_steps=2,
    eval_steps=2,
    max_steps=2,
)


@pytest.mark.parametrize("arm", ARMS)
def test_early_stopping_state_persists(tmp_path: Path, arm: str) -> None:
    cb = EarlyStoppingCallback(early_stopping_patience=5, early_stopping_threshold=0.2)
    _create_trainer(tmp_path / "out", callbacks=[cb, *_ours(arm)], **_CHECKPOINTED).train()
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
    first = [
        EventRecorderCallback(),
        StatefulTestCallback("first"),
        StatefulTestCallback("second"),
        *_ours(arm),
    ]
    _create_trainer(tmp_path / "out", callbacks=first, **_CHECKPOINTED).train()
    trainer = _create_trainer(
        tmp_path / "out", callbacks=[StatefulTestCallback(), EventRecorderCallback(), StatefulTestCallback(), *_ours(arm)],
        restore_callback_states_from_checkpoint=True, **_CHECKPOINTED,
    )  # fmt: skip
    trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    restored = [c for c in trainer.callback_handler.callbacks if isinstance(c, StatefulTestCallback)]
    assert [c.my_value for c in restored] == ["first", "second"]
    # otel_train: our callback keeps no state in the checkpoint (it is not an ExportableState)
    saved = TrainerState.load_from_json(str(tmp_path / "out" / "checkpoint-2" / TRAINER_STATE_NAME))
    assert set(saved.stateful_callbacks) == {"StatefulTestCallback", "TrainerControl"}


@pytest.mark.parametrize("arm", ARMS)
def test_missing_stateful_callback_warning(
    tmp_path: Path, arm: str, caplog: pytest.LogCaptureFixture
) -> None:
    _create_trainer(
        tmp_path / "out", callbacks=[EarlyStoppingCallback(), *_ours(arm)], **_CHECKPOINTED
    ).train()
    trainer = _create_trainer(
        tmp_path / "out", callbacks=_ours(arm), save_strategy="steps", eval_strategy="steps", save_steps=2,
        eval_steps=2, max_steps=2, restore_callback_states_from_checkpoint=True,
    )  # fmt: skip
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
    kwargs = dict(max_steps=4, save_steps=2, logging_steps=1, disable_tqdm=True)
    first = _create_trainer(tmp_path / "out", callbacks=[StopTrainingCallback(2), *_ours(arm)], **kwargs)
    first.train()
    recorder = EventRecorderCallback()
    trainer = _create_trainer(tmp_path / "out", callbacks=[recorder, *_ours(arm)], **kwargs)
    trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert trainer.state.global_step == 4 and recorder.events.count("on_step_end") == 2
    if arm != "upstream":
        assert _run_steps(tmp_path) == [2, 2]


# --- auto_find_batch_size: the training loop re-entered after an out-of-memory error --------------
class _OomAt(RegressionPreTrainedModel):
    """Runs out of memory (accelerate matches the text) for batches of `oom_rows` rows."""

    oom_rows = 8

    def forward(self, input_x: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if self.training and input_x.shape[0] == self.oom_rows:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().forward(input_x, labels, **kwargs)


@pytest.mark.parametrize("arm", ARMS)
def test_auto_find_batch_size_event_flow(tmp_path: Path, arm: str) -> None:
    """otel_train: not in upstream's file. The first attempt fails in its first step; the
    retry's events are a whole run's, after a second on_train_begin; ours sees the same."""
    recorder = EventRecorderCallback()
    trainer = _create_trainer(
        tmp_path / "out", callbacks=[recorder, *_ours(arm)], model=_OomAt(RegressionModelConfig()),
        auto_find_batch_size=True, per_device_train_batch_size=8, max_steps=3, logging_steps=1,
        save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    trainer.train()
    assert trainer._train_batch_size == 7
    failed = ["on_train_begin", "on_epoch_begin", "on_step_begin"]
    assert recorder.events[: 1 + len(failed)] == ["on_init_end", *failed]
    step = ["on_step_begin", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end", "on_log"]
    retry = ["on_train_begin", "on_epoch_begin", *step * 3, "on_epoch_end", "on_log", "on_train_end"]
    assert recorder.events[1 + len(failed) :] == retry
    if arm != "upstream":  # one run, the failed step left out, its session ended
        assert _run_steps(tmp_path) == [3]
        assert current_session() is None
