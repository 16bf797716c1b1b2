"""FLOPs per token (hand-checked), the peak table, and MFU in the HardwareMonitor."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers.events import Events
from helpers.fake_nvml import FakeGpu, FakeNvml, gpu_uuid
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from torch import nn

from otel_train import semconv as sc
from otel_train.config import Config
from otel_train.core.buffer import Interval
from otel_train.hardware import HardwareMonitor, discover_with_timeout
from otel_train.hardware.mfu import (
    count_non_embedding_params,
    detect_layers_and_width,
    flops_per_token_from_model,
    normalize_dtype,
    resolve_peak,
    transformer_flops_per_token,
)

V, D, FF, L, S = 50, 16, 32, 2, 24


class TinyLM(nn.Module):
    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.wpe = nn.Embedding(S, D)
        layer = nn.TransformerEncoderLayer(D, nhead=2, dim_feedforward=FF, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, num_layers=L, enable_nested_tensor=False)
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        if tied:
            self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1])
        return self.head(self.ln_f(self.blocks(self.wte(idx) + self.wpe(pos))))


def hand_params(tied: bool) -> int:
    per_layer = (
        (3 * D * D + 3 * D)  # attention in_proj (q, k, v) weight + bias
        + (D * D + D)  # attention out_proj
        + (D * FF + FF)  # linear1
        + (FF * D + D)  # linear2
        + 2 * (2 * D)  # norm1, norm2
    )
    # Embedding lookups excluded; the LM head (D x V) is a real matmul, tied or not.
    return L * per_layer + 2 * D + D * V


def test_transformer_flops_formula() -> None:
    assert transformer_flops_per_token(1000, 2, 24, 16) == 6 * 1000 + 12 * 2 * 24 * 16
    assert transformer_flops_per_token(1000, 2, 24, 16, causal=True) == 6 * 1000 + 6 * 2 * 24 * 16
    assert transformer_flops_per_token(1000, 2, 24, 16, include_attention=False) == 6000
    # GPT-3 175B at s=2048 (PaLM table 3 reports ~6N + 12LHQT): 96 layers, d=12288
    assert transformer_flops_per_token(175e9, 96, 2048, 12288) / 175e9 == pytest.approx(6 + 0.166, abs=0.01)
    with pytest.raises(ValueError):
        transformer_flops_per_token(-1, 1, 1, 1)


@pytest.mark.parametrize("tied", [True, False])
def test_flops_of_a_small_transformer_match_a_hand_calculation(tied: bool) -> None:
    model = TinyLM(tied)
    model(torch.zeros(1, S, dtype=torch.long))  # it is a working model
    assert count_non_embedding_params(model) == hand_params(tied)
    assert detect_layers_and_width(model) == (L, D)
    expected = 6 * hand_params(tied) + 12 * L * S * D
    assert flops_per_token_from_model(model, S) == expected


def test_undetectable_model_needs_explicit_sizes() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="n_layers and d_model"):
        flops_per_token_from_model(model, 8)
    assert flops_per_token_from_model(model, 8, n_layers=1, d_model=4) == 6 * 20 + 12 * 1 * 8 * 4


def test_hf_style_config_is_used() -> None:
    model = nn.Linear(2, 2)
    model.config = type("Cfg", (), {"num_hidden_layers": 7, "hidden_size": 64})()  # type: ignore[assignment]
    assert detect_layers_and_width(model) == (7, 64)


@pytest.mark.parametrize(
    ("name", "dtype", "peak", "entry"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.5e12, "h100-sxm"),
        ("NVIDIA H100 PCIe", torch.bfloat16, 756.5e12, "h100-pcie"),
        ("NVIDIA H100 NVL", "fp8", 1670.5e12, "h100-nvl"),
        ("NVIDIA H200", "bf16", 989.5e12, "h200-sxm"),
        ("NVIDIA H200 NVL", "bf16", 835.5e12, "h200-nvl"),
        ("NVIDIA H20", "bf16", 148e12, "h20"),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156e12, "a100-sxm"),
        ("NVIDIA A100 80GB PCIe", "fp16", 312e12, "a100-pcie"),
        ("NVIDIA A100-SXM4-40GB", "fp32", 19.5e12, "a100-sxm"),
        ("NVIDIA B200", "bf16", 2250e12, "b200"),
        ("NVIDIA L4", "bf16", 121e12, "l4"),
        ("NVIDIA L40S", "bf16", 366e12, "l40s"),
        ("NVIDIA GeForce RTX 4090", "fp16", 165.2e12, "rtx-4090"),
        ("AMD Instinct MI300X", "bf16", 1307.4e12, "mi300x"),
    ],
)
def test_peak_table(name: str, dtype: Any, peak: float, entry: str) -> None:
    value, source = resolve_peak(name, dtype, environ={})
    assert value == pytest.approx(peak)
    assert source == f"table:{entry}:{normalize_dtype(dtype)}"


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("NVIDIA GeForce GTX 1080", "fp32"), ("Tesla K80", "fp32"), (None, "bf16"), ("NVIDIA A100-SXM4-80GB", "fp8"),
     ("NVIDIA H100 80GB HBM3", "int4"),
     ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", "bf16"),
     ("NVIDIA RTX A1000", "bf16"), ("NVIDIA RTX A1000 6GB Laptop GPU", "fp16"),  # not an A100  # a MIG slice: the board's peak would be wrong
     ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", "bf16")],
)  # fmt: skip
def test_unknown_device_or_dtype_has_no_peak(name: str | None, dtype: str) -> None:
    assert resolve_peak(name, dtype, environ={}) == (None, None)


def test_peak_overrides_and_their_sources() -> None:
    assert resolve_peak("NVIDIA H100 80GB HBM3", "bf16", 1e15, environ={}) == (1e15, "config:peak_flops")
    env = {"OTEL_TRAIN_PEAK_FLOPS": "2e14"}
    assert resolve_peak("unknown", "bf16", None, environ=env) == (2e14, "env:OTEL_TRAIN_PEAK_FLOPS")
    # load_config copies the variable into peak_flops: still reported as coming from the env
    assert resolve_peak("unknown", "bf16", 2e14, environ=env) == (2e14, "env:OTEL_TRAIN_PEAK_FLOPS")
    assert resolve_peak("unknown", "bf16", None, environ={"OTEL_TRAIN_PEAK_FLOPS": "junk"}) == (None, None)


# --- MFU in the monitor ----------------------------------------------------------------------------------
@pytest.fixture
def reader() -> Iterator[InMemoryMetricReader]:
    r = InMemoryMetricReader()
    yield r


def run_flushes(
    reader: InMemoryMetricReader, gpu_name: str, events: Events, n: int = 1, **settings: Any
) -> tuple[HardwareMonitor, dict[str, list[tuple[dict[str, Any], float]]]]:
    provider = MeterProvider(metric_readers=[reader])
    nvml = FakeNvml([FakeGpu(uuid=gpu_uuid(0), name=gpu_name)])
    mon = HardwareMonitor(
        Config(**settings), provider.get_meter("t"), events, 0, discover_with_timeout(0, nvml, {})
    )
    mon.start(background=False)
    for i in range(n):
        mon.on_flush(
            Interval(seq=i, step=i, wall_time=0.0, elapsed_s=2.0, steps=10, tokens=10_000, samples=10)
        )
    out: dict[str, list[tuple[dict[str, Any], float]]] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else []:
        for scope in rm.scope_metrics:
            for metric in scope.metrics:
                out[metric.name] = [(dict(p.attributes or {}), p.value) for p in metric.data.data_points]
    mon.close()
    provider.shutdown()
    return mon, out


def test_mfu_from_table(reader: InMemoryMetricReader) -> None:
    events = Events()
    _, pts = run_flushes(reader, "NVIDIA H100 80GB HBM3", events, flops_per_token=1e9)
    achieved = 1e9 * 10_000 / 2.0
    assert pts[sc.FLOPS.name] == [({}, pytest.approx(achieved))]
    [(attrs, mfu)] = pts[sc.MFU.name]
    assert mfu == pytest.approx(achieved / 989.5e12)
    assert attrs == {sc.PEAK_SOURCE: "table:h100-sxm:bf16", sc.COMPUTE_DTYPE: "bf16", sc.PEAK_FLOPS: 989.5e12}
    assert not events.items


@pytest.mark.parametrize(("dtype", "peak"), [("fp8", 1979e12), ("fp16", 989.5e12), ("tf32", 494.7e12)])
def test_the_compute_dtype_setting_picks_its_peak_row(
    reader: InMemoryMetricReader, dtype: str, peak: float
) -> None:
    _, pts = run_flushes(reader, "NVIDIA H100 80GB HBM3", Events(), flops_per_token=1e9, compute_dtype=dtype)
    [(attrs, mfu)] = pts[sc.MFU.name]
    assert mfu == pytest.approx(1e9 * 10_000 / 2.0 / peak)
    assert attrs == {sc.PEAK_SOURCE: f"table:h100-sxm:{dtype}", sc.COMPUTE_DTYPE: dtype, sc.PEAK_FLOPS: peak}


def _mfu_points(mon: HardwareMonitor, reader: InMemoryMetricReader, autocast: str | None) -> dict[str, Any]:
    mon.on_flush(Interval(seq=0, step=0, wall_time=0.0, elapsed_s=2.0, steps=10, tokens=10_000, samples=10,
                          autocast_dtype=autocast))  # fmt: skip
    data = reader.get_metrics_data()
    assert data is not None
    [mfu] = [
        m
        for rm in data.resource_metrics
        for s in rm.scope_metrics
        for m in s.metrics
        if m.name == sc.MFU.name
    ]
    # one point per dtype reported so far (a gauge keeps each attribute set's last value)
    return {p.attributes[sc.COMPUTE_DTYPE]: p.attributes for p in mfu.data.data_points}


def test_auto_takes_the_autocast_dtype_seen_at_a_flush(reader: InMemoryMetricReader) -> None:
    provider = MeterProvider(metric_readers=[reader])
    nvml = FakeNvml([FakeGpu(uuid=gpu_uuid(0), name="NVIDIA H100 80GB HBM3")])
    mon = HardwareMonitor(
        Config(flops_per_token=1e9), provider.get_meter("t"), None, 0, discover_with_timeout(0, nvml, {})
    )
    mon.start(background=False)
    try:
        assert mon.efficiency.compute_dtype() == "bf16"  # nothing seen yet: bf16 assumed
        points = _mfu_points(mon, reader, "fp16")
        assert points["fp16"][sc.PEAK_SOURCE] == "table:h100-sxm:fp16"
        _mfu_points(mon, reader, None)  # autocast not active at this flush: the seen dtype stays
        assert mon.efficiency.compute_dtype() == "fp16"
    finally:
        mon.close()
        provider.shutdown()


def test_a_set_compute_dtype_wins_over_the_autocast_dtype_seen(reader: InMemoryMetricReader) -> None:
    provider = MeterProvider(metric_readers=[reader])
    nvml = FakeNvml([FakeGpu(uuid=gpu_uuid(0), name="NVIDIA H100 80GB HBM3")])
    config = Config(flops_per_token=1e9, compute_dtype="fp8")
    mon = HardwareMonitor(config, provider.get_meter("t"), None, 0, discover_with_timeout(0, nvml, {}))
    mon.start(background=False)
    try:
        points = _mfu_points(mon, reader, "bf16")
        assert set(points) == {"fp8"}
        assert points["fp8"][sc.PEAK_FLOPS] == 1979e12
    finally:
        mon.close()
        provider.shutdown()


def test_fp32_means_tf32_when_torch_lets_matmuls_use_tf32(reader: InMemoryMetricReader) -> None:
    provider = MeterProvider(metric_readers=[reader])
    nvml = FakeNvml([FakeGpu(uuid=gpu_uuid(0), name="NVIDIA H100 80GB HBM3")])
    config = Config(flops_per_token=1e9, compute_dtype="fp32")
    mon = HardwareMonitor(config, provider.get_meter("t"), None, 0, discover_with_timeout(0, nvml, {}))
    mon.start(background=False)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert mon.efficiency.resolve_peak() == (67e12, "table:h100-sxm:fp32")
        torch.set_float32_matmul_precision("high")
        assert mon.efficiency.resolve_peak() == (494.7e12, "table:h100-sxm:tf32")
    finally:
        torch.set_float32_matmul_precision(before)
        mon.close()
        provider.shutdown()


class _Intervals:
    def __init__(self) -> None:
        self.autocast: list[str | None] = []

    def on_flush(self, interval: Interval) -> None:
        self.autocast.append(interval.autocast_dtype)

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("torch_dtype", "name"), [(torch.bfloat16, "bf16"), (torch.float16, "fp16")])
def test_cpu_autocast_around_the_step_is_detected_in_a_session(torch_dtype: torch.dtype, name: str) -> None:
    import urllib.request

    from helpers.ports import free_port
    from prometheus_client.parser import text_string_to_metric_families

    import otel_train as ot
    from otel_train.testing import current_session

    port = free_port()
    ot.init(prometheus_port=port, verbosity=0, log_interval=2, run_dir_enabled=False,
                      peak_flops=1e12, flops_per_token=1e6)  # fmt: skip
    session = current_session()
    intervals = _Intervals()
    session.worker.add_listener(intervals)
    try:
        model = nn.Linear(4, 4)
        for i in range(2):
            with torch.autocast("cpu", dtype=torch_dtype), ot.step(i, tokens=100):
                ot.record("loss", model(torch.ones(2, 4)).float().sum())
        session.worker.stop(timeout_s=10)
        text = urllib.request.urlopen(session.prometheus_url, timeout=10).read().decode()
    finally:
        ot.shutdown()
    [mfu] = [
        s for f in text_string_to_metric_families(text) for s in f.samples if s.name == sc.MFU.prometheus_name
    ]
    assert intervals.autocast == [name]  # read on the training thread (autocast state is per thread)
    assert mfu.labels["compute_dtype"] == name
    assert mfu.labels["peak_source"] == "config:peak_flops"
    assert float(mfu.labels["peak_flops"]) == 1e12


def test_unknown_device_gives_flops_but_no_mfu(reader: InMemoryMetricReader) -> None:
    _, pts = run_flushes(reader, "NVIDIA Mystery GPU", Events(), flops_per_token=1e9)
    assert sc.FLOPS.name in pts
    assert sc.MFU.name not in pts


def test_configured_flops_per_token_and_dtype(reader: InMemoryMetricReader) -> None:
    provider = MeterProvider(metric_readers=[reader])
    nvml = FakeNvml([FakeGpu(uuid=gpu_uuid(0), name="NVIDIA A100-SXM4-80GB")])
    config = Config(flops_per_token=2e9, compute_dtype="tf32")
    mon = HardwareMonitor(config, provider.get_meter("t"), None, 0, discover_with_timeout(0, nvml, {}))
    mon.start(background=False)
    assert mon.efficiency.resolve_peak() == (156e12, "table:a100-sxm:tf32")
    mon.on_flush(Interval(seq=0, step=0, wall_time=0.0, elapsed_s=1.0, steps=1, tokens=1000, samples=1))
    data = reader.get_metrics_data()
    assert data is not None
    mfu = [
        m
        for rm in data.resource_metrics
        for s in rm.scope_metrics
        for m in s.metrics
        if m.name == sc.MFU.name
    ]
    assert mfu[0].data.data_points[0].value == pytest.approx(2e9 * 1000 / 156e12)
    mon.close()
    provider.shutdown()


def test_wrong_peak_over_100_percent_raises_one_event(reader: InMemoryMetricReader) -> None:
    events = Events()
    _, pts = run_flushes(reader, "NVIDIA H100 80GB HBM3", events, n=3, flops_per_token=1e9, peak_flops=1e9)
    [(attrs, mfu)] = pts[sc.MFU.name]
    assert mfu > 1.0
    assert attrs == {sc.PEAK_SOURCE: "config:peak_flops", sc.COMPUTE_DTYPE: "bf16", sc.PEAK_FLOPS: 1e9}
    over = [e for e in events.items if e[0] == "mfu_over_100"]
    assert len(over) == 1  # once, not every flush
    assert "config:peak_flops" in over[0][1]


def test_mfu_reaches_the_console_and_run_dir_under_its_catalogue_key(capsys) -> None:
    """The peak source describes the MFU value; as a key segment it made `throughput/mfu/<source>`,
    which the console's summary line never found and which renamed the series when the source did."""
    import json

    import otel_train as ot
    from otel_train.testing import current_session

    ot.init(prometheus_port=0, verbosity=1, progress_bar=False, log_interval=5,
                      peak_flops=1e12, flops_per_token=1e6)  # fmt: skip
    session = current_session()
    for i in range(5):
        with ot.step(i, tokens=1000):
            ot.record("loss", 1.0)
    run_dir = session.run_dir
    ot.shutdown()
    assert run_dir is not None
    rows = [json.loads(line) for line in (run_dir / "metrics.rank0.jsonl").read_text().splitlines()]
    mfu_keys = {k for row in rows for k in row if k.startswith(sc.MFU.key)}
    assert mfu_keys == {sc.MFU.key}
    assert any(row.get(sc.MFU.key, 0) > 0 for row in rows)
    assert " | mfu " in capsys.readouterr().out
