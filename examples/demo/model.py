"""A small decoder-only character-level transformer (pre-LN, causal self-attention).

Plain PyTorch, no otel_train imports: the model is what a user brings. The training loop in
`train.py` is where the instrumentation lives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    context: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    dropout: float = 0.0
    tie_weights: bool = True

    def __post_init__(self) -> None:
        if self.d_model % self.n_head != 0:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if self.vocab_size < 1 or self.context < 1 or self.n_layer < 1:
            raise ValueError("vocab_size, context and n_layer must be >= 1")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim)
        q = q.view(batch, time, self.n_head, -1).transpose(1, 2)
        k = k.view(batch, time, self.n_head, -1).transpose(1, 2)
        v = v.view(batch, time, self.n_head, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(batch, time, channels)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharTransformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.context, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer).
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx: (B, T) token ids, T <= context. Returns logits (B, T, vocab) and the mean CE loss."""
        _, time = idx.shape
        if time > self.cfg.context:
            raise ValueError(f"sequence length {time} exceeds the model context {self.cfg.context}")
        pos = torch.arange(time, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; `non_embedding` excludes the token and position embeddings and,
        when untied, the output head (the vocabulary matrices, as in Kaplan et al. 2020)."""
        params = {id(p): p for p in self.parameters()}  # dedupe the tied head
        if non_embedding:
            for p in (self.tok_emb.weight, self.pos_emb.weight, self.head.weight):
                params.pop(id(p), None)
        return sum(p.numel() for p in params.values())

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Autoregressive temperature sampling; idx (B, T) is extended by max_new_tokens."""
        for _ in range(max_new_tokens):
            window = idx[:, -self.cfg.context :]
            logits, _ = self(window)
            logits = logits[:, -1, :] / max(temperature, 1e-6)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1, None]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            # Sample on the CPU generator so results are deterministic on every device.
            nxt = torch.multinomial(probs.float().cpu(), num_samples=1, generator=generator)
            idx = torch.cat([idx, nxt.to(idx.device)], dim=1)
        return idx


def flops_per_token(cfg: ModelConfig, non_embedding_params: int | None = None) -> float:
    """Training FLOPs per token ≈ 6·N + 12·L·T·d (Kaplan et al. 2020, forward + backward).

    N is the non-embedding parameter count; the second term is attention over the context
    (QK^T and AV: 2·2·L·T·d forward, times 3 for forward + backward). When `non_embedding_params`
    is not given it is computed analytically for this architecture: per layer 12·d² + 13·d
    (qkv, proj, fc, proj weights and biases, two LayerNorms), plus the final LayerNorm 2·d.
    """
    d, n_layer = cfg.d_model, cfg.n_layer
    if non_embedding_params is None:
        non_embedding_params = n_layer * (12 * d * d + 13 * d) + 2 * d
    return float(6 * non_embedding_params + 12 * n_layer * cfg.context * d)
