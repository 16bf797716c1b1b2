"""otel_train.integrations.deepspeed's steps against real DeepSpeed 0.19.8 (one gloo rank, CPU
accelerator): what lies between two steps (an evaluation, a save) is not the next step's time, a
resumed engine goes on with its own step count, a PipelineEngine's `train_batch` is a step, and a
loop that marks its own steps keeps them.
Each job runs in a process of its own (`helpers.multirank`); see test_deepspeed.py for the set-up."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.multirank import run_ranks

pytest.importorskip("deepspeed")

import otel_train as ot
from integrations.test_deepspeed import RANK_ENV, TIMEOUT

MICRO, GAS = 2, 2
PAUSE_S = 0.5  # each eval batch, and the save's slowed file write
STALL_TIMEOUT_S = 1.0  # a gap between steps longer than this, with eval batches in it, is eval time


def _config(**extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "zero_optimization": {"stage": 1},
        "zero_force_ds_cpu_optimizer": False,
        **extra,
    }


def _model() -> Any:
    import torch

    class SlowEval(torch.nn.Module):
        """Lasts PAUSE_S longer in eval mode: an evaluation batch that takes a while."""

        def forward(self, x: Any) -> Any:
            if not self.training:
                time.sleep(PAUSE_S)
            return x

    torch.manual_seed(0)
    return torch.nn.Sequential(SlowEval(), torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _train(engine: Any, steps: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(1)
    for _ in range(steps * GAS):
        engine.backward(engine(torch.randn(MICRO, 16, generator=gen)).pow(2).mean())
        engine.step()


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.rank0.jsonl").read_text().splitlines()]


def between_steps_job(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """2 steps, an evaluation of 3 slow batches, 2 steps, a save slowed by PAUSE_S, 2 steps."""
    import deepspeed
    import torch

    from otel_train.integrations.deepspeed import instrument

    deepspeed.init_distributed(dist_backend="gloo")
    ot.init(output_dir=out_dir, run_name="between", verbosity=0, log_interval=2, hardware=False,
            prometheus_port=0, stall_timeout_s=STALL_TIMEOUT_S)  # fmt: skip
    model = _model()
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config=_config()
    )
    instrument(engine)
    _train(engine, 2)
    engine.eval()
    with torch.no_grad():
        for _ in range(3):
            engine(torch.randn(MICRO, 16))
    engine.train()
    _train(engine, 2)
    write = engine.checkpoint_engine.save

    def slow_write(*args: Any, **kwargs: Any) -> Any:
        time.sleep(PAUSE_S)
        return write(*args, **kwargs)

    engine.checkpoint_engine.save = slow_write
    engine.save_checkpoint(str(Path(out_dir) / "ckpt"))
    engine.checkpoint_engine.save = write
    _train(engine, 2)
    ot.shutdown()
    return json.loads((Path(out_dir) / "between" / "goodput.rank0.json").read_text())


def test_an_evaluation_or_a_save_between_steps_is_not_the_next_steps_time(tmp_path: Path) -> None:
    """The step after an evaluation (or a save) begins where it ended, not where the step before
    it did: the evaluation (a gap longer than stall_timeout_s with eval batches in it) is eval
    badput, the save checkpoint badput once (not also productive), and productive time plus every
    cause adds up to the wall time."""
    [account] = run_ranks(1, between_steps_job, (str(tmp_path),), timeout=TIMEOUT, env=RANK_ENV)
    badput = account["badput"]
    assert badput["eval"] >= 3 * PAUSE_S, badput  # the three slow eval batches at least
    assert badput["checkpoint_save"] >= PAUSE_S, badput
    assert account["productive_s"] < PAUSE_S, account  # 6 steps of a tiny model, no pause inside
    assert account["productive_s"] + sum(badput.values()) == pytest.approx(account["wall_s"], abs=1e-3)


def resumed_job(rank: int, world: int, out_dir: str, phase: str) -> list[int]:
    """`first`: 3 steps and a save. `resume`: the same run id, a new engine loading that save
    (its global_steps is 3), 3 more steps. Returns the steps the run directory's rows name."""
    import deepspeed
    import torch

    from otel_train.integrations.deepspeed import instrument

    deepspeed.init_distributed(dist_backend="gloo")
    ot.init(output_dir=out_dir, run_name="resumed", run_id="job-7", verbosity=0, log_interval=1,
            hardware=False, prometheus_port=0)  # fmt: skip
    model = _model()
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config=_config()
    )
    instrument(engine)
    if phase == "resume":
        engine.load_checkpoint(str(Path(out_dir) / "ckpt"))
    _train(engine, 3)
    if phase == "first":
        engine.save_checkpoint(str(Path(out_dir) / "ckpt"))
    ot.shutdown()
    return [row["step"] for row in _rows(Path(out_dir) / "resumed") if "train/steps" in row]


def test_a_resumed_engine_goes_on_with_its_own_step_count(tmp_path: Path) -> None:
    """Steps are numbered as DeepSpeed counts them (`global_steps`): the process that loads the
    checkpoint of step 3 runs steps 3-5, appended after the first process's 0-2 (not 0-2 again)."""
    run_ranks(1, resumed_job, (str(tmp_path), "first"), timeout=TIMEOUT, env=RANK_ENV)
    [steps] = run_ranks(1, resumed_job, (str(tmp_path), "resume"), timeout=TIMEOUT, env=RANK_ENV)
    assert steps == [0, 1, 2, 3, 4, 5]


def pipeline_job(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """A one-stage PipelineModule trained with `engine.train_batch()` 4 times."""
    import deepspeed
    import torch
    from deepspeed.pipe import PipelineModule

    from otel_train.integrations.deepspeed import instrument

    deepspeed.init_distributed(dist_backend="gloo")
    ot.init(
        output_dir=out_dir, run_name="pipe", verbosity=0, log_interval=1, hardware=False, prometheus_port=0
    )
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)]
    net = PipelineModule(layers=layers, num_stages=1, loss_fn=torch.nn.MSELoss())
    config = _config(optimizer={"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}})
    del config["zero_optimization"]
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    instrument(engine)
    gen = torch.Generator().manual_seed(1)

    def batches() -> Any:
        while True:
            yield torch.randn(MICRO, 16, generator=gen), torch.randn(MICRO, 4, generator=gen)

    data = batches()
    losses = [float(engine.train_batch(data_iter=data)) for _ in range(4)]
    ot.shutdown()
    return {"losses": losses, "rows": _rows(Path(out_dir) / "pipe")}


def test_a_pipeline_engines_train_batch_is_one_step(tmp_path: Path) -> None:
    """PipelineEngine.train_batch runs forward, backward and the optimizer step inside itself,
    past the engine's wrapped methods: each call is one step, with its loss and samples."""
    [result] = run_ranks(1, pipeline_job, (str(tmp_path),), timeout=TIMEOUT, env=RANK_ENV)
    rows = [row for row in result["rows"] if "train/steps" in row]
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    assert [row["train/loss"] for row in rows] == pytest.approx(result["losses"], rel=1e-6)
    assert sum(row["throughput/samples"] for row in rows) == 4 * MICRO * GAS


def loop_steps_job(rank: int, world: int, out_dir: str) -> list[dict[str, Any]]:
    """A loop that marks its own steps (`ot.step` around each optimizer step of GAS micro-batches),
    then instruments its engine: 3 steps."""
    import deepspeed
    import torch

    from otel_train.integrations.deepspeed import instrument

    deepspeed.init_distributed(dist_backend="gloo")
    ot.init(output_dir=out_dir, run_name="loop", verbosity=0, log_interval=1, hardware=False,
            prometheus_port=0)  # fmt: skip
    model = _model()
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config=_config()
    )
    instrument(engine)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        with ot.step(step, samples=MICRO * GAS):
            for _ in range(GAS):
                engine.backward(engine(torch.randn(MICRO, 16, generator=gen)).pow(2).mean())
                engine.step()
    ot.shutdown()
    return _rows(Path(out_dir) / "loop")


def test_a_loop_that_marks_its_own_steps_keeps_them_under_the_engines_phases(tmp_path: Path) -> None:
    """The engine's adapter sees the loop's open step at its first forward and leaves the steps to
    it (docs/design/integrations.md#deepspeed): each counted once, no step nested in another, and
    the adapter's phases and values inside them."""
    [rows] = run_ranks(1, loop_steps_job, (str(tmp_path),), timeout=TIMEOUT, env=RANK_ENV)
    stepped = [row for row in rows if "train/steps" in row]
    assert [row["step"] for row in stepped] == [0, 1, 2]
    assert sum(row["train/steps"] for row in stepped) == 3
    assert not any(row.get("otel_train/dropped/nested_step") for row in rows), rows
    assert sum(row["timers/forward/count"] for row in stepped) == 3 * GAS
    assert sum(row["timers/backward/count"] for row in stepped) == 3 * GAS
    assert sum(row["timers/optimizer/count"] for row in stepped) == 3  # at the boundary only
    assert sum(row["throughput/samples"] for row in stepped) == 3 * MICRO * GAS
    assert all("train/loss" in row and "train/grad_norm" in row for row in stepped), stepped


def batch_counts_job(rank: int, world: int, out_dir: str) -> list[dict[str, Any]]:
    """A token model called with a batch dict (`engine(batch)`), 2 steps of GAS micro-batches, the
    last micro-batch one row short (a loader's last batch)."""
    import deepspeed
    import torch

    from otel_train.integrations.deepspeed import instrument

    class TokenModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(50, 16), torch.nn.Linear(16, 4)

        def forward(self, batch: dict[str, Any]) -> Any:
            return self.head(self.embed(batch["input_ids"])).pow(2).mean()

    deepspeed.init_distributed(dist_backend="gloo")
    ot.init(output_dir=out_dir, run_name="counts", verbosity=0, log_interval=1, hardware=False,
            prometheus_port=0)  # fmt: skip
    torch.manual_seed(0)
    model = TokenModel()
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config=_config()
    )
    instrument(engine)
    for rows in (MICRO, MICRO, MICRO, MICRO - 1):
        ids = torch.randint(0, 50, (rows, 5))
        engine.backward(engine({"input_ids": ids, "attention_mask": torch.ones_like(ids)}))
        engine.step()
    ot.shutdown()
    return _rows(Path(out_dir) / "counts")


def test_samples_and_tokens_are_counted_from_the_batches_that_ran(tmp_path: Path) -> None:
    """Samples per step are the micro-batches' rows, not micro batch x accumulation from the
    config (a short last batch), and tokens are found in a batch dict's `input_ids`."""
    [rows] = run_ranks(1, batch_counts_job, (str(tmp_path),), timeout=TIMEOUT, env=RANK_ENV)
    steps = [row for row in rows if "train/steps" in row]
    assert [row["throughput/samples"] for row in steps] == [MICRO * GAS, MICRO * GAS - 1]
    assert [row["throughput/tokens"] for row in steps] == [5 * MICRO * GAS, 5 * (MICRO * GAS - 1)]


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        ("positional ids", (12, 3)),
        ("input_ids keyword", (12, 3)),
        ("batch dict", (12, 3)),
        ("other keywords", (12, 3)),
        ("image and labels", (0, 3)),
        ("no tensor", (0, 0)),
    ],
)
def test_a_forwards_tokens_and_rows_come_from_its_inputs_shapes(call: str, expected: tuple[int, int]) -> None:
    import torch

    from otel_train.integrations.deepspeed import _batch_counts

    ids, mask = torch.zeros(3, 4, dtype=torch.long), torch.ones(3, 4, dtype=torch.long)
    pixels, labels = torch.zeros(3, 3, 8, 8), torch.zeros(3, dtype=torch.long)
    args, kwargs = {
        "positional ids": ((ids,), {}),
        "input_ids keyword": ((), {"input_ids": ids, "attention_mask": mask}),
        "batch dict": (({"attention_mask": mask, "input_ids": ids},), {}),
        "other keywords": ((), {"a": ids, "b": mask}),
        "image and labels": ((pixels, labels), {}),  # a classifier's integer labels are no tokens
        "no tensor": (("text",), {}),
    }[call]
    assert _batch_counts(args, kwargs) == expected
