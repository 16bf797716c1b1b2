"""Config: one frozen dataclass of every setting, each declared once with `setting(...)`.

Validation, the environment and file parsing (config_loading), the control file (control) and the
docs' configuration page (docs/hooks.py) all read the declarations: docs/reference/configuration.md.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import re
import secrets
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from otel_train.redaction import REDACTED, is_secret_key, redact, redact_url

# Which series each rank exports (README "Scale"). "auto": essential from RANK_SERIES_ESSENTIAL_FROM ranks on.
RankSeries = Literal["auto", "full", "essential"]
RANK_SERIES_ESSENTIAL_FROM = 1024

CONFIG_FILE_ENV = "OTEL_TRAIN_CONFIG"
_METADATA_KEY = "otel_train.setting"


class ConfigError(ValueError):
    """A setting is invalid. The message names the setting, the bad value and the fix."""


@dataclass(frozen=True)
class Setting:
    """What a field's type and default do not say: its allowed values, its other environment
    variables, whether it may change at runtime, and its doc."""

    doc: str
    # The allowed range (inclusive ge/le, exclusive gt/lt); None (for an optional field) is always allowed.
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    pattern: str | None = None  # a string setting must match it whole
    check: Callable[[Any], str | None] | None = None  # a rule beyond the range: the fix, None when fine
    fix: str | None = None  # the error's advice where the type and range alone say too little
    env: tuple[str, ...] = ()  # standard OpenTelemetry variables that also set it
    env_in_ms: bool = False  # those variables give milliseconds (the OpenTelemetry spec's unit)
    # A float setting must be finite (inf overflows the int conversions of timeouts and cadences)
    # unless this says what inf means there, e.g. "never by time".
    inf_means: str | None = None
    runtime: bool = False  # the control file may change it in a running job


def setting(
    default: Any = dataclasses.MISSING, *, factory: Callable[[], Any] | None = None, **rules: Any
) -> Any:
    """A `Config` field: its default (or `factory`) and its `Setting` made of `rules`."""
    metadata = {_METADATA_KEY: Setting(**rules)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


# --- the rules beyond a range, each named in its setting's declaration -------------------------------
_URL_RE = re.compile(r"^https?://[^/\s]+")
_SIGNAL_PATH_RE = re.compile(r"/v1/(metrics|traces|logs)/?$")


def _url_port_ok(url: str) -> bool:
    from urllib.parse import urlsplit

    try:
        port = urlsplit(url).port
    except ValueError:
        return False
    return port is None or port >= 1


def _otlp_base_url_problem(url: str) -> str | None:
    if _URL_RE.match(url) is None:
        return "use a URL such as http://localhost:4318 (HTTP) or http://localhost:4317 (gRPC), or unset it"
    if not _url_port_ok(url):
        return "the port must be a number in 1-65535, e.g. http://localhost:4318"
    if _SIGNAL_PATH_RE.search(url.split("?", 1)[0]) is not None:
        return (
            "give the base URL without /v1/metrics, /v1/traces or /v1/logs (otel_train appends the "
            "signal path itself), e.g. http://localhost:4318"
        )
    return None


def _signal_url_problem(signal: str) -> Callable[[str], str | None]:
    """The check of one signal's own URL, which is used as-is (the OTel spec's rule)."""
    example = f"http://localhost:4318/v1/{signal}"
    if signal == "metrics":
        example = f"http://localhost:8428/opentelemetry/v1/metrics (VictoriaMetrics) or {example}"

    def problem(url: str) -> str | None:
        ok = _URL_RE.match(url) is not None and _url_port_ok(url)
        return None if ok else f"use the full {signal} URL, e.g. {example}, or unset it"

    return problem


def _blank_problem(text: str) -> str | None:
    return None if text.strip() else "use a non-empty name"


def _signal_problem(name: str) -> str | None:
    import signal

    if name.strip().lower() in SIGNAL_OFF:
        return None
    number = signal_number(name)
    if number in (signal.SIGKILL, signal.SIGSTOP):  # the OS lets no process handle these
        return (
            f"{signal.Signals(number).name} cannot be caught, so it cannot trigger a dump: use a signal such "
            "as SIGUSR1 or SIGUSR2, or off to turn signal dumps off"
        )
    if number is not None:
        return None
    return "use a signal name such as SIGUSR1 or SIGUSR2, or off to turn signal dumps off"


SIGNAL_OFF = ("", "off", "none")  # stack_dump_signal values that turn signal dumps off


def signal_number(name: str) -> int | None:
    """`SIGUSR1` / `USR1` / `10` as a signal number, None if there is no such signal (or it is off)."""
    import signal

    text = name.strip().upper()
    if text.lower() in SIGNAL_OFF:
        return None
    if text.isascii() and text.isdigit():  # "²" is a digit to isdigit, not to int()
        number = int(text)
        return number if number in {s.value for s in signal.Signals} else None
    member = getattr(signal.Signals, text if text.startswith("SIG") else f"SIG{text}", None)
    return int(member) if member is not None else None


_RUN_NAME = r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}"
_RUN_NAME_FIX = "use letters, digits and _ . : - (max 128 characters)"


@dataclass(frozen=True)
class Config:
    # identity
    service_name: str = setting(
        "otel-train", check=_blank_problem, env=("OTEL_SERVICE_NAME",),
        doc="`service.name` resource attribute",
    )  # fmt: skip
    run_name: str | None = setting(
        None, pattern=_RUN_NAME, fix=_RUN_NAME_FIX,
        doc="run directory name (default: UTC date-time + 4 hex); see [Reusing a run name](../reliability.md#reusing-a-run-name)",
    )  # fmt: skip
    run_id: str | None = setting(
        None, pattern=_RUN_NAME, fix=_RUN_NAME_FIX,
        doc="shared by all ranks of a job; default: TORCHELASTIC_RUN_ID / SLURM_JOB_ID, else agreed at init",
    )  # fmt: skip
    # Joins run_id and rank in the identity, so two roles' rank 0 never share a file or a series.
    role: str = setting(
        "", pattern=r"([A-Za-z0-9][A-Za-z0-9_-]{0,63})?",
        fix="use letters, digits, _ and - (max 64 characters, no dots: the role is part of file names), "
        "e.g. controller, policy, generation; or leave it empty",
        doc="this process's part in a single-controller job (`controller`, `policy`, `generation`, ...): a "
        "`role` label on every series, in `service.instance.id` and in run-dir file names "
        "(`metrics.<role>.rank<k>.jsonl`); empty: no role. See "
        "[Ray, NeMo RL and other single-controller jobs](../frameworks/ray-nemo-rl.md)",
    )  # fmt: skip
    resource_attributes: dict[str, str] = setting(
        factory=dict, env=("OTEL_RESOURCE_ATTRIBUTES",),
        doc="extra resource attributes (secret-looking keys are dropped)",
    )  # fmt: skip
    output_dir: str = setting("runs", doc="root of run directories: `<output_dir>/<run_name>/`")
    run_dir_enabled: bool = setting(True, doc="write the run directory (JSONL, progress, config, env)")
    # OTLP push
    otlp_endpoint: str | None = setting(
        None, check=_otlp_base_url_problem, env=("OTEL_EXPORTER_OTLP_ENDPOINT",),
        doc="OTLP collector base URL (no `/v1/metrics`: the signal path is appended); OTLP is off when "
        "unset; `user:password@` and secret-looking query keys (`?api_key=`) are used but written "
        "everywhere as `***`",
    )  # fmt: skip
    otlp_metrics_endpoint: str | None = setting(
        None, check=_signal_url_problem("metrics"), env=("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",),
        doc="Metrics only, full URL used as-is (e.g. VictoriaMetrics' `http://host:8428/opentelemetry/v1/metrics`, "
        "see [Scale-out store](../scale.md#scale-out-store)); spans and logs go to their own URLs or `otlp_endpoint`",
    )  # fmt: skip
    otlp_traces_endpoint: str | None = setting(
        None, check=_signal_url_problem("traces"), env=("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",),
        doc="Spans only, full URL used as-is (e.g. a Tempo or Jaeger OTLP receiver's `.../v1/traces`)",
    )  # fmt: skip
    otlp_logs_endpoint: str | None = setting(
        None, check=_signal_url_problem("logs"), env=("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT",),
        doc="Health events as OTel logs only, full URL used as-is (e.g. a Loki OTLP receiver's `.../v1/logs`)",
    )  # fmt: skip
    otlp_protocol: Literal["http/protobuf", "grpc"] = setting(
        "http/protobuf", env=("OTEL_EXPORTER_OTLP_PROTOCOL",),
        fix="OpenTelemetry's Python SDK has no http/json exporter; set OTEL_TRAIN_OTLP_PROTOCOL="
        "http/protobuf to keep another tool's OTEL_EXPORTER_OTLP_PROTOCOL",
        doc="`http/protobuf` or `grpc`",
    )  # fmt: skip
    otlp_headers: dict[str, str] = setting(
        factory=dict, env=("OTEL_EXPORTER_OTLP_HEADERS",),
        doc="headers sent with every export (never written anywhere)",
    )  # fmt: skip
    otlp_timeout_s: float = setting(
        5.0, gt=0, le=60, env=("OTEL_EXPORTER_OTLP_TIMEOUT",), env_in_ms=True,
        fix="use seconds in (0, 60]; OTEL_EXPORTER_OTLP_TIMEOUT is in milliseconds: (0, 60000]",
        doc="per-export timeout, seconds (the `OTEL_EXPORTER_OTLP_TIMEOUT` variable is milliseconds, as the "
        "OTel spec says; below 100 ms is refused as a seconds-vs-ms mistake, above 60 s as too long to wait "
        "at each export)",
    )  # fmt: skip
    otlp_insecure: bool = setting(True, doc="gRPC without TLS for `http://` endpoints")
    metric_export_interval_s: float = setting(
        10.0, gt=0, env=("OTEL_METRIC_EXPORT_INTERVAL",), env_in_ms=True,
        doc="OTLP metric push interval (env var in ms, as the spec says)",
    )  # fmt: skip
    # in-process Prometheus pull endpoint: http://<host>:<port + local_rank>/metrics
    prometheus_port: int = setting(
        9464, ge=0, le=65535, fix="use a TCP port 1-65535, or 0 to disable (0 turns the pull endpoint off)",
        doc="pull endpoint base port (+ local rank); 0 disables",
    )  # fmt: skip
    prometheus_host: str = setting("127.0.0.1", doc="pull endpoint bind address")
    console_exporter: bool = setting(False, doc="print OTel metrics/spans/logs to stdout (debugging)")
    # flush cadence and hot-path bounds
    log_interval: int | None = setting(
        None, ge=1, fix="use a whole number of steps >= 1, or leave it unset for the adaptive cadence",
        doc="flush every N steps; unset: adaptive (every 10 steps, but at most about once per "
        "`log_interval_min_s`, rounded to 10/20/50/100/... steps, decided on rank 0; with `cross_rank=False` "
        "each rank decides its own); steps faster than the worker writes flushes (its `queue_size` full) "
        "go with a later flush, said once",
    )  # fmt: skip
    log_interval_min_s: float = setting(
        1.0, gt=0,
        doc="adaptive cadence: flush at most about this often (up to 2x less often when a flush's worker CPU "
        "would exceed 0.25 % of the time between flushes)",
    )  # fmt: skip
    log_interval_s: float = setting(
        30.0, gt=0, inf_means="never by time",
        doc="...or after N seconds (not for ranks in lockstep, `cross_rank=True`, whose flush steps must "
        "match); it also caps the adaptive interval, on every rank",
    )  # fmt: skip
    max_metric_names: int = setting(
        64,
        ge=1,
        doc="distinct `record()` names, and as many timer and span names; more are dropped and counted",
    )
    max_values_per_interval: int = setting(
        10_000, ge=1,
        doc="values kept per name between flushes (also step durations and timers: every per-interval list)",
    )  # fmt: skip
    queue_size: int = setting(8, ge=1, doc="flushes waiting for the background worker")
    shutdown_timeout_s: float = setting(2.0, gt=0, le=60, doc="bound on exporter shutdown (at most 60 s)")
    # timers and traces
    timing_log_level: int | None = setting(
        None, ge=0, le=2, runtime=True,
        fix="use 0, 1 or 2, or leave it unset (1; Megatron's Timers keep their own level)",
        doc="timers above this level cost ~nothing (0, 1, 2); unset, 1, except that an instrumented "
        "Megatron `Timers` keeps its own level",
    )  # fmt: skip
    timing_log_option: Literal["max", "minmax", "all"] = setting(
        "minmax", doc="cross-rank timer view: `max`, `minmax`, `all`"
    )
    traces: bool = setting(True, doc="emit step spans")
    trace_first: int = setting(3, ge=0, runtime=True, doc="trace the first N steps...")
    trace_every: int = setting(100, ge=1, runtime=True, doc="...then every N-th step")
    # console
    verbosity: int = setting(
        1, ge=0, le=2, runtime=True, fix="use 0 (quiet), 1 or 2",
        doc="0 quiet, 1 summaries and final table, 2 debug",
    )  # fmt: skip
    progress_bar: bool = setting(True, doc="progress bar on a terminal")
    total_steps: int | None = setting(None, ge=1, runtime=True, doc="planned steps (ETA, progress)")
    # health
    loss_spike_factor: float = setting(
        3.0, gt=1,
        doc="a loss above factor x its recent mean, and 8 recent standard deviations above it, is a spike event",
    )  # fmt: skip
    stall_timeout_s: float = setting(
        300.0, gt=0,
        # There is no off switch: the watchdog's stack dumps are the only evidence of a hang.
        fix="use a number of seconds > 0 (stall detection has no off switch: for stack dumps after very long "
        "gaps only, use e.g. 86400, a day)",
        doc="no step for this long: every thread's stack goes to `stacks.rank<k>.<n>.txt` in the run dir "
        "and a stall event names the file",
    )  # fmt: skip
    checkpoint_timeout_s: float = setting(
        1800.0, gt=0,
        doc='in place of `stall_timeout_s` while a checkpoint save runs (an open `ot.span("checkpoint")`, '
        "or a save a framework integration announces): a hung save is still a stall",
    )  # fmt: skip
    first_step_timeout_s: float = setting(
        1800.0, gt=0,
        doc="in place of `stall_timeout_s` while the first step runs (compilation, warm-up and the collectives' "
        "set-up are in it): a first batch or first all-reduce that never comes is still a stall",
    )  # fmt: skip
    eval_timeout_s: float = setting(
        7200.0, gt=0,
        doc="eval batches between steps (`adapters.heartbeat()`) keep the stall watchdog quiet for this long "
        "after the last step, then `stall_timeout_s` runs: an evaluation whose loader never ends is a stall; "
        "inside an open `ot.span(\"eval\")` the watchdog waits this long for any progress",
    )  # fmt: skip
    stack_dump_signal: str = setting(
        "SIGUSR1", check=_signal_problem,
        doc="`kill -USR1 <pid>` writes the same stack dump, also while the rank is blocked in a collective; "
        "`off` turns it off",
    )  # fmt: skip
    # bridges
    tensorboard: bool = setting(False, doc="TensorBoard bridge")
    wandb: bool = setting(
        False,
        doc="Weights & Biases bridge; W&B's `WANDB_DIR` and `WANDB_RUN_ID`, if set, are where it writes "
        "(in place of `<run_dir>/wandb/`) and its run id",
    )
    mlflow: bool = setting(False, doc="MLflow bridge")
    bridge_all_ranks: bool = setting(False, doc="bridges on every rank (one run per rank) instead of rank 0")
    bridge_queue_size: int = setting(
        64, ge=1, doc="per-bridge queue; a slow backend drops (counted) beyond it"
    )
    wandb_project: str | None = setting(
        None, doc="W&B project; unset: W&B's `WANDB_PROJECT` variable if set, else `otel-train`"
    )
    wandb_entity: str | None = setting(None, doc="W&B entity")
    wandb_group: str | None = setting(None, doc="W&B group")
    wandb_tags: tuple[str, ...] = setting((), doc="W&B tags (comma-separated in env)")
    wandb_mode: Literal["auto", "online", "offline", "disabled"] = setting(
        "auto",
        doc="`auto` (online with W&B credentials: `WANDB_API_KEY` or a `wandb login` entry in the netrc "
        "file; offline without; a `WANDB_MODE` variable wins over `auto`; an online init that fails logs "
        "offline, with the `wandb sync` command in a warning), `online`, `offline`, `disabled`",
    )
    mlflow_tracking_uri: str | None = setting(
        None, doc="unset: the `MLFLOW_TRACKING_URI` variable if set, else a local store under the run dir"
    )
    mlflow_experiment: str | None = setting(
        None,
        doc="MLflow experiment; unset: MLflow's `MLFLOW_EXPERIMENT_NAME`, else `MLFLOW_EXPERIMENT_ID` variable "
        "if set, else `otel-train`. A `MLFLOW_RUN_ID` variable names an existing run the bridge logs into "
        "(not with a `role` or `bridge_all_ranks`: each has a run of its own)",
    )
    samples_to_show: int = setting(4, ge=0, doc="validation samples shown per call")
    # hardware
    hardware: bool = setting(True, doc="NVML / CUDA allocator / host metrics")
    hardware_interval_s: float = setting(5.0, gt=0, doc="NVML sampling interval")
    peak_flops: float | None = setting(None, gt=0, doc="override the peak FLOP/s per GPU for MFU")
    # "auto" cannot see autocast around the forward pass alone: it has ended by the flush.
    compute_dtype: Literal["auto", "fp8", "bf16", "fp16", "tf32", "fp32"] = setting(
        "auto",
        doc="the precision whose peak MFU divides by: `fp8`, `bf16`, `fp16`, `tf32`, `fp32` (`fp32` counts as "
        "`tf32` when torch lets float32 matmuls use TF32); `auto`: the `torch.autocast` dtype active around "
        "`ot.step` at a flush (it is per thread: autocast around the forward pass alone ends before the "
        "flush and is not seen), else `bf16`. The HF, Lightning and Accelerate integrations, when they start "
        "the session, pass the precision the framework trains in (`TrainingArguments(bf16/fp16/tf32=True)`, "
        '`Trainer(precision="bf16-mixed")`, `Accelerator(mixed_precision="bf16")`, ...) unless you set one. The MFU point carries `compute.dtype`, '
        "`peak.flops` and `peak.source`",
    )
    flops_per_token: float | None = setting(None, gt=0, doc="model FLOPs per token for MFU")
    cuda_peak_per_interval: bool = setting(
        True,
        doc="reset torch.cuda peak memory stats at each flush; `False` if your code reads `max_memory_allocated()`",
    )
    watch_aggregate: Literal["layer", "model"] = setting(
        "layer",
        doc='`ot.watch` statistics per layer group (up to `max_layers`), or `"model"`: one group for the '
        "whole model, ~2 series per rank instead of ~2 × 64 (see [Series budget](../scale.md#series-budget))",
    )
    # distributed
    straggler_threshold: float = setting(
        0.9, gt=0, lt=1, runtime=True, fix="use a score in (0, 1), e.g. 0.9",
        doc="a rank whose smoothed relative score (1 − lateness ÷ step time) falls below this is a chronic "
        "straggler",
    )  # fmt: skip
    straggler_ewma: float = setting(
        0.5, gt=0, le=1, doc="weight of the newest flush interval in the smoothed straggler scores"
    )
    collective_timeout_s: float = setting(
        60.0, gt=0,
        doc="a rank that sends no telemetry row for this long turns the exchange off (and the timeout of "
        "the run id broadcast at `init()`)",
    )  # fmt: skip
    exchange_grace_s: float = setting(
        1.0, gt=0,
        doc="how long rank 0's worker waits at a flush for the rows of the ranks that were in at its previous "
        "flush (lockstep ranks: milliseconds); later rows are taken at a later flush, never waited for on "
        "the training thread",
    )  # fmt: skip
    exchange_fanin: int = setting(
        16, ge=2, fix="use a whole number of children per rank >= 2, e.g. 16",
        doc="children per rank in the exchange's reduction tree (at least 2; ranks grouped per node first "
        "where `LOCAL_WORLD_SIZE` says which share one; a node leader has up to twice this): every rank's "
        "CPU and bytes per flush are O(fan-in), the depth O(log N). A fan-in >= the world size - 1 is the "
        "star around rank 0 (exact rows of every rank); larger jobs carry 4 rows whole per subtree and a "
        "mergeable summary of the rest ([Cross-rank exchange](../scale.md#cross-rank-exchange))",
    )  # fmt: skip
    cross_rank: bool = setting(
        True,
        doc="one exchange per flush with rank 0 (cross-rank stats, stragglers, one flush cadence), never "
        "waited for on the training thread: for ranks in lockstep (DDP, FSDP); `False` for independent ranks "
        "(evaluators, RL workers, separate trials), which then meet only at `init()` and exchange nothing. "
        "Rank 0's value wins (warned)",
    )
    rank_series: RankSeries = setting(
        "auto",
        doc='which series each rank exports: `"full"` (every one), `"essential"` (only those that find and '
        'explain a bad rank; job-level series come from rank 0 in both), or `"auto"` (essential from '
        f"{RANK_SERIES_ESSENTIAL_FROM:,} ranks on)",
    )

    @property
    def timer_level(self) -> int:
        """The level `ot.timer` and `ot.phase` keep timers up to: `timing_log_level`, 1 when unset."""
        return 1 if self.timing_log_level is None else self.timing_log_level


FIELDS: dict[str, dataclasses.Field[Any]] = {f.name: f for f in dataclasses.fields(Config)}


DEFAULT_PROJECT = "otel-train"  # the W&B project and MLflow experiment where nothing names one


def wandb_project_from_env(fallback: str = DEFAULT_PROJECT) -> str:
    """The W&B project where the user set no `wandb_project`: W&B's own `WANDB_PROJECT` (settings
    the user already gave the framework are adopted), else `fallback`."""
    return os.environ.get("WANDB_PROJECT", "").strip() or fallback


def env_name(field_name: str) -> str:
    return f"OTEL_TRAIN_{field_name.upper()}"


# --- the table, read by the loaders, the control file and the docs ----------------------------------
@dataclass(frozen=True)
class Declaration:
    """A field as the table holds it: its type (`X` of `X | None`), optional, default, `Setting`."""

    type: Any
    optional: bool
    default: Any
    setting: Setting


_TABLES: dict[type, dict[str, Declaration]] = {}


def declared(cls: type[Config] = Config) -> Mapping[str, Declaration]:
    """Each field of `cls`, in order. A field re-declared without `setting` (a subclass changing a
    default) keeps its base class's `Setting`; one never declared with it has an empty doc and no rule."""
    if cls in _TABLES:
        return _TABLES[cls]
    hints = typing.get_type_hints(cls)
    table: dict[str, Declaration] = {}
    for f in dataclasses.fields(cls):
        specs = (getattr(c, "__dataclass_fields__", {}).get(f.name) for c in cls.__mro__)
        spec = next((s.metadata[_METADATA_KEY] for s in specs if s and _METADATA_KEY in s.metadata), None)
        hint, args = hints[f.name], typing.get_args(hints[f.name])
        optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        table[f.name] = Declaration(
            next(a for a in args if a is not type(None)) if optional else hint,
            optional,
            default,
            spec if spec is not None else Setting(doc=""),
        )
    _TABLES[cls] = table
    return table


def runtime_settings(cls: type[Config] = Config) -> list[str]:
    """The settings the control file may change in a running job."""
    return [name for name, entry in declared(cls).items() if entry.setting.runtime]


def allowed(name: str, cls: type[Config] = Config, in_ms: bool = False) -> str:
    """The values setting `name` accepts, in words (an error's fix, the docs page); `in_ms`: as
    its standard variables give them, in milliseconds (an `env_in_ms` setting)."""
    entry = declared(cls)[name]
    spec = entry.setting
    scale = 1000 if in_ms else 1
    if in_ms:
        kind = "a number of milliseconds" if spec.inf_means else "a finite number of milliseconds"
    else:
        kind = _kind(entry.type, name)
    bounds = [(spec.ge, "[", ">="), (spec.gt, "(", ">"), (spec.le, "]", "<="), (spec.lt, ")", "<")]
    given = [(f"{v * scale:g}", bracket, op) for v, bracket, op in bounds if v is not None]
    if len(given) == 2:
        (low, left, _), (high, right, _) = given
        text = f"{kind} in {left}{low}, {high}{right}"
    else:
        text = " ".join([kind, *(f"{op} {v}" for v, _, op in given)])
    if spec.inf_means is not None:
        text += f", or inf ({spec.inf_means})"
    return text + ", or leave it unset" * entry.optional


_KINDS = {bool: "true or false", int: "an integer", dict: "a mapping of strings", tuple: "a list of strings"}


def _kind(hint: Any, name: str) -> str:
    if hint is float:
        return "a number of seconds" if name.endswith("_s") else "a number"
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(hint)))
    return _KINDS.get(typing.get_origin(hint) or hint, "a string")


def _is_a(value: Any, hint: Any) -> bool:
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if typing.get_origin(hint) is Literal:
        return any(value == choice and type(value) is type(choice) for choice in typing.get_args(hint))
    if typing.get_origin(hint) is dict:
        return isinstance(value, dict) and all(isinstance(x, str) for kv in value.items() for x in kv)
    if typing.get_origin(hint) is tuple:
        return isinstance(value, tuple) and all(isinstance(x, str) for x in value)
    return isinstance(value, hint)


def problem(name: str, value: Any, cls: type[Config] = Config) -> str | None:
    """What is wrong with `value` for setting `name`, as the fix; None when it is allowed."""
    entry = declared(cls)[name]
    spec = entry.setting
    if value is None and entry.optional:
        return None
    advice = spec.fix or f"use {allowed(name, cls)}"
    if not _is_a(value, entry.type):
        if _kind(entry.type, name) == "a string" or typing.get_origin(entry.type) is Literal:
            # YAML reads off, no, 2024-01-01 and 42 as a bool, a date and a number
            advice += f" (got {type(value).__name__}: in a YAML file, quote it)"
        return f"expected {_kind(entry.type, name)}; {advice}" if spec.fix else advice
    if entry.type is float and not math.isfinite(value) and not (value > 0 and spec.inf_means is not None):
        return f"it must be a finite number; {advice}"
    in_range = (
        (spec.ge is None or value >= spec.ge)
        and (spec.gt is None or value > spec.gt)
        and (spec.le is None or value <= spec.le)
        and (spec.lt is None or value < spec.lt)
    )
    if not in_range or (spec.pattern is not None and re.fullmatch(spec.pattern, value) is None):
        return advice
    return spec.check(value) if spec.check is not None else None


def validate(config: Config, sources: Mapping[str, str] | None = None) -> None:
    """Check every setting; `sources` (field -> where its value came from) makes an error name what
    the user set (e.g. OTEL_EXPORTER_OTLP_TIMEOUT rather than OTEL_TRAIN_*)."""
    sources = sources or {}
    for name in declared(type(config)):
        value = getattr(config, name)
        fix = problem(name, value, type(config))
        if fix is None:
            continue
        shown = REDACTED if is_secret_key(name) else repr(redact_url(value))
        source = sources.get(name)
        if source is None:
            where = f"env {env_name(name)}"
        elif source.startswith("OTEL_"):
            where = f"from {source}"
        else:
            where = f"from {source}; env {env_name(name)}"
        raise ConfigError(f"setting {name} = {shown} is invalid: {fix} ({where}).")


# What a run name may not hold (see `_RUN_NAME`), as a project name given as its prefix is cleaned.
_NOT_RUN_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.:-]+")


def default_run_name(prefix: str | None = None) -> str:
    """`[<prefix>-]<UTC date-time>-<4 hex>`, so a run never reuses the previous run's directory;
    `prefix` (a framework's project name) is made a valid run name's start (at most 100 characters)."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    name = f"{stamp}-{secrets.token_hex(2)}"
    start = _NOT_RUN_NAME_CHARS.sub("-", prefix or "").lstrip("-_.:")[:100]
    return f"{start}-{name}" if start else name


def config_as_dict(config: Config) -> dict[str, Any]:
    """The resolved config with secrets redacted (for config.json, bridges, logs)."""
    return redact(dataclasses.asdict(config))
