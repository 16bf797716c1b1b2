"""Framework integrations, one line each (nothing here is imported by `import otel_train`):

- `otel_train.integrations.transformers.OtelTrainCallback`: `Trainer(..., callbacks=[...])`
- `otel_train.integrations.lightning.OtelTrainLogger` / `OtelTrainCallback`: Lightning `Trainer`
- `otel_train.integrations.accelerate.OtelTrainTracker`: `Accelerator(log_with=[...])`
- `otel_train.integrations.megatron.OtelTrainCallback`: Megatron Bridge `pretrain(..., callbacks=[...])`;
  `instrument(timers)` for Megatron-Core's `Timers`
- `otel_train.integrations.trl.instrument(trainer)`: TRL's SFT / GRPO / DPO / ... trainers
"""
