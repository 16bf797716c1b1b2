"""The NeMo RL logger backend (issue #25, part 2), driven exactly as NeMo RL's `Logger` drives its
backends (nemo_rl/utils/logger.py at 0275e758: `Logger.log_metrics` fans each call out to every
backend in `Logger.loggers` with positional (metrics, step, prefix, step_metric, step_finished);
`RayGpuMonitorLogger.flush`, on the monitor's thread, calls it with prefix="ray",
step_metric="ray/ray_step" and the seconds since the monitor started as `step`). NeMo RL itself is
not installable here (not on PyPI; Python >= 3.13 and torch 2.11), so the fan-out is reproduced."""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

import otel_train as ot
from otel_train.integrations.nemo_rl import OtelTrainLogger, publish_reductions
from otel_train.run_directory import RunFiles
from otel_train.testing import current_session


class NemoLogger:
    """NeMo RL's `Logger` fan-out (the parts a backend sees), as in its source."""

    def __init__(self) -> None:
        self.loggers: list[Any] = []

    def log_metrics(
        self,
        metrics: dict[str, Any],
        step: int,
        prefix: str | None = "",
        step_metric: str | None = None,
        step_finished: bool = False,
    ) -> None:
        for logger in self.loggers:
            logger.log_metrics(metrics, step, prefix, step_metric, step_finished)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        for logger in self.loggers:
            logger.log_hyperparams(params)

    def finish(self) -> None:
        for logger in self.loggers:
            finish = getattr(logger, "finish", None)
            if callable(finish):
                finish()


def _gpu_monitor_flush(logger: NemoLogger, seconds: float) -> None:
    """RayGpuMonitorLogger.flush: from its own thread, the step metric added to the metrics."""
    metrics = {"node.0.gpu.0.util": 0.75, "node.0.mem_gb": 3.5, "ray/ray_step": seconds}

    def flush() -> None:
        logger.log_metrics(metrics, step=int(seconds), prefix="ray", step_metric="ray/ray_step")

    thread = threading.Thread(target=flush)
    thread.start()
    thread.join()


def _grpo_loop(logger: NemoLogger, steps: int) -> None:
    """grpo.py's per-step logging order: train metrics, rollout metrics, then the timing sums last
    (step_finished=True), with GPU-monitor flushes arriving in between."""
    logger.log_hyperparams({"grpo": {"num_prompts_per_step": 4}, "policy": {"lr": 1e-6}})
    for step in range(steps):
        train = {"loss": 0.5 / (step + 1), "reward": 1.0 + step, "global_valid_toks": 512, "lengths": [3, 4]}
        logger.log_metrics(train, step + 1, prefix="train")
        logger.log_metrics({"mean_gen_tokens_per_sample": 64.0}, step + 1, prefix="train_rollout")
        _gpu_monitor_flush(logger, seconds=100.0 + 10 * step)  # a time in seconds, not a step
        timing = {
            "policy_training": 0.2,
            "generation": 0.1,
            "logprob_inference": 0.05,
            "total_step_time": 0.4,
            "valid_tokens_per_sec_per_gpu": 1280.0,
        }
        logger.log_metrics(timing, step + 1, prefix="timing/train", step_finished=True)


def _rows(tmp_path: Path) -> list[dict[str, Any]]:
    files = RunFiles(tmp_path / "grpo", 0, "controller")
    return [json.loads(line) for line in files.metrics.read_text().splitlines()]


def test_grpo_loop_gives_steps_phases_and_gauges(tmp_path: Path) -> None:
    logger = _backend(tmp_path)
    _grpo_loop(logger, steps=3)
    logger.finish()
    assert current_session() is None  # the backend shut down the session it started
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]  # training steps; no step from the monitor's seconds
    for row in rows:
        for phase, seconds in (("policy_training", 0.2), ("generation", 0.1), ("logprob_inference", 0.05)):
            assert row[f"timers/{phase}/total"] == pytest.approx(seconds)
        assert row["timers/step/count"] == 1
        assert row["timers/step/total"] == pytest.approx(0.4, abs=0.05)  # total_step_time backdates
        assert row["throughput/tokens"] == 512
        assert row["ray/node/0/gpu/0/util"] == 0.75 and row["ray/node/0/mem_gb"] == 3.5  # gauges
        assert not [k for k in row if "ray_step" in k]  # the monitor's clock is not a metric
        assert "timing/train/valid_tokens_per_sec_per_gpu" in row  # a rate, not a phase
        assert "timers/valid_tokens_per_sec_per_gpu/total" not in row
    assert rows[1]["train/reward"] == 2.0 and rows[0]["train_rollout/mean_gen_tokens_per_sample"] == 64.0
    hparams = json.loads(RunFiles(tmp_path / "grpo", 0, "controller").hparams.read_text())
    assert "4" in json.dumps(hparams)


def test_step_finished_on_a_metrics_call_ends_the_step_once(tmp_path: Path) -> None:
    ot.init(role="controller", output_dir=str(tmp_path), run_name="grpo", log_interval=1, verbosity=0,
            prometheus_port=0)  # fmt: skip
    backend = OtelTrainLogger()
    try:
        for step in (1, 2):
            backend.log_metrics({"loss": 1.0}, step, "train", None, True)
            backend.log_metrics({"total_step_time": 0.1}, step, "timing/train", None, True)  # same step
        backend.finish()  # not its session: left running, idle (no stall until a step begins)
        session = current_session()
        assert session is not None and session.last_step() == (2, None)
    finally:
        ot.shutdown()
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2]


def test_reductions_over_workers_and_validation_samples(tmp_path: Path) -> None:
    ot.init(role="controller", output_dir=str(tmp_path), run_name="grpo", log_interval=1, verbosity=0,
            prometheus_port=0)  # fmt: skip
    backend = OtelTrainLogger()
    try:
        reduced = publish_reductions("policy/grad_norm", {0: 1.0, 1: 3.0, 2: float("nan")})
        assert reduced == {"policy/grad_norm/mean": 2.0, "policy/grad_norm/max": 3.0}
        assert publish_reductions("x", ["a", None]) == {}
        backend.log_val_samples([("2+2?", "4"), ("3+3?", "6")], step=1)
        backend.log_metrics({"total_step_time": 0.1}, 1, "timing/train", None, True)
    finally:
        ot.shutdown()
    row = _rows(tmp_path)[0]
    assert row["policy/grad_norm/mean"] == 2.0 and row["policy/grad_norm/max"] == 3.0
    samples = RunFiles(tmp_path / "grpo", 0, "controller").samples.read_text()
    assert "2+2?" in samples and "6" in samples


def _backend(tmp_path: Path) -> NemoLogger:
    logger = NemoLogger()
    logger.loggers.append(
        OtelTrainLogger(
            role="controller",
            output_dir=str(tmp_path),
            run_name="grpo",
            log_interval=1,
            verbosity=0,
            prometheus_port=0,
        )
    )
    return logger


def _goodput(tmp_path: Path) -> dict[str, Any]:
    account: dict[str, Any] = json.loads(RunFiles(tmp_path / "grpo", 0, "controller").goodput.read_text())
    return account


def test_grpo_setup_and_validation_timings_end_no_step(tmp_path: Path) -> None:
    """grpo.py's real order (NVIDIA-NeMo/RL nemo_rl/algorithms/grpo.py at 7ea279a): `timing/setup`
    at step 0 (lines 1668-1670); val_at_start: `validation`, then `timing/validation` at step 0
    (2770-2771); a validation step runs validate() inside its `total_step_time` timer (2832, 3387)
    and logs `timing/validation` then `validation` (3398-3403) BEFORE the step's `train` and
    `timing/train` with step_finished=True (3762-3771)."""
    logger = _backend(tmp_path)
    logger.log_metrics({"total_setup_time_s": 30.0, "policy_init_time_s": 20.0}, 0, prefix="timing/setup")
    logger.log_metrics({"accuracy": 0.1}, 0, prefix="validation")
    logger.log_metrics({"total_validation_time": 0.2}, 0, prefix="timing/validation")
    for total_steps in range(3):
        step = total_steps + 1
        validation = 0.5 if step == 2 else 0.0  # val_period=2
        if validation:
            logger.log_metrics({"total_validation_time": validation}, step, prefix="timing/validation")
            logger.log_metrics({"accuracy": 0.5}, step, prefix="validation")
        logger.log_metrics({"loss": float(step), "global_valid_toks": 1000}, step, prefix="train")
        logger.log_metrics({"samples_per_second": 8.0}, step, prefix="performance")
        timing = {"policy_training": 0.07, "generation": 0.03, "total_step_time": 0.1 + validation}
        logger.log_metrics(timing, step, prefix="timing/train", step_finished=True)
    logger.finish()
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]  # setup and val_at_start are no step 0
    for row in rows:
        assert row["train/loss"] == row["step"]  # each step keeps its own loss, none averaged in
        assert row["throughput/tokens"] == 1000
        assert row["timers/policy_training/total"] == pytest.approx(0.07)
        assert row["timers/generation/total"] == pytest.approx(0.03)
        assert row["timers/step/total"] == pytest.approx(0.1, abs=0.05)  # the validation is not step time
        assert "timers/total_setup_time_s/total" not in row  # setup is startup, not a phase of a step
        assert "timers/total_validation_time/total" not in row
    assert rows[0]["timing/setup/total_setup_time_s"] == 30.0  # recorded, as a metric
    assert rows[0]["timers/validation/total"] == pytest.approx(0.2, abs=0.05)  # val_at_start
    assert rows[1]["timers/validation/total"] == pytest.approx(0.5, abs=0.05)
    assert rows[1]["validation/accuracy"] == 0.5
    account = _goodput(tmp_path)
    assert account["last_step"] == 3
    assert account["badput"]["eval"] == pytest.approx(0.7, abs=0.05)  # both validations, once each
    assert account["productive_s"] == pytest.approx(0.3, abs=0.05)  # three steps of 0.1 s


def test_dpo_per_dataset_validation_timings_book_eval_once(tmp_path: Path) -> None:
    """dpo.py's real order (NVIDIA-NeMo/RL nemo_rl/algorithms/dpo.py at 7ea279a): validate(), called
    inside the step's `total_step_time` timer (593, 616), logs per dataset `validation-<name>` and
    `timing/validation-<name>`, then their sum as `timing/validation` (380-396); then `train` and
    `timing/train`, without step_finished (794-795). SFT logs the same way (sft.py 503-507,
    653-654)."""
    logger = _backend(tmp_path)
    for total_steps in range(2):
        step = total_steps + 1
        if step == 2:
            for name, seconds in (("math", 0.3), ("code", 0.1)):
                logger.log_metrics({"loss": 0.9}, step, prefix=f"validation-{name}")
                per_dataset = {"total_validation_time": seconds}
                logger.log_metrics(per_dataset, step, prefix=f"timing/validation-{name}")
            logger.log_metrics({"total_validation_time": 0.4}, step, prefix="timing/validation")
        logger.log_metrics({"loss": float(step), "global_valid_toks": 64}, step, prefix="train")
        total = 0.2 + (0.4 if step == 2 else 0.0)
        logger.log_metrics({"policy_training": 0.2, "total_step_time": total}, step, prefix="timing/train")
    logger.finish()
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[1]["train/loss"] == 2.0 and rows[1]["throughput/tokens"] == 64
    assert rows[1]["timers/policy_training/total"] == pytest.approx(0.2)
    assert rows[1]["timers/step/total"] == pytest.approx(0.2, abs=0.05)
    assert rows[1]["timing/validation_math/total_validation_time"] == 0.3  # per dataset: a metric only
    assert _goodput(tmp_path)["badput"]["eval"] == pytest.approx(0.4, abs=0.05)  # the sum, once


def test_a_grpo_step_of_hundreds_of_names_keeps_them_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real GRPO step logs train, rollout and timing names and the GPU monitor's per GPU, past
    the 64 names a plain `ot.init()` keeps: the backend raises the cap unless the user set it."""
    logger = _backend(tmp_path)
    train = {f"metric_{k}": float(k) for k in range(150)}
    logger.log_metrics(train, 1, prefix="train")
    logger.log_metrics({"total_step_time": 0.1}, 1, "timing/train", None, True)
    logger.finish()
    [row] = _rows(tmp_path)
    assert all(row[f"train/metric_{k}"] == float(k) for k in range(150))
    assert "otel_train/dropped/invalid_name" not in row

    monkeypatch.setenv("OTEL_TRAIN_MAX_METRIC_NAMES", "100")  # the user's choice stands
    OtelTrainLogger(output_dir=str(tmp_path), run_name="own", prometheus_port=0, verbosity=0).finish()
    assert json.loads(RunFiles(tmp_path / "own").config.read_text())["max_metric_names"] == 100


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_one_element_arrays_are_numbers(kind: str) -> None:
    from otel_train.integrations.nemo_rl import _number

    if kind == "torch":
        import torch

        values = [torch.tensor([2.0]), torch.tensor([[2.0]]), torch.tensor(2.0), torch.tensor([1.0, 2.0])]
    else:
        import numpy as np

        values = [np.array([2.0]), np.array([[2.0]]), np.float64(2.0), np.array([1.0, 2.0])]
    assert [_number(v) for v in values] == [2.0, 2.0, 2.0, None]
