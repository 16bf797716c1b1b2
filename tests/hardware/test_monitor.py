"""HardwareMonitor against the fake NVML with a real MeterProvider + InMemoryMetricReader."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from helpers.events import Events
from helpers.fake_nvml import (
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_RESET_REQUIRED,
    NVML_ERROR_UNKNOWN,
    FakeGpu,
    FakeNvml,
    gpu_uuid,
)
from helpers.waiting import wait_for
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_train import semconv as sc
from otel_train.config import Config
from otel_train.core.buffer import Interval
from otel_train.core.instruments import StepReader, key_for
from otel_train.hardware import (
    RES_GPU_DRIVER_VERSION,
    RES_GPU_NAME,
    RES_GPU_PCI_BUS_ID,
    RES_GPU_UUID,
    Discovery,
    HardwareMonitor,
    discover_with_timeout,
    gpu_sampler,
    parse_cuda_visible_devices,
)
from otel_train.hardware.discovery import GpuDevice

GPU_SPECS = list(gpu_sampler.GPU_SPECS)
HOST_SPECS = [sc.PROCESS_CPU_UTILIZATION, sc.PROCESS_MEMORY_USAGE, sc.SYSTEM_MEMORY_USAGE]


@dataclass
class Rig:
    reader: InMemoryMetricReader
    provider: MeterProvider
    events: Events
    monitors: list[HardwareMonitor] = field(default_factory=list)

    def monitor(
        self,
        nvml: Any = None,
        local_rank: int = 0,
        *,
        settings: dict[str, Any] | None = None,
        environ: dict[str, str] | None = None,
        torch_cuda: Any = None,
        clock: Any = None,
        init_timeout_s: float = 5.0,
    ) -> HardwareMonitor:
        """A monitor as assemble builds one (discovery first), with fakes put in its parts."""
        config = Config(**{"hardware_interval_s": 0.02, **(settings or {})})
        discovery = (
            discover_with_timeout(local_rank, nvml, environ or {}, torch_cuda, init_timeout_s)
            if config.hardware
            else Discovery(None, reason="hardware off")
        )
        mon = HardwareMonitor(
            config, self.provider.get_meter("otel_train"), self.events, local_rank, discovery
        )
        if torch_cuda is not None:
            mon.efficiency.torch_cuda = lambda: torch_cuda
        if clock is not None:
            mon.gpu_sampler.clock = clock
        self.monitors.append(mon)
        return mon

    def points(self) -> dict[str, list[tuple[dict[str, Any], float, str]]]:
        """name -> [(attributes, value, unit)] of the current collection."""
        out: dict[str, list[tuple[dict[str, Any], float, str]]] = {}
        data = self.reader.get_metrics_data()
        for rm in data.resource_metrics if data else []:
            for scope in rm.scope_metrics:
                for metric in scope.metrics:
                    for p in metric.data.data_points:
                        out.setdefault(metric.name, []).append(
                            (dict(p.attributes or {}), p.value, metric.unit)
                        )
        return out


@pytest.fixture
def rig() -> Iterator[Rig]:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    r = Rig(reader, provider, Events())
    yield r
    for mon in r.monitors:
        mon.close()
    provider.shutdown()


def value(points: dict[str, list[tuple[dict[str, Any], float, str]]], name: str, **attrs: str) -> float:
    matches = [v for a, v, _ in points.get(name, []) if all(a.get(k) == want for k, want in attrs.items())]
    assert len(matches) == 1, (name, attrs, points.get(name))
    return matches[0]


def interval(**kw: Any) -> Interval:
    base: dict[str, Any] = {
        "seq": 1,
        "step": 9,
        "wall_time": 0.0,
        "elapsed_s": 10.0,
        "steps": 10,
        "tokens": 0,
        "samples": 0,
    }
    base.update(kw)
    return Interval(**base)


# --- catalogue conformance --------------------------------------------------------------------------------
def test_gpu_metrics_match_catalogue_names_units_attributes(rig: Rig) -> None:
    gpu = FakeGpu(uuid=gpu_uuid(0), clock_reasons=0x4 | 0x40, xids=[48])
    nvml = FakeNvml([gpu])
    now = [100.0]
    mon = rig.monitor(nvml, clock=lambda: now[0])
    mon.start(background=False)
    mon.sample_once()
    now[0] += 2.0
    mon.sample_once()  # hw.gpu.io integrates the throughput over the 2 s between samples
    pts = rig.points()
    for spec in GPU_SPECS:
        assert spec.name in pts, spec.name
        for attrs, _, unit in pts[spec.name]:
            assert unit == spec.unit, spec.name
            assert set(attrs) == set(spec.attributes), (spec.name, attrs)
            assert attrs[sc.HW_ID] == gpu.uuid and attrs[sc.HW_NAME] == gpu.name
            assert attrs.get(sc.HW_TYPE, sc.HW_TYPE_GPU) == sc.HW_TYPE_GPU
    assert value(pts, sc.GPU_UTILIZATION.name) == pytest.approx(0.75)
    assert value(pts, sc.GPU_MEMORY_UTILIZATION.name) == pytest.approx(gpu.memory_used / gpu.memory_total)
    assert value(pts, sc.GPU_MEMORY_CONTROLLER.name) == pytest.approx(0.30)
    assert value(pts, sc.GPU_MEMORY_USAGE.name) == gpu.memory_used
    assert value(pts, sc.GPU_MEMORY_LIMIT.name) == gpu.memory_total
    assert value(pts, sc.GPU_TEMPERATURE.name) == 55
    assert value(pts, sc.GPU_POWER.name) == pytest.approx(350.0)  # mW -> W
    assert value(pts, sc.GPU_ENERGY.name) == pytest.approx(1000.0)  # mJ -> J
    assert value(pts, sc.GPU_CLOCK_SM.name) == pytest.approx(1980e6)  # MHz -> Hz
    assert value(pts, sc.GPU_CLOCK_MEMORY.name) == pytest.approx(2619e6)
    assert value(pts, sc.GPU_IO.name, **{sc.DIRECTION: "receive"}) == 2000 * 1024 * 2  # KB/s x 2 s
    assert value(pts, sc.GPU_IO.name, **{sc.DIRECTION: "transmit"}) == 1000 * 1024 * 2
    throttle = {a[sc.THROTTLE_REASON]: v for a, v, _ in pts[sc.GPU_THROTTLE.name]}
    assert throttle == {"power_cap": 1, "thermal": 1, "hw_slowdown": 0, "sw_slowdown": 0}
    errors = {a[sc.ERROR_TYPE]: v for a, v, _ in pts[sc.GPU_ERRORS.name]}
    assert errors == {"ecc_corrected": 0, "ecc_uncorrected": 0, "xid": 1}
    [(_, message, attrs)] = rig.events.named("gpu_xid")  # the code, which the count cannot carry
    assert attrs == {sc.HW_ID: gpu.uuid, sc.HW_NAME: gpu.name, sc.XID: 48} and "XID 48" in message
    for spec in HOST_SPECS:
        assert spec.name in pts or spec is sc.PROCESS_CPU_UTILIZATION  # CPU needs a 2nd sample
        for attrs, _, unit in pts.get(spec.name, []):
            assert unit == spec.unit and set(attrs) == set(spec.attributes)


def test_gpu_resource_attributes(rig: Rig) -> None:
    gpu = FakeGpu(uuid=gpu_uuid(3), name="NVIDIA H200", pci_bus_id="00000000:9A:00.0")
    mon = rig.monitor(FakeNvml([gpu], driver_version="560.35.03"))
    assert mon.discovery.resource_attributes() == {
        RES_GPU_UUID: gpu.uuid,
        RES_GPU_PCI_BUS_ID: "00000000:9A:00.0",  # bytes in the NVML struct, decoded
        RES_GPU_NAME: "NVIDIA H200",
        RES_GPU_DRIVER_VERSION: "560.35.03",
    }


def test_unsupported_values_are_absent_not_zero_and_not_asked_again(rig: Rig) -> None:
    gpu = FakeGpu(
        uuid=gpu_uuid(0),
        unsupported={
            "nvmlDeviceGetUtilizationRates",
            "nvmlDeviceGetTotalEccErrors",
            "nvmlDeviceGetPowerUsage",
        },
        no_permission={"nvmlDeviceGetTemperature"},  # MIG in a container
    )
    nvml = FakeNvml([gpu])
    mon = rig.monitor(nvml)
    mon.start(background=False)
    mon.sample_once()
    mon.sample_once()
    pts = rig.points()
    for spec in (sc.GPU_UTILIZATION, sc.GPU_MEMORY_CONTROLLER, sc.GPU_POWER, sc.GPU_TEMPERATURE):
        assert spec.name not in pts, spec.name
    assert {a[sc.ERROR_TYPE] for a, _, _ in pts[sc.GPU_ERRORS.name]} == {"xid"}
    assert value(pts, sc.GPU_MEMORY_USAGE.name) == gpu.memory_used  # the other fields still work
    assert value(pts, sc.GPU_ENERGY.name) == pytest.approx(1000.0)
    assert nvml.calls["nvmlDeviceGetUtilizationRates"] == 1  # remembered, not polled again
    assert nvml.calls["nvmlDeviceGetTemperature"] == 1


def test_throttle_reasons_fall_back_to_the_old_function(rig: Rig) -> None:
    gpu = FakeGpu(uuid=gpu_uuid(0), clock_reasons=0x8, unsupported={"nvmlDeviceGetCurrentClocksEventReasons"})
    mon = rig.monitor(FakeNvml([gpu]))
    mon.start(background=False)
    mon.sample_once()
    throttle = {a[sc.THROTTLE_REASON]: v for a, v, _ in rig.points()[sc.GPU_THROTTLE.name]}
    assert throttle == {"power_cap": 0, "thermal": 0, "hw_slowdown": 1, "sw_slowdown": 0}


def test_callbacks_read_only_the_cache(rig: Rig) -> None:
    nvml = FakeNvml()
    mon = rig.monitor(nvml)
    mon.start(background=False)
    mon.sample_once()
    before = dict(nvml.calls)
    for _ in range(3):
        assert rig.points()[sc.GPU_UTILIZATION.name]
    assert dict(nvml.calls) == before


# --- device mapping --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("visible", "local_rank", "expected"),
    [
        ("1,0", 0, 1),  # rank-local device 0 is physical GPU 1
        ("1,0", 1, 0),
        (None, 1, 1),  # unset: all devices, local rank's index
        (f"{gpu_uuid(1)},{gpu_uuid(0)}", 0, 1),  # UUID form
        (gpu_uuid(1)[:12], 3, 1),  # unique UUID prefix; one GPU per process: any local rank
    ],
)
def test_cuda_visible_devices_maps_local_rank_to_uuid(
    rig: Rig, visible: str | None, local_rank: int, expected: int
) -> None:
    nvml = FakeNvml([FakeGpu(uuid=gpu_uuid(0)), FakeGpu(uuid=gpu_uuid(1), name="NVIDIA A100-SXM4-80GB")])
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    mon = rig.monitor(nvml, local_rank=local_rank, environ=environ)
    mon.start(background=False)
    mon.sample_once()
    assert mon.discovery.resource_attributes()[RES_GPU_UUID] == gpu_uuid(expected)
    ids = {a[sc.HW_ID] for a, _, _ in rig.points()[sc.GPU_MEMORY_USAGE.name]}
    assert ids == {gpu_uuid(expected)}  # only the GPU this rank uses


def test_a_gpu_nvml_refuses_does_not_hide_the_others(rig: Rig) -> None:
    """GPU 0 outside this job's device cgroup (NoPermission): GPU 1, the one the rank uses, is found."""
    refused = FakeGpu(uuid=gpu_uuid(0), no_permission={"nvmlDeviceGetHandleByIndex"})
    nvml = FakeNvml([refused, FakeGpu(uuid=gpu_uuid(1))])
    mon = rig.monitor(nvml, environ={"CUDA_VISIBLE_DEVICES": gpu_uuid(1)})
    mon.start(background=False)
    mon.sample_once()
    assert mon.discovery.resource_attributes()[RES_GPU_UUID] == gpu_uuid(1)
    assert {a[sc.HW_ID] for a, _, _ in rig.points()[sc.GPU_MEMORY_USAGE.name]} == {gpu_uuid(1)}


def test_xid_wait_not_supported_means_no_xid_series(rig: Rig) -> None:
    gpu = FakeGpu(uuid=gpu_uuid(0), unsupported={"nvmlEventSetWait"})
    mon = rig.monitor(FakeNvml([gpu]))
    mon.start(background=False)
    mon.sample_once()
    mon.sample_once()
    errors = {a[sc.ERROR_TYPE] for a, _, _ in rig.points()[sc.GPU_ERRORS.name]}
    assert errors == {"ecc_corrected", "ecc_uncorrected"}  # no "xid" count stuck at 0
    assert not [e for e in rig.events.items if e[0] == "gpu_lost"]


def test_hidden_or_ambiguous_devices_give_no_gpu(rig: Rig) -> None:
    nvml = FakeNvml([FakeGpu(uuid=gpu_uuid(0)), FakeGpu(uuid=gpu_uuid(1))])
    assert rig.monitor(nvml, environ={"CUDA_VISIBLE_DEVICES": "-1"}).discovery.resource_attributes() == {}
    assert (
        rig.monitor(
            nvml, local_rank=5, environ={"CUDA_VISIBLE_DEVICES": "0,1"}
        ).discovery.resource_attributes()
        == {}
    )
    assert nvml.initialized == 0  # each failed discovery shut NVML down again


def test_parse_cuda_visible_devices() -> None:
    assert parse_cuda_visible_devices(None) is None
    assert parse_cuda_visible_devices("") == []
    assert parse_cuda_visible_devices("1, 0") == ["1", "0"]
    assert parse_cuda_visible_devices("0,-1,2") == ["0"]  # CUDA stops at the first invalid entry
    assert parse_cuda_visible_devices("GPU-abc,MIG-GPU-abc/1/0") == ["GPU-abc", "MIG-GPU-abc/1/0"]
    assert parse_cuda_visible_devices("0,²,1") == ["0"]  # a digit to isdigit, not to int()


class FakeTorchCuda:
    """The torch.cuda calls the monitor makes (host-side only)."""

    def __init__(self, uuids: list[str], stats: dict[str, int] | None = None, total: int = 100) -> None:
        self.uuids = uuids
        self.stats = dict(stats or {})
        self.total = total
        self.peak_resets = 0

    initialized = True

    def is_initialized(self) -> bool:
        return self.initialized

    def device_count(self) -> int:
        return len(self.uuids)

    def current_device(self) -> int:
        return 0

    def get_device_properties(self, index: int) -> Any:
        return type(
            "Props", (), {"uuid": self.uuids[index].removeprefix("GPU-"), "total_memory": self.total}
        )()

    def get_device_name(self, index: int) -> str:
        return "NVIDIA H100 80GB HBM3"

    def memory_stats(self, device: int) -> dict[str, int]:
        return dict(self.stats)

    def reset_peak_memory_stats(self, device: int) -> None:
        self.peak_resets += 1


def test_initialised_torch_uuid_wins_over_index_order(rig: Rig) -> None:
    # CUDA's default FASTEST_FIRST order can differ from NVML's PCI order: torch's UUID is exact.
    nvml = FakeNvml([FakeGpu(uuid=gpu_uuid(0)), FakeGpu(uuid=gpu_uuid(1))])
    torch_cuda = FakeTorchCuda([gpu_uuid(1), gpu_uuid(0)])
    mon = rig.monitor(nvml, torch_cuda=torch_cuda, environ={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert mon.discovery.resource_attributes()[RES_GPU_UUID] == gpu_uuid(1)


# --- failure modes ---------------------------------------------------------------------------------------
def test_hung_nvml_call_does_not_block_collection(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    nvml = FakeNvml()
    skew = [0.0]
    mon = rig.monitor(nvml, clock=lambda: time.monotonic() + skew[0])
    mon.start()  # background sampler threads
    wait_for(lambda: mon.gpu_sampler.samples >= 1, 10, "GPU samples")
    nvml.hang("nvmlDeviceGetUtilizationRates")
    try:
        assert nvml.hanging.wait(10), "the sampler never reached the hung call"
        result: dict[str, Any] = {}

        def collect() -> None:
            result["points"] = rig.points()
            mon.on_flush(interval(tokens=100))  # the flush worker is not blocked either
            result["done"] = True

        t = threading.Thread(target=collect, daemon=True)
        t.start()
        t.join(10)  # liveness, not speed: without the cache this would block until release()
        assert result.get("done"), "collection blocked on the hung NVML call"
        assert value(result["points"], sc.GPU_UTILIZATION.name) == pytest.approx(0.75)  # cached value
        assert nvml.hanging.is_set()  # the sampler is still stuck while we collected
        skew[0] = 60.0  # a minute later the flush says so, naming the call
        with caplog.at_level(logging.WARNING, logger="otel_train.hardware"):
            mon.on_flush(interval())
        assert "stuck in nvmlDeviceGetUtilizationRates" in caplog.text
    finally:
        nvml.release()
    mon.close()


def test_hung_nvml_init_is_abandoned(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    nvml = FakeNvml()
    nvml.hang("nvmlInit")
    try:
        mon = rig.monitor(nvml, init_timeout_s=0.2)
        with caplog.at_level(logging.INFO, logger="otel_train.hardware"):
            mon.start(background=False)
        assert not mon.gpu_sampler.devices
        assert "did not return" in caplog.text
        assert not any(n.startswith("hw.") for n in rig.points())
    finally:
        nvml.release()
    # the init that returned after the timeout is shut down again: nobody samples through it
    wait_for(lambda: nvml.calls["nvmlShutdown"] == 1, 10, "the late NVML init shut down")
    assert nvml.initialized == 0


def test_sampler_follows_the_gpu_torch_uses_once_cuda_is_initialised(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """Discovery before CUDA goes by index (NVML's PCI order); CUDA's FASTEST_FIRST order put the
    H100 first on this workstation, so torch's cuda:0 is NVML's device 1."""
    a1000 = FakeGpu(uuid=gpu_uuid(0), name="NVIDIA RTX A1000", energy_mj=5_000_000)
    h100 = FakeGpu(uuid=gpu_uuid(1), name="NVIDIA H100 80GB HBM3", energy_mj=1_000_000)
    nvml = FakeNvml([a1000, h100])
    torch_cuda = FakeTorchCuda([gpu_uuid(1), gpu_uuid(0)])
    torch_cuda.initialized = False
    mon = rig.monitor(nvml, torch_cuda=torch_cuda, settings={"flops_per_token": 1e9})
    mon.start(background=False)
    assert mon.discovery.resource_attributes()[RES_GPU_UUID] == gpu_uuid(0)  # by index, as before CUDA
    mon.sample_once()
    mon.on_flush(interval(tokens=1000))  # CUDA not initialised yet: nothing to check against
    torch_cuda.initialized = True
    with caplog.at_level(logging.WARNING, logger="otel_train.hardware"):
        mon.on_flush(interval(tokens=1000))
        mon.sample_once()
    assert "CUDA device is NVIDIA H100 80GB HBM3" in caplog.text and "CUDA_DEVICE_ORDER" in caplog.text
    pts = rig.points()
    assert {a[sc.HW_ID] for a, _, _ in pts[sc.GPU_UTILIZATION.name]} == {gpu_uuid(1)}
    assert mon.efficiency.resolve_peak("bf16")[1] == "table:h100-sxm:bf16"  # not the A1000's "no peak"
    mon.on_flush(interval(tokens=1000))  # the energy baseline starts again on the followed GPU
    h100.energy_mj += 2_000_000
    mon.sample_once()
    mon.on_flush(interval(tokens=1000))
    assert value(rig.points(), sc.POWER_AVERAGE.name) > 0  # from the H100's counter alone


def test_an_unknown_nvml_error_on_one_field_of_a_healthy_gpu_does_not_lose_it(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    gpu = FakeGpu(uuid=gpu_uuid(0), errors={"nvmlDeviceGetPcieThroughput": NVML_ERROR_UNKNOWN})
    mon = rig.monitor(FakeNvml([gpu]))
    mon.start(background=False)
    with caplog.at_level(logging.WARNING, logger="otel_train.hardware"):
        for _ in range(3):
            mon.sample_once()
    assert not rig.events.named("gpu_lost")
    pts = rig.points()
    assert value(pts, sc.GPU_UTILIZATION.name) == pytest.approx(0.75)
    assert sc.GPU_IO.name not in pts
    told = [r for r in caplog.records if "nvmlDeviceGetPcieThroughput failed" in r.getMessage()]
    assert len(told) == 2, told  # once per field (receive, transmit) over three samples


def test_an_unknown_error_from_a_gpu_that_cannot_say_its_uuid_is_a_lost_gpu(rig: Rig) -> None:
    gpu = FakeGpu(uuid=gpu_uuid(0))
    mon = rig.monitor(FakeNvml([gpu]))
    mon.start(background=False)
    mon.sample_once()
    gpu.errors = dict.fromkeys(("nvmlDeviceGetUtilizationRates", "nvmlDeviceGetUUID"), NVML_ERROR_UNKNOWN)
    mon.sample_once()
    (lost,) = rig.events.named("gpu_lost")
    assert "nvmlDeviceGetUUID" in lost[1]
    assert rig.events.severities["gpu_lost"] == ["ERROR"]


def test_a_gpu_that_requires_a_reset_is_lost(rig: Rig) -> None:
    gpu = FakeGpu(uuid=gpu_uuid(0), errors={"nvmlDeviceGetMemoryInfo": NVML_ERROR_RESET_REQUIRED})
    mon = rig.monitor(FakeNvml([gpu]))
    mon.start(background=False)
    mon.sample_once()
    assert len(rig.events.named("gpu_lost")) == 1
    assert not any(spec.name in rig.points() for spec in GPU_SPECS)


def test_a_read_that_keeps_failing_is_absent_and_said_once(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    gpu = FakeGpu(uuid=gpu_uuid(0), errors={"nvmlDeviceGetPowerUsage": NVML_ERROR_INVALID_ARGUMENT})
    nvml = FakeNvml([gpu])
    mon = rig.monitor(nvml)
    mon.start(background=False)
    with caplog.at_level(logging.WARNING, logger="otel_train.hardware"):
        for _ in range(3):
            mon.sample_once()
    assert sc.GPU_POWER.name not in rig.points()
    assert nvml.calls["nvmlDeviceGetPowerUsage"] == 3  # asked again: it may recover
    assert sum("nvmlDeviceGetPowerUsage failed" in r.getMessage() for r in caplog.records) == 1
    del gpu.errors["nvmlDeviceGetPowerUsage"]
    mon.sample_once()
    assert value(rig.points(), sc.GPU_POWER.name) == pytest.approx(350.0)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_sampler_thread_ended_by_a_bug_leaves_no_stale_gauges(rig: Rig) -> None:
    nvml = FakeNvml()
    mon = rig.monitor(nvml)
    mon.start()
    wait_for(lambda: mon.gpu_sampler.samples >= 1, 10, "GPU samples")
    assert sc.GPU_UTILIZATION.name in rig.points()
    nvml.nvmlDeviceGetTemperature = None  # type: ignore[method-assign]  # calling it: TypeError, a bug
    (thread,) = [t for t in mon._threads if t.name == "otel-train-hw-gpu"]
    thread.join(10)
    assert not thread.is_alive()
    assert not any(spec.name in rig.points() for spec in GPU_SPECS)  # gone, not frozen at old values


def test_gpu_lost_stops_its_gauges_and_emits_one_event(rig: Rig) -> None:
    gpu = FakeGpu(uuid=gpu_uuid(0))
    nvml = FakeNvml([gpu])
    mon = rig.monitor(nvml)
    mon.start(background=False)
    mon.sample_once()
    assert sc.GPU_UTILIZATION.name in rig.points()
    gpu.lost = True
    for _ in range(3):
        mon.sample_once()
    pts = rig.points()
    for spec in GPU_SPECS:  # gauges and the observable counters alike: no more points
        assert spec.name not in pts, spec.name
    lost = rig.events.named("gpu_lost")
    assert len(lost) == 1
    assert lost[0][2][sc.HW_ID] == gpu.uuid
    calls = sum(nvml.calls.values())
    mon.sample_once()
    assert sum(nvml.calls.values()) == calls  # the lost handle is not polled any more
    assert sc.PROCESS_MEMORY_USAGE.name in pts  # host metrics go on


@pytest.mark.parametrize("code", [NVML_ERROR_LIBRARY_NOT_FOUND, NVML_ERROR_DRIVER_NOT_LOADED])
def test_no_nvml_means_no_gpu_metrics_and_one_info_line(
    rig: Rig, caplog: pytest.LogCaptureFixture, code: int
) -> None:
    nvml = FakeNvml()
    nvml.init_error = code
    mon = rig.monitor(nvml)
    with caplog.at_level(logging.DEBUG, logger="otel_train.hardware"):
        mon.start(background=False)
        mon.sample_once()
        mon.on_flush(interval())
    records = [r for r in caplog.records if r.name == "otel_train.hardware" and r.levelno >= logging.INFO]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert "no GPU metrics" in records[0].getMessage()
    pts = rig.points()
    assert not [n for n in pts if n.startswith("hw.")]
    assert sc.PROCESS_MEMORY_USAGE.name in pts
    assert mon.discovery.resource_attributes() == {}


def test_missing_pynvml_package(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    mon = rig.monitor(None)
    with caplog.at_level(logging.INFO, logger="otel_train.hardware"):
        mon.start(background=False)
    assert not mon.gpu_sampler.devices
    assert "nvidia-ml-py not importable" in caplog.text


def test_hardware_disabled_does_nothing(rig: Rig) -> None:
    nvml = FakeNvml()
    mon = rig.monitor(nvml, settings={"hardware": False})
    mon.start()
    mon.on_flush(interval())
    assert mon.discovery.resource_attributes() == {}
    assert rig.points() == {}
    assert sum(nvml.calls.values()) == 0


def test_close_shuts_nvml_down(rig: Rig) -> None:
    nvml = FakeNvml()
    mon = rig.monitor(nvml)
    mon.start()
    wait_for(lambda: mon.gpu_sampler.samples >= 2, 10, "GPU samples")
    mon.close(timeout_s=5)
    assert nvml.initialized == 0
    assert nvml.calls["nvmlEventSetFree"] == 1


# --- host ------------------------------------------------------------------------------------------------
def test_host_metrics(rig: Rig) -> None:
    import psutil

    mon = rig.monitor(FakeNvml())
    mon.start(background=False)
    mon.sample_once()
    sum(i * i for i in range(20000))  # a little CPU between the two samples
    mon.sample_once()
    pts = rig.points()
    assert 0.0 <= value(pts, sc.PROCESS_CPU_UTILIZATION.name) <= 1.0
    assert value(pts, sc.PROCESS_MEMORY_USAGE.name) > 10 * 1024**2
    used = value(pts, sc.SYSTEM_MEMORY_USAGE.name, **{sc.MEMORY_STATE: "used"})
    free = value(pts, sc.SYSTEM_MEMORY_USAGE.name, **{sc.MEMORY_STATE: "free"})
    assert used > 0 and free > 0
    assert used + free == pytest.approx(psutil.virtual_memory().total, rel=0.05)


def test_process_cpu_utilization_is_a_share_of_the_cpus_available_to_it(rig: Rig) -> None:
    """The OTel convention: CPU time over elapsed time and the CPUs the process may use."""

    class FourCpuProcess:
        def cpu_percent(self, interval: None) -> float:
            return 150.0  # psutil: one and a half cores busy

        def cpu_affinity(self) -> list[int]:
            return [0, 1, 2, 3]

        def memory_info(self) -> Any:
            return type("Mem", (), {"rss": 1})()

    mon = rig.monitor(FakeNvml())
    mon.host_sampler.process = FourCpuProcess()
    mon.start(background=False)
    mon.sample_once()
    mon.sample_once()
    assert value(rig.points(), sc.PROCESS_CPU_UTILIZATION.name) == pytest.approx(0.375)


# --- flush: allocator, pressure, energy ------------------------------------------------------------------
def test_cuda_allocator_gauges_counters_and_pressure(rig: Rig) -> None:
    stats = {
        "allocated_bytes.all.current": 40,
        "reserved_bytes.all.current": 60,
        "allocated_bytes.all.peak": 55,
        "num_alloc_retries": 2,
        "num_ooms": 0,
    }
    torch_cuda = FakeTorchCuda([gpu_uuid(0)], stats, total=100)
    mon = rig.monitor(FakeNvml([FakeGpu(uuid=gpu_uuid(0), memory_used=1)]), torch_cuda=torch_cuda)
    mon.start(background=False)
    mon.sample_once()
    mon.on_flush(interval())
    pts = rig.points()
    assert value(pts, sc.CUDA_MEMORY_ALLOCATED.name) == 40
    assert value(pts, sc.CUDA_MEMORY_RESERVED.name) == 60
    assert value(pts, sc.CUDA_MEMORY_PEAK.name) == 55
    assert value(pts, sc.CUDA_ALLOC_RETRIES.name) == 2
    assert torch_cuda.peak_resets == 1  # the peak is per interval
    assert not rig.events.named("memory_pressure")

    torch_cuda.stats.update({"num_alloc_retries": 5, "num_ooms": 1, "reserved_bytes.all.current": 97})
    mon.on_flush(interval())
    mon.on_flush(interval())  # still high: no second event
    pts = rig.points()
    assert value(pts, sc.CUDA_ALLOC_RETRIES.name) == 5  # cumulative counter: 2 + 3
    assert value(pts, sc.CUDA_OOMS.name) == 1
    assert len(rig.events.named("memory_pressure")) == 1

    torch_cuda.stats["reserved_bytes.all.current"] = 50
    mon.on_flush(interval())
    torch_cuda.stats["reserved_bytes.all.current"] = 99
    mon.on_flush(interval())
    assert len(rig.events.named("memory_pressure")) == 2  # re-armed after it dropped


def test_peak_reset_can_be_left_to_user_code(rig: Rig) -> None:
    stats = {"allocated_bytes.all.current": 40, "allocated_bytes.all.peak": 55}
    torch_cuda = FakeTorchCuda([gpu_uuid(0)], stats, total=100)
    mon = rig.monitor(
        FakeNvml([FakeGpu(uuid=gpu_uuid(0))]), torch_cuda=torch_cuda,
        settings={"cuda_peak_per_interval": False},
    )  # fmt: skip
    mon.start(background=False)
    mon.on_flush(interval())
    mon.on_flush(interval())
    assert value(rig.points(), sc.CUDA_MEMORY_PEAK.name) == 55  # the run's peak, still reported
    assert torch_cuda.peak_resets == 0  # max_memory_allocated() in user code is untouched


def test_nvml_memory_pressure_without_torch(rig: Rig) -> None:
    gpu = FakeGpu(uuid=gpu_uuid(0), memory_total=100, memory_used=96)
    mon = rig.monitor(FakeNvml([gpu]))
    mon.start(background=False)
    mon.sample_once()
    mon.on_flush(interval())
    [(_, message, _)] = rig.events.named("memory_pressure")
    assert "96.0%" in message


def test_run_dir_rows_carry_sampled_counters_increase_from_the_second_reading_with_no_rate() -> None:
    """The sampler reads energy, ECC errors and PCIe bytes every `hardware_interval_s`, while rows
    come at every flush (about once a second by default): the rows the run directory writes
    (`StepReader`) leave out the first reading (energy and ECC counts since driver load, not this
    run's), carry each later reading's increase in the interval it arrived in (0 in the others),
    and give them no `_per_s`: a rate over a flush interval would be 0 most of the time and a
    multiple of the truth at the flush after a sample."""
    gpu = FakeGpu(uuid=gpu_uuid(0), energy_mj=3_600_000_000, ecc_corrected=7)  # 3.6 MJ since driver load
    reader = StepReader()
    provider = MeterProvider(metric_readers=[reader])
    now = [100.0]
    rig = Rig(InMemoryMetricReader(), provider, Events())
    mon = rig.monitor(FakeNvml([gpu]), settings={"hardware_interval_s": 5.0}, clock=lambda: now[0])
    mon.start(background=False)
    energy = key_for(sc.GPU_ENERGY.name, {sc.HW_ID: gpu.uuid, sc.HW_NAME: gpu.name, sc.HW_TYPE: "gpu"})
    ecc = key_for(
        sc.GPU_ERRORS.name,
        {sc.HW_ID: gpu.uuid, sc.HW_NAME: gpu.name, sc.HW_TYPE: "gpu", sc.ERROR_TYPE: "ecc_corrected"},
    )
    sampled = (sc.GPU_ENERGY.key.split("/")[-1], "/errors/", "/io/")
    try:
        mon.sample_once()
        first = reader.collect_scalars(interval_s=1.0)
        assert (
            first[key_for(sc.GPU_POWER.name, {sc.HW_ID: gpu.uuid, sc.HW_NAME: gpu.name, sc.HW_TYPE: "gpu"})]
            == 350.0
        )
        assert not [k for k in first if any(part in k for part in sampled)], sorted(first)
        rows = []
        for second in range(1, 11):  # flushes every second; a sample every 5
            now[0] += 1.0
            if second % 5 == 0:
                gpu.energy_mj += 5 * 350_000  # 350 W for 5 s
                gpu.ecc_corrected += 1
                mon.sample_once()
            rows.append(reader.collect_scalars(interval_s=1.0))
    finally:
        mon.close()
        provider.shutdown()
    assert [row[energy] for row in rows] == [0, 0, 0, 0, 1750.0, 0, 0, 0, 0, 1750.0]
    assert [row[ecc] for row in rows] == [0, 0, 0, 0, 1, 0, 0, 0, 0, 1]
    assert sum(row[energy] for row in rows) == 2 * 1750.0  # nothing of the 3.6 MJ before the run
    io = [k for row in rows for k in row if "/io/" in k]
    assert io and all(row[k] >= 0 for row in rows for k in row if "/io/" in k)
    assert not [k for row in rows for k in row if k.endswith("_per_s") and any(p in k for p in sampled)]


def test_energy_per_step_token_and_average_power(rig: Rig) -> None:
    now = [100.0]
    gpu = FakeGpu(uuid=gpu_uuid(0), energy_mj=1_000_000)
    mon = rig.monitor(FakeNvml([gpu]), clock=lambda: now[0])
    mon.start(background=False)
    mon.sample_once()
    mon.on_flush(interval())  # baseline
    assert sc.POWER_AVERAGE.name not in rig.points()
    now[0] = 110.0
    gpu.energy_mj += 3_000_000  # 3000 J in 10 s = 300 W
    mon.sample_once()
    mon.on_flush(interval(elapsed_s=10.0, steps=5, tokens=5000))
    pts = rig.points()
    assert value(pts, sc.POWER_AVERAGE.name) == pytest.approx(300.0)
    assert value(pts, sc.ENERGY_PER_STEP.name) == pytest.approx(600.0)
    assert value(pts, sc.ENERGY_PER_TOKEN.name) == pytest.approx(0.6)
    for spec in (sc.POWER_AVERAGE, sc.ENERGY_PER_STEP, sc.ENERGY_PER_TOKEN):
        assert pts[spec.name][0][2] == spec.unit


def test_energy_waits_for_a_new_sample(rig: Rig) -> None:
    now = [100.0]
    gpu = FakeGpu(uuid=gpu_uuid(0))
    mon = rig.monitor(FakeNvml([gpu]), clock=lambda: now[0])
    mon.start(background=False)
    mon.sample_once()
    mon.on_flush(interval())
    mon.on_flush(interval())  # no new sample: nothing (not a fake 0 W)
    assert sc.POWER_AVERAGE.name not in rig.points()


def test_discovery_for_resource_only_is_released_on_close(rig: Rig) -> None:
    nvml = FakeNvml()
    mon = rig.monitor(nvml)
    assert mon.discovery.resource_attributes()[RES_GPU_UUID] == gpu_uuid(0)
    mon.close()
    assert nvml.initialized == 0


def test_energy_sums_every_gpu_of_the_rank_or_is_none_when_one_cannot_say() -> None:
    gpus = [FakeGpu(uuid=gpu_uuid(0), energy_mj=1_000_000), FakeGpu(uuid=gpu_uuid(1), energy_mj=2_000_000)]
    nvml = FakeNvml(gpus)
    nvml.nvmlInit()
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(len(gpus))]
    sampler = gpu_sampler.GpuSampler(Events())
    sampler.attach(nvml, [GpuDevice(h, g.uuid, g.name, None) for h, g in zip(handles, gpus, strict=True)])
    sampler.sample()
    assert sampler.snapshot.energy_j == 3000.0  # mJ -> J, both GPUs
    gpus[1].unsupported.add("nvmlDeviceGetTotalEnergyConsumption")
    sampler.sample()
    assert sampler.snapshot.energy_j is None  # one GPU's share unknown: no partial sum
    gpus[1].lost = True
    sampler.sample()
    assert sampler.snapshot.energy_j == 1000.0  # a lost GPU's series stop: the rest is every GPU
    gpus[0].lost = True
    sampler.sample()
    assert sampler.snapshot.energy_j is None
