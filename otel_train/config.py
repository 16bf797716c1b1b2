"""Config: one frozen dataclass of every setting, with its default and its allowed values.

`load_config` (config_loading) resolves one from kwargs > environment > YAML file > defaults.
Standard OpenTelemetry variables are honoured (`OTEL_EXPORTER_OTLP_ENDPOINT`, `..._PROTOCOL`,
`..._HEADERS`, `..._TIMEOUT`, `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`, `OTEL_SERVICE_NAME`,
`OTEL_RESOURCE_ATTRIBUTES`, `OTEL_METRIC_EXPORT_INTERVAL`);
every field also reads `OTEL_TRAIN_<FIELD>` (for example `OTEL_TRAIN_LOG_INTERVAL=50`).
Invalid settings raise `ConfigError` at `init()`, naming the setting, the bad value and the fix.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from otel_train.redaction import REDACTED, is_secret_key, redact, redact_url

OtlpProtocol = Literal["http/protobuf", "grpc"]
TimingLogOption = Literal["max", "minmax", "all"]
WatchAggregate = Literal["layer", "model"]
# The precision MFU's peak is taken for (otel_train.hardware.mfu); "auto": detected (see Config.compute_dtype).
ComputeDtype = Literal["auto", "fp8", "bf16", "fp16", "tf32", "fp32"]
# Which series each rank exports (README "Scale"): every one, or only those that find and explain a
# bad rank (job-level series come from rank 0 in both). "auto": essential from
# RANK_SERIES_ESSENTIAL_FROM ranks on.
RankSeries = Literal["auto", "full", "essential"]
RANK_SERIES_ESSENTIAL_FROM = 1024


class ConfigError(ValueError):
    """A setting is invalid. The message names the setting, the bad value and the fix."""


@dataclass(frozen=True)
class Config:
    # identity
    service_name: str = "otel-train"
    run_name: str | None = None  # default: <UTC date-time>-<4 hex>
    run_id: str | None = None  # default: scheduler job id (torchrun/SLURM) or a new uuid
    # this process's part in a single-controller job (controller, policy, generation, ...): joins
    # run_id and rank in the identity, so two roles' rank 0 never share a file or a series
    role: str = ""
    resource_attributes: dict[str, str] = field(default_factory=dict)
    # where local output goes: <output_dir>/<run_name>/
    output_dir: str = "runs"
    run_dir_enabled: bool = True
    # OTLP push (off unless an endpoint is set)
    otlp_endpoint: str | None = None
    # Metrics only, the full URL used as-is (the OTel spec's OTEL_EXPORTER_OTLP_METRICS_ENDPOINT),
    # e.g. a store's own OTLP path: http://victoriametrics:8428/opentelemetry/v1/metrics. Spans
    # and logs still go to otlp_endpoint (none when it is unset).
    otlp_metrics_endpoint: str | None = None
    otlp_protocol: OtlpProtocol = "http/protobuf"
    otlp_headers: dict[str, str] = field(default_factory=dict)
    otlp_timeout_s: float = 5.0
    otlp_insecure: bool = True
    metric_export_interval_s: float = 10.0
    # in-process Prometheus pull endpoint: http://<host>:<port + local_rank>/metrics; 0 disables
    prometheus_port: int = 9464
    prometheus_host: str = "127.0.0.1"
    console_exporter: bool = False  # print OTel metrics/spans/logs to stdout (debugging)
    # flush cadence and hot-path bounds
    # flush every N steps; unset: adaptive (every 10 steps, but at most about once per
    # log_interval_min_s, rounded to 10/20/50/100/... steps, decided on rank 0 for every rank)
    log_interval: int | None = None
    log_interval_min_s: float = 1.0
    log_interval_s: float = 30.0  # ... or after this many seconds (single-process only)
    max_metric_names: int = 64  # distinct record() names; more are dropped and counted
    max_values_per_interval: int = 10_000  # per name, between flushes
    queue_size: int = 8  # flush batches waiting for the background worker
    shutdown_timeout_s: float = 2.0
    # timers and traces
    # Timers with level > this cost ~nothing (Megatron semantics). Unset: 1 (`timer_level`), but an
    # instrumented Megatron `Timers` reports every timer its own log_level enables.
    timing_log_level: int | None = None
    timing_log_option: TimingLogOption = "minmax"
    traces: bool = True
    trace_first: int = 3  # sample the first N steps ...
    trace_every: int = 100  # ... then every N-th step
    # console
    verbosity: int = 1  # 0 quiet, 1 summary lines + final table, 2 also debug
    progress_bar: bool = True
    total_steps: int | None = None
    # health
    loss_spike_factor: float = 3.0  # loss > factor x recent EWMA mean is a spike
    stall_timeout_s: float = 300.0  # no completed step for this long: stall event + stack dump
    stack_dump_signal: str = "SIGUSR1"  # `kill -USR1 <pid>` dumps every thread's stack; "" turns it off
    # bridges
    tensorboard: bool = False
    wandb: bool = False
    mlflow: bool = False
    bridge_all_ranks: bool = False
    bridge_queue_size: int = 64
    wandb_project: str = "otel-train"
    wandb_entity: str | None = None
    wandb_group: str | None = None
    wandb_tags: tuple[str, ...] = ()
    wandb_mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    mlflow_tracking_uri: str | None = None  # default: file store under the run dir
    mlflow_experiment: str = "otel-train"
    samples_to_show: int = 4
    # hardware
    hardware: bool = True
    hardware_interval_s: float = 5.0
    peak_flops: float | None = None  # override the peak table (FLOP/s per GPU)
    # The precision the matmuls run in, whose peak MFU divides by. "auto": the torch.autocast dtype
    # active on the training thread at a flush, else bf16 (autocast around the forward pass only
    # cannot be seen from a flush); set it for fp8, fp16 without autocast, tf32 or fp32 training.
    compute_dtype: ComputeDtype = "auto"
    flops_per_token: float | None = None
    # Reset torch.cuda's peak memory stats at each flush (peak per interval). False leaves them to
    # your code (torch.cuda.max_memory_allocated() keeps working); the peak is then the run's.
    cuda_peak_per_interval: bool = True
    # ot.watch's statistics per layer group (up to its max_layers), or one group for the whole
    # model: on a huge job, ~2 series per rank (grad and param norm) instead of ~2 x 64, or 4 x 64
    # with activations, which are per layer only (README "Series budget").
    watch_aggregate: WatchAggregate = "layer"
    # distributed
    straggler_threshold: float = 0.9  # relative score: 1 - lateness / step time
    straggler_ewma: float = 0.5
    collective_timeout_s: float = 60.0
    # How long rank 0 waits at a flush for the rows of the ranks that were on time at the last one
    # (lockstep ranks come within milliseconds); a row that comes later is taken at a later flush.
    exchange_grace_s: float = 1.0
    # Children per rank in the exchange's reduction tree (per node first, then this fan-in). A
    # fan-in >= the world size - 1 is the star around rank 0 (crossrank/tree.py, README "Scale").
    exchange_fanin: int = 16
    # One exchange per flush with rank 0 (cross-rank stats, stragglers, one cadence): right for ranks
    # that train in lockstep (DDP, FSDP). False for independent ranks (evaluators, RL workers,
    # separate trials): they then meet only at init() and never wait for each other's flushes.
    cross_rank: bool = True
    rank_series: RankSeries = "auto"

    @property
    def timer_level(self) -> int:
        """The level `ot.timer` and `ot.phase` keep timers up to: `timing_log_level`, 1 when unset."""
        return 1 if self.timing_log_level is None else self.timing_log_level


_SIGNAL_PATH_RE = re.compile(r"/v1/(metrics|traces|logs)/?$")
CONFIG_FILE_ENV = "OTEL_TRAIN_CONFIG"

FIELDS: dict[str, dataclasses.Field[Any]] = {f.name: f for f in dataclasses.fields(Config)}


def env_name(field_name: str) -> str:
    return f"OTEL_TRAIN_{field_name.upper()}"


# What a run name may not hold (see `validate`), as a project name given as its prefix is cleaned.
_NOT_RUN_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.:-]+")


def default_run_name(prefix: str | None = None) -> str:
    """The run name when none is set: `<UTC date-time>-<4 hex>`, so a run never reuses the previous
    run's directory. With `prefix` (a framework's project name), `<prefix>-<UTC date-time>-<4 hex>`,
    the prefix made a valid run name's start (other characters as `-`, at most 100 of them)."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    name = f"{stamp}-{secrets.token_hex(2)}"
    start = _NOT_RUN_NAME_CHARS.sub("-", prefix or "").lstrip("-_.:")[:100]
    return f"{start}-{name}" if start else name


def validate(config: Config, sources: Mapping[str, str] | None = None) -> None:
    """Check ranges; `sources` (field -> where the value came from) makes errors name the variable
    or file the user actually set, e.g. OTEL_EXPORTER_OTLP_TIMEOUT rather than OTEL_TRAIN_*."""
    sources = sources or {}

    def need(cond: bool, name: str, fix: str) -> None:
        if not cond:
            value = getattr(config, name)
            shown = REDACTED if is_secret_key(name) else repr(redact_url(value))
            source = sources.get(name)
            if source is None:
                where = f"env {env_name(name)}"
            elif source.startswith("OTEL_"):
                where = f"from {source}"
            else:
                where = f"from {source}; env {env_name(name)}"
            raise ConfigError(f"setting {name} = {shown} is invalid: {fix} ({where}).")

    need(
        config.log_interval is None or config.log_interval >= 1,
        "log_interval",
        "use a whole number of steps >= 1, or leave it unset for the adaptive cadence",
    )
    need(config.log_interval_min_s > 0, "log_interval_min_s", "use a positive number of seconds")
    need(config.log_interval_s > 0, "log_interval_s", "use a positive number of seconds")
    need(0 <= config.prometheus_port <= 65535, "prometheus_port", "use a TCP port 1-65535, or 0 to disable")
    need(config.metric_export_interval_s > 0, "metric_export_interval_s", "use a positive number of seconds")
    need(
        0 < config.otlp_timeout_s <= 60,
        "otlp_timeout_s",
        "use seconds in (0, 60]; OTEL_EXPORTER_OTLP_TIMEOUT is in milliseconds: (0, 60000]",
    )
    need(
        config.timing_log_level in (None, 0, 1, 2),
        "timing_log_level",
        "use 0, 1 or 2, or leave it unset (1; Megatron's Timers keep their own level)",
    )
    need(config.trace_first >= 0, "trace_first", "use an integer >= 0")
    need(config.trace_every >= 1, "trace_every", "use an integer >= 1")
    need(config.verbosity in (0, 1, 2), "verbosity", "use 0 (quiet), 1 or 2")
    need(config.max_metric_names >= 1, "max_metric_names", "use an integer >= 1")
    need(config.max_values_per_interval >= 1, "max_values_per_interval", "use an integer >= 1")
    need(config.queue_size >= 1, "queue_size", "use an integer >= 1")
    need(config.bridge_queue_size >= 1, "bridge_queue_size", "use an integer >= 1")
    need(0 < config.shutdown_timeout_s <= 60, "shutdown_timeout_s", "use seconds in (0, 60]")
    need(
        config.total_steps is None or config.total_steps >= 1,
        "total_steps",
        "use a positive integer or leave unset",
    )
    need(config.loss_spike_factor > 1, "loss_spike_factor", "use a factor > 1")
    need(config.stall_timeout_s > 0, "stall_timeout_s", "use a positive number of seconds")
    need(
        config.stack_dump_signal == "" or signal_number(config.stack_dump_signal) is not None,
        "stack_dump_signal",
        "use a signal name such as SIGUSR1 or SIGUSR2, or an empty string to turn signal dumps off",
    )
    need(config.hardware_interval_s > 0, "hardware_interval_s", "use a positive number of seconds")
    need(config.peak_flops is None or config.peak_flops > 0, "peak_flops", "use FLOP/s > 0 or leave unset")
    need(0 < config.straggler_threshold < 1, "straggler_threshold", "use a score in (0, 1), e.g. 0.9")
    need(0 < config.straggler_ewma <= 1, "straggler_ewma", "use a smoothing factor in (0, 1]")
    need(config.collective_timeout_s > 0, "collective_timeout_s", "use a positive number of seconds")
    need(config.exchange_grace_s > 0, "exchange_grace_s", "use a positive number of seconds")
    need(
        config.exchange_fanin >= 2, "exchange_fanin", "use a whole number of children per rank >= 2, e.g. 16"
    )
    need(bool(config.service_name.strip()), "service_name", "use a non-empty name")
    if config.otlp_endpoint is not None:
        endpoint = config.otlp_endpoint
        need(
            re.match(r"^https?://[^/\s]+", endpoint) is not None,
            "otlp_endpoint",
            "use a URL such as http://localhost:4318 (HTTP) or http://localhost:4317 (gRPC), or unset it",
        )
        need(
            _url_port_ok(endpoint),
            "otlp_endpoint",
            "the port must be a number in 1-65535, e.g. http://localhost:4318",
        )
        need(
            _SIGNAL_PATH_RE.search(endpoint.split("?", 1)[0]) is None,
            "otlp_endpoint",
            "give the base URL without /v1/metrics, /v1/traces or /v1/logs (otel_train appends the "
            "signal path itself), e.g. http://localhost:4318",
        )
    if config.otlp_metrics_endpoint is not None:
        need(
            re.match(r"^https?://[^/\s]+", config.otlp_metrics_endpoint) is not None
            and _url_port_ok(config.otlp_metrics_endpoint),
            "otlp_metrics_endpoint",
            "use the full metrics URL, e.g. http://localhost:8428/opentelemetry/v1/metrics "
            "(VictoriaMetrics) or http://localhost:4318/v1/metrics, or unset it",
        )
    need(
        re.match(r"^([A-Za-z0-9][A-Za-z0-9_-]{0,63})?$", config.role) is not None,
        "role",
        "use letters, digits, _ and - (max 64 characters, no dots: the role is part of file names), "
        "e.g. controller, policy, generation; or leave it empty",
    )
    for name in ("run_name", "run_id"):
        value = getattr(config, name)
        need(
            value is None or re.match(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$", value) is not None,
            name,
            "use letters, digits and _ . : - (max 128 characters)",
        )


def _url_port_ok(url: str) -> bool:
    from urllib.parse import urlsplit

    try:
        port = urlsplit(url).port
    except ValueError:
        return False
    return port is None or port >= 1


def signal_number(name: str) -> int | None:
    """`SIGUSR1` / `USR1` / `10` as a signal number, None if there is no such signal."""
    import signal

    text = name.strip().upper()
    if text.isdigit():
        number = int(text)
        return number if number in {s.value for s in signal.Signals} else None
    member = getattr(signal.Signals, text if text.startswith("SIG") else f"SIG{text}", None)
    return int(member) if member is not None else None


def config_as_dict(config: Config) -> dict[str, Any]:
    """The resolved config with secrets redacted (for config.json, bridges, logs)."""
    return redact(dataclasses.asdict(config))
