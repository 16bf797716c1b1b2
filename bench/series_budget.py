"""Series budget: how many distinct series one rank exports (README "Series budget").

Counts the samples of the real pull endpoint (`/metrics`: one sample is one series in Prometheus,
and the Collector's exporter and VictoriaMetrics' OTLP ingestion make the same ones) after a short
training loop that uses the usual API (four timed phases, loss/lr/grad_norm, tokens, a GradScaler),
for: defaults, ot.watch on a 64-layer model (grads + params), with activations too, and the same
with watch_aggregate="model"; each in the full and the essential series tier (`rank_series`). The
job-level series (`train.job.*`, once per job from rank 0) are counted apart from the rank's own.

    python bench/series_budget.py
"""

from __future__ import annotations

import sys
import urllib.request
from collections import Counter
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers.ports import free_port

import otel_train as ot
from otel_train import semconv
from otel_train.testing import current_session

LAYERS = 64


class Deep(nn.Module):
    """embed + 62 blocks + head: exactly 64 layer groups for ot.watch (max_layers=64)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(LAYERS - 2)])
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def exported_series(
    watch: bool,
    activations: bool = False,
    aggregate: str = "layer",
    steps: int = 12,
    rank_series: str = "full",
) -> Counter[str]:
    """Series per metric family on one rank's /metrics after `steps` steps."""
    port = free_port()
    ot.init(prometheus_port=port, run_id="budget", verbosity=0, log_interval=2,
            run_dir_enabled=False, watch_aggregate=aggregate, rank_series=rank_series)  # fmt: skip
    try:
        train(steps, watch, activations)
        current_session().worker.stop(timeout_s=10)  # type: ignore[union-attr]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        ot.shutdown()
    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        counts[family.name] += len(family.samples)
    return counts


def train(steps: int, watch: bool, activations: bool = False) -> None:
    """The usual API on the running session: four timed phases, loss/lr, tokens, a GradScaler."""
    model = Deep()
    scaler = torch.amp.GradScaler("cpu")
    if watch:
        ot.watch(model, every=2, activations=activations, scaler=scaler)
    else:  # the scaler's series without a model watch: what ot.watch(scaler=) adds, by hand
        from otel_train.numerics import ScalerWatch

        session = current_session()
        assert session is not None
        session.worker.add_listener(ScalerWatch(scaler, session.meter))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(steps):
        with ot.step(step, tokens=256, samples=8):
            with ot.timer("data"):
                x = torch.randn(4, 8)
            optimizer.zero_grad()
            with ot.timer("forward"):
                loss = model(x).pow(2).mean()
            with ot.timer("backward"):
                scaler.scale(loss).backward()
            with ot.timer("optimizer"):
                scaler.step(optimizer)
                scaler.update()
            ot.record("loss", loss)
            ot.record("lr", 1e-3)


JOB_FAMILIES = frozenset(
    spec.prometheus_name.removesuffix("_total") for spec in semconv.CATALOGUE if spec.scope == "job"
)


def main() -> None:
    cases = {}
    for tier in ("full", "essential"):
        cases[f"defaults (no watch), {tier}"] = exported_series(watch=False, rank_series=tier)
        cases[f"ot.watch, {LAYERS} layers (grads+params), {tier}"] = exported_series(
            watch=True, rank_series=tier
        )
        cases[f"ot.watch, {LAYERS} layers, activations=True, {tier}"] = exported_series(
            watch=True, activations=True, rank_series=tier
        )
        cases[f'same, watch_aggregate="model", {tier}'] = exported_series(
            watch=True, activations=True, aggregate="model", rank_series=tier
        )
    for name, counts in cases.items():
        rank = Counter({family: n for family, n in counts.items() if family not in JOB_FAMILIES})
        job = sum(counts.values()) - sum(rank.values())
        layer = sum(n for family, n in rank.items() if family.startswith("train_layer_"))
        print(f"{name:58s} {sum(rank.values()):5d} per rank ({layer:3d} train_layer_*)  + {job} job-level")
    top = cases["defaults (no watch), full"].most_common(6)
    print("largest families at defaults:", ", ".join(f"{f}={n}" for f, n in top))


if __name__ == "__main__":
    main()
