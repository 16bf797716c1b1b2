"""Every `hw.*` metric otel_train emits is the OTel hardware semantic conventions' metric of that
name: same unit, same instrument kind, every attribute the spec requires (and the value a GPU
refinement pins, `hw.type="gpu"`). The spec's data is tests/data/semconv_hw.yaml, trimmed from the
semantic-conventions repository at the tag it names (tests/helpers/semconv_trim.py). What the spec
has no metric for is an otel_train extension and must not take an `hw.` name."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml
from helpers.events import Events
from helpers.fake_nvml import FakeGpu, FakeNvml, gpu_uuid
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_train import semconv as sc
from otel_train.config import Config
from otel_train.hardware import HardwareMonitor, discover_with_timeout, gpu_sampler

SPEC = yaml.safe_load((Path(__file__).parents[1] / "data" / "semconv_hw.yaml").read_text())
INSTRUMENT = {
    sc.Kind.GAUGE: "gauge", sc.Kind.OBSERVABLE_GAUGE: "gauge", sc.Kind.COUNTER: "counter",
    sc.Kind.OBSERVABLE_COUNTER: "counter", sc.Kind.OBSERVABLE_UP_DOWN_COUNTER: "updowncounter",
}  # fmt: skip
GPU_VALUES = {
    r["metric"]: r["values"] for r in SPEC["refinements"].values() if r["values"].get("hw.type") == "gpu"
}


def spec_violations(specs: list[sc.MetricSpec], spec: dict[str, Any] = SPEC) -> list[str]:
    """What in `specs` (catalogue entries) disagrees with the hardware conventions."""
    out = []
    for metric in specs:
        if not metric.name.startswith("hw."):
            continue
        want = spec["metrics"].get(metric.name)
        if want is None:
            out.append(
                f"{metric.name}: not a metric of the hardware conventions (an extension is otel_train.*)"
            )
            continue
        if metric.unit != want["unit"]:
            out.append(f"{metric.name}: unit {metric.unit!r}, the spec says {want['unit']!r}")
        if INSTRUMENT[metric.kind] != want["instrument"]:
            out.append(f"{metric.name}: a {INSTRUMENT[metric.kind]}, the spec says {want['instrument']}")
        missing = set(want["required"]) - set(metric.attributes)
        if missing:
            out.append(f"{metric.name}: lacks required attributes {sorted(missing)}")
    return out


def test_the_spec_data_names_its_source() -> None:
    assert SPEC["source"]["repository"] == "open-telemetry/semantic-conventions"
    assert SPEC["source"]["tag"] == "v1.44.0" and len(SPEC["source"]["commit"]) == 40
    assert {"hw.gpu.io", "hw.gpu.memory.utilization", "hw.errors", "hw.power"} <= set(SPEC["metrics"])
    assert GPU_VALUES["hw.errors"] == {"hw.type": "gpu"}


def test_every_hw_metric_in_the_catalogue_follows_the_spec() -> None:
    assert spec_violations(list(sc.CATALOGUE)) == []
    assert any(m.name.startswith("hw.") for m in sc.CATALOGUE)


def test_a_renamed_or_changed_metric_fails() -> None:
    """Planted violations: the check must catch each of them."""
    planted = [
        dataclasses.replace(sc.GPU_POWER, name="hw.gpu.power"),  # renamed out of the spec
        dataclasses.replace(sc.GPU_ENERGY, attributes=(sc.HW_ID, sc.HW_NAME)),  # hw.type dropped
        dataclasses.replace(sc.GPU_IO, kind=sc.Kind.OBSERVABLE_GAUGE),  # the old PCIe gauge
        dataclasses.replace(sc.GPU_MEMORY_USAGE, unit="MiBy"),
    ]
    found = spec_violations(planted)
    assert len(found) == 4, found
    assert "hw.gpu.power: not a metric" in found[0] and "hw.type" in found[1]
    assert "gauge" in found[2] and "unit" in found[3]


def test_every_emitted_hw_data_point_carries_what_the_spec_requires() -> None:
    """The sampler against the fake NVML: what actually reaches the exporters."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    gpu = FakeGpu(uuid=gpu_uuid(0), clock_reasons=0x40, xids=[79])
    mon = HardwareMonitor(
        Config(hardware_interval_s=0.02),
        provider.get_meter("otel_train"),
        Events(),
        0,
        discover_with_timeout(0, FakeNvml([gpu]), {}),
    )
    try:
        mon.start(background=False)
        mon.sample_once()
        data = reader.get_metrics_data()
    finally:
        mon.close()
        provider.shutdown()
    emitted = {m.name: m for rm in data.resource_metrics for s in rm.scope_metrics for m in s.metrics}
    gpu_names = {spec.name for spec in gpu_sampler.GPU_SPECS}
    assert gpu_names <= set(emitted)
    for name in gpu_names:
        if not name.startswith("hw."):
            assert name.startswith("otel_train.gpu."), name  # an extension, named as one
            continue
        want = SPEC["metrics"][name]
        assert emitted[name].unit == want["unit"], name
        for point in emitted[name].data.data_points:
            attrs = dict(point.attributes or {})
            assert set(want["required"]) <= set(attrs), (name, attrs)
            for key, value in GPU_VALUES.get(name, {}).items():
                assert attrs[key] == value, (name, attrs)
            if "hw.type" in attrs:
                assert attrs["hw.type"] == "gpu"
