"""The integrations pass the precision their framework trains in to MFU (`compute_dtype`), unless
the user chose one: HF `TrainingArguments(bf16=True)`, Lightning `precision="bf16-mixed"`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from otel_train.integrations._common import with_precision
from otel_train.testing import current_session


@pytest.mark.parametrize(
    ("framework", "expected"),
    [("bf16-mixed", "bf16"), ("16-mixed", "fp16"), ("32-true", "fp32"), ("transformer-engine", "fp8"),
     ("tf32", "tf32"), ("64-true", None), (None, None)],
)  # fmt: skip
def test_framework_precisions_map_onto_compute_dtype(framework: str | None, expected: str | None) -> None:
    assert with_precision({}, framework).get("compute_dtype") == expected


def test_the_users_choice_wins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert with_precision({"compute_dtype": "fp8"}, "bf16-mixed") == {"compute_dtype": "fp8"}
    monkeypatch.setenv("OTEL_TRAIN_COMPUTE_DTYPE", "tf32")
    assert "compute_dtype" not in with_precision({}, "bf16-mixed")
    monkeypatch.delenv("OTEL_TRAIN_COMPUTE_DTYPE")
    monkeypatch.setenv("OTEL_TRAIN_CONFIG", str(tmp_path / "otel.yaml"))
    assert "compute_dtype" not in with_precision({}, "bf16-mixed")


class _Seen:
    """A callback that notes the running session's compute_dtype during training."""

    dtype: Any = None


def test_hf_trainer_in_bf16_reports_bf16(tmp_path: Path) -> None:
    from helpers.integration_models import TokenDataset, tiny_causal_lm
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from otel_train.integrations.transformers import OtelTrainCallback

    seen = _Seen()

    class Note(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            session = current_session()
            seen.dtype = session.config.compute_dtype if session is not None else None

    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=2,
                             report_to="none", use_cpu=True, bf16=True, disable_tqdm=True, save_strategy="no")  # fmt: skip
    callback = OtelTrainCallback(prometheus_port=0, verbosity=0, hardware=False)
    Trainer(
        model=tiny_causal_lm(), args=args, train_dataset=TokenDataset(8), callbacks=[callback, Note()]
    ).train()
    assert seen.dtype == "bf16"


def test_lightning_bf16_mixed_reports_bf16(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    import torch
    from lightning.pytorch import Callback, LightningModule, Trainer

    from otel_train.integrations.lightning import OtelTrainCallback

    seen = _Seen()

    class Tiny(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Note(Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            session = current_session()
            seen.dtype = session.config.compute_dtype if session is not None else None

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
    trainer = Trainer(max_steps=2, precision="bf16-mixed", accelerator="cpu", devices=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(tmp_path),
                      callbacks=[OtelTrainCallback(prometheus_port=0, verbosity=0, hardware=False), Note()])  # fmt: skip
    trainer.fit(Tiny(), data)
    assert seen.dtype == "bf16"
