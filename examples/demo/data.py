"""Offline character-level corpus: the Python standard library's own source, or any text file.

Everything is deterministic: files are read in sorted order, the split is contiguous, and
batches come from an explicit `torch.Generator`.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_MAX_CHARS = 2_000_000
# Directories under the stdlib that are not representative library source (or not stdlib at all).
_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3", "turtledemo"}
)


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The `*.py` files of the standard library, sorted by relative path (deterministic)."""
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in base.rglob("*.py")
        if p.is_file() and not any(part in _SKIP_DIRS for part in p.relative_to(base).parts[:-1])
    ]
    return sorted(files, key=lambda p: p.relative_to(base).as_posix())


def read_corpus(paths: Iterable[Path], max_chars: int = DEFAULT_MAX_CHARS) -> str:
    """Concatenate files (UTF-8, undecodable ones skipped) until `max_chars` is reached."""
    parts: list[str] = []
    total = 0
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        # Keep the corpus ASCII-heavy: drop the rare non-ASCII characters so the vocab stays small.
        text = text.encode("ascii", errors="ignore").decode("ascii")
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(parts)[:max_chars]


class CorpusError(ValueError):
    """The demo's text cannot train it (no corpus, or too short for the context)."""


def load_text(data: str | Path | None = None, max_chars: int = DEFAULT_MAX_CHARS) -> str:
    """`data` is a text file; None means the stdlib corpus (capped at `max_chars`)."""
    if data is None:
        text = read_corpus(stdlib_files(), max_chars)
        if not text:
            raise CorpusError("found no Python standard-library sources; pass --data FILE")
        return text
    text = Path(data).read_text(encoding="utf-8", errors="replace")
    if max_chars > 0:
        text = text[:max_chars]
    if len(text) < 2:
        raise CorpusError(f"{data} holds fewer than 2 characters of text")
    return text


@dataclass(frozen=True)
class CharVocab:
    chars: tuple[str, ...]

    @classmethod
    def from_text(cls, text: str) -> CharVocab:
        return cls(tuple(sorted(set(text))))

    @property
    def size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        stoi = {c: i for i, c in enumerate(self.chars)}
        return torch.tensor([stoi[c] for c in text], dtype=torch.long)

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def can_encode(self, text: str) -> bool:
        known = set(self.chars)
        return all(c in known for c in text)


def split(data: torch.Tensor, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous split: the first (1 - val_fraction) is train, the rest validation."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n_train = int(len(data) * (1.0 - val_fraction))
    return data[:n_train], data[n_train:]


def get_batch(
    data: torch.Tensor,
    batch_size: int,
    context: int,
    generator: torch.Generator,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: x = data[i : i + context], y = data[i + 1 : i + 1 + context]."""
    if len(data) <= context:
        raise ValueError(f"split of {len(data)} tokens is too short for context {context}")
    starts = torch.randint(len(data) - context, (batch_size,), generator=generator)
    offsets = torch.arange(context)
    idx = starts[:, None] + offsets[None, :]
    x, y = data[idx], data[idx + 1]
    if torch.device(device).type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def unigram_entropy(data: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy (nats) of the best context-free predictor: the baseline to beat."""
    counts = torch.bincount(data, minlength=vocab_size).double()
    probs = counts[counts > 0] / counts.sum()
    return float(-(probs * probs.log()).sum())
