"""Framework integrations (nothing here is imported by `import otel_train`): `transformers`,
`lightning`, `accelerate`, `megatron`, `deepspeed`, `trl`, `oumi`, `ray`, `nemo_rl`.

Each module's docstring names its entry point; docs/design/integrations.md says how each works.
"""
