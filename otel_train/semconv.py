"""The metric catalogue: every instrument otel_train creates, named once.

Code, dashboards, alert rules and bridges import these specs; nobody retypes a metric name.
Naming and bridge keys: docs/design/core.md#semconv.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any


class Kind(str, Enum):
    COUNTER = "counter"
    HISTOGRAM = "histogram"
    GAUGE = "gauge"  # synchronous gauge, set on the flush worker
    OBSERVABLE_GAUGE = "observable_gauge"  # read from a cache by an SDK callback
    OBSERVABLE_COUNTER = "observable_counter"
    OBSERVABLE_UP_DOWN_COUNTER = "observable_up_down_counter"


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: Kind
    unit: str
    description: str
    key: str
    attributes: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None
    gpu_only: bool = False
    # Exported per rank in both series tiers (Config.rank_series; docs/scale.md "Series budget"):
    # what finds and explains a bad rank. The others go per rank to the store in "full" only; the
    # local outputs (run dir, bridges, console) always get every metric.
    essential: bool = False
    # "job": one series per job, exported by rank 0 alone without rank labels (crossrank/job_outputs,
    # exporters/job_provider), in both tiers; "rank": one per rank.
    scope: str = "rank"

    def create(self, meter: Any, callback: Callable[..., Iterable[Any]] | None = None) -> Any:
        """The instrument this spec describes, on `meter` (observable kinds read `callback`): the one
        way otel_train makes a catalogue instrument."""
        kw: dict[str, Any] = {"unit": self.unit, "description": self.description}
        callbacks = [callback] if callback else None
        match self.kind:
            case Kind.COUNTER:
                return meter.create_counter(self.name, **kw)
            case Kind.HISTOGRAM:
                buckets = None if self.buckets is None else list(self.buckets)
                return meter.create_histogram(self.name, explicit_bucket_boundaries_advisory=buckets, **kw)
            case Kind.GAUGE:
                return meter.create_gauge(self.name, **kw)
            case Kind.OBSERVABLE_GAUGE:
                return meter.create_observable_gauge(self.name, callbacks=callbacks, **kw)
            case Kind.OBSERVABLE_COUNTER:
                return meter.create_observable_counter(self.name, callbacks=callbacks, **kw)
            case Kind.OBSERVABLE_UP_DOWN_COUNTER:
                return meter.create_observable_up_down_counter(self.name, callbacks=callbacks, **kw)

    @property
    def prometheus_name(self) -> str:
        """Series name on the in-process pull endpoint (opentelemetry-exporter-prometheus)."""
        return prometheus_name(self, collector=False)

    @property
    def collector_prometheus_name(self) -> str:
        """Series name through the OTel Collector's prometheus exporter (otlptranslator)."""
        return prometheus_name(self, collector=True)


# Seconds-scaled buckets (the SDK defaults are for milliseconds). Few on purpose: every bucket is a
# series per phase, and the budget is <= 200 series per rank at default settings.
STEP_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
PHASE_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
)  # fmt: skip

# Attribute keys (data point attributes; identity lives in the Resource).
PHASE = "train.phase"
ERROR_TYPE = "error.type"
REASON = "otel_train.reason"
EVENT = "otel_train.event"
STRAGGLER_KIND = "straggler.kind"  # relative | individual
STAT = "stat"  # min | max | mean | median | argmin_rank | argmax_rank
BADPUT_CAUSE = "train.badput.cause"  # goodput.CAUSES: startup | eval | checkpoint_save | ... | other
LAYER = "train.layer"  # a module path from ot.watch(model), e.g. blocks.3.attn
HW_ID = "hw.id"
HW_NAME = "hw.name"
HW_TYPE = "hw.type"  # "gpu" on the common hw.* metrics (hw.power, hw.energy, hw.errors, hw.temperature)
HW_TYPE_GPU = "gpu"
THROTTLE_REASON = "otel_train.gpu.throttle.reason"
XID = "otel_train.gpu.xid"  # the XID code on a `gpu_xid` health event
DIRECTION = "network.io.direction"
MEMORY_STATE = "system.memory.state"
# Where the MFU denominator came from: table:<entry>:<dtype> | config:peak_flops | env:...
PEAK_SOURCE = "peak.source"
COMPUTE_DTYPE = "compute.dtype"  # the precision MFU's peak is for: fp8 | bf16 | fp16 | tf32 | fp32
PEAK_FLOPS = "peak.flops"  # the MFU denominator itself, FLOP/s per GPU

# Resource attribute keys that must become labels on every Prometheus series (both paths).
RUN_ID = "run_id"
RANK = "rank"
# The process's part in a single-controller job (controller, policy, generation, ...): ranks are
# numbered per role, so (run_id, role, rank) is the identity. Absent when the role setting is empty.
ROLE = "role"
LABEL_RESOURCE_KEYS: tuple[str, ...] = (RUN_ID, ROLE, RANK, "local_rank", "host.name")
# Per-launch resource attributes (process.pid; process.command_line etc. from SDK resource
# detectors; the run name, generated anew by each launch unless set) are kept off the metrics
# Resource: stores that turn every resource attribute into a label (VictoriaMetrics' and Mimir's
# OTLP ingestion, the Collector's prometheus exporter) would start new series on every restart.
# Spans and logs, which are events, not series, carry PROCESS_PID and RUN_NAME.
PROCESS_ATTRIBUTE_PREFIX = "process."
PROCESS_PID = "process.pid"
RUN_NAME = "otel_train.run_name"

# Short aliases for the table below.
S = Kind
_m = MetricSpec


# --- training ------------------------------------------------------------------------------------
STEPS = _m("train.steps", S.COUNTER, "{step}", "Completed training steps.", "train/steps", essential=True)
TOKENS = _m("train.tokens", S.COUNTER, "{token}", "Tokens processed.", "throughput/tokens")
SAMPLES = _m("train.samples", S.COUNTER, "{sample}", "Samples processed.", "throughput/samples")
STEP_DURATION = _m("train.step.duration", S.HISTOGRAM, "s", "Wall time of one training step.", "timers/step",
                   buckets=STEP_BUCKETS, essential=True)  # fmt: skip
PHASE_DURATION = _m("train.phase.duration", S.HISTOGRAM, "s",
                    "Wall time of a timed phase (forward, backward, ...); one that raised carries its "
                    "error.type, and a step that raised is phase `step` with its error.type.", "timers/{train.phase}",
                    attributes=(PHASE, ERROR_TYPE), buckets=PHASE_BUCKETS)  # fmt: skip
CURRENT_STEP = _m("train.step.current", S.GAUGE, "{step}", "Index of the last completed step.", "train/step",
                  essential=True)  # fmt: skip
LAST_STEP_TIME = _m("train.step.last_timestamp", S.GAUGE, "s", "Unix time at which the last step completed.",
                    "health/last_step_time")  # fmt: skip
TOTAL_STEPS = _m("train.steps.planned", S.GAUGE, "{step}", "Planned number of steps (when known).",
                 "train/steps_planned", essential=True)  # fmt: skip
ETA = _m("train.eta", S.GAUGE, "s", "Estimated time to the planned last step.", "progress/eta_s")
LOSS = _m("train.loss", S.GAUGE, "",
          "Training loss: mean over the interval's recorded values (one per step).",
          "train/loss")  # fmt: skip
LEARNING_RATE = _m("train.learning_rate", S.GAUGE, "", "Learning rate.", "train/learning_rate")
GRAD_NORM = _m("train.grad.norm", S.GAUGE, "",
               "Global gradient norm: mean over the interval's recorded values.",
               "train/grad_norm")  # fmt: skip
PARAM_NORM = _m("train.param.norm", S.GAUGE, "", "Global parameter L2 norm (ot.watch).", "train/param_norm")
EVAL_LOSS = _m("eval.loss", S.GAUGE, "", "Validation loss.", "eval/loss")
EVAL_PERPLEXITY = _m("eval.perplexity", S.GAUGE, "", "Validation perplexity.", "eval/perplexity")
EVAL_ACCURACY = _m("eval.accuracy", S.GAUGE, "1", "Validation top-1 token accuracy.", "eval/accuracy")

# --- per-step values over the flush interval ---------------------------------------------------------
# A value recorded every step (ot.record) reaches the SDK once per flush as the MEAN of the interval's
# values (the HF Trainer / Megatron convention: a 100-step interval is not one sampled step). Its
# smallest, largest and last value go alongside: as gauges of their own for the loss and the gradient
# norm (`train.loss.max`, key `train/loss_max`), and for every other recorded name as bridge keys only
# (`interval_key`: `train/foo_max`; not as series, for the series budget).
INTERVAL_STATS: tuple[str, ...] = ("min", "max", "last")


def interval_key(key: str, stat: str) -> str:
    """The bridge key of a recorded value's interval statistic (`train/loss`, `max` -> `train/loss_max`)."""
    return f"{key}_{stat}"


def _interval_specs(base: MetricSpec, what: str) -> dict[str, MetricSpec]:
    words = {"min": "Smallest", "max": "Largest", "last": "Last"}
    return {
        stat: _m(f"{base.name}.{stat}", S.GAUGE, base.unit, f"{words[stat]} {what} of the interval's steps.",
                 interval_key(base.key, stat))
        for stat in INTERVAL_STATS
    }  # fmt: skip


LOSS_STATS = _interval_specs(LOSS, "training loss")
LOSS_MIN, LOSS_MAX, LOSS_LAST = LOSS_STATS["min"], LOSS_STATS["max"], LOSS_STATS["last"]
GRAD_NORM_STATS = _interval_specs(GRAD_NORM, "global gradient norm")
GRAD_NORM_MIN, GRAD_NORM_MAX, GRAD_NORM_LAST = (GRAD_NORM_STATS[s] for s in INTERVAL_STATS)
# Instrument name -> its interval statistics' gauges (the others' statistics are bridge keys only).
INTERVAL_STAT_SPECS: dict[str, dict[str, MetricSpec]] = {
    LOSS.name: LOSS_STATS,
    GRAD_NORM.name: GRAD_NORM_STATS,
}
INTERVAL_STAT_NAMES: frozenset[str] = frozenset(
    spec.name for specs in INTERVAL_STAT_SPECS.values() for spec in specs.values()
)

# --- ot.watch(model): per layer, on watched steps --------------------------------------------------
LAYER_GRAD_NORM = _m("train.layer.grad.norm", S.GAUGE, "", "Gradient L2 norm of one layer (ot.watch).",
                     "grad_norm/{train.layer}", (LAYER,))  # fmt: skip
LAYER_PARAM_NORM = _m("train.layer.param.norm", S.GAUGE, "", "Parameter L2 norm of one layer (ot.watch).",
                      "param_norm/{train.layer}", (LAYER,))  # fmt: skip
LAYER_ACTIVATION_RMS = _m("train.layer.activation.rms", S.GAUGE, "",
                          "Root mean square of a layer's output (ot.watch).", "activation_rms/{train.layer}",
                          (LAYER,))  # fmt: skip
LAYER_ACTIVATION_ABSMAX = _m("train.layer.activation.absmax", S.GAUGE, "",
                             "Largest absolute value in a layer's output (ot.watch).",
                             "activation_absmax/{train.layer}", (LAYER,))  # fmt: skip

# --- health ----------------------------------------------------------------------------------------
NONFINITE_LOSS = _m("train.loss.nonfinite", S.COUNTER, "{value}", "Non-finite (NaN/Inf) loss values seen.",
                    "health/nonfinite_loss", essential=True)  # fmt: skip
GOODPUT = _m("train.goodput", S.GAUGE, "1",
             "Share of the job's wall time (all restarts of the run id) spent in training steps.",
             "train/goodput")  # fmt: skip
BADPUT_DURATION = _m("train.badput.duration", S.COUNTER, "s", "Wall time (all restarts of the run id) not "
                     "spent in productive training steps, by cause.", "train/badput/{train.badput.cause}",
                     (BADPUT_CAUSE,))  # fmt: skip
PRODUCTIVE_DURATION = _m("train.productive.duration", S.COUNTER, "s", "Wall time (all restarts of the run "
                         "id) spent in productive training steps; with train.badput.duration, the run id's "
                         "whole wall time.", "train/productive")  # fmt: skip
INTERRUPTIONS = _m("train.interruptions", S.COUNTER, "{interruption}",
                   "Restarts of the run id: each process after the first one of a run id counts one.",
                   "train/interruptions")  # fmt: skip
STEP_DEVIATION = _m("train.step.deviation", S.GAUGE, "1", "Mean step time of the interval against the "
                    "typical one (median of the last 100 intervals' means), minus 1: 0 = as usual, 0.25 = "
                    "25 % slower.", "train/step_deviation")  # fmt: skip
LOSS_SCALE = _m("train.loss_scale", S.GAUGE, "",
                "Mixed-precision loss scale (GradScaler, ot.watch(model, scaler=...)).",
                "train/loss_scale")  # fmt: skip
SKIPPED_STEPS = _m("train.optimizer.skipped_steps", S.COUNTER, "{step}",
                   "Optimizer steps skipped for inf/NaN gradients (GradScaler, ot.watch(model, scaler=...)).",
                   "train/skipped_steps", essential=True)  # fmt: skip
PROFILED_STEPS = _m("train.profiler.steps", S.COUNTER, "{step}",
                    "Steps run inside a run.profile window (their durations are skewed by the profiler).",
                    "train/profiled_steps")  # fmt: skip
HEALTH_EVENTS = _m("train.health.events", S.COUNTER, "{event}", "Health events by name, every one the run "
                   "raises (e.g. nonfinite, nonfinite_grad, loss_spike, straggler, stall, hang, gpu_lost).",
                   "health/{otel_train.event}", attributes=(EVENT,), essential=True)  # fmt: skip
STALL_DURATION = _m("train.stall.duration", S.OBSERVABLE_GAUGE, "s", "How long this rank has had no step or "
                    "eval batch, once past stall_timeout_s (checkpoint_timeout_s during a checkpoint save); "
                    "0 while it progresses or idles on purpose. The stall alerts read it.",
                    "health/stall_duration", essential=True)  # fmt: skip
DROPPED = _m("otel_train.dropped", S.COUNTER, "{value}",
             "Measurements otel_train dropped (bad value, bad or excess name, full queue, slow sink).",
             "otel_train/dropped/{otel_train.reason}", attributes=(REASON,), essential=True)  # fmt: skip

# --- distributed -----------------------------------------------------------------------------------
STRAGGLER_SCORE = _m("train.straggler.score", S.GAUGE, "1", "Straggler score of this rank (1 = healthy, "
                     "lower = slower). relative: 1 - this rank's lateness / step time (the share of the "
                     "job's step the others wait for it); individual: own best / own time now (step time "
                     "minus the time spent waiting for others).", "stragglers/{straggler.kind}",
                     attributes=(STRAGGLER_KIND, PHASE), essential=True)  # fmt: skip
STRAGGLER_LATENESS = _m("train.straggler.lateness", S.GAUGE, "s", "How late this rank arrives per step, "
                        "against the other ranks' median arrival (median over the interval, at its latest "
                        "phase end; 0 = on time). The rank the others wait for has the largest.",
                        "stragglers/lateness", essential=True)  # fmt: skip
STRAGGLER_WAIT = _m("train.straggler.wait", S.GAUGE, "s", "Time per step this rank waits for the latest rank "
                    "at the synchronization (0 = nobody to wait for).", "stragglers/wait",
                    essential=True)  # fmt: skip
PHASE_CROSS_RANK = _m("train.phase.cross_rank", S.GAUGE, "s", "Cross-rank statistic (min/max/mean/median) of "
                      "a phase's mean time over the interval; for the step, of each rank's lower-median "
                      "step time (argmin_rank/argmax_rank: the rank).", "timers/{train.phase}/ranks_{stat}",
                      attributes=(PHASE, STAT))  # fmt: skip

DATA_DUPLICATE_RANKS = _m("train.data.duplicate_ranks", S.GAUGE, "{rank}", "Data-parallel ranks that trained "
                          "on the same batch as another peer at the latest compared watched step (rank 0; 0 "
                          "= the data is sharded). ot.watch fingerprints the batches.",
                          "data/duplicate_ranks", essential=True)  # fmt: skip
REPLICA_DIVERGENCE = _m("train.replica.divergence", S.GAUGE, "1", "Largest relative difference of a layer's "
                        "parameter norm between data-parallel replicas at the latest compared watched step "
                        "(rank 0; 0 under healthy DDP).", "data/replica_divergence",
                        essential=True)  # fmt: skip

# --- the job's own series (rank 0, no rank label; crossrank/job_block, job_outputs) ---------------------
# Summed exactly over the ranks through the one exchange per flush: histograms and counters over every
# row rank 0 took, gauges over the rows of its latest flush (docs/scale.md "Job-level series"). Fed
# when an exporter collects, not at the flush (rank 0's flush stays as cheap).
JOB_STEP_DURATION = _m("train.job.step.duration", S.HISTOGRAM, "s", "Wall time of one training step, every "
                       "rank's steps (bucket counts summed over the ranks).", "job/timers/step",
                       buckets=STEP_BUCKETS, scope="job")  # fmt: skip
JOB_PHASE_DURATION = _m("train.job.phase.duration", S.HISTOGRAM, "s",
                        "Wall time of a timed phase, every rank's (bucket counts summed over the ranks).",
                        "job/timers/{train.phase}", attributes=(PHASE,), buckets=PHASE_BUCKETS,
                        scope="job")  # fmt: skip
JOB_SAMPLES = _m("train.job.samples", S.OBSERVABLE_COUNTER, "{sample}", "Samples processed by all ranks.",
                 "job/throughput/samples", scope="job")  # fmt: skip
JOB_TOKENS = _m("train.job.tokens", S.OBSERVABLE_COUNTER, "{token}", "Tokens processed by all ranks.",
                "job/throughput/tokens", scope="job")  # fmt: skip
JOB_SAMPLES_RATE = _m("train.job.samples.rate", S.OBSERVABLE_GAUGE, "{sample}/s",
                      "Samples per second of the job over rank 0's latest flush interval.",
                      "job/samples_rate", scope="job")  # fmt: skip
JOB_TOKENS_RATE = _m("train.job.tokens.rate", S.OBSERVABLE_GAUGE, "{token}/s",
                     "Tokens per second of the job over rank 0's latest flush interval.", "job/tokens_rate",
                     scope="job")  # fmt: skip
JOB_LOSS = _m("train.job.loss", S.OBSERVABLE_GAUGE, "",
              "Training loss: mean over every rank's recorded values of the interval.", "job/loss",
              scope="job")  # fmt: skip
JOB_LOSS_MIN = _m("train.job.loss.min", S.OBSERVABLE_GAUGE, "",
                  "Smallest training loss any rank recorded in the interval.", "job/loss_min",
                  scope="job")  # fmt: skip
JOB_LOSS_MAX = _m("train.job.loss.max", S.OBSERVABLE_GAUGE, "",
                  "Largest training loss any rank recorded in the interval.", "job/loss_max",
                  scope="job")  # fmt: skip
JOB_PHASE_CROSS_RANK = _m("train.job.phase.cross_rank", S.OBSERVABLE_GAUGE, "s", "Over every rank's mean "
                          "time of a phase in the interval: min/max/mean (argmin_rank/argmax_rank: the "
                          "rank).", "job/timers/{train.phase}/ranks_{stat}", attributes=(PHASE, STAT),
                          scope="job")  # fmt: skip
JOB_RANKS = _m("train.job.ranks", S.OBSERVABLE_GAUGE, "{rank}",
               "Ranks' rows in the job-level series of rank 0's latest flush.", "job/ranks",
               scope="job")  # fmt: skip

# --- throughput and efficiency ---------------------------------------------------------------------
FLOPS = _m("train.flops.rate", S.GAUGE, "{flop}/s", "Achieved model FLOP/s per GPU.",
           "throughput/flops_per_s")  # fmt: skip
MFU = _m("train.mfu", S.GAUGE, "1",
         "Model FLOPs utilization vs the device's peak for the job's compute dtype.", "throughput/mfu",
         attributes=(PEAK_SOURCE, COMPUTE_DTYPE, PEAK_FLOPS))  # fmt: skip
ENERGY_PER_TOKEN = _m("train.energy.per_token", S.GAUGE, "J", "GPU energy per token.",
                      "energy/joules_per_token", gpu_only=True)  # fmt: skip
ENERGY_PER_STEP = _m("train.energy.per_step", S.GAUGE, "J", "GPU energy per step.", "energy/joules_per_step",
                     gpu_only=True)  # fmt: skip
POWER_AVERAGE = _m("train.power.average", S.GAUGE, "W", "Average GPU power over the interval.",
                   "energy/avg_power_w", gpu_only=True)  # fmt: skip

# --- GPU ---------------------------------------------------------------------------------------------
# `hw.*` names are exactly the OTel hardware semantic conventions (tests/test_hw_semconv.py checks
# them against the spec's YAML at a pinned version); what the spec has no metric for is our
# extension, named `otel_train.gpu.*`.
_GPU = (HW_ID, HW_NAME)
_GPU_TYPED = (HW_ID, HW_NAME, HW_TYPE)  # the common hw.* metrics say which kind of component
GPU_UTILIZATION = _m("hw.gpu.utilization", S.OBSERVABLE_GAUGE, "1", "GPU busy fraction.",
                     "gpu/{hw.id}/utilization", _GPU, gpu_only=True, essential=True)  # fmt: skip
GPU_MEMORY_UTILIZATION = _m("hw.gpu.memory.utilization", S.OBSERVABLE_GAUGE, "1",
                            "Fraction of GPU memory used.", "gpu/{hw.id}/memory_used_fraction", _GPU,
                            gpu_only=True)  # fmt: skip
GPU_MEMORY_CONTROLLER = _m("otel_train.gpu.memory_controller.utilization", S.OBSERVABLE_GAUGE, "1",
                           "GPU memory controller busy fraction (NVML utilization.memory; an otel_train "
                           "extension).", "gpu/{hw.id}/memory_controller_busy", _GPU,
                           gpu_only=True)  # fmt: skip
GPU_MEMORY_USAGE = _m("hw.gpu.memory.usage", S.OBSERVABLE_UP_DOWN_COUNTER, "By", "GPU memory used.",
                      "gpu/{hw.id}/memory_used", _GPU, gpu_only=True, essential=True)  # fmt: skip
GPU_MEMORY_LIMIT = _m("hw.gpu.memory.limit", S.OBSERVABLE_UP_DOWN_COUNTER, "By", "GPU memory total.",
                      "gpu/{hw.id}/memory_limit", _GPU, gpu_only=True, essential=True)  # fmt: skip
GPU_TEMPERATURE = _m("hw.temperature", S.OBSERVABLE_GAUGE, "Cel", "GPU temperature.",
                     "gpu/{hw.id}/temperature", _GPU_TYPED, gpu_only=True, essential=True)  # fmt: skip
GPU_POWER = _m("hw.power", S.OBSERVABLE_GAUGE, "W", "GPU power draw.", "gpu/{hw.id}/power", _GPU_TYPED,
               gpu_only=True, essential=True)  # fmt: skip
GPU_ENERGY = _m("hw.energy", S.OBSERVABLE_COUNTER, "J", "GPU energy since driver load.", "gpu/{hw.id}/energy",
                _GPU_TYPED, gpu_only=True)  # fmt: skip
GPU_ERRORS = _m("hw.errors", S.OBSERVABLE_COUNTER, "{error}", "GPU errors: ecc_corrected, ecc_uncorrected, "
                "xid (critical XID events; each one's code is on a gpu_xid health event).",
                "gpu/{hw.id}/errors/{error.type}", (*_GPU_TYPED, ERROR_TYPE), gpu_only=True,
                essential=True)  # fmt: skip
GPU_IO = _m("hw.gpu.io", S.OBSERVABLE_COUNTER, "By", "Bytes the GPU received and transmitted over PCIe "
            "(NVML's PCIe throughput samples integrated over the sampling period: an estimate).",
            "gpu/{hw.id}/io/{network.io.direction}", (*_GPU, DIRECTION), gpu_only=True)  # fmt: skip
GPU_CLOCK_SM = _m("otel_train.gpu.clock.sm", S.OBSERVABLE_GAUGE, "Hz", "SM clock (an otel_train extension).",
                  "gpu/{hw.id}/clock_sm", _GPU, gpu_only=True)  # fmt: skip
GPU_CLOCK_MEMORY = _m("otel_train.gpu.clock.memory", S.OBSERVABLE_GAUGE, "Hz",
                      "Memory clock (an otel_train extension).", "gpu/{hw.id}/clock_memory", _GPU,
                      gpu_only=True)  # fmt: skip
GPU_THROTTLE = _m("otel_train.gpu.throttle", S.OBSERVABLE_GAUGE, "1",
                  "1 while a clock-event/throttle reason is active (an otel_train extension).",
                  "gpu/{hw.id}/throttle/{otel_train.gpu.throttle.reason}", (*_GPU, THROTTLE_REASON),
                  gpu_only=True, essential=True)  # fmt: skip
CUDA_MEMORY_ALLOCATED = _m("train.cuda.memory.allocated", S.GAUGE, "By", "CUDA allocator: allocated.",
                           "cuda/memory_allocated", gpu_only=True)  # fmt: skip
CUDA_MEMORY_RESERVED = _m("train.cuda.memory.reserved", S.GAUGE, "By", "CUDA allocator: reserved.",
                          "cuda/memory_reserved", gpu_only=True)  # fmt: skip
CUDA_MEMORY_PEAK = _m("train.cuda.memory.peak", S.GAUGE, "By",
                      "CUDA allocator: peak allocated over the interval.", "cuda/memory_peak",
                      gpu_only=True)  # fmt: skip
CUDA_ALLOC_RETRIES = _m("train.cuda.alloc_retries", S.COUNTER, "{retry}", "CUDA allocator retries.",
                        "cuda/alloc_retries", gpu_only=True)  # fmt: skip
CUDA_OOMS = _m("train.cuda.ooms", S.COUNTER, "{event}", "CUDA out-of-memory events.", "cuda/ooms",
               gpu_only=True)  # fmt: skip

# Apple silicon (torch.mps): the Metal allocator, read at the flush (mps_memory.py)
MPS_MEMORY_ALLOCATED = _m("train.mps.memory.allocated", S.GAUGE, "By",
                          "MPS: memory occupied by tensors (torch.mps.current_allocated_memory).",
                          "mps/memory_allocated", gpu_only=True)  # fmt: skip
MPS_MEMORY_DRIVER = _m("train.mps.memory.driver", S.GAUGE, "By", "MPS: memory the Metal driver allocated for "
                       "this process, caches included (torch.mps.driver_allocated_memory).",
                       "mps/memory_driver", gpu_only=True)  # fmt: skip
MPS_MEMORY_LIMIT = _m("train.mps.memory.limit", S.GAUGE, "By", "MPS: recommended maximum working set of the "
                      "device (torch.mps.recommended_max_memory).", "mps/memory_limit",
                      gpu_only=True)  # fmt: skip

# --- host ------------------------------------------------------------------------------------------
PROCESS_CPU_UTILIZATION = _m("process.cpu.utilization", S.OBSERVABLE_GAUGE, "1",
                             "Process CPU use as a share of the CPUs available to it (1 = all busy).",
                             "host/process_cpu")  # fmt: skip
PROCESS_MEMORY_USAGE = _m("process.memory.usage", S.OBSERVABLE_UP_DOWN_COUNTER, "By",
                          "Process resident memory.", "host/process_rss")  # fmt: skip
SYSTEM_MEMORY_USAGE = _m("system.memory.usage", S.OBSERVABLE_UP_DOWN_COUNTER, "By",
                         "Host memory by state: free = available to new allocations (MemAvailable), "
                         "used = the rest.", "host/memory_{system.memory.state}",
                         (MEMORY_STATE,))  # fmt: skip

# --- collectives (PyTorch's Flight Recorder; see otel_train/diagnostics/collectives.py) --------------
PROCESS_GROUP = "train.collective.group"  # the process group's description (default_pg, ...) or name
COLLECTIVE_OP = "train.collective.op"  # all_reduce | all_gather | reduce_scatter | ... ; "other" past the cap
COLLECTIVE_COUNT = _m("train.collective.count", S.COUNTER, "{collective}",
                      "Collectives this rank completed, per process group and op (Flight Recorder).",
                      "collective/{train.collective.group}/{train.collective.op}/count",
                      (PROCESS_GROUP, COLLECTIVE_OP))  # fmt: skip
COLLECTIVE_SIZE = _m("train.collective.size", S.COUNTER, "By",
                     "Bytes of the input tensors this rank passed to collectives, per process group and op.",
                     "collective/{train.collective.group}/{train.collective.op}/bytes",
                     (PROCESS_GROUP, COLLECTIVE_OP))  # fmt: skip
COLLECTIVE_TIME = _m("train.collective.time", S.COUNTER, "s", "Time in collectives as the backend measured "
                     "it (NCCL with TORCH_NCCL_ENABLE_TIMING=1 only).",
                     "collective/{train.collective.group}/{train.collective.op}/time",
                     (PROCESS_GROUP, COLLECTIVE_OP), gpu_only=True)  # fmt: skip
COLLECTIVE_LAST = _m("train.collective.last_seconds", S.OBSERVABLE_GAUGE, "s", "Seconds since this rank last "
                     "enqueued or completed a collective, while one is pending or the rank is stalled (else "
                     "0): rises in a hang, no step needed.", "collective/last_seconds",
                     essential=True)  # fmt: skip

# --- DeepSpeed ZeRO (integrations/deepspeed.py; checked across ranks in crossrank/zero_partition.py) ---
ZERO_STAGE = _m("deepspeed.zero.stage", S.GAUGE, "1", "DeepSpeed ZeRO stage this rank trains with (0-3).",
                "deepspeed/zero/stage")  # fmt: skip
ZERO_DP_SIZE = _m("deepspeed.zero.dp_size", S.GAUGE, "{rank}",
                  "Ranks of the data-parallel group ZeRO partitions over.",
                  "deepspeed/zero/dp_size")  # fmt: skip
ZERO_MODEL_NUMEL = _m("deepspeed.zero.model.numel", S.GAUGE, "{element}", "Trainable parameter elements of "
                      "the whole model (every rank's ZeRO partitions together hold them).",
                      "deepspeed/zero/model_numel")  # fmt: skip
ZERO_PARTITION_NUMEL = _m("deepspeed.zero.partition.numel", S.GAUGE, "{element}", "fp32 master-weight "
                          "elements this rank's optimizer owns (its ZeRO partition; the whole model at "
                          "stage 0).", "deepspeed/zero/partition_numel")  # fmt: skip
ZERO_OPTIMIZER_STATE_BYTES = _m("deepspeed.zero.optimizer_state.bytes", S.GAUGE, "By",
                                "Bytes of optimizer state (Adam's moments, ...) this rank holds for its "
                                "ZeRO partition.", "deepspeed/zero/optimizer_state_bytes")  # fmt: skip
ZERO_PARAM_SHARD_NUMEL = _m("deepspeed.zero.param_shard.numel", S.GAUGE, "{element}",
                            "ZeRO-3: parameter elements this rank holds between gathers (its shard of every "
                            "parameter).", "deepspeed/zero/param_shard_numel")  # fmt: skip
DS_COMM_SIZE = "deepspeed.comm.size_class"  # message size rounded up to a power of two (64KiB)
DS_COMM_COUNT = _m("deepspeed.comm.count", S.OBSERVABLE_COUNTER, "{collective}",
                   "Collectives DeepSpeed's comms logger timed on this rank, per op and message size class.",
                   "deepspeed/comm/{train.collective.op}/{deepspeed.comm.size_class}/count",
                   (COLLECTIVE_OP, DS_COMM_SIZE))  # fmt: skip
DS_COMM_BYTES = _m("deepspeed.comm.size", S.OBSERVABLE_COUNTER, "By",
                   "Message bytes of the collectives DeepSpeed's comms logger timed, per op and size class.",
                   "deepspeed/comm/{train.collective.op}/{deepspeed.comm.size_class}/bytes",
                   (COLLECTIVE_OP, DS_COMM_SIZE))  # fmt: skip
DS_COMM_TIME = _m("deepspeed.comm.time", S.OBSERVABLE_COUNTER, "s", "Latency DeepSpeed's comms logger "
                  "measured for its collectives (it synchronizes the device after each), per op and size "
                  "class.", "deepspeed/comm/{train.collective.op}/{deepspeed.comm.size_class}/time",
                  (COLLECTIVE_OP, DS_COMM_SIZE))  # fmt: skip
DS_COMM_BUSBW = _m("deepspeed.comm.busbw", S.OBSERVABLE_GAUGE, "Gbit/s", "Bus bandwidth DeepSpeed's comms "
                   "logger computed, mean of the collectives since the previous export, per op and size "
                   "class.", "deepspeed/comm/{train.collective.op}/{deepspeed.comm.size_class}/busbw",
                   (COLLECTIVE_OP, DS_COMM_SIZE))  # fmt: skip

CATALOGUE: tuple[MetricSpec, ...] = tuple(v for v in list(globals().values()) if isinstance(v, MetricSpec))
BY_NAME: dict[str, MetricSpec] = {m.name: m for m in CATALOGUE}
JOB_SPECS: tuple[MetricSpec, ...] = tuple(m for m in CATALOGUE if m.scope == "job")

# `ot.record()` names that map onto catalogue instruments. Anything else becomes a gauge named
# `train.<name>` (or the name itself when it already has a namespace such as `eval.` or `train.`).
RECORD_ALIASES: dict[str, str] = {
    "loss": LOSS.name,
    "lr": LEARNING_RATE.name,
    "learning_rate": LEARNING_RATE.name,
    "grad_norm": GRAD_NORM.name,
    "eval_loss": EVAL_LOSS.name,
    "val_loss": EVAL_LOSS.name,
    "perplexity": EVAL_PERPLEXITY.name,
    "accuracy": EVAL_ACCURACY.name,
}

_NAME_RE = re.compile(r"^[a-z][a-z0-9_.]{0,120}$")


def instrument_name_for(record_name: str) -> str | None:
    """Map a user's record name (`loss`, `train/loss`, `eval/perplexity`) to an instrument name;
    None when it cannot be made valid (then dropped and counted).

    A name of the user's own keeps its case (`val_F1` -> `eval.F1`): it is the run dir's and the
    bridges' key, case-sensitive like every logger; the SDK instrument is its `otel_name()`.
    Catalogue names and aliases match in any case and come back as the catalogue spells them.
    """
    raw = record_name.strip().replace("/", ".").replace("-", "_").replace(" ", "_")
    raw = re.sub(r"\.+", ".", raw).strip(".")
    if not raw:  # "", "/", " ": no name at all
        return None
    folded = raw.lower()
    if folded in RECORD_ALIASES:
        return RECORD_ALIASES[folded]
    if "." not in raw:
        raw, folded = f"train.{raw}", f"train.{folded}"
    alias = RECORD_ALIASES.get(folded[6:], "") if folded.startswith("train.") else ""
    if alias.startswith("train."):  # train/lr is train.learning_rate; train/accuracy stays train's own
        return alias
    if folded in BY_NAME:
        return folded
    return raw if _NAME_RE.match(folded) else None


def otel_name(instrument_name: str) -> str:
    """The SDK instrument (and so the OTLP/Prometheus name) of `instrument_name`: case folded."""
    return instrument_name.lower()


def default_key(instrument_name: str) -> str:
    """Bridge key for an instrument that is not in the catalogue (a user's own)."""
    return instrument_name.replace(".", "/")


# The derived bridge keys the StepReader writes (see its module doc), for readers of flat scalars.
RATE_SUFFIX = "_per_s"  # a counter's per-second rate: `throughput/tokens_per_s`


def rate_key(spec: MetricSpec) -> str:
    """A counter's per-second rate key (`throughput/tokens` -> `throughput/tokens_per_s`)."""
    return spec.key + RATE_SUFFIX


def stat_key(key: str, stat: str) -> str:
    """A histogram statistic's key (`timers/step`, `mean` -> `timers/step/mean`); `stat` is one of
    mean, count, total, min, max, p50, p95."""
    return f"{key}/{stat}"


def key_prefix(spec: MetricSpec) -> str:
    """The fixed start of every key `spec` produces (`timers/{train.phase}` -> `timers/`)."""
    return spec.key.split("{", 1)[0]


# --- Prometheus naming (both export paths) ---------------------------------------------------------
_UNIT_WORDS = {
    "s": "seconds", "ms": "milliseconds", "By": "bytes", "W": "watts", "J": "joules", "Cel": "celsius",
    "Hz": "hertz", "%": "percent",
}  # fmt: skip
_PER_UNIT_WORDS = {"s": "second", "m": "minute", "h": "hour", "d": "day"}


def _unit_suffix(unit: str) -> str:
    unit = re.sub(r"\{[^}]*\}", "", unit)  # annotations such as {token} are dropped
    if not unit or unit == "1":
        return ""
    if "/" in unit:
        num, den = unit.split("/", 1)
        parts = [_UNIT_WORDS.get(num, num) if num else "", "per", _PER_UNIT_WORDS.get(den, den)]
        return "_".join(p for p in parts if p)
    return _UNIT_WORDS.get(unit, unit)


def prometheus_name(spec: MetricSpec, collector: bool) -> str:
    """The Prometheus series base name for `spec` (histograms add _bucket/_sum/_count). The paths
    differ for gauges with unit `1`: only the Collector (otlptranslator) appends `_ratio`."""
    base = re.sub(r"[^a-zA-Z0-9_]", "_", spec.name)
    base = re.sub(r"__+", "_", base)
    suffix = _unit_suffix(spec.unit)
    if collector and spec.unit == "1" and spec.kind in (Kind.GAUGE, Kind.OBSERVABLE_GAUGE):
        suffix = "ratio"
    # otlptranslator skips a unit word already present anywhere in the name; the Python exporter
    # only skips it when the name already ends with it.
    tokens = base.split("_")
    present = all(w in tokens for w in suffix.split("_")) if collector else base.endswith(suffix)
    if suffix and not present:
        base = f"{base}_{suffix}"
    if spec.kind in (Kind.COUNTER, Kind.OBSERVABLE_COUNTER):
        base = f"{base}_total"
    return base


# --- the library's own names: what a user's record() name must not take ----------------------------
_HISTOGRAM_SUFFIXES = "/(?:mean|count|total|min|max|p50|p95)"


def prometheus_sanitized(name: str) -> str:
    """What opentelemetry-exporter-prometheus makes of an instrument name (no unit, no suffix)."""
    name = re.sub(r"[^a-zA-Z0-9:]+", "_", name)
    return "_" + name[1:] if name[:1].isdigit() else name


def _key_pattern(spec: MetricSpec) -> re.Pattern[str]:
    """Every bridge key `spec` can produce: placeholders, extra attribute segments, derived keys."""
    template = re.sub(r"\\\{[^}]*\\\}", "[^/]+", re.escape(spec.key))
    extra = "(?:/[^/]+)*" if spec.attributes or spec.kind is Kind.HISTOGRAM else ""
    if spec.kind in (Kind.COUNTER, Kind.OBSERVABLE_COUNTER):
        derived = "(?:_per_s)?"
    elif spec.kind is Kind.HISTOGRAM:
        derived = _HISTOGRAM_SUFFIXES
    else:
        derived = ""
    return re.compile(f"^{template}{extra}{derived}$")


@functools.cache
def _reserved() -> tuple[list[tuple[re.Pattern[str], str]], dict[str, str]]:
    keys = [(_key_pattern(spec), spec.name) for spec in CATALOGUE]
    prom: dict[str, str] = {"target_info": "target_info"}
    for spec in CATALOGUE:
        for collector in (False, True):
            stem = prometheus_name(spec, collector).removesuffix("_total")
            for suffix in ("", "_total", "_created", "_bucket", "_sum", "_count"):
                prom.setdefault(stem + suffix, spec.name)
    return keys, prom


def reserved_by(instrument: str) -> str | None:
    """The library instrument whose bridge keys or Prometheus series a user gauge named
    `instrument` would overwrite or duplicate (None when the name is free). Called once per name."""
    if instrument in BY_NAME:
        own = BY_NAME[instrument].kind is not Kind.GAUGE or instrument in INTERVAL_STAT_NAMES
        return instrument if own else None
    if instrument.startswith("otel_train."):
        return "otel_train.*"
    keys, prom = _reserved()
    key = default_key(instrument)
    for pattern, owner in keys:
        if pattern.match(key):
            return owner
    return prom.get(prometheus_sanitized(instrument))
