"""The reference instrumented training: a tiny character-level transformer on Python source.

Run it from the repository root with `python -m examples.demo` (or `make demo`). The loop below
uses only the public otel_train API, exactly as a user would. `--uninstrumented` runs the very same loop with
a plain no-op stand-in for the API instead (for the overhead benchmark).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

import torch

from examples.demo.data import CharVocab, CorpusError, get_batch, load_text, split, unigram_entropy
from examples.demo.model import CharTransformer, ModelConfig, flops_per_token
from otel_train.config import ConfigError

F = TypeVar("F", bound=Callable[..., Any])

SAMPLE_PROMPTS = ("def ", "import ", "class ")

# Defaults are tuned so the whole demo (training, eval, sampling, checkpoint) takes about a
# minute and a half on 2 CPU cores and ends far below the unigram baseline (~3.1 nats).
DEFAULT_STEPS = 600
DEFAULT_BATCH_SIZE = 32
DEFAULT_CONTEXT = 128


# ---------------------------------------------------------------------------------------------
# The slice of the otel_train API the demo uses, and a no-op stand-in for --uninstrumented.


class TimerLike(Protocol):
    """What `ot.timer(...)` returns: a context manager and a decorator."""

    def __enter__(self) -> Any: ...
    def __exit__(self, exc_type: Any, exc: Any, tb: Any, /) -> Any: ...
    def __call__(self, fn: F, /) -> F: ...


class Telemetry(Protocol):
    def init(self, **settings: Any) -> Any: ...
    def shutdown(self) -> Any: ...
    def step(self, step: int, *, tokens: int, samples: int) -> AbstractContextManager[Any]: ...
    def timer(self, name: str, level: int = ..., cuda: bool = ...) -> TimerLike: ...
    def record(self, name: str, value: Any) -> Any: ...
    def span(self, name: str) -> AbstractContextManager[Any]: ...
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> Any: ...
    def log_samples(self, samples: list[tuple[str, str]], step: int | None = None) -> Any: ...
    def log_hyperparams(self, params: dict[str, Any]) -> Any: ...
    def watch(self, model: Any, every: int = ..., *, activations: bool = ...) -> Any: ...


_NULL_CONTEXT = contextlib.nullcontext()


class _NullTimer(contextlib.nullcontext[None]):
    def __call__(self, fn: F, /) -> F:
        return fn


_NULL_TIMER = _NullTimer()


class _NullSession:
    run_dir = None

    def __enter__(self) -> _NullSession:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class NullTelemetry:
    """Same methods as the otel_train API, doing nothing. Not otel_train: a plain shim."""

    def init(self, **settings: Any) -> _NullSession:
        return _NullSession()

    def shutdown(self) -> None:
        return None

    def step(self, step: int, *, tokens: int, samples: int) -> AbstractContextManager[Any]:
        return _NULL_CONTEXT

    def timer(self, name: str, level: int = 1, cuda: bool = False) -> TimerLike:
        return _NULL_TIMER

    def record(self, name: str, value: Any) -> None:
        return None

    def span(self, name: str) -> AbstractContextManager[Any]:
        return _NULL_CONTEXT

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        return None

    def log_samples(self, samples: list[tuple[str, str]], step: int | None = None) -> None:
        return None

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        return None

    def watch(self, model: Any, every: int = 100, *, activations: bool = False) -> None:
        return None


def telemetry(instrumented: bool) -> Telemetry:
    if not instrumented:
        return NullTelemetry()
    import otel_train

    return cast(Telemetry, otel_train)


# ---------------------------------------------------------------------------------------------
# Plain training helpers (no telemetry).


def lr_at(it: int, max_lr: float, warmup: int, total: int, min_lr: float) -> float:
    """Linear warmup to `max_lr` over `warmup` iterations, then cosine decay to `min_lr` at `total`.

    `it` is the 0-based iteration: lr_at(0) = max_lr / warmup, lr_at(warmup) = max_lr,
    lr_at(total) = min_lr (and min_lr beyond).
    """
    if warmup > 0 and it < warmup:
        return max_lr * (it + 1) / warmup
    progress = min(1.0, (it - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds CUDA
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy ships with torch wheels
        return
    np.random.seed(seed % 2**32)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available here; use --device cpu or auto")
    return torch.device(name)


def make_optimizer(
    model: torch.nn.Module, lr: float, weight_decay: float, device: torch.device
) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not on biases, LayerNorm gains)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.99), fused=device.type == "cuda")


@torch.no_grad()
def evaluate(
    model: CharTransformer,
    val_data: torch.Tensor,
    batch_size: int,
    context: int,
    batches: int,
    seed: int,
    device: torch.device,
) -> tuple[float, float]:
    """Mean val loss and top-1 next-character accuracy over fixed (seeded) val batches."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device)
    for _ in range(batches):
        x, y = get_batch(val_data, batch_size, context, gen, device)
        logits, loss = model(x, y)
        assert loss is not None
        loss_sum += loss
        correct += (logits.argmax(dim=-1) == y).float().mean()
    model.train()
    return (loss_sum / batches).item(), (correct / batches).item()


def generate_samples(
    model: CharTransformer,
    vocab: CharVocab,
    prompts: Sequence[str],
    max_new_tokens: int,
    temperature: float,
    seed: int,
    device: torch.device,
) -> list[tuple[str, str]]:
    """(prompt, continuation) pairs, sampled with temperature under torch.no_grad()."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    out: list[tuple[str, str]] = []
    with torch.no_grad():
        for prompt in prompts:
            idx = vocab.encode(prompt)[None, :].to(device)
            ids = model.generate(idx, max_new_tokens, temperature=temperature, generator=gen)
            out.append((prompt, vocab.decode(ids[0, idx.size(1) :].tolist())))
    model.train()
    return out


# ---------------------------------------------------------------------------------------------


@dataclass
class Result:
    steps: int
    train_loss: float  # mean training loss over the last eval interval
    val_loss: float
    val_accuracy: float
    unigram_baseline: float
    wall_s: float
    run_dir: Path | None
    checkpoint: Path | None
    metrics_url: str | None = None  # the Prometheus pull endpoint while it was training


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show defaults, except for flags and unset (None) options."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.nargs == 0 or action.default is None:
            return action.help
        return super()._get_help_string(action)


def build_parser(prog: str = "python -m examples.demo") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Train a tiny character-level transformer on Python source, instrumented with otel_train.",
        formatter_class=_HelpFormatter,
    )
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps")
    g.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, help="sequences per step")
    g.add_argument("--context", type=int, default=DEFAULT_CONTEXT, help="context length (characters)")
    g.add_argument("--layers", type=int, default=4, help="transformer blocks")
    g.add_argument("--d-model", type=int, default=128, help="model width")
    g.add_argument("--heads", type=int, default=4, help="attention heads")
    g.add_argument("--untied", action="store_true", help="untie the output head from the token embedding")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=3e-4, help="learning rate at the end of the cosine")
    g.add_argument("--warmup", type=int, default=50, help="warmup steps")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decay (matrices only)")
    g.add_argument("--grad-clip", type=float, default=1.0, help="max global grad norm")
    g.add_argument("--eval-interval", type=int, default=100, help="steps between evals (and at the end)")
    g.add_argument("--eval-batches", type=int, default=8, help="val batches per eval")
    g.add_argument("--sample-interval", type=int, default=200, help="steps between samples (and at the end)")
    g.add_argument("--sample-tokens", type=int, default=80, help="characters generated per prompt")
    g.add_argument("--temperature", type=float, default=0.8, help="sampling temperature")
    g.add_argument(
        "--device", choices=("cpu", "cuda", "auto"), default="auto", help="auto: cuda if available"
    )
    g.add_argument("--data", default=None, help="a text file; when unset, the Python stdlib's own source")
    g.add_argument("--max-chars", type=int, default=2_000_000, help="corpus cap (0 with --data: none)")
    g.add_argument("--seed", type=int, default=1337, help="seeds init, batches, eval and samples")
    t = p.add_argument_group("telemetry")
    t.add_argument("--run-name", default=None, help="when unset, demo-<UTC time>-<4 hex>")
    t.add_argument(
        "--output-dir", default=None, help="run dirs go under here; when unset, otel_train's (./runs)"
    )
    t.add_argument(
        "--log-interval",
        type=int,
        default=None,
        help="flush telemetry every N steps; when unset, otel_train's adaptive cadence (every 10 steps, "
        "at most about once a second: a flush's worker CPU is the training thread's loss on a fast GPU)",
    )
    t.add_argument(
        "--otlp-endpoint", default=None, help="e.g. http://localhost:4318; when unset, OTEL_EXPORTER_OTLP_ENDPOINT (no OTLP push without either)"
    )
    t.add_argument("--prometheus-port", type=int, default=9464, help="pull endpoint port, 0 disables")
    t.add_argument("--trace-every", type=int, default=100, help="trace every N-th step")
    t.add_argument(
        "--watch-every",
        type=int,
        default=50,
        help="ot.watch: per-layer norms and activations every N steps, 0 = off",
    )
    t.add_argument("--no-tensorboard", dest="tensorboard", action="store_false", help="no TensorBoard bridge")
    t.add_argument(
        "--no-wandb",
        dest="wandb",
        action="store_false",
        help="no W&B bridge (W&B runs offline unless configured)",
    )
    t.add_argument("--no-mlflow", dest="mlflow", action="store_false", help="no MLflow bridge")
    t.add_argument("--quiet", action="store_true", help="no console output from the demo or otel_train")
    t.add_argument("--uninstrumented", action="store_true", help="same loop, no otel_train calls (benchmark)")
    return p


@dataclass
class _Setup:
    """Everything the loop trains with, built before telemetry starts."""

    device: torch.device
    vocab: CharVocab
    train_data: torch.Tensor
    val_data: torch.Tensor
    baseline: float
    cfg: ModelConfig
    model: CharTransformer
    flops_per_token: float
    optimizer: torch.optim.Optimizer
    prompts: list[str]
    batch_gen: torch.Generator
    run_name: str


def _setup(args: argparse.Namespace) -> _Setup:
    seed_everything(args.seed)
    device = resolve_device(args.device)
    text = load_text(args.data, args.max_chars)
    vocab = CharVocab.from_text(text)
    train_data, val_data = split(vocab.encode(text), val_fraction=0.1)
    if len(val_data) <= args.context:  # the smaller split must hold one context and its target
        raise CorpusError(
            f"{len(text):,} characters of text leave {len(val_data):,} for validation, fewer than "
            f"--context {args.context} + 1: use a longer --data file (or --max-chars) or a smaller --context"
        )
    baseline = unigram_entropy(train_data, vocab.size)
    cfg = ModelConfig(
        vocab_size=vocab.size,
        context=args.context,
        n_layer=args.layers,
        n_head=args.heads,
        d_model=args.d_model,
        tie_weights=not args.untied,
    )
    model = CharTransformer(cfg).to(device)
    fpt = flops_per_token(cfg, model.num_params(non_embedding=True))
    optimizer = make_optimizer(model, args.lr, args.weight_decay, device)
    prompts = [p for p in SAMPLE_PROMPTS if vocab.can_encode(p)] or [text[0]]
    batch_gen = torch.Generator().manual_seed(args.seed)
    # Not from the seeded `random`: two runs started in the same second must not collide.
    run_name = args.run_name or time.strftime("demo-%Y%m%d-%H%M%S-", time.gmtime()) + secrets.token_hex(2)
    return _Setup(
        device,
        vocab,
        train_data,
        val_data,
        baseline,
        cfg,
        model,
        fpt,
        optimizer,
        prompts,
        batch_gen,
        run_name,
    )


def _settings(args: argparse.Namespace, setup: _Setup) -> dict[str, Any]:
    """ot.init() settings from the command line."""
    settings: dict[str, Any] = {
        "run_name": setup.run_name,
        "log_interval": args.log_interval,
        "total_steps": args.steps,
        "verbosity": 0 if args.quiet else 1,
        "prometheus_port": args.prometheus_port,
        "tensorboard": args.tensorboard,
        "wandb": args.wandb,
        "mlflow": args.mlflow,
        "trace_every": args.trace_every,
        "flops_per_token": setup.flops_per_token,
    }
    if args.output_dir is not None:
        settings["output_dir"] = args.output_dir
    if "OTEL_TRAIN_SHUTDOWN_TIMEOUT_S" not in os.environ:
        # Three bridges close at the end (W&B's offline finish alone takes seconds on a busy 2-core
        # machine): the library's 2 s default would abandon the last export and say so.
        settings["shutdown_timeout_s"] = 15.0
    if args.otlp_endpoint is not None:
        settings["otlp_endpoint"] = args.otlp_endpoint
    return settings


def _hyperparams(args: argparse.Namespace, setup: _Setup) -> dict[str, Any]:
    return {
        **asdict(setup.cfg),
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "min_lr": args.min_lr,
        "warmup": args.warmup,
        "weight_decay": args.weight_decay,
        "grad_clip": args.grad_clip,
        "seed": args.seed,
        "data": args.data or "python-stdlib",
        "train_chars": len(setup.train_data),
        "val_chars": len(setup.val_data),
        "params": setup.model.num_params(non_embedding=False),
        "non_embedding_params": setup.model.num_params(),
        "flops_per_token": setup.flops_per_token,
        "device": str(setup.device),
    }


@dataclass
class _Losses:
    """The latest train/val figures; the train loss is summed on the device (no per-step sync)."""

    train_sum: torch.Tensor
    train_count: int = 0
    train: float = float("nan")
    val: float = float("nan")
    val_acc: float = float("nan")


def train(args: argparse.Namespace, ot: Telemetry) -> Result:
    t_start = time.perf_counter()
    say: Callable[..., None] = (lambda *a, **k: None) if args.quiet else print
    setup = _setup(args)
    say(
        f"otel_train demo: {setup.model.num_params(non_embedding=False) / 1e6:.2f}M params "
        f"({setup.model.num_params() / 1e6:.2f}M non-embedding), vocab {setup.vocab.size}, "
        f"{len(setup.train_data):,} train / {len(setup.val_data):,} val chars, device {setup.device}, "
        f"unigram baseline {setup.baseline:.3f} nats" + (" [uninstrumented]" if args.uninstrumented else "")
    )
    losses = _Losses(torch.zeros((), device=setup.device))
    checkpoint: Path | None = None
    run_dir: Path | None = None

    with ot.init(**_settings(args, setup)) as run:
        run_dir = getattr(run, "run_dir", None)
        metrics_url = getattr(run, "prometheus_url", None)
        ot.log_hyperparams(_hyperparams(args, setup))
        if args.watch_every:
            # per-layer grad/param norms and activation stats on every N-th step (read at the step's
            # end: after clipping); grad_norm recorded below stays the pre-clip global norm
            ot.watch(setup.model, every=args.watch_every, activations=True)
        sample = ot.timer("generate", level=2)(generate_samples)

        setup.model.train()
        for step in range(args.steps):  # 0-based, like otel_train (its console shows step + 1)
            done = step + 1
            lr = lr_at(step, args.lr, args.warmup, args.steps, args.min_lr)
            loss = _train_step(ot, args, setup, step, lr)
            losses.train_sum += loss
            losses.train_count += 1
            last = done == args.steps
            if done % args.eval_interval == 0 or last:
                _evaluate(ot, args, setup, step, losses)
                if args.uninstrumented:  # otherwise otel_train's console shows progress
                    say(
                        f"step {done:>5}/{args.steps}  train loss {losses.train:.3f}  val loss {losses.val:.3f}  "
                        f"ppl {math.exp(min(losses.val, 50.0)):.2f}  acc {losses.val_acc:.3f}  "
                        f"lr {lr:.2e}  {time.perf_counter() - t_start:.0f}s"
                    )
            if done % args.sample_interval == 0 or last:
                samples = _generate(ot, args, setup, sample, step)
                if args.uninstrumented:
                    for prompt, output in samples:
                        say(f"  sample {(prompt + output)!r}")

        with ot.span("checkpoint"):
            checkpoint = _save_checkpoint(args, setup, run_dir)

    return Result(
        steps=args.steps,
        train_loss=losses.train,
        val_loss=losses.val,
        val_accuracy=losses.val_acc,
        unigram_baseline=setup.baseline,
        wall_s=time.perf_counter() - t_start,
        run_dir=Path(run_dir) if run_dir is not None else None,
        checkpoint=checkpoint,
        metrics_url=metrics_url,
    )


def _train_step(ot: Telemetry, args: argparse.Namespace, setup: _Setup, step: int, lr: float) -> torch.Tensor:
    """One instrumented optimizer step; returns the (detached, on-device) loss."""
    for group in setup.optimizer.param_groups:
        group["lr"] = lr
    on_gpu = setup.device.type == "cuda"  # time device work with CUDA events (no sync on this thread)
    with ot.step(step, tokens=args.batch_size * args.context, samples=args.batch_size):
        with ot.timer("data"):
            x, y = get_batch(setup.train_data, args.batch_size, args.context, setup.batch_gen, setup.device)
        with ot.timer("forward", cuda=on_gpu):
            _, loss = setup.model(x, y)
            assert loss is not None
        with ot.timer("backward", cuda=on_gpu):
            setup.optimizer.zero_grad(set_to_none=True)
            loss.backward()
        with ot.timer("optimizer", cuda=on_gpu):
            with ot.timer("grad_clip", level=2):
                grad_norm = torch.nn.utils.clip_grad_norm_(setup.model.parameters(), args.grad_clip)
            setup.optimizer.step()
        loss = loss.detach()
        ot.record("loss", loss)  # a tensor: resolved by otel_train at the flush, not here
        ot.record("lr", lr)
        ot.record("grad_norm", grad_norm)
    return loss


def _evaluate(ot: Telemetry, args: argparse.Namespace, setup: _Setup, step: int, losses: _Losses) -> None:
    """Validation loss/accuracy and the mean train loss since the last eval, logged for `step`."""
    with ot.span("eval"):
        losses.val, losses.val_acc = evaluate(
            setup.model,
            setup.val_data,
            args.batch_size,
            args.context,
            args.eval_batches,
            args.seed,
            setup.device,
        )
        losses.train = losses.train_sum.item() / losses.train_count
        losses.train_sum.zero_()
        losses.train_count = 0
        ot.log_metrics(
            {
                "eval/loss": losses.val,
                "eval/perplexity": math.exp(min(losses.val, 50.0)),
                "eval/accuracy": losses.val_acc,
            },
            step=step,
        )


def _generate(
    ot: Telemetry, args: argparse.Namespace, setup: _Setup, sample: Callable[..., Any], step: int
) -> list[tuple[str, str]]:
    """Sample continuations of the prompts (`sample`: the timed generate_samples) and log them."""
    done = step + 1
    with ot.span("generate"):
        samples: list[tuple[str, str]] = sample(
            setup.model, setup.vocab, setup.prompts, args.sample_tokens, args.temperature, args.seed + done,
            setup.device,
        )  # fmt: skip
    ot.log_samples(samples, step=step)
    return samples


def _save_checkpoint(args: argparse.Namespace, setup: _Setup, run_dir: Path | None) -> Path:
    ckpt_dir = run_dir if run_dir is not None else _default_run_dir(args.output_dir, setup.run_name)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = ckpt_dir / "checkpoint.pt"
    torch.save(
        {
            "model": setup.model.state_dict(),
            "config": asdict(setup.cfg),
            "vocab": "".join(setup.vocab.chars),
            "step": args.steps,
        },
        checkpoint,
    )
    return checkpoint


def _default_run_dir(output_dir: str | None, run_name: str) -> Path:
    base = output_dir or os.environ.get("OTEL_TRAIN_OUTPUT_DIR") or "runs"
    return Path(base) / run_name


def print_outputs(result: Result, args: argparse.Namespace) -> None:
    """Say where everything went (only what exists, so it is always accurate)."""
    print(
        f"done: {result.steps} steps in {result.wall_s:.1f}s; train loss {result.train_loss:.3f}, "
        f"val loss {result.val_loss:.3f} (ppl {math.exp(min(result.val_loss, 50.0)):.2f}, "
        f"acc {result.val_accuracy:.3f}); unigram baseline {result.unigram_baseline:.3f}"
    )
    if result.checkpoint is not None:
        print(f"  checkpoint   {result.checkpoint}")
    if result.metrics_url:
        print(
            f"  Prometheus   {result.metrics_url} while training (see deploy/prometheus/pull-endpoints.example.yml)"
        )
    run_dir = result.run_dir
    if run_dir is None or not run_dir.exists():
        return
    print(f"  run dir      {run_dir}")
    for path in sorted(run_dir.glob("*.jsonl")):
        print(f"  jsonl        {path}")
    if args.tensorboard and any(run_dir.rglob("events.out.tfevents.*")):
        print(f"  TensorBoard  tensorboard --logdir {run_dir.parent}")
    if args.wandb:
        offline = sorted(run_dir.rglob("offline-run-*"))
        if offline:
            print(f"  W&B          wandb sync {offline[-1]}")
    if args.mlflow:
        stores = sorted(p for p in run_dir.rglob("mlruns") if p.is_dir())
        databases = sorted(run_dir.rglob("mlflow*.db"))
        if stores:
            print(f"  MLflow       mlflow ui --backend-store-uri {stores[0].resolve().as_uri()}")
        elif databases:
            print(f"  MLflow       mlflow ui --backend-store-uri sqlite:///{databases[0].resolve()}")


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the command line, before anything is built or any run directory made."""
    positive = (
        "steps", "batch_size", "context", "layers", "d_model", "heads", "log_interval",
        "eval_interval", "eval_batches", "sample_interval", "sample_tokens", "trace_every",
    )  # fmt: skip
    for name in positive:
        value = getattr(args, name)
        if value is not None and value < 1:  # --log-interval may be unset
            return f"--{name.replace('_', '-')} must be >= 1"
    for name in ("warmup", "watch_every", "prometheus_port"):
        if getattr(args, name) < 0:
            return f"--{name.replace('_', '-')} must be >= 0" + (
                " (0 turns it off)" if name != "warmup" else ""
            )
    if args.max_chars < (0 if args.data is not None else 1):
        return "--max-chars must be >= 1 (0, no cap, only with --data)"
    if args.d_model % args.heads:
        return f"--d-model {args.d_model} must be a multiple of --heads {args.heads}"
    if not (args.lr > 0 and args.min_lr >= 0):
        return f"--lr must be > 0 and --min-lr >= 0 (got {args.lr} and {args.min_lr})"
    if not (args.weight_decay >= 0 and args.grad_clip > 0 and args.temperature > 0):
        return "--weight-decay must be >= 0, --grad-clip and --temperature > 0"
    if args.data is not None and not Path(args.data).is_file():
        return f"--data {args.data}: no such file"
    return None


def main(argv: list[str] | None = None, prog: str = "python -m examples.demo") -> int:
    """Run the demo; a bad command line or corpus, or a setting otel_train refuses, exits 2 with
    one line naming the flag (no traceback, and no run directory left behind by a bad flag)."""
    args = build_parser(prog).parse_args(argv)
    problem = check_args(args)
    if problem is not None:
        return _error(prog, f"{problem} ({prog} --help lists the flags)")
    try:
        result = train(args, telemetry(not args.uninstrumented))
    except CorpusError as exc:
        return _error(prog, str(exc))
    except ConfigError as exc:  # a run name in use, an unwritable --output-dir, ...
        return _error(prog, f"{exc} (--run-name and --output-dir set otel_train's run_name and output_dir)")
    if not args.quiet:
        print_outputs(result, args)
    return 0


def _error(prog: str, message: str) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
