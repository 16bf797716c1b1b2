"""Tiny models and data sets for the framework-integration tests, built from a config (no hub)."""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 64
SEQ = 16


class TokenDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Deterministic synthetic causal-LM rows: `input_ids` and `labels` of length SEQ."""

    def __init__(self, rows: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (rows, SEQ), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def tiny_causal_lm() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=32,
        n_layer=1,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)
