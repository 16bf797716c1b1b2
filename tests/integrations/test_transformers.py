"""Hugging Face Trainer + OtelTrainCallback: real Trainer, tiny config-built GPT-2, CPU."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from helpers.events import SlowStretches, run_events
from helpers.integration_models import TokenDataset, tiny_causal_lm
from helpers.multirank import DEFAULT_FR, run_ranks
from helpers.ports import free_port
from prometheus_client.parser import text_string_to_metric_families
from transformers import TrainerCallback

import otel_train as ot
from otel_train.integrations.transformers import OtelTrainCallback
from otel_train.testing import current_session

MAX_STEPS = 6
GRAD_ACCUM = 2


def _trainer(
    out: Path,
    callback: OtelTrainCallback | None,
    max_steps: int = MAX_STEPS,
    ddp: bool = False,
    dataset: Any = None,
    model: Any = None,
    **overrides: Any,
) -> Any:
    from transformers import Trainer, TrainingArguments

    settings: dict[str, Any] = dict(
        output_dir=str(out),
        max_steps=max_steps,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=GRAD_ACCUM,
        learning_rate=1e-3,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="steps",
        save_steps=max_steps,
        report_to="none",
        use_cpu=True,
        include_num_input_tokens_seen=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        hub_token="hf_PLANTED_SECRET_TOKEN",
        ddp_backend="gloo" if ddp else None,
    )
    args = TrainingArguments(**{**settings, **overrides})
    return Trainer(
        model=model if model is not None else tiny_causal_lm(),
        args=args,
        train_dataset=dataset if dataset is not None else TokenDataset(64),
        eval_dataset=TokenDataset(8, seed=1),
        callbacks=[callback] if callback is not None else None,
    )


def _rows(run_dir: Path, rank: int = 0) -> list[dict[str, Any]]:
    path = run_dir / f"metrics.rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name.startswith("train_phase_duration") and "train_phase" in labels:
                key = f"{sample.name}{{{labels['train_phase']}}}"
            else:
                key = sample.name
            values[key] = values.get(key, 0.0) + sample.value if key.endswith("_count") else sample.value
    return values


def test_trainer_steps_logs_eval_and_tokens_reach_pull_endpoint_and_jsonl(tmp_path: Path) -> None:
    port = free_port()
    ot.init(run_name="hf", prometheus_port=port, verbosity=0, log_interval=2, hardware=False)
    session = current_session()
    trainer = _trainer(tmp_path / "hf-out", OtelTrainCallback())
    trainer.train()

    assert current_session() is session  # the user's session is neither replaced nor shut down
    metrics = _scrape(f"http://127.0.0.1:{port}/metrics")
    ot.shutdown()

    # One otel_train step per optimizer step, not per micro-batch.
    assert trainer.state.global_step == MAX_STEPS
    assert metrics["train_steps_total"] == MAX_STEPS
    assert metrics["train_step_duration_seconds_count"] == MAX_STEPS
    for phase in ("data", "forward_backward", "optimizer"):
        assert metrics[f"train_phase_duration_seconds_count{{{phase}}}"] == MAX_STEPS
    assert metrics["train_phase_duration_seconds_count{eval}"] >= 1  # the step-6 eval rides the final flush
    for name in ("train_loss", "train_learning_rate", "train_grad_norm", "eval_loss"):
        assert metrics[name] > 0, name
    # Every row has 2 x 16 tokens per micro-batch, 2 micro-batches per step.
    assert metrics["train_tokens_total"] == MAX_STEPS * GRAD_ACCUM * 2 * 16
    assert metrics["train_samples_total"] == MAX_STEPS * GRAD_ACCUM * 2  # the rows of those batches

    rows = _rows(session.run_dir)
    keys = set().union(*rows)
    assert {"train/loss", "train/learning_rate", "train/grad_norm", "eval/loss"} <= keys
    assert {"timers/step/mean", "timers/forward_backward/mean", "timers/optimizer/mean"} <= keys
    assert sum(r.get("train/steps", 0) for r in rows) == MAX_STEPS
    assert sum(r.get("timers/eval/count", 0) for r in rows) == 2  # eval_steps=3 over 6 steps
    assert sum(r.get("timers/checkpoint/count", 0) for r in rows) == 1
    assert sum(r.get("throughput/tokens", 0) for r in rows) == MAX_STEPS * GRAD_ACCUM * 2 * 16
    assert sum(r.get("throughput/samples", 0) for r in rows) == MAX_STEPS * GRAD_ACCUM * 2
    last_loss = [r["train/loss"] for r in rows if r.get("train/loss") is not None][-1]
    trainer_losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert last_loss == pytest.approx(trainer_losses[-1], rel=1e-6)

    hparams = json.loads((session.run_dir / "hparams.json").read_text())
    assert hparams["gradient_accumulation_steps"] == GRAD_ACCUM
    assert "PLANTED_SECRET" not in (session.run_dir / "hparams.json").read_text()


def test_callback_starts_its_own_session_and_leaves_it_to_the_next_callbacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_TRAIN_PROMETHEUS_PORT", "0")
    callback = OtelTrainCallback(settings={"run_name": "lazy", "verbosity": 0, "hardware": False})
    trainer = _trainer(tmp_path / "hf-out", callback, max_steps=4)
    trainer.train()
    lazy = current_session()  # started at on_train_begin; idle after train(), for an evaluate or a save
    assert lazy is not None and lazy.run_name == "lazy"
    # ... until another callback's run begins (or the process exits): the user chose total_steps here
    monkeypatch.setenv("OTEL_TRAIN_TOTAL_STEPS", "40")
    callback = OtelTrainCallback(settings={"run_name": "chosen", "verbosity": 0, "hardware": False})
    _trainer(tmp_path / "hf-out", callback, max_steps=4).train()
    assert current_session() is not lazy
    ot.shutdown()
    run_dir = tmp_path / "runs" / "lazy"
    rows = _rows(run_dir)
    assert sum(r.get("train/steps", 0) for r in rows) == 4
    config = json.loads((run_dir / "config.json").read_text())
    assert config["total_steps"] == 4  # taken from the Trainer's max_steps
    assert json.loads((tmp_path / "runs" / "chosen" / "config.json").read_text())["total_steps"] == 40


def test_predicts_test_metrics_are_filed_like_an_evaluations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """trainer.predict() hands test_loss and test_runtime to on_predict only (never to on_log):
    they reach the rows at the step they follow, as eval_* do."""
    monkeypatch.setenv("OTEL_TRAIN_PROMETHEUS_PORT", "0")
    callback = OtelTrainCallback(settings={"run_name": "predict", "verbosity": 0, "hardware": False,
                                           "output_dir": str(tmp_path / "runs")})  # fmt: skip
    trainer = _trainer(tmp_path / "hf-out", callback, max_steps=4)
    trainer.train()
    output = trainer.predict(TokenDataset(8, seed=2))
    ot.shutdown()
    rows = _rows(tmp_path / "runs" / "predict")
    tested = [r for r in rows if "test/loss" in r]
    assert tested, sorted(set().union(*rows))
    value = tested[-1]["test/loss"]
    assert value == pytest.approx(output.metrics["test_loss"]) and tested[-1]["step"] == 3


class _StopAtStep3(TrainerCallback):
    """What EarlyStoppingCallback does when patience runs out: ask the Trainer to stop."""

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 3:
            control.should_training_stop = True


def test_early_stopping_makes_the_steps_run_the_plan(tmp_path: Path) -> None:
    callback = OtelTrainCallback(
        run_name="early", verbosity=0, hardware=False, prometheus_port=0, log_interval=100
    )
    trainer = _trainer(tmp_path / "hf-out", callback, max_steps=20, eval_strategy="no", save_strategy="no")
    trainer.add_callback(_StopAtStep3())
    trainer.train()
    ot.shutdown()  # the callback's run idles after train(), until process exit
    assert trainer.state.global_step == 3
    # the plan changed after the last step's row (the Trainer's end-of-train log has a row of its own)
    last = [r for r in _rows(tmp_path / "runs" / "early") if "train/steps_planned" in r][-1]
    assert last["train/steps_planned"] == 3 and last["progress/eta_s"] == 0


def test_a_resumes_checkpoint_loading_is_checkpoint_restore_not_startup(tmp_path: Path) -> None:
    """`train(resume_from_checkpoint=...)` loads the model, optimizer and scheduler before
    `on_train_begin`, when the callback's run has not begun: goodput books that time as
    checkpoint_restore (each load's own time), not startup. (In a fresh process the account begins
    at the process's start; here, a later run of the test process, at its init.)"""
    from transformers import Trainer

    slow = SlowStretches()

    class SlowLoading(Trainer):
        def _load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
            if checkpoint is not None:
                slow.sleep(0.5)  # a large optimizer state on a slow file system
            super()._load_optimizer_and_scheduler(checkpoint)

    settings = dict(run_id="resumed-hf", verbosity=0, hardware=False, prometheus_port=0)
    first = _trainer(tmp_path / "hf-out", OtelTrainCallback(run_name="first", **settings), max_steps=2,
                     eval_strategy="no", save_steps=2)  # fmt: skip
    first.train()
    ot.shutdown()
    again = _trainer(tmp_path / "hf-out", OtelTrainCallback(run_name="resumed", **settings), max_steps=4,
                     eval_strategy="no", save_strategy="no")  # fmt: skip
    resumed = SlowLoading(model=again.model, args=again.args, train_dataset=again.train_dataset,
                          callbacks=[OtelTrainCallback(run_name="resumed", **settings)])  # fmt: skip
    resumed.train(resume_from_checkpoint=str(tmp_path / "hf-out" / "checkpoint-2"))
    ot.shutdown()
    assert resumed.state.global_step == 4
    account = json.loads((tmp_path / "runs" / "resumed" / "goodput.rank0.json").read_text())
    assert account["badput"]["checkpoint_restore"] >= 0.5, account  # startup before (no span)


def test_each_log_leaves_with_its_own_steps_flush(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The Trainer logs after on_step_end: the step stays open for its log, so the loss it logged
    leaves with that step's flush (the console's line for the step shows it; its row comes before
    the step's flush row), not with the next one's, and the last log is not left for the end."""
    # (a shutdown budget a loaded host's worker needs: a flush it has not written by then prints nothing)
    callback = OtelTrainCallback(
        run_name="logs", verbosity=1, hardware=False, prometheus_port=0, shutdown_timeout_s=60.0
    )
    trainer = _trainer(tmp_path / "hf-out", callback, logging_steps=2, eval_strategy="no", save_strategy="no")
    trainer.train()
    # The run idles after train() (an evaluate may follow); the worker prints the console's lines,
    # the last one maybe after train() returned: all are out once shutdown drained it.
    ot.shutdown()
    printed = capsys.readouterr().out
    logged = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
    assert sorted(logged) == [2, 4, 6]
    for step, loss in logged.items():
        assert f"step {step}/{MAX_STEPS} | loss {loss:.4f}" in printed, printed
    rows = _rows(tmp_path / "runs" / "logs")
    for step in logged:
        log_row = next(i for i, r in enumerate(rows) if r["step"] == step - 1 and "train/loss" in r)
        flush_row = next(i for i, r in enumerate(rows) if r["step"] == step - 1 and "train/steps" in r)
        assert log_row < flush_row, rows


def test_a_decorated_training_step_under_the_callback_counts_each_step_once(tmp_path: Path) -> None:
    """The callback marks the optimizer steps; a user's `@ot.step` on `training_step` (one per
    micro-batch) runs inside them: counted once, as the callback's steps."""
    from transformers import Trainer

    class DecoratedStep(Trainer):
        @ot.step
        def training_step(self, *args: Any, **kwargs: Any) -> Any:
            return super().training_step(*args, **kwargs)

    callback = OtelTrainCallback(
        run_name="nested", verbosity=0, hardware=False, prometheus_port=0, log_interval=1
    )
    plain = _trainer(tmp_path / "hf-out", callback, eval_strategy="no", save_strategy="no")
    trainer = DecoratedStep(
        model=plain.model, args=plain.args, train_dataset=plain.train_dataset, callbacks=[callback]
    )
    trainer.train()
    ot.shutdown()  # the callback's run idles after train(), until process exit
    rows = _rows(tmp_path / "runs" / "nested")
    assert sum(r.get("train/steps", 0) for r in rows) == MAX_STEPS
    assert sum(r.get("otel_train/dropped/nested_step", 0) for r in rows) == MAX_STEPS * GRAD_ACCUM


def test_callback_takes_settings_as_keyword_arguments(tmp_path: Path) -> None:
    callback = OtelTrainCallback(
        run_name="kw", verbosity=0, hardware=False, prometheus_port=0, log_interval=2
    )
    _trainer(tmp_path / "hf-out", callback, max_steps=2, eval_strategy="no", save_strategy="no").train()
    config = json.loads((tmp_path / "runs" / "kw" / "config.json").read_text())
    assert (config["run_name"], config["log_interval"]) == ("kw", 2)
    with pytest.raises(ot.ConfigError, match="unknown setting 'run_nme': did you mean 'run_name'"):
        OtelTrainCallback(run_nme="x")
    with pytest.raises(ot.ConfigError, match=r"'tensorbord'.*'tensorboard'"):
        OtelTrainCallback(settings={"tensorbord": True})


def test_train_raising_mid_epoch_ends_the_callbacks_session_without_a_false_stall(tmp_path: Path) -> None:
    """The user catches the Trainer's exception and handles it for longer than stall_timeout_s: the
    open step ended as failed and the session the callback started is shut down, so no stall."""
    model = tiny_causal_lm()
    forwards = [0]

    def fail_in_step_3(module: Any, inputs: Any, output: Any) -> None:
        forwards[0] += 1
        if forwards[0] == 2 * GRAD_ACCUM + 1:  # first micro-batch of the third step
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    model.register_forward_hook(fail_in_step_3)
    callback = OtelTrainCallback(
        run_name="boom", verbosity=0, hardware=False, prometheus_port=0, stall_timeout_s=0.5
    )
    trainer = _trainer(tmp_path / "hf-out", callback, model=model, eval_strategy="no", save_strategy="no")
    with pytest.raises(RuntimeError, match="illegal memory access"):
        trainer.train()
    raised_at = time.time()
    assert current_session() is None  # shut down before the exception reached the user
    time.sleep(2.0)  # the user handles the error: four stall timeouts
    ot.shutdown()  # (what a user would call; without the fix it writes the pending stall event)
    run_dir = tmp_path / "runs" / "boom"
    # (a step slower than 0.5 s on a loaded machine may be a true stall DURING training)
    assert not [e for e in run_events(run_dir, event="stall") if e["time"] >= raised_at], run_events(run_dir)
    assert sum(r.get("train/steps", 0) for r in _rows(run_dir)) == 2  # the failed third step is not counted
    # the run ended as failed (W&B and MLflow mark it so; progress.txt's end line says it)
    assert "| end of process (failed) |" in (run_dir / "progress.txt").read_text()
    [failed] = run_events(run_dir, event="run_failed")
    assert failed["message"].startswith("the training ended by RuntimeError at step 2: ")  # the third
    assert "illegal memory access" in failed["message"] and failed["error.type"] == "RuntimeError"


def test_the_users_run_outlives_train_flushed_and_without_a_false_stall(tmp_path: Path) -> None:
    """A run the user started stays open after `train()` (an evaluate, a save, a push to the hub
    follows): its last steps reach the outputs at once, and the pause is no stall."""
    ot.init(
        run_name="after", output_dir=str(tmp_path / "runs"), prometheus_port=0, verbosity=0,
        hardware=False, log_interval=100, stall_timeout_s=0.5,
    )  # fmt: skip
    session = current_session()
    trainer = _trainer(tmp_path / "hf-out", OtelTrainCallback(), eval_strategy="no", save_strategy="no")
    trainer.train()
    trained_at = time.time()
    deadline = time.monotonic() + 30  # liveness bound: the worker writes the pause's flush
    while session.worker.steps_done < MAX_STEPS and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sum(r.get("train/steps", 0) for r in _rows(session.run_dir)) == MAX_STEPS  # before shutdown
    time.sleep(2.0)  # the user's work after train(): four stall timeouts
    assert current_session() is session
    ot.shutdown()
    # (a step slower than 0.5 s on a loaded machine may be a true stall DURING training)
    stalls = run_events(session.run_dir, event="stall")
    assert not [e for e in stalls if e["time"] >= trained_at], run_events(session.run_dir)


def test_an_evaluation_longer_than_the_stall_timeout_is_no_stall(tmp_path: Path) -> None:
    """Each eval batch (`on_prediction_step`) tells the stall watchdog the loop is alive: an
    evaluation of 8 batches of 0.2 s under stall_timeout_s=1 raises no stall event."""
    model = tiny_causal_lm()
    slow = SlowStretches()

    def slow_eval_batch(module: Any, inputs: Any, output: Any) -> None:
        if not module.training:
            slow.sleep(0.2)

    model.register_forward_hook(slow_eval_batch)
    callback = OtelTrainCallback(
        run_name="longeval", verbosity=0, hardware=False, prometheus_port=0, stall_timeout_s=1.0
    )
    trainer = _trainer(
        tmp_path / "hf-out", callback, model=model, max_steps=2, eval_steps=2, save_strategy="no",
        per_device_eval_batch_size=1,
    )  # fmt: skip
    trainer.train()
    ot.shutdown()
    run_dir = tmp_path / "runs" / "longeval"
    assert sum(r.get("timers/eval/count", 0) for r in _rows(run_dir)) == 1  # the evaluation ran
    assert len(slow.spans) == 8
    assert slow.stalls_inside(run_dir) == []


def test_tokens_are_counted_when_the_trainer_does_not_count_them(tmp_path: Path) -> None:
    """The Trainer counts input tokens only with include_num_input_tokens_seen (its default is
    "no"); without it the callback counts them as the Trainer's "all" would, from the shapes of
    each step's micro-batches (no device read): tokens/s from the first run."""
    callback = OtelTrainCallback(run_name="tokens", verbosity=0, hardware=False, prometheus_port=0)
    trainer = _trainer(
        tmp_path / "hf-out",
        callback,
        include_num_input_tokens_seen="no",
        eval_strategy="no",
        save_strategy="no",
    )
    trainer.train()
    ot.shutdown()  # the callback's run idles after train(), until process exit
    assert trainer.state.num_input_tokens_seen == 0  # the Trainer counted none
    rows = _rows(tmp_path / "runs" / "tokens")
    # 2 rows of 16 tokens per micro-batch, GRAD_ACCUM micro-batches per step
    assert sum(r.get("throughput/tokens", 0) for r in rows) == MAX_STEPS * GRAD_ACCUM * 2 * 16
    assert any(r.get("throughput/tokens_per_s", 0) > 0 for r in rows)


def test_a_step_that_accumulates_longer_than_the_stall_timeout_is_no_stall(tmp_path: Path) -> None:
    """Each micro-batch of a step that accumulates gradients (`on_substep_end`) tells the stall
    watchdog the loop is alive: steps of 4 micro-batches of 0.3 s under stall_timeout_s=1 raise no
    stall event."""
    model = tiny_causal_lm()
    slow = SlowStretches()

    def slow_micro_batch(module: Any, inputs: Any, output: Any) -> None:
        if module.training:
            slow.sleep(0.3)

    model.register_forward_hook(slow_micro_batch)
    callback = OtelTrainCallback(
        run_name="accumulating", verbosity=0, hardware=False, prometheus_port=0, stall_timeout_s=1.0
    )
    trainer = _trainer(
        tmp_path / "hf-out", callback, model=model, max_steps=2, gradient_accumulation_steps=4,
        eval_strategy="no", save_strategy="no",
    )  # fmt: skip
    trainer.train()
    ot.shutdown()  # the callback's run idles after train(), until process exit
    run_dir = tmp_path / "runs" / "accumulating"
    assert sum(r.get("train/steps", 0) for r in _rows(run_dir)) == 2
    assert len(slow.spans) == 8  # 2 steps of 4 micro-batches, each longer than the timeout
    assert slow.stalls_inside(run_dir) == []


@pytest.mark.parametrize("strategy", ["steps", "epoch", "eval_then_save", "best"])
def test_a_checkpoint_save_longer_than_the_stall_timeout_is_no_stall(tmp_path: Path, strategy: str) -> None:
    """The Trainer's save comes after `on_step_end` (or `on_epoch_end`), which knows it is due
    (`control.should_save`), and after the evaluation due at the same step (`on_evaluate`; with
    save_strategy="best" the Trainer decides after it): the watchdog then waits
    checkpoint_timeout_s, so a 1.5 s save under stall_timeout_s=0.5 raises no stall event."""
    model = tiny_causal_lm()
    save_pretrained = model.save_pretrained
    slow = SlowStretches()

    def slow_save(*args: Any, **kwargs: Any) -> Any:
        slow.sleep(1.5)
        return save_pretrained(*args, **kwargs)

    model.save_pretrained = slow_save  # type: ignore[method-assign]
    callback = OtelTrainCallback(
        run_name="longsave", verbosity=0, hardware=False, prometheus_port=0, stall_timeout_s=0.5
    )
    by_epoch = strategy == "epoch"  # 2 epochs of 2 steps (8 rows, batch 2, accumulation 2)
    trainer = _trainer(
        tmp_path / "hf-out", callback, model=model, max_steps=-1 if by_epoch else 2, save_steps=1,
        eval_strategy="steps" if strategy in ("eval_then_save", "best") else "no", eval_steps=1,
        save_strategy="epoch" if by_epoch else strategy if strategy == "best" else "steps",
        num_train_epochs=2, dataset=TokenDataset(8) if by_epoch else None,
        metric_for_best_model="rising" if strategy == "best" else None, greater_is_better=True,
    )  # fmt: skip
    evaluations = iter(range(1, 100))
    trainer.compute_metrics = lambda _: {"rising": next(evaluations)}  # each evaluation a new best
    trainer.train()
    ot.shutdown()
    run_dir = tmp_path / "runs" / "longsave"
    assert sum(r.get("timers/checkpoint/count", 0) for r in _rows(run_dir)) == 2  # both saves ran
    assert len(slow.spans) == 2
    assert slow.stalls_inside(run_dir) == []


def test_compute_metrics_longer_than_the_stall_timeout_is_no_stall(tmp_path: Path) -> None:
    """The Trainer computes the metrics after the evaluation's last batch, with no hook between:
    the callback's eval span is open from the first batch to `on_evaluate`, so the watchdog waits
    eval_timeout_s, and a 1.5 s `compute_metrics` under stall_timeout_s=0.5 raises no stall event;
    the span is still one eval per evaluation."""
    slow = SlowStretches()

    def compute_metrics(_: Any) -> dict[str, float]:
        slow.sleep(1.5)
        return {"score": 1.0}

    callback = OtelTrainCallback(
        run_name="slowmetrics", verbosity=0, hardware=False, prometheus_port=0, stall_timeout_s=0.5
    )
    trainer = _trainer(
        tmp_path / "hf-out", callback, max_steps=2, eval_strategy="steps", eval_steps=1, save_strategy="no"
    )
    trainer.compute_metrics = compute_metrics
    trainer.train()
    ot.shutdown()
    run_dir = tmp_path / "runs" / "slowmetrics"
    assert len(slow.spans) == 2
    assert slow.stalls_inside(run_dir) == []
    assert sum(r.get("timers/eval/count", 0) for r in _rows(run_dir)) == 2
    assert [r["eval/score"] for r in _rows(run_dir) if "eval/score" in r] == [1.0, 1.0]


def test_callback_adds_no_host_sync_on_the_training_thread(tmp_path: Path) -> None:
    """Count Tensor.item / tolist / __float__ / cpu calls on the training thread with and without
    the callback: the Trainer's own syncs are the same, the callback adds none."""
    import torch

    def count_syncs(callbacks: list[Any]) -> int:
        calls = [0]
        main = threading.current_thread()
        originals = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "__float__", "cpu")}

        def counting(name: str) -> Any:
            original = originals[name]

            def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
                if threading.current_thread() is main:
                    calls[0] += 1
                return original(self, *args, **kwargs)

            return wrapper

        try:
            for name in originals:
                setattr(torch.Tensor, name, counting(name))
            from transformers import Trainer

            trainer = _trainer(tmp_path / f"out{len(callbacks)}", OtelTrainCallback())
            trainer.callback_handler.callbacks = [
                c for c in trainer.callback_handler.callbacks if not isinstance(c, OtelTrainCallback)
            ]
            for callback in callbacks:
                trainer.add_callback(callback)
            assert isinstance(trainer, Trainer)
            trainer.train()
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
        return calls[0]

    ot.init(run_name="sync", prometheus_port=0, verbosity=0, log_interval=2, hardware=False)
    baseline = count_syncs([])
    instrumented = count_syncs([OtelTrainCallback()])
    assert baseline > 0  # the counter works: the Trainer's own logging syncs
    assert instrumented == baseline


def _ddp_rank(rank: int, world_size: int, out: str, count_tokens: str) -> dict[str, Any]:
    ot.init(verbosity=0, log_interval=2, hardware=False, prometheus_port=0)
    session = current_session()
    assert session is not None
    trainer = _trainer(
        Path(out) / f"hf-out{rank}", OtelTrainCallback(), max_steps=4, ddp=True,
        include_num_input_tokens_seen=count_tokens,
    )  # fmt: skip
    trainer.train()
    run_dir = str(session.run_dir)
    ot.shutdown()
    return {
        "run_dir": run_dir,
        "steps": trainer.state.global_step,
        "sink_errors": dict(session.worker.sink_errors),
    }


@pytest.mark.multirank
@pytest.mark.parametrize("count_tokens", ["all", "no"])  # the Trainer's gathered count, or each rank's own
def test_trainer_under_two_gloo_ranks_one_run_dir_and_cross_rank_timers(
    tmp_path: Path, count_tokens: str
) -> None:
    results = run_ranks(2, _ddp_rank, (str(tmp_path), count_tokens), timeout=240)
    # every rank writes the run's hparams.json (log_hyperparams on each): none fails doing so
    assert [r["sink_errors"] for r in results] == [{}, {}]
    run_dirs = {r["run_dir"] for r in results}
    assert len(run_dirs) == 1, run_dirs  # one run directory for the job
    run_dir = Path(run_dirs.pop())
    for rank in (0, 1):
        rows = _rows(run_dir, rank)
        assert sum(r.get("train/steps", 0) for r in rows) == 4
        assert any(r.get("train/loss") is not None for r in rows)
        # each rank: 4 steps of GRAD_ACCUM micro-batches of 2 rows of 16 tokens
        assert sum(r.get("throughput/tokens", 0) for r in rows) == 4 * GRAD_ACCUM * 2 * 16
    keys = set().union(*_rows(run_dir, 0))
    # Cross-rank reductions of the callback's timers appear on rank 0.
    assert any(k.startswith("timers/forward_backward/") and "max" in k for k in keys), sorted(keys)


class SlowRows(TokenDataset):
    """A dataset whose `__getitem__` takes `delay_s` (a slow disk or decoder on one rank)."""

    def __init__(self, rows: int, delay_s: float) -> None:
        super().__init__(rows)
        self.delay_s = delay_s

    def __getitem__(self, index: int) -> dict[str, Any]:
        time.sleep(self.delay_s)
        return super().__getitem__(index)


STRAGGLER_STEPS = 24


def _ddp_slow_data_rank(rank: int, world_size: int, out: str) -> dict[str, Any]:
    # The user's session only to see the events; the timing is the callback's alone.
    ot.init(verbosity=0, log_interval=4, hardware=False, prometheus_port=0, collective_timeout_s=60.0)
    session = current_session()
    events: list[dict[str, Any]] = []
    session.events.add_callback(lambda event, message, attrs: events.append({"event": event, **attrs}))
    dataset = SlowRows(256, 0.015 if rank == 1 else 0.0)  # 4 rows per step: +60 ms per step on rank 1
    trainer = _trainer(
        Path(out) / f"hf-out{rank}", OtelTrainCallback(), max_steps=STRAGGLER_STEPS, ddp=True,
        dataset=dataset, eval_strategy="no", save_strategy="no",
    )  # fmt: skip
    trainer.train()
    reducer = session.reducer
    ot.shutdown()
    return {"stragglers": [e for e in events if e["event"] == "straggler"], "abstain": reducer.abstain_reason}


@pytest.mark.multirank
def test_trainer_under_ddp_names_the_rank_slow_in_data_and_never_the_waiting_rank(tmp_path: Path) -> None:
    """2 gloo ranks, the callback alone, rank 1's dataset slow: the fast rank waits for it inside
    forward_backward (DDP's all-reduce); only rank 1 is named, in `data`."""
    results = run_ranks(2, _ddp_slow_data_rank, (str(tmp_path),), timeout=240)
    reported = results[0]["stragglers"]
    assert results[0]["abstain"] is None  # arrivals exist: the detector does not abstain
    (first,) = reported  # named once while it stays a straggler; rank 0 never
    assert (first["rank"], first["train.phase"], first["category"]) == (1, "data", "data"), first
    assert first["pattern"] == "chronic" and first["waiting_ranks"] == "0"


def _ddp_slow_compute_rank(rank: int, world_size: int, out: str) -> dict[str, Any]:
    """Rank 1's model 30 ms slower in every forward (a slower GPU), the callback alone."""
    ot.init(verbosity=0, log_interval=4, hardware=False, prometheus_port=0, collective_timeout_s=60.0)
    session = current_session()
    events: list[dict[str, Any]] = []
    session.events.add_callback(lambda event, message, attrs: events.append({"event": event, **attrs}))
    model = tiny_causal_lm()
    if rank == 1:
        model.register_forward_pre_hook(lambda module, args: time.sleep(0.03))
    trainer = _trainer(
        Path(out) / f"hf-out{rank}", OtelTrainCallback(), max_steps=STRAGGLER_STEPS, ddp=True,
        dataset=TokenDataset(256), model=model, eval_strategy="no", save_strategy="no",
    )  # fmt: skip
    trainer.train()
    ot.shutdown()
    return {"stragglers": [e for e in events if e["event"] == "straggler"]}


@pytest.mark.multirank
def test_trainer_under_ddp_names_the_rank_slow_in_compute_from_torchs_default_flight_recorder(
    tmp_path: Path,
) -> None:
    """One timer holds the micro-batches' forward and backward and the all-reduce, so every timer
    ends at the same time on both ranks: only the arrivals at the collectives, from the Flight
    Recorder torch keeps without being asked, find the rank the other waits for."""
    results = run_ranks(2, _ddp_slow_compute_rank, (str(tmp_path),), timeout=240, env=DEFAULT_FR)
    (first,) = results[0]["stragglers"]  # named once while it stays a straggler; rank 0 never
    assert (first["rank"], first["train.phase"], first["category"]) == (1, "forward_backward", "compute")
    assert first["pattern"] == "chronic" and first["waiting_ranks"] == "0", first
    assert "in 'forward_backward' (default_pg)" in first["collective"], first  # DDP's, or a gather
    # 2 micro-batches a step, each 30 ms slower on rank 1
    assert first["lateness_ms"] == pytest.approx(GRAD_ACCUM * 30, rel=0.35), first
    assert first["wait_ms"] == pytest.approx(GRAD_ACCUM * 30, rel=0.35), first


_HOOKS = (
    "on_step_begin",
    "on_pre_optimizer_step",
    "on_optimizer_step",
    "on_step_end",
    "on_log",
    "on_evaluate",
)


@pytest.mark.gpu
@pytest.mark.parametrize("watch_every", [0, 2])
def test_callback_hooks_never_sync_the_device_on_cuda(tmp_path: Path, watch_every: int) -> None:
    """Every hook of the callback runs under `set_sync_debug_mode("error")` on a real GPU (the
    Trainer's own syncs, outside the hooks, are allowed); with `watch_every`, ot.watch's statistics
    are taken inside `on_optimizer_step` and the batch is handed over in `on_step_begin`."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")

    class Strict(OtelTrainCallback):
        pass

    def strict(name: str) -> Any:
        original = getattr(OtelTrainCallback, name)

        def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
            torch.cuda.set_sync_debug_mode("error")
            try:
                return original(self, *args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        return hook

    for name in _HOOKS:
        setattr(Strict, name, strict(name))
    from transformers import Trainer, TrainingArguments

    ot.init(run_name="gpu-sync", prometheus_port=0, verbosity=0, log_interval=2)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=6, per_device_train_batch_size=2,
        gradient_accumulation_steps=GRAD_ACCUM, logging_steps=2, eval_strategy="steps", eval_steps=3,
        save_strategy="no", report_to="none", disable_tqdm=True, include_num_input_tokens_seen=True,
    )  # fmt: skip
    model = tiny_causal_lm().cuda()
    trainer = Trainer(
        model=model, args=args, train_dataset=TokenDataset(32), eval_dataset=TokenDataset(8, seed=1),
        callbacks=[Strict(watch_every=watch_every)],
    )  # fmt: skip
    trainer.train()
    session = current_session()
    assert session is not None
    ot.shutdown()
    rows = _rows(session.run_dir)
    assert sum(r.get("train/steps", 0) for r in rows) == 6
    if watch_every:  # read before the Trainer zeroed the gradients
        layers = [v for r in rows for k, v in r.items() if k.startswith("grad_norm/transformer.")]
        assert layers and all(v > 0 for v in layers), sorted(set().union(*rows))


def _oom_at_batch_size(model: Any, size: int) -> list[int]:
    """Make `model` raise the CUDA out-of-memory error (the text accelerate's
    `should_reduce_batch_size` matches) for every micro-batch of `size` rows; returns the batch
    sizes seen, in order."""
    seen: list[int] = []

    def hook(module: Any, inputs: Any, output: Any) -> None:
        rows = int(inputs[0].shape[0])
        seen.append(rows)
        if rows == size:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    model.transformer.wte.register_forward_hook(hook)
    return seen


def test_auto_find_batch_size_retry_keeps_one_run_and_ends_it(tmp_path: Path) -> None:
    """`auto_find_batch_size`: the first batch size runs out of memory in its first step and
    accelerate re-enters the training loop (a second `on_train_begin` in one `train()`). The
    callback's run goes on (idle after train()), the failed attempt's step is not a success, and
    the next Trainer gets a run of its own."""
    run_dirs = []
    for attempt in range(2):
        model = tiny_causal_lm()
        seen = _oom_at_batch_size(model, 8)
        callback = OtelTrainCallback(verbosity=0, hardware=False, prometheus_port=0)
        trainer = _trainer(
            tmp_path / f"hf-out{attempt}", callback, max_steps=3, model=model, auto_find_batch_size=True,
            per_device_train_batch_size=8, eval_strategy="no", save_strategy="no",
        )  # fmt: skip
        trainer.train()
        assert seen[0] == 8 and trainer._train_batch_size == 7  # a real retry, at accelerate's 0.9 x
        assert current_session() is not None  # the session the callback started idles after train()
        ot.shutdown()
        (run_dir,) = [d for d in (tmp_path / "runs").iterdir() if d not in run_dirs]
        run_dirs.append(run_dir)
        rows = _rows(run_dir)
        assert trainer.state.global_step == 3
        assert sum(r.get("train/steps", 0) for r in rows) == 3  # the step that ran out of memory is not one
        assert sum(r.get("timers/step/count", 0) for r in rows) == 3
        assert sum(r.get("throughput/tokens", 0) for r in rows) == 3 * GRAD_ACCUM * 7 * 16


@pytest.mark.parametrize(
    ("trainer_args", "otel_settings", "env", "log_interval", "run_dirs"),
    [
        ({"logging_steps": 3}, {}, {}, 3, "hf-out/_otel_train"),  # each flush holds one Trainer log
        ({"logging_steps": 0.5}, {}, {}, 2, "hf-out/_otel_train"),  # a ratio of max_steps=4
        ({}, {}, {}, None, "hf-out/_otel_train"),  # the Trainer's default 500: otel_train's cadence
        ({"logging_steps": 3, "logging_strategy": "epoch"}, {}, {}, None, "hf-out/_otel_train"),
        ({"logging_steps": 3}, {"log_interval": 2, "output_dir": "mine"}, {}, 2, "mine"),
        (
            {"logging_steps": 3},
            {},
            {"OTEL_TRAIN_LOG_INTERVAL": "1", "OTEL_TRAIN_OUTPUT_DIR": "env"},
            1,
            "env",
        ),
    ],
)
def test_trainer_logging_steps_and_output_dir_are_adopted_unless_otel_train_has_its_own(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    trainer_args: dict[str, Any],
    otel_settings: dict[str, Any],
    env: dict[str, str],
    log_interval: int | None,
    run_dirs: str,
) -> None:
    monkeypatch.delenv("OTEL_TRAIN_OUTPUT_DIR")  # (the suite's own run-dir place)
    monkeypatch.chdir(tmp_path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = {"run_name": "adopt", "verbosity": 0, "hardware": False, "prometheus_port": 0}
    callback = OtelTrainCallback(**settings, **otel_settings)
    overrides = {"logging_steps": 500, **trainer_args}  # 500: the field's default (never set by the user)
    trainer = _trainer(
        Path("hf-out"), callback, max_steps=4, eval_strategy="no", save_strategy="no", **overrides
    )
    trainer.train()
    ot.shutdown()
    run_dir = tmp_path / run_dirs / "adopt"
    config = json.loads((run_dir / "config.json").read_text())
    assert config["log_interval"] == log_interval
    assert sum(r.get("train/steps", 0) for r in _rows(run_dir)) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({"hf-out", run_dirs.split("/")[0]})
    if log_interval is not None:  # flushed every log_interval steps (the last one at the end)
        steps = [r["train/steps"] for r in _rows(run_dir) if r.get("train/steps")]
        assert steps[0] == log_interval, steps


def test_a_setting_in_the_config_file_wins_over_the_trainers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`OTEL_TRAIN_CONFIG` names a file with `log_interval: 2`: the user chose it there, so the
    Trainer's `logging_steps=3` is not adopted over it (the output_dir, not in the file, still is)."""
    monkeypatch.delenv("OTEL_TRAIN_OUTPUT_DIR")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "otel.yaml").write_text("log_interval: 2\nverbosity: 0\n")
    monkeypatch.setenv("OTEL_TRAIN_CONFIG", str(tmp_path / "otel.yaml"))
    callback = OtelTrainCallback(run_name="filed", hardware=False, prometheus_port=0)
    trainer = _trainer(
        Path("hf-out"), callback, max_steps=4, eval_strategy="no", save_strategy="no", logging_steps=3
    )
    trainer.train()
    config = json.loads((tmp_path / "hf-out" / "_otel_train" / "filed" / "config.json").read_text())
    assert config["log_interval"] == 2


@pytest.mark.parametrize("bridge_on", [True, False], ids=["session-bridge-on", "session-bridge-off"])
def test_the_running_sessions_bridges_decide_which_reporters_go(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, bridge_on: bool
) -> None:
    """A session started before the Trainer: its TensorBoard bridge, not the callback's own
    settings (which start no session now), decides whether the Trainer's TensorBoardCallback goes."""
    from transformers.integrations import TensorBoardCallback

    ot.init(run_name="first", tensorboard=bridge_on, verbosity=0, hardware=False, prometheus_port=0)
    callback = OtelTrainCallback(tensorboard=not bridge_on)
    with caplog.at_level("WARNING", logger="otel_train"):
        trainer = _trainer(
            tmp_path / "hf", callback, max_steps=1, eval_strategy="no", save_strategy="no",
            report_to=["tensorboard"],
        )  # fmt: skip
    kept = any(type(c) is TensorBoardCallback for c in trainer.callback_handler.callbacks)
    assert kept is not bridge_on
    assert ("tensorboard=False" in caplog.text) is bridge_on
    ot.shutdown()


def _tensorboard_scalars(log_dir: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: set[str] = set()
    for events in log_dir.rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events.parent))
        accumulator.Reload()
        tags |= set(accumulator.Tags().get("scalars", []))
        tags |= set(accumulator.Tags().get("tensors", []))
    return tags


def test_report_to_tensorboard_keeps_the_trainers_reporter_unless_otel_trains_bridge_is_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`report_to=["tensorboard"]`: with otel_train's bridge off (its default) the Trainer's own
    TensorBoardCallback writes and otel_train opens none; with `tensorboard=True` the Trainer's is
    taken off at construction and the Trainer's logs reach TensorBoard once, through otel_train."""
    from transformers.integrations import TensorBoardCallback

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "hf-tb"))
    settings = {"verbosity": 0, "hardware": False, "prometheus_port": 0}
    kept = _trainer(
        tmp_path / "a", OtelTrainCallback(run_name="kept", **settings), max_steps=2,
        eval_strategy="no", save_strategy="no", report_to=["tensorboard"],
    )  # fmt: skip
    assert any(type(c) is TensorBoardCallback for c in kept.callback_handler.callbacks)
    kept.train()
    ot.shutdown()  # the callback's run idles after train(), until process exit
    assert "loss" in _tensorboard_scalars(tmp_path / "hf-tb") or "train/loss" in _tensorboard_scalars(
        tmp_path / "hf-tb"
    )
    assert json.loads((tmp_path / "runs" / "kept" / "config.json").read_text())["tensorboard"] is False
    assert not (tmp_path / "runs" / "kept" / "tensorboard").exists()

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "hf-tb2"))
    with caplog.at_level("WARNING", logger="otel_train"):
        taken = _trainer(
            tmp_path / "b", OtelTrainCallback(run_name="taken", tensorboard=True, **settings), max_steps=2,
            eval_strategy="no", save_strategy="no", report_to=["tensorboard"],
        )  # fmt: skip
    assert not any(type(c) is TensorBoardCallback for c in taken.callback_handler.callbacks)
    assert "tensorboard=False" in caplog.text
    taken.train()
    ot.shutdown()
    assert not (tmp_path / "hf-tb2").exists()  # the Trainer's reporter never ran
    assert "train/loss" in _tensorboard_scalars(tmp_path / "runs" / "taken" / "tensorboard")

    # Added with add_callback, it first sees the Trainer after the reporter began its run: too late
    # to take it off, so it says so, and how to pass it instead.
    late = _trainer(
        tmp_path / "c", None, max_steps=2, eval_strategy="no", save_strategy="no", report_to=["tensorboard"]
    )
    late.add_callback(OtelTrainCallback(run_name="late", tensorboard=True, **settings))
    caplog.clear()
    with caplog.at_level("WARNING", logger="otel_train"):
        late.train()
    ot.shutdown()
    assert "added with trainer.add_callback, after the Trainer's TensorBoardCallback began" in caplog.text
    assert "Trainer(callbacks=[OtelTrainCallback(" in caplog.text and "tensorboard=False" in caplog.text


class _SessionSeen(TrainerCallback):
    """Added after the OtelTrainCallback: the session it started, kept past its shutdown."""

    def __init__(self) -> None:
        self.session: Any = None

    def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
        self.session = current_session()


def test_report_to_wandb_with_otel_trains_wandb_bridge_makes_one_wandb_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both the Trainer (`report_to=["wandb"]`) and otel_train (`wandb=True`) asked for W&B (offline
    here): one W&B run, otel_train's, in the project the Trainer's reporter would have used."""
    pytest.importorskip("wandb")
    monkeypatch.chdir(tmp_path)  # where the Trainer's WandbCallback would put its run
    monkeypatch.setenv("WANDB_PROJECT", "hf-project")
    callback = OtelTrainCallback(run_name="wb", wandb=True, verbosity=0, hardware=False, prometheus_port=0)
    trainer = _trainer(
        tmp_path / "hf-out",
        callback,
        max_steps=2,
        eval_strategy="no",
        save_strategy="no",
        report_to=["wandb"],
    )
    sessions = _SessionSeen()
    trainer.add_callback(sessions)
    trainer.train()
    ot.shutdown()
    # shutdown waits shutdown_timeout_s for the bridges; on a busy host the bridge process writes
    # the W&B run (and wandb_run.json) after that, then exits
    session = sessions.session
    assert session is not None and session.bridges is not None and session.bridges.wait(120)
    runs = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("offline-run-*") if p.is_dir())
    assert len(runs) == 1, runs
    info = json.loads((tmp_path / "runs" / "wb" / "wandb_run.json").read_text())
    assert info["project"] == "hf-project"


TORCHRUN_SCRIPT = """
import sys
import torch.distributed as dist
from transformers import Trainer, TrainingArguments
from helpers.integration_models import TokenDataset, tiny_causal_lm
from otel_train.integrations.transformers import OtelTrainCallback

args = TrainingArguments(
    output_dir=sys.argv[1], max_steps=4, per_device_train_batch_size=2, per_device_eval_batch_size=4,
    logging_steps=2, report_to="none", use_cpu=True, ddp_backend="gloo", save_strategy="no",
    eval_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
)
callback = OtelTrainCallback(run_name="tr", verbosity=0, hardware=False, prometheus_port=0)
trainer = Trainer(model=tiny_causal_lm(), args=args, train_dataset=TokenDataset(64),
                  eval_dataset=TokenDataset(8, seed=1), callbacks=[callback])
trainer.train()
trainer.evaluate()  # after train(), as HF's example scripts evaluate
dist.destroy_process_group()  # a script may; the callback's run still ends at process exit
"""


@pytest.mark.multirank
def test_a_torchrun_job_evaluating_after_train_keeps_its_eval_and_ends_its_run_at_exit(
    tmp_path: Path,
) -> None:
    """Two ranks under the real launcher, the run the callback started left to process exit (atexit
    shutdown, after the script destroyed its process group): every rank exits 0 with its steps, the
    evaluation after train() and its goodput account in the run directory."""
    import os
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    done = subprocess.run(
        [*launch, str(script), str(tmp_path / "hf-out")], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "runs" / "tr"  # the suite's OTEL_TRAIN_OUTPUT_DIR
    for rank in (0, 1):
        rows = _rows(run_dir, rank)
        assert sum(r.get("train/steps", 0) for r in rows) == 4
        assert [r["step"] for r in rows if "eval/loss" in r] == [3]
        assert json.loads((run_dir / f"goodput.rank{rank}.json").read_text())["last_step"] == 3
    assert "end of process" in (run_dir / "progress.txt").read_text()


def test_an_evaluate_after_train_and_one_without_train_are_eval_spans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """trainer.evaluate() outside training: its time is an `eval` span (goodput's eval), from its
    first batch (no mark of a training step to start from), whether train() ran before or not."""
    monkeypatch.setenv("OTEL_TRAIN_PROMETHEUS_PORT", "0")
    for name, train in (("after", True), ("alone", False)):
        settings = {"run_name": name, "verbosity": 0, "hardware": False, "output_dir": str(tmp_path / "runs")}
        trainer = _trainer(tmp_path / f"hf-{name}", OtelTrainCallback(settings=settings), max_steps=2,
                           eval_strategy="no")  # fmt: skip
        if train:
            trainer.train()
        trainer.evaluate()
        ot.shutdown()
        rows = _rows(tmp_path / "runs" / name)
        evals = [r["timers/eval/total"] for r in rows if "timers/eval/total" in r]
        assert len(evals) == 1 and evals[0] > 0, (name, sorted(set().union(*rows)))
        assert any("eval/loss" in r for r in rows), name
