"""TRL's GRPO and SFT trainers with `otel_train.integrations.trl.instrument(trainer)`: real runs on a
tiny config-built GPT-2 and a word-level tokenizer built here (no hub), a few steps on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")

import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from trl.extras.profiling import ProfilingContext

import otel_train as ot
from otel_train.integrations import trl as ot_trl
from otel_train.testing import current_session

WORDS = ["<pad>", "<unk>", "<eos>"] + [f"w{i}" for i in range(61)]
STEPS = 3


def _tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()  # joins the words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>"
    )


def _model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(WORDS), n_positions=32, n_embd=32, n_layer=1, n_head=2,
                        bos_token_id=2, eos_token_id=2, pad_token_id=0)  # fmt: skip
    return GPT2LMHeadModel(config)


def reward_len(completions: list[str], **kwargs: Any) -> list[float]:
    return [float(len(c.split())) for c in completions]


def _common(tmp_path: Path) -> dict[str, Any]:
    return dict(output_dir=str(tmp_path / "out"), max_steps=STEPS, logging_steps=1, report_to="none",
                use_cpu=True, save_strategy="no", disable_tqdm=True)  # fmt: skip


def _settings(tmp_path: Path, name: str) -> dict[str, Any]:
    return dict(run_name=name, output_dir=str(tmp_path / "runs"), prometheus_port=0, verbosity=0,
                hardware=False, log_interval=1)  # fmt: skip


def _rows(tmp_path: Path, name: str) -> list[dict[str, Any]]:
    text = (tmp_path / "runs" / name / "metrics.rank0.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def test_grpo_phases_rewards_and_completions(tmp_path: Path) -> None:
    data = Dataset.from_dict({"prompt": [f"w{i} w{i + 1} w{i + 2}" for i in range(16)]})
    args = GRPOConfig(**_common(tmp_path), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, log_completions=True)  # fmt: skip
    trainer = GRPOTrainer(model=_model(), reward_funcs=reward_len, args=args, train_dataset=data,
                          processing_class=_tokenizer())  # fmt: skip
    original = ProfilingContext.__enter__
    assert ot_trl.instrument(trainer, **_settings(tmp_path, "grpo")) is trainer
    trainer.train()
    assert current_session() is not None  # the HF callback's run idles after train(), until exit
    ot.shutdown()
    assert ProfilingContext.__enter__ is original  # the patch is undone at train end

    rows = _rows(tmp_path, "grpo")
    keys = set().union(*rows)
    assert sum(r.get("train/steps") or 0 for r in rows) == STEPS
    # TRL's own profiled blocks, as otel_train phases (one generation per step here)
    for phase in ("generation", "rewards", "reward.reward_len", "loss", "logprobs", "prepare_inputs"):
        assert f"timers/{phase}/mean" in keys, phase
    assert sum(r.get("timers/generation/count") or 0 for r in rows) == STEPS
    assert sum(r.get("timers/rewards/count") or 0 for r in rows) == STEPS
    # rewards as metrics (the Trainer's logs through the HF callback): 6-word completions at most
    rewards = [r["rewards/reward_len/mean"] for r in rows if "rewards/reward_len/mean" in r]
    assert rewards and all(0 <= v <= 6 for v in rewards) and {"train/reward", "train/reward_std"} <= keys
    # each log filed at the step it follows (global_step - 1), not at the next flush's
    assert [r["step"] for r in rows if "train/reward" in r] == list(range(STEPS))
    # tokens: GRPO's own count of prompt and completion tokens (its batches hold text, no input_ids)
    assert trainer.state.num_input_tokens_seen > 0
    assert sum(r.get("throughput/tokens") or 0 for r in rows) == trainer.state.num_input_tokens_seen
    # GRPO's completions table through ot.log_samples
    samples = [
        json.loads(line) for line in (tmp_path / "runs" / "grpo" / "samples.jsonl").read_text().splitlines()
    ]
    completions = [s for s in samples if s["key"] == "completions"]
    assert {s["step"] for s in completions} == set(range(STEPS))  # once per training log, at its step
    assert all(s["prompt"].startswith("w") and len(s["output"].split()) <= 6 for s in completions)


def test_grpo_completions_are_sent_once_per_generation(tmp_path: Path) -> None:
    """`steps_per_generation=2`: GRPO generates at steps 0 and 2 only and keeps the batch in
    `_logs` until the next generation; each batch is one set of samples, at the step that
    generated it, not again at the step after."""
    data = Dataset.from_dict({"prompt": [f"w{i} w{i + 1} w{i + 2}" for i in range(16)]})
    args = GRPOConfig(**{**_common(tmp_path), "max_steps": 4}, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=6, log_completions=True,
                      steps_per_generation=2)  # fmt: skip
    trainer = GRPOTrainer(model=_model(), reward_funcs=reward_len, args=args, train_dataset=data,
                          processing_class=_tokenizer())  # fmt: skip
    ot_trl.instrument(trainer, **_settings(tmp_path, "grpo2"))
    trainer.train()
    ot.shutdown()
    rows = _rows(tmp_path, "grpo2")
    generated = sorted(r["step"] for r in rows if r.get("timers/generation/count"))
    assert generated == [0, 2]
    text = (tmp_path / "runs" / "grpo2" / "samples.jsonl").read_text()
    completions = [s for s in map(json.loads, text.splitlines()) if s["key"] == "completions"]
    assert sorted({s["step"] for s in completions}) == generated
    assert len(completions) == 2 * 4  # two batches of 4 (prompt, completion) rows


def test_train_raising_restores_profiling_and_ends_the_run(tmp_path: Path) -> None:
    """A reward function raises in the second step: TRL's ProfilingContext is restored and the
    session the HF callback started is shut down before the exception reaches the caller, as at a
    normal end (no on_train_end comes)."""
    calls = [0]

    def reward_server(completions: list[str], **kwargs: Any) -> list[float]:
        calls[0] += 1
        if calls[0] == 2:
            raise ConnectionError("reward server down")
        return reward_len(completions)

    data = Dataset.from_dict({"prompt": [f"w{i} w{i + 1} w{i + 2}" for i in range(16)]})
    args = GRPOConfig(**_common(tmp_path), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6)  # fmt: skip
    trainer = GRPOTrainer(model=_model(), reward_funcs=reward_server, args=args, train_dataset=data,
                          processing_class=_tokenizer())  # fmt: skip
    original = (ProfilingContext.__enter__, ProfilingContext.__exit__)
    ot_trl.instrument(trainer, **_settings(tmp_path, "raises"))
    with pytest.raises(ConnectionError, match="reward server down"):
        trainer.train()
    assert (ProfilingContext.__enter__, ProfilingContext.__exit__) == original
    assert current_session() is None
    rows = _rows(tmp_path, "raises")
    assert sum(r.get("train/steps") or 0 for r in rows) == 1  # the failed second step is not counted


def test_sft_steps_and_metrics(tmp_path: Path) -> None:
    data = Dataset.from_dict({"text": [" ".join(f"w{(i + j) % 61}" for j in range(10)) for i in range(16)]})
    args = SFTConfig(**_common(tmp_path), per_device_train_batch_size=4, max_length=16)
    trainer = SFTTrainer(model=_model(), args=args, train_dataset=data, processing_class=_tokenizer())
    ot_trl.instrument(trainer, **_settings(tmp_path, "sft"))
    trainer.train()
    ot.shutdown()
    rows = _rows(tmp_path, "sft")
    keys = set().union(*rows)
    assert sum(r.get("train/steps") or 0 for r in rows) == STEPS
    assert {
        "train/loss",
        "timers/forward_backward/mean",
        "train/mean_token_accuracy",
        "train/entropy",
    } <= keys


def test_dpo_counts_a_preference_pair_as_one_sample(tmp_path: Path) -> None:
    """DPO batches each pair as two rows (the chosen, then the rejected): counted by rows, samples
    and samples/s were twice the pairs trained on."""
    from trl import DPOConfig, DPOTrainer

    pairs = Dataset.from_dict({
        "prompt": [f"w{i} w{i + 1}" for i in range(8)],
        "chosen": [f"w{i + 2} w{i + 3}" for i in range(8)],
        "rejected": [f"w{i + 9} w{i + 7}" for i in range(8)],
    })  # fmt: skip
    args = DPOConfig(**_common(tmp_path), per_device_train_batch_size=2, max_length=16)
    trainer = DPOTrainer(
        model=_model(), ref_model=_model(), args=args, train_dataset=pairs, processing_class=_tokenizer()
    )
    ot_trl.instrument(trainer, **_settings(tmp_path, "dpo"))
    trainer.train()
    ot.shutdown()
    rows = _rows(tmp_path, "dpo")
    assert sum(r.get("train/steps") or 0 for r in rows) == STEPS
    assert sum(r.get("throughput/samples") or 0 for r in rows) == STEPS * 2  # pairs, not rows


def test_instrument_takes_the_trainers_own_reporter_off_for_a_bridged_backend(tmp_path: Path) -> None:
    """report_to="tensorboard" and instrument(trainer, tensorboard=True): one TensorBoard run (the
    bridge's), as with Trainer(callbacks=[OtelTrainCallback(tensorboard=True)]), not two."""
    from transformers.integrations import TensorBoardCallback

    data = Dataset.from_dict({"text": [" ".join(f"w{(i + j) % 61}" for j in range(10)) for i in range(16)]})
    args = SFTConfig(**{**_common(tmp_path), "report_to": "tensorboard"}, per_device_train_batch_size=4,
                     max_length=16)  # fmt: skip
    trainer = SFTTrainer(model=_model(), args=args, train_dataset=data, processing_class=_tokenizer())
    assert any(isinstance(c, TensorBoardCallback) for c in trainer.callback_handler.callbacks)
    ot_trl.instrument(trainer, tensorboard=True, **_settings(tmp_path, "sft-tb"))
    assert not any(isinstance(c, TensorBoardCallback) for c in trainer.callback_handler.callbacks)
    trainer.train()
    ot.shutdown()
    assert list((tmp_path / "runs" / "sft-tb").rglob("events.out.tfevents.*")), "the bridge's run"
    assert not list((tmp_path / "out").rglob("events.out.tfevents.*")), "the Trainer's own run too"


def test_profiling_patch_is_explicit_and_reversible() -> None:
    enter, exit_ = ProfilingContext.__enter__, ProfilingContext.__exit__
    ot_trl.enable_profiling(["my_reward"])
    ot_trl.enable_profiling()  # idempotent: patched once
    assert ProfilingContext.__enter__ is not enter
    assert ot_trl.phase_name("GRPOTrainer.transformers.generate") == "generation"
    assert ot_trl.phase_name("RLOOTrainer._calculate_rewards") == "rewards"
    assert ot_trl.phase_name("GRPOTrainer.sync_weights") == "sync_weights"
    ot_trl.disable_profiling()
    ot_trl.disable_profiling()
    assert (ProfilingContext.__enter__, ProfilingContext.__exit__) == (enter, exit_)


def test_each_profiled_block_tells_the_stall_watchdog_the_step_goes_on(tmp_path: Path) -> None:
    """A GRPO step is generation, rewards, log-probs and loss blocks: each one's end is progress,
    so a step of many blocks longer than stall_timeout_s is no stall."""
    ot.init(**_settings(tmp_path, "blocks"), stall_timeout_s=1.0)
    session = current_session()
    ot_trl.enable_profiling()
    try:
        with ot.step(0):
            before = session.progress_ns
            with ProfilingContext("GRPOTrainer._calculate_rewards", report_to=[]):
                pass
            assert session.progress_ns > before
    finally:
        ot_trl.disable_profiling()
        ot.shutdown()


def test_nothing_imported_unless_asked() -> None:
    code = "import sys, otel_train; print(any(m == 'trl' or m.startswith('trl.') for m in sys.modules))"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
