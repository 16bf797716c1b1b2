"""Hugging Face Trainer + OtelTrainCallback: where the Trainer's logs are filed (the step each one
follows) and what a non-finite gradient norm in them raises. Real Trainer, tiny config-built GPT-2,
CPU."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch
from helpers.integration_models import TokenDataset, tiny_causal_lm
from transformers import Trainer, TrainerCallback, TrainingArguments

import otel_train as ot
from otel_train.integrations.transformers import OtelTrainCallback


def _trainer(out: Path, callbacks: list[Any], max_steps: int, **overrides: Any) -> Trainer:
    args = TrainingArguments(
        **{
            **dict(
                output_dir=str(out),
                max_steps=max_steps,
                per_device_train_batch_size=2,
                per_device_eval_batch_size=4,
                learning_rate=1e-3,
                report_to="none",
                use_cpu=True,
                disable_tqdm=True,
                dataloader_num_workers=0,
                save_strategy="no",
            ),
            **overrides,
        }
    )
    return Trainer(
        model=tiny_causal_lm(),
        args=args,
        train_dataset=TokenDataset(64),
        eval_dataset=TokenDataset(8, seed=1),
        callbacks=callbacks,
    )


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _steps_of(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in rows if r.get(key) is not None]


@pytest.mark.parametrize("own_session", [False, True], ids=["callbacks-session", "users-session"])
def test_the_trainers_logs_are_filed_at_the_step_they_follow(tmp_path: Path, own_session: bool) -> None:
    """HF logs the loss at global steps 3, 6 and 9 (step indices 2, 5, 8) and evaluates there, after
    on_step_end: each value is filed at that step, not one log interval later. The user's session
    flushes every 100 steps: the logs are still filed at their own steps."""
    settings: dict[str, Any] = dict(run_name="logs", verbosity=0, hardware=False, prometheus_port=0)
    if own_session:
        ot.init(**settings, output_dir=str(tmp_path / "runs"), log_interval=100)
        callback = OtelTrainCallback()
    else:
        callback = OtelTrainCallback(**settings)  # logging_steps=3 becomes log_interval=3
    trainer = _trainer(
        tmp_path / "hf-out", [callback], max_steps=9, logging_steps=3, eval_strategy="steps", eval_steps=3
    )
    trainer.train()
    ot.shutdown()

    rows = _lines(tmp_path / "runs" / "logs" / "metrics.rank0.jsonl")
    hf_losses = [(h["step"] - 1, h["loss"]) for h in trainer.state.log_history if "loss" in h]
    hf_evals = [(h["step"] - 1, h["eval_loss"]) for h in trainer.state.log_history if "eval_loss" in h]
    assert [step for step, _ in hf_losses] == [2, 5, 8]
    assert _steps_of(rows, "train/loss") == [(s, pytest.approx(v, rel=1e-6)) for s, v in hf_losses]
    assert _steps_of(rows, "eval/loss") == [(s, pytest.approx(v, rel=1e-6)) for s, v in hf_evals]
    assert [s for s, _ in _steps_of(rows, "train/learning_rate")] == [2, 5, 8]
    # the step counts are unchanged: every step counted once
    assert sum(r.get("train/steps", 0) for r in rows) == 9


def test_evaluations_before_and_after_train_belong_to_the_callbacks_run(tmp_path: Path) -> None:
    """`trainer.evaluate()` before `train()` begins the callback's run, and those after it (as HF's
    example scripts evaluate) are still part of it: each filed once at the step it follows (step 0
    before training), in the one run directory, as the Trainer's own TensorBoard reporter has them."""
    callback = OtelTrainCallback(run_name="evals", verbosity=0, hardware=False, prometheus_port=0)
    trainer = _trainer(
        tmp_path / "hf-out", [callback], max_steps=4, logging_steps=2, eval_strategy="steps", eval_steps=4
    )
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    test = trainer.evaluate(metric_key_prefix="test")["test_loss"]
    ot.shutdown()

    assert [d.name for d in (tmp_path / "runs").iterdir()] == ["evals"]
    rows = _lines(tmp_path / "runs" / "evals" / "metrics.rank0.jsonl")
    in_training = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h][1]
    assert _steps_of(rows, "eval/loss") == [
        (0, pytest.approx(before, rel=1e-6)),
        (3, pytest.approx(in_training, rel=1e-6)),
        (3, pytest.approx(after, rel=1e-6)),
    ]
    assert _steps_of(rows, "test/loss") == [(3, pytest.approx(test, rel=1e-6))]
    assert sum(r.get("train/steps", 0) for r in rows) == 4
    assert not any("eval/loss_min" in r for r in rows)  # each a logged value, none aggregated


def test_a_second_train_with_the_same_callback_is_a_run_of_its_own(tmp_path: Path) -> None:
    """The run idles after `train()` (the evaluation after it is still its own); the next `train()`,
    whose steps count from 0 again, ends it and begins a new run."""
    from otel_train.testing import current_session

    callback = OtelTrainCallback(verbosity=0, hardware=False, prometheus_port=0)
    trainer = _trainer(tmp_path / "hf-out", [callback], max_steps=3, logging_steps=1)
    trainer.train()
    first = current_session()
    trainer.evaluate()
    trainer.train()
    assert current_session() is not first
    ot.shutdown()
    assert first is not None and first.run_dir is not None
    runs = sorted(d.name for d in (tmp_path / "runs").iterdir())
    assert len(runs) == 2
    for run in runs:
        rows = _lines(tmp_path / "runs" / run / "metrics.rank0.jsonl")
        assert sum(r.get("train/steps", 0) for r in rows) == 3
        evals = [r["step"] for r in rows if "eval/loss" in r]
        assert evals == ([2] if run == first.run_dir.name else [])


def test_the_evaluation_at_the_start_is_filed_at_step_0(tmp_path: Path) -> None:
    """`eval_on_start=True`: the Trainer evaluates at global step 0, before the first step."""
    callback = OtelTrainCallback(run_name="start", verbosity=0, hardware=False, prometheus_port=0)
    trainer = _trainer(
        tmp_path / "hf-out", [callback], max_steps=4, logging_steps=2, eval_strategy="steps", eval_steps=4,
        eval_on_start=True,
    )  # fmt: skip
    trainer.train()
    ot.shutdown()
    rows = _lines(tmp_path / "runs" / "start" / "metrics.rank0.jsonl")
    hf_evals = [(h["step"], h["eval_loss"]) for h in trainer.state.log_history if "eval_loss" in h]
    assert [step for step, _ in hf_evals] == [0, 4]
    assert _steps_of(rows, "eval/loss") == [(max(s - 1, 0), pytest.approx(v, rel=1e-6)) for s, v in hf_evals]
    assert not any("eval/loss_min" in r for r in rows)


class _PoisonAfter(TrainerCallback):
    """Fills a weight with NaN after global step `step`: from the next step on the loss and every
    gradient are NaN (a run gone bad)."""

    def __init__(self, step: int) -> None:
        self._step = step

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if state.global_step == self._step:
            with torch.no_grad():
                model.transformer.h[0].mlp.c_fc.weight.fill_(float("nan"))


def _nan_run(tmp_path: Path) -> tuple[Trainer, list[dict[str, Any]]]:
    callback = OtelTrainCallback(run_name="nan", verbosity=0, hardware=False, prometheus_port=0)
    # logging_nan_inf_filter=True is the Trainer's default: it logs the NaN loss as 0.0
    trainer = _trainer(tmp_path / "hf-out", [callback, _PoisonAfter(2)], max_steps=6, logging_steps=2)
    trainer.train()
    ot.shutdown()  # the callback's run idles after train(), until process exit
    return trainer, _lines(tmp_path / "runs" / "nan" / "events.rank0.jsonl")


def test_a_nan_gradient_norm_in_the_trainers_logs_raises_nonfinite_grad(tmp_path: Path) -> None:
    """The Trainer's NaN filter hides the NaN loss (no `nonfinite` event from the loss): its NaN
    grad_norm raises `nonfinite_grad` at the first log that has one (global step 4), not again at
    each later log while it stays NaN (a diverged run logs it every `logging_steps`)."""
    trainer, events = _nan_run(tmp_path)
    logged = [(h["step"], h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
    assert [step for step, _, _ in logged] == [2, 4, 6]
    assert [loss for _, loss, _ in logged][1:] == [0.0, 0.0]  # the NaN losses, as the filter logs them
    assert [math.isnan(norm) for _, _, norm in logged] == [False, True, True]
    assert [(e["event"], e["step"]) for e in events] == [("nonfinite_grad", 3)]
    assert (
        "grad_norm=nan" in events[0]["message"]
        and "said once until it is finite again" in events[0]["message"]
    )


def test_nonfinite_grad_is_said_once_a_spell() -> None:
    from otel_train.integrations.transformers import _nonfinite_grad

    said: list[str] = []
    ot.init(run_name="spells", verbosity=0, hardware=False, prometheus_port=0)
    ot.on_event(lambda event, message, attributes: said.append(event))
    spell = False
    for norm in (1.0, float("nan"), float("inf"), float("nan"), 2.0, float("nan")):
        spell = _nonfinite_grad(norm, 1, spell, lambda: False)
    assert spell is True
    spell = _nonfinite_grad(float("nan"), 1, False, lambda: True)  # the scaler skipped it: no spell
    ot.shutdown()
    assert said == ["nonfinite_grad", "nonfinite_grad"] and spell is False


def test_a_step_the_loss_scaler_skipped_raises_no_nonfinite_grad(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp16 with a loss scaler: an inf/NaN gradient norm makes the scaler skip the step and lower its
    scale, which is how fp16 training works, not a run gone bad (as for ot.watch(scaler=...))."""
    from accelerate import Accelerator

    # fp16's scaler needs a GPU: its verdict on the last step is what the callback reads
    monkeypatch.setattr(Accelerator, "optimizer_step_was_skipped", property(lambda self: True))
    _, events = _nan_run(tmp_path)
    assert [e for e in events if e["event"] == "nonfinite_grad"] == []
