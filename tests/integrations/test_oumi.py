"""Oumi 0.9 (`make test` installs it with --no-deps beside torch 2.13): real `oumi.train` runs with
`otel_train.integrations.oumi.train`, for the TRL_SFT trainer (a Hugging Face Trainer) and Oumi's own
OUMI trainer (which calls HF callbacks with `state=None` and never `on_train_begin`).

Everything is local (HF_HUB_OFFLINE=1): a tiny GPT-2 built from a config and a word-level tokenizer
trained on the spot, saved to a temporary directory; the data are token rows in a JSONL file, read
by a dataset registered through Oumi's own registry (Oumi 0.9's chat-template SFT datasets pass a
`Conversation` object that transformers 5.23's `apply_chat_template` no longer accepts).
"""

from __future__ import annotations

import importlib
import json
import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("oumi")

from helpers.events import SlowStretches

from otel_train.testing import current_session

ROWS = 64
SEQ = 16
STEPS = 6
DATASET = "otel_train_test_tokens"


def _register_dataset() -> None:
    import pandas as pd
    import torch

    importlib.import_module("oumi.train")  # first: importing oumi.core.registry alone is circular
    from oumi.core.datasets import BaseMapDataset
    from oumi.core.registry import REGISTRY, register_dataset

    if REGISTRY.get_dataset(DATASET) is not None:
        return

    @register_dataset(DATASET)
    class TokenRows(BaseMapDataset):  # type: ignore[misc]
        default_dataset = DATASET

        def __init__(self, tokenizer: Any = None, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self._data = self._load_data()

        def _load_data(self) -> pd.DataFrame:
            lines = Path(str(self.dataset_path)).read_text().splitlines()
            return pd.DataFrame({"ids": [json.loads(line) for line in lines]})

        def transform(self, sample: Any) -> dict[str, Any]:
            ids = torch.tensor(sample["ids"])
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


@pytest.fixture(scope="module")
def local_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(model dir with a tokenizer, JSONL of token rows): nothing from a hub."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("oumi-local")
    words = [f"w{i}" for i in range(60)]
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(
        [" ".join(words)], trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "<eos>"])
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>", bos_token="<eos>"
    )
    model_dir = root / "model"
    fast.save_pretrained(model_dir)
    config = GPT2Config(
        vocab_size=len(fast), n_positions=SEQ, n_embd=32, n_layer=1, n_head=2,
        bos_token_id=fast.eos_token_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
    )  # fmt: skip
    GPT2LMHeadModel(config).save_pretrained(model_dir)
    rng = random.Random(0)
    data = root / "tokens.jsonl"
    data.write_text(
        "".join(json.dumps([rng.randrange(3, len(fast)) for _ in range(SEQ)]) + "\n" for _ in range(ROWS))
    )
    return model_dir, data


def _config(kind: str, model_dir: Path, data: Path, out: Path) -> Any:
    from oumi.core.configs import (
        DataParams,
        DatasetParams,
        DatasetSplitParams,
        ModelParams,
        TrainingConfig,
        TrainingParams,
    )
    from oumi.core.configs.params.training_params import TrainerType

    return TrainingConfig(
        model=ModelParams(model_name=str(model_dir), model_max_length=SEQ, torch_dtype_str="float32"),
        data=DataParams(
            train=DatasetSplitParams(
                datasets=[DatasetParams(dataset_name=DATASET, dataset_path=str(data))],
                collator_name="text_with_padding",
            )
        ),
        training=TrainingParams(
            trainer_type=TrainerType.OUMI if kind == "oumi" else TrainerType.TRL_SFT,
            output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=2, logging_steps=1,
            save_steps=0, save_final_model=False, enable_wandb=False, enable_tensorboard=False,
            enable_mlflow=False, include_performance_metrics=False,
        ),
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["trl_sft", "oumi"])
def test_oumi_train_with_the_callback(
    kind: str, local_model: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from otel_train.integrations.oumi import train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _register_dataset()
    oumi_train = importlib.import_module("oumi.train")
    original = oumi_train.build_training_callbacks
    out = tmp_path / "oumi-out"

    train(
        _config(kind, *local_model, out),
        run_name=kind,
        verbosity=0,
        hardware=False,
        prometheus_port=0,
        log_interval=2,
    )

    assert oumi_train.build_training_callbacks is original  # Oumi is left as it was
    assert current_session() is None  # the callback's session ended with the training
    run_dir = tmp_path / "runs" / kind
    rows = [json.loads(line) for line in (run_dir / "metrics.rank0.jsonl").read_text().splitlines()]
    assert sum(r.get("train/steps", 0) for r in rows) == STEPS
    assert sum(r.get("timers/step/count", 0) for r in rows) == STEPS
    # The loss is Oumi's own logged loss (Oumi writes it to its metrics file too).
    logged = [json.loads(line) for line in (out / "metrics_rank0000.jsonl").read_text().splitlines()]
    oumi_losses = [m.get("loss", m.get("train/loss")) for m in logged if {"loss", "train/loss"} & set(m)]
    # Each of Oumi's logs is filed at the step it follows, in a row of its own (as the HF
    # Trainer's are): the same values, in the same order.
    losses = [r["train/loss"] for r in rows if r.get("train/loss") is not None]
    assert oumi_losses and losses == pytest.approx(oumi_losses, rel=1e-6)
    assert json.loads((run_dir / "config.json").read_text())["total_steps"] == STEPS
    if kind == "trl_sft":  # the HF Trainer's phases; OumiTrainer fetches the batch inside its step
        assert sum(r.get("timers/forward_backward/count", 0) for r in rows) == STEPS
    else:
        assert not any("timers/data/count" in r for r in rows)


def test_oumi_train_raising_restores_oumi_and_ends_the_session(
    local_model: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from otel_train.integrations.oumi import instrument

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _register_dataset()
    oumi_train = importlib.import_module("oumi.train")
    original = oumi_train.build_training_callbacks
    config = _config("oumi", *local_model, tmp_path / "oumi-out")
    config.training.max_steps = 1000
    with (
        pytest.raises(RuntimeError, match="stop here"),
        instrument(run_name="stopped", verbosity=0, hardware=False) as callback,
    ):
        assert oumi_train.build_training_callbacks is not original
        real_step_end = callback.on_step_end

        def interrupted(*args: Any, **kwargs: Any) -> None:
            real_step_end(*args, **kwargs)
            if callback._steps == 3:
                raise RuntimeError("stop here")  # after the third step

        callback.on_step_end = interrupted  # type: ignore[method-assign]
        oumi_train.train(config)
    assert oumi_train.build_training_callbacks is original
    assert current_session() is None
    rows = [
        json.loads(x)
        for x in (tmp_path / "runs" / "stopped" / "metrics.rank0.jsonl").read_text().splitlines()
    ]
    assert sum(r.get("train/steps", 0) for r in rows) == 3


def test_oumis_own_trainer_evaluates_and_saves_in_spans_and_a_long_evaluation_is_no_stall(
    local_model: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Oumi's own trainer calls no callback while it evaluates or saves. Evaluations of 8 batches
    of 0.25 s (a slow eval forward) after steps 3 and 6 under stall_timeout_s=0.75: each an `eval`
    span whose batches are heartbeats (no stall), and each `save_state` a `checkpoint` span."""
    from oumi.core.configs import DatasetParams, DatasetSplitParams
    from transformers import GPT2LMHeadModel

    from otel_train.integrations.oumi import train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _register_dataset()
    slow = SlowStretches()
    forward = GPT2LMHeadModel.forward

    def slow_in_eval(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.training:
            slow.sleep(0.25)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(GPT2LMHeadModel, "forward", slow_in_eval)
    model_dir, data = local_model
    config = _config("oumi", model_dir, data, tmp_path / "oumi-out")
    config.data.validation = DatasetSplitParams(
        datasets=[DatasetParams(dataset_name=DATASET, dataset_path=str(data))],
        collator_name="text_with_padding",
    )
    config.training.eval_strategy, config.training.eval_steps = "steps", 3
    config.training.save_steps = 3
    native = importlib.import_module("oumi.core.trainers.oumi_trainer").Trainer
    originals = (native.evaluate, native.save_state)

    train(config, run_name="evals", verbosity=0, hardware=False, prometheus_port=0, stall_timeout_s=0.75)

    assert (native.evaluate, native.save_state) == originals  # Oumi is left as it was
    run_dir = tmp_path / "runs" / "evals"
    rows = [json.loads(line) for line in (run_dir / "metrics.rank0.jsonl").read_text().splitlines()]
    assert sum(r.get("train/steps", 0) for r in rows) == STEPS
    assert sum(r.get("timers/eval/count", 0) for r in rows) == 2
    assert sum(r.get("timers/checkpoint/count", 0) for r in rows) == 2
    assert len(slow.spans) == 2 * ROWS // 8  # two evaluations of 8 batches
    assert slow.stalls_inside(run_dir) == []
