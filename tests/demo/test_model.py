"""The demo's model, data and schedule (plain PyTorch, CPU, fast), plus tiny end-to-end runs."""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import pytest
import torch

from examples.demo.data import (
    CharVocab,
    get_batch,
    load_text,
    read_corpus,
    split,
    stdlib_files,
    unigram_entropy,
)
from examples.demo.model import CharTransformer, ModelConfig, flops_per_token
from examples.demo.train import NullTelemetry, Telemetry, lr_at, main, telemetry

TINY = ModelConfig(vocab_size=11, context=16, n_layer=2, n_head=2, d_model=32)


def test_forward_shapes_and_loss() -> None:
    torch.manual_seed(0)
    model = CharTransformer(TINY)
    x = torch.randint(TINY.vocab_size, (3, 16))
    logits, loss = model(x, x)
    assert logits.shape == (3, 16, TINY.vocab_size)
    assert loss is not None and loss.shape == ()
    # At init the prediction is near uniform: loss ≈ ln(vocab).
    assert abs(loss.item() - math.log(TINY.vocab_size)) < 0.5
    logits, loss = model(x[:, :5])
    assert logits.shape == (3, 5, TINY.vocab_size) and loss is None
    with pytest.raises(ValueError, match="exceeds the model context"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("tie", [True, False])
def test_causal_masking(tie: bool) -> None:
    torch.manual_seed(0)
    model = CharTransformer(
        ModelConfig(vocab_size=11, context=16, n_layer=2, n_head=2, d_model=32, tie_weights=tie)
    )
    model.eval()
    x = torch.randint(TINY.vocab_size, (2, 16))
    changed = x.clone()
    t = 9
    changed[:, t] = (changed[:, t] + 1) % TINY.vocab_size
    with torch.no_grad():
        a, _ = model(x)
        b, _ = model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t])  # earlier positions never see the future
    assert not torch.allclose(a[:, t:], b[:, t:])  # ... later ones do


def test_loss_decreases_on_tiny_corpus() -> None:
    torch.manual_seed(0)
    text = "def add(a, b):\n    return a + b\n\n" * 40
    vocab = CharVocab.from_text(text)
    train_data, _ = split(vocab.encode(text))
    model = CharTransformer(ModelConfig(vocab_size=vocab.size, context=16, n_layer=2, n_head=2, d_model=32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(30):
        x, y = get_batch(train_data, 16, 16, gen)
        _, loss = model(x, y)
        assert loss is not None
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5


def test_split_and_batches_deterministic(tmp_path: Path) -> None:
    data = torch.arange(1000)
    train_a, val_a = split(data, 0.1)
    train_b, val_b = split(data.clone(), 0.1)
    assert len(train_a) == 900 and len(val_a) == 100
    assert torch.equal(train_a, train_b) and torch.equal(val_a, val_b)
    assert torch.equal(torch.cat([train_a, val_a]), data)  # contiguous, nothing lost
    x1, y1 = get_batch(train_a, 4, 8, torch.Generator().manual_seed(3))
    x2, y2 = get_batch(train_a, 4, 8, torch.Generator().manual_seed(3))
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(y1, x1 + 1)  # targets are the inputs shifted by one
    assert int(x1.max()) < 900
    with pytest.raises(ValueError):
        split(data, 0.0)

    # Files are read in sorted relative-path order, skipping test dirs, capped.
    (tmp_path / "b.py").write_text("bbbb")
    (tmp_path / "a.py").write_text("aaaa")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "c.py").write_text("cccc")
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "t.py").write_text("tttt")
    files = stdlib_files(tmp_path)
    assert [f.relative_to(tmp_path).as_posix() for f in files] == ["a.py", "b.py", "pkg/c.py"]
    assert read_corpus(files, max_chars=10) == "aaaabbbbcc"


def test_stdlib_corpus_is_deterministic() -> None:
    a = load_text(None, max_chars=50_000)
    b = load_text(None, max_chars=50_000)
    assert a == b and len(a) == 50_000
    vocab = CharVocab.from_text(a)
    assert vocab.decode(vocab.encode(a[:200]).tolist()) == a[:200]
    assert 0 < unigram_entropy(vocab.encode(a), vocab.size) < math.log(vocab.size)


@pytest.mark.parametrize("tie", [True, False])
def test_flops_per_token_matches_hand_count(tie: bool) -> None:
    cfg = ModelConfig(vocab_size=7, context=4, n_layer=2, n_head=2, d_model=8, tie_weights=tie)
    d = 8
    per_layer = (
        2 * d  # ln1
        + d * 3 * d
        + 3 * d  # qkv
        + d * d
        + d  # attention output proj
        + 2 * d  # ln2
        + d * 4 * d
        + 4 * d  # mlp fc
        + 4 * d * d
        + d  # mlp proj
    )
    n_non_embedding = 2 * per_layer + 2 * d  # + final LayerNorm
    assert n_non_embedding == 1760
    model = CharTransformer(cfg)
    assert model.num_params(non_embedding=True) == n_non_embedding
    embeddings = 7 * d + 4 * d + (0 if tie else 7 * d)
    assert model.num_params(non_embedding=False) == n_non_embedding + embeddings
    expected = 6 * 1760 + 12 * 2 * 4 * 8
    assert flops_per_token(cfg) == expected == 11328
    assert flops_per_token(cfg, model.num_params()) == expected


def test_lr_schedule_warmup_and_cosine() -> None:
    max_lr, min_lr, warmup, total = 1e-3, 1e-4, 10, 110
    assert lr_at(0, max_lr, warmup, total, min_lr) == pytest.approx(max_lr / warmup)
    assert lr_at(warmup - 1, max_lr, warmup, total, min_lr) == pytest.approx(max_lr)
    assert lr_at(warmup, max_lr, warmup, total, min_lr) == pytest.approx(max_lr)
    assert lr_at(60, max_lr, warmup, total, min_lr) == pytest.approx((max_lr + min_lr) / 2)
    assert lr_at(total, max_lr, warmup, total, min_lr) == pytest.approx(min_lr)
    assert lr_at(total + 50, max_lr, warmup, total, min_lr) == pytest.approx(min_lr)
    warm = [lr_at(i, max_lr, warmup, total, min_lr) for i in range(warmup)]
    decay = [lr_at(i, max_lr, warmup, total, min_lr) for i in range(warmup, total + 1)]
    assert warm == sorted(warm) and decay == sorted(decay, reverse=True)
    assert lr_at(0, max_lr, 0, total, min_lr) == pytest.approx(max_lr)  # no warmup


def test_null_shim_covers_the_api_the_demo_uses() -> None:
    shim = telemetry(instrumented=False)
    assert isinstance(shim, NullTelemetry)
    protocol_methods = {
        n for n, v in vars(Telemetry).items() if inspect.isfunction(v) and not n.startswith("_")
    }
    assert protocol_methods <= {n for n in dir(shim) if not n.startswith("_")}
    with shim.init(run_name="x") as session, shim.step(1, tokens=1, samples=1), shim.timer("data"):
        shim.record("loss", torch.tensor(1.0))
    assert session.run_dir is None
    assert shim.timer("f", level=2)(len) is len  # ot.timer is a decorator too


def _tiny_args(tmp_path: Path) -> list[str]:
    data = tmp_path / "corpus.txt"
    data.write_text("import os\n\ndef main():\n    return os.getcwd()\n\nclass A:\n    pass\n" * 30)
    return [
        "--data", str(data),
        "--steps", "6",
        "--batch-size", "4",
        "--context", "16",
        "--layers", "1",
        "--d-model", "16",
        "--heads", "2",
        "--eval-interval", "3",
        "--eval-batches", "2",
        "--sample-interval", "3",
        "--sample-tokens", "8",
        "--log-interval", "2",
        "--output-dir", str(tmp_path / "runs"),
        "--run-name", "tiny",
        "--prometheus-port", "0",
        "--no-tensorboard", "--no-wandb", "--no-mlflow",
    ]  # fmt: skip


def test_demo_main_uninstrumented_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*_tiny_args(tmp_path), "--uninstrumented"]) == 0
    checkpoint = tmp_path / "runs" / "tiny" / "checkpoint.pt"
    state = torch.load(checkpoint, weights_only=True)
    assert state["step"] == 6 and state["config"]["n_layer"] == 1
    out = capsys.readouterr().out
    assert "sample 'def " in out and "done: 6 steps" in out


def test_demo_main_instrumented_end_to_end(tmp_path: Path) -> None:
    assert main([*_tiny_args(tmp_path), "--quiet"]) == 0
    assert list((tmp_path / "runs").rglob("checkpoint.pt"))
