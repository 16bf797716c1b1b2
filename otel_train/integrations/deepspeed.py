"""DeepSpeed: `engine = instrument(deepspeed.initialize(...)[0])`, no DeepSpeed config change.

Phases, per-step values, the ZeRO facts and DeepSpeed's comms logger, on that engine instance
only. How it works: docs/design/integrations.md#deepspeed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
from collections.abc import Callable, Iterable, Mapping
from time import perf_counter_ns
from typing import Any

from opentelemetry.metrics import Observation

import otel_train as ot
from otel_train import adapters, semconv
from otel_train.integrations._common import (
    HookStep,
    settings_from_kwargs,
    spanned,
    start_session,
    with_precision,
)

__all__ = ["instrument", "zero_facts"]

log = logging.getLogger("otel_train")

# DeepSpeed's global timers (summed over the accumulation window, reset at the boundary) that are
# finer than the adapter's own phases; fwd / bwd / step are those phases already.
ENGINE_TIMERS = ("bwd_inner", "bwd_allreduce")
# The ZeRO-1/2 optimizer's timers (stage_1_and_2.py OPTIMIZER_*_TIMER), logged by DeepSpeed itself.
OPTIMIZER_TIMERS = ("optimizer_allgather", "optimizer_gradients", "optimizer_step")
FACT_READS = 16  # optimizer steps at which the ZeRO facts are read while the state does not exist yet
MAX_COMM_SERIES = 32  # (op, size class) pairs exported; the rest are "other"
_said: set[str] = set()


def instrument(
    engine: Any, *, steps: bool = True, settings: Mapping[str, Any] | None = None, **kwargs: Any
) -> Any:
    """Instrument a `deepspeed.DeepSpeedEngine` (what `deepspeed.initialize` returns first); returns
    the same engine. Idempotent. `steps=False`: the caller (a Trainer) marks steps and logs loss, lr
    and grad norm. Keyword arguments / `settings`: `ot.init()` settings for a session started here."""
    needed = ("is_gradient_accumulation_boundary", "zero_optimization_stage")
    if not all(callable(getattr(engine, name, None)) for name in needed):
        raise TypeError(
            f"instrument() needs the DeepSpeedEngine that deepspeed.initialize() returns first, got "
            f"{type(engine).__name__}: engine, optimizer, _, _ = deepspeed.initialize(...); instrument(engine)."
        )
    if "_otel_train" in engine.__dict__:
        return engine
    merged = settings_from_kwargs(settings, kwargs, "instrument")
    start_session(with_precision(merged, precision(engine)))
    adapter = _Adapter(engine, steps)
    engine.__dict__["_otel_train"] = adapter
    adapter.wrap()
    adapter.announce()
    return engine


def precision(engine: Any) -> str:
    """`fp16`, `bf16` or `fp32`: what the engine trains in."""
    if _call(engine, "fp16_enabled"):
        return "fp16"
    if _call(engine, "bfloat16_enabled"):
        return "bf16"
    return "fp32"


def zero_facts(engine: Any) -> dict[str, Any]:
    """This rank's ZeRO facts, read from the engine and the torch optimizer holding this rank's
    partition (`engine.optimizer.optimizer` under ZeRO): stage, dp size, the model's trainable
    elements, the fp32 partition this rank's optimizer owns, its state bytes, ZeRO-3's parameter
    shard, and the devices of the master weights and the state. Walks tensors: call it once."""
    import torch

    stage = int(_call(engine, "zero_optimization_stage") or 0)
    outer = getattr(engine, "optimizer", None)
    inner = getattr(outer, "optimizer", None) if stage >= 1 else None
    holder = inner if inner is not None and hasattr(inner, "param_groups") else outer
    groups = list(getattr(holder, "param_groups", None) or ())
    params = [p for g in groups for p in g.get("params", ()) if isinstance(p, torch.Tensor)]
    state = getattr(holder, "state", None) or {}
    if not params:  # ZeRO-3 hands its flat partitions to the torch optimizer only inside step()
        params = [p for p in state if isinstance(p, torch.Tensor)]
    if not params and stage >= 3:  # and until a step is applied (fp16's first ones may overflow)
        flat = getattr(outer, "fp32_partitioned_groups_flat", None) or ()
        params = [p for p in flat if isinstance(p, torch.Tensor)]
    state_tensors = [
        t for s in state.values() if isinstance(s, Mapping) for t in s.values() if isinstance(t, torch.Tensor)
    ]
    module_params = list(engine.module.parameters())
    model = sum(int(getattr(p, "ds_numel", p.numel())) for p in module_params if p.requires_grad)
    shard = -1
    if stage >= 3:
        shard = sum(
            int(p.ds_tensor.numel()) for p in module_params if getattr(p, "ds_tensor", None) is not None
        )
    return {
        "stage": stage,
        "dp_size": int(getattr(engine, "dp_world_size", 1) or 1),
        "model_numel": model,
        "partition_numel": sum(int(p.numel()) for p in params),
        "partition_groups": [int(p.numel()) for p in params],
        "optimizer_state_bytes": sum(int(t.numel()) * t.element_size() for t in state_tensors if t.dim() > 0),
        "param_shard_numel": shard,
        "master_device": str(params[0].device) if params else "",
        "state_device": str(state_tensors[0].device) if state_tensors else "",
    }


class _Adapter:
    """The wrapped engine's state (training thread, except `comms`' callbacks on the worker)."""

    def __init__(self, engine: Any, steps: bool) -> None:
        import torch

        self.engine = engine
        self.grad_enabled = torch.is_grad_enabled
        self.steps = steps  # mark steps and record loss / lr / grad norm
        self.marking = steps  # False once the loop's own step is seen
        self.hook_step = HookStep()  # the step this adapter began
        self.checked = False  # whether the loop's own ot.step was looked for (at the first forward)
        self.last_end: int | None = None  # perf_counter_ns where the previous optimizer step ended
        self.tokens = 0
        self.backward_timer: Any = None
        self.skips = semconv.SKIPPED_STEPS.create(ot.get_meter())
        self.skipped = int(getattr(engine, "skipped_steps", 0) or 0)
        self.fp16 = precision(engine) == "fp16"
        self.breakdown = bool(_call(engine, "wall_clock_breakdown"))
        # managed_gradient_accumulation=false: every step() is the caller's boundary (the engine
        # says "boundary" only while step() runs)
        self.unmanaged = _call(engine, "managed_gradient_accumulation") is False
        self.optimizer_times: dict[str, float] = {}  # ms, as DeepSpeed's timers.log read them
        micro_batch = int(_call(engine, "train_micro_batch_size_per_gpu") or 0)
        # the configured samples per step, where a step's forwards showed no tensor to count rows of
        self.configured_samples = micro_batch * int(_call(engine, "gradient_accumulation_steps") or 1)
        self.rows = 0  # this step's micro-batches' rows (samples), from their shapes
        self.facts_pending = True  # no optimizer state yet: read the facts again at the next step
        self.fact_reads = 0
        self.comms: _Comms | None = None

    # --- wrapping -------------------------------------------------------------------------------

    def wrap(self) -> None:
        from deepspeed.runtime.pipe.engine import PipelineEngine

        engine = self.engine
        d = engine.__dict__
        d["forward"] = _wraps(engine.forward, self._forward)
        d["backward"] = _wraps(engine.backward, self._backward)
        d["step"] = _wraps(engine.step, self._step)
        # Looked up on the engine each time DeepSpeed runs them: a torch-style loss.backward() passes
        # through them too.
        d["_backward_prologue"] = _wraps(engine._backward_prologue, self._backward_started)
        d["_backward_epilogue"] = _wraps(engine._backward_epilogue, self._backward_ended)
        if self.steps:  # a Trainer that drives the engine spans its own saves
            d["save_checkpoint"] = _wraps(spanned(engine.save_checkpoint, "checkpoint"), self._between)
            d["load_checkpoint"] = _wraps(spanned(engine.load_checkpoint, "load_checkpoint"), self._between)
        if isinstance(engine, PipelineEngine):
            # train_batch runs the module's forward, backward and step inside itself, past the
            # instance's wrapped methods: the whole call is the step
            d["train_batch"] = _wraps(engine.train_batch, self._train_batch)
            d["eval_batch"] = _wraps(engine.eval_batch, self._eval_batch)
        if self.breakdown:
            engine.timers.__dict__["log"] = _wraps(engine.timers.log, self._timers_log)

    def _forward(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not (self.engine.training and self.grad_enabled()):
            # engine.eval() or no_grad: no training step nor phase, nor its tokens
            return self._eval_batch(original, *args, **kwargs)
        if self.marking and not self.hook_step.open:
            self._begin()
        tokens, rows = _batch_counts(args, kwargs)
        self.tokens += tokens
        self.rows += rows
        with ot.timer("forward"):
            return original(*args, **kwargs)

    def _between(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """An eval batch, a save or a load between two steps: the next step begins after it (its
        data wait is backdated to here, not over it, so goodput books it as eval or checkpoint
        time and the step's duration leaves it out)."""
        try:
            return original(*args, **kwargs)
        finally:
            if not self.hook_step.open:
                self.last_end = perf_counter_ns()

    def _eval_batch(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """An eval-mode forward, or PipelineEngine.eval_batch: a long evaluation is no stall."""
        adapters.heartbeat()
        return self._between(original, *args, **kwargs)

    def _train_batch(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """PipelineEngine.train_batch: one optimizer step over all its micro-batches."""
        if self.marking and not self.hook_step.open:
            self._begin()
        try:
            loss = original(*args, **kwargs)
        except BaseException:
            self.hook_step.fail()
            raise
        if self.steps and loss is not None:
            ot.record("loss", loss)  # the mean over the micro-batches, as train_batch returns it
        self._after_step()
        return loss

    def _backward(self, original: Callable[..., Any], loss: Any, *args: Any, **kwargs: Any) -> Any:
        if self.steps:
            ot.record("loss", loss)  # the tensor: resolved at the flush, no sync here
        return original(loss, *args, **kwargs)

    def _backward_started(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.backward_timer is None:
            self.backward_timer = ot.timer("backward").start()
        return original(*args, **kwargs)

    def _backward_ended(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        timer, self.backward_timer = self.backward_timer, None
        if timer:
            timer.stop()
        return out

    def _step(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not self.unmanaged and not self.engine.is_gradient_accumulation_boundary():
            adapters.heartbeat()  # a micro-batch of the step: a long step is no stall
            return original(*args, **kwargs)
        try:
            with ot.timer("optimizer"):
                out = original(*args, **kwargs)
        except BaseException:
            self.hook_step.fail()
            raise
        self._after_step()
        return out

    def _timers_log(
        self, original: Callable[..., Any], names: Iterable[str], *args: Any, **kwargs: Any
    ) -> Any:
        names = list(names)
        held = self.engine.timers.timers
        for name in names:
            if name in OPTIMIZER_TIMERS and name in held:
                # DeepSpeed reads (and on CUDA synchronizes) the same timer next, in its log
                with contextlib.suppress(Exception):
                    self.optimizer_times[name] = float(held[name].elapsed(reset=False))
        return original(names, *args, **kwargs)

    # --- steps ----------------------------------------------------------------------------------

    def _begin(self) -> None:
        if not self.checked:  # once: run_info() costs microseconds, a loop keeps its shape
            info = ot.run_info()
            if info is None:
                return
            self.checked = True
            if info.open_step is not None:  # the loop marks its own steps
                self.marking = False
                return
        # numbered as DeepSpeed counts its optimizer steps: a resumed engine (load_checkpoint)
        # continues its own count
        index = int(getattr(self.engine, "global_steps", 0) or 0)
        self.hook_step.begin(index, self.last_end)

    def _after_step(self) -> None:
        engine = self.engine
        applied = bool(_call(engine, "was_step_applied"))
        if self.steps:
            lr = _call(engine, "get_lr")
            if isinstance(lr, (list, tuple)) and lr:
                ot.record("learning_rate", lr[0])
            norm = _call(engine, "get_global_grad_norm")
            if norm is not None and applied:  # an overflowed step's norm is inf by design: not a value
                ot.record("grad_norm", norm)
        if self.fp16:
            scale = getattr(getattr(engine, "optimizer", None), "loss_scale", None)
            if scale is not None:
                ot.record(semconv.LOSS_SCALE.name, scale)
        skipped = int(getattr(engine, "skipped_steps", 0) or 0)
        if skipped > self.skipped:
            self.skips.add(skipped - self.skipped)
        self.skipped = skipped
        if self.breakdown:
            self._finer_phases()
        self._zero()
        if self.hook_step.open:
            tokens, self.tokens = self.tokens, 0
            samples, self.rows = self.rows or self.configured_samples, 0
            self.hook_step.end(tokens=tokens or None, samples=samples or None)
        self.last_end = perf_counter_ns()

    def _finer_phases(self) -> None:
        timers = _call(self.engine, "get_wall_clock_timers") or {}
        for name in ENGINE_TIMERS:
            if isinstance(timers.get(name), (int, float)):
                adapters.phase(name, timers[name] / 1000.0)
        for name, ms in self.optimizer_times.items():
            adapters.phase(name, ms / 1000.0)
        self.optimizer_times.clear()

    def _zero(self) -> None:
        """This rank's ZeRO facts, read until the optimizer state exists (torch creates it at the
        first applied step; fp16 may skip several), recorded when they change: their gauges keep
        the value, and the partition check's block sends the last ones at every flush."""
        if self.fact_reads >= FACT_READS or not self.facts_pending:
            return
        self.fact_reads += 1
        try:
            facts = zero_facts(self.engine)
        except Exception as exc:  # DeepSpeed's optimizer internals, which differ by version and stage
            log.warning("otel_train: DeepSpeed ZeRO facts unreadable: %s", exc)
            self.fact_reads = FACT_READS
            return
        self.facts_pending = facts["optimizer_state_bytes"] == 0
        for spec, key in _FACT_GAUGES:
            if facts[key] >= 0:  # no parameter shard below ZeRO-3
                ot.record(spec.name, facts[key])
        if not self.facts_pending or self.fact_reads == FACT_READS:
            _log_facts(facts)

    # --- once, at instrument() ------------------------------------------------------------------

    def announce(self) -> None:
        engine = self.engine
        stage = int(_call(engine, "zero_optimization_stage") or 0)
        ot.log_hyperparams({"deepspeed": hyperparams(engine)})
        info = ot.run_info()
        rank0 = info is None or info.rank == 0
        offload = _call(engine, "zero_offload_optimizer")
        if rank0 and stage in (1, 2) and _device(offload) == "nvme":
            message = (
                f"DeepSpeed ZeRO-{stage} was asked to offload the optimizer to NVMe (offload_optimizer.device: "
                f"nvme, nvme_path {getattr(offload, 'nvme_path', None)!s}), but ZeRO-1/2 run any offload device "
                "as CPU offload: nothing is written to nvme_path and the state stays in host memory. Use "
                'zero_optimization.stage 3 for NVMe swapping, or set offload_optimizer.device: "cpu" to say '
                "what runs."
            )
            log.warning("otel_train: %s", message)
            ot.event(
                "zero_partition", message, {"ranks": "all", "zero.stage": stage, "kind": "nvme_not_used"}
            )
        self.comms = _Comms.start(engine, rank0)


_FACT_GAUGES = (
    (semconv.ZERO_STAGE, "stage"),
    (semconv.ZERO_DP_SIZE, "dp_size"),
    (semconv.ZERO_MODEL_NUMEL, "model_numel"),
    (semconv.ZERO_PARTITION_NUMEL, "partition_numel"),
    (semconv.ZERO_OPTIMIZER_STATE_BYTES, "optimizer_state_bytes"),
    (semconv.ZERO_PARAM_SHARD_NUMEL, "param_shard_numel"),
)


def _log_facts(facts: dict[str, Any]) -> None:
    info = ot.run_info()
    log.info(
        "otel_train: DeepSpeed ZeRO-%d on rank %s of %d data-parallel ranks: partition %d of %d trainable "
        "elements (groups %s) on %s, optimizer state %d B on %s%s",
        facts["stage"], info.rank if info else "?", facts["dp_size"], facts["partition_numel"],
        facts["model_numel"], facts["partition_groups"], facts["master_device"] or "-",
        facts["optimizer_state_bytes"], facts["state_device"] or "-",
        f", parameter shard {facts['param_shard_numel']} elements" if facts["param_shard_numel"] >= 0 else "",
    )  # fmt: skip


def hyperparams(engine: Any) -> dict[str, Any]:
    """What the engine's config says about ZeRO, batch and precision (once per run)."""
    out: dict[str, Any] = {
        "zero_stage": int(_call(engine, "zero_optimization_stage") or 0),
        "dp_world_size": int(getattr(engine, "dp_world_size", 1) or 1),
        "precision": precision(engine),
        "train_micro_batch_size_per_gpu": _call(engine, "train_micro_batch_size_per_gpu"),
        "train_batch_size": _call(engine, "train_batch_size"),
        "gradient_accumulation_steps": _call(engine, "gradient_accumulation_steps"),
        "overlap_comm": _call(engine, "zero_overlap_comm"),
        "wall_clock_breakdown": bool(_call(engine, "wall_clock_breakdown")),
    }
    for key in ("offload_optimizer", "offload_param"):
        cfg = _call(engine, f"zero_{key}")
        out[f"{key}.device"] = _device(cfg)
        if cfg is not None and _device(cfg) != "none":
            for field in ("nvme_path", "pin_memory", "ratio", "buffer_count"):
                value = getattr(cfg, field, None)
                if value is not None:
                    out[f"{key}.{field}"] = value if isinstance(value, (bool, int, float)) else str(value)
    return out


# --- the comms logger -----------------------------------------------------------------------------


class _Comms:
    """DeepSpeed's comms logger read at export time (observable instruments' callbacks, on the
    worker): cumulative count, bytes and time per (op, size class) from the deltas of its
    `comms_dict`, the mean bus bandwidth since the previous export. No collective, no sync."""

    def __init__(self, logger: Any) -> None:
        self.logger = logger
        self.lock = threading.Lock()
        self.seen: dict[tuple[str, int], int] = {}  # (op, size) -> entries consumed
        self.totals: dict[tuple[str, str], list[float]] = {}  # (op, class) -> [count, bytes, seconds]
        self.busbw: dict[tuple[str, str], list[float]] = {}  # (op, class) -> [sum, n] since last export

    @classmethod
    def start(cls, engine: Any, rank0: bool) -> _Comms | None:
        config = getattr(engine, "config", None)
        section = config.get("comms_logger") if isinstance(config, Mapping) else None
        import deepspeed.comm as dist

        logger = dist.comms_logger
        if not logger.enabled:
            return None
        if rank0 and "comms" not in _said:
            _said.add("comms")
            off = isinstance(section, Mapping) and section.get("enabled") is False
            log.warning(
                "otel_train: DeepSpeed's comms logger is on%s: it synchronizes the device after every "
                "collective it times (and barriers under MPI), which slows the step it measures. Its counts, "
                'bytes, latency and bus bandwidth are exported as deepspeed.comm.*. Remove the "comms_logger" '
                "section from the DeepSpeed config to turn it off: DeepSpeed checks only that the key is present.",
                ' although the config says "comms_logger": {"enabled": false}' if off else "",
            )
        comms = cls(logger)
        meter = ot.get_meter()
        for index, spec in enumerate((semconv.DS_COMM_COUNT, semconv.DS_COMM_BYTES, semconv.DS_COMM_TIME)):
            spec.create(meter, functools.partial(comms.observe_totals, index))
        semconv.DS_COMM_BUSBW.create(meter, comms.observe_busbw)
        return comms

    def poll(self) -> None:
        raw = self.logger.comms_dict
        for _ in range(3):  # the training thread may add an op while this copies: try again
            with contextlib.suppress(RuntimeError):
                items = [(op, list(sizes.items())) for op, sizes in list(raw.items())]
                break
        else:
            return
        for op, sizes in items:
            for size, entry in sizes:
                try:
                    count, lats, busbws = int(entry[0]), entry[1], entry[3]
                except (TypeError, IndexError, ValueError):
                    continue
                key = (str(op), int(size))
                done = self.seen.get(key, 0)
                if count < done:  # reset_log(): counting starts again
                    done = 0
                if count == done:
                    continue
                self.seen[key] = count
                series = self._series(*key)
                total = self.totals.setdefault(series, [0.0, 0.0, 0.0])
                total[0] += count - done
                total[1] += (count - done) * int(size)
                total[2] += sum(float(v) for v in lats[done:count]) / 1000.0  # ms -> s
                bw = self.busbw.setdefault(series, [0.0, 0.0])
                new_bw = [float(v) for v in busbws[done:count] if math.isfinite(float(v))]
                bw[0] += sum(new_bw)
                bw[1] += len(new_bw)

    def _series(self, op: str, size: int) -> tuple[str, str]:
        name = op.split("|", 1)[0].strip() or "other"  # debug mode appends the caller
        series = (name, size_class(size))
        if series not in self.totals and len(self.totals) >= MAX_COMM_SERIES:
            return ("other", "other")
        return series

    def observe_totals(self, index: int, options: Any) -> Iterable[Any]:
        """The cumulative count (`index` 0), bytes (1) or seconds (2) per series."""
        with self.lock:
            self.poll()
            return [Observation(t[index], _attrs(k)) for k, t in self.totals.items()]

    def observe_busbw(self, options: Any) -> Iterable[Any]:
        with self.lock:
            self.poll()
            out = [Observation(s / n, _attrs(k)) for k, (s, n) in self.busbw.items() if n > 0]
            self.busbw = {}
            return out


def size_class(size: int) -> str:
    """A message size rounded up to a power of two, as a label: 37540 -> `64KiB`."""
    bound = 1 << max(int(size) - 1, 0).bit_length()
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if bound >= 1 << shift:
            return f"{bound >> shift}{unit}"
    return f"{bound}B"


def _attrs(key: tuple[str, str]) -> dict[str, str]:
    return {semconv.COLLECTIVE_OP: key[0], semconv.DS_COMM_SIZE: key[1]}


# --- helpers --------------------------------------------------------------------------------------


def _wraps(original: Callable[..., Any], hook: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return hook(original, *args, **kwargs)

    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    wrapper.__doc__ = getattr(original, "__doc__", None)
    return wrapper


def _call(obj: Any, name: str) -> Any:
    method = getattr(obj, name, None)
    if not callable(method):
        return None
    try:
        return method()
    except Exception:  # a DeepSpeed engine getter that does not apply to this engine's setup
        return None


def _device(cfg: Any) -> str:
    if cfg is None:
        return "none"
    device = getattr(cfg, "device", None)
    return str(getattr(device, "value", device) or "none")


def _batch_counts(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[int, int]:
    """(tokens, rows) of one forward's inputs, from shapes (no sync). Tokens: the elements of
    `input_ids`, else of the first integer tensor of two or more dimensions (a classifier's labels
    are none); rows: that tensor's first dimension, else the first tensor's. The positional
    arguments come first, then the keywords; a mapping among them (`engine(batch)`) is looked into."""
    import torch

    tensors: list[Any] = []
    for value in (*args, kwargs):
        if isinstance(value, Mapping):
            ids = value.get("input_ids")
            if isinstance(ids, torch.Tensor) and not ids.is_floating_point():
                return int(ids.numel()), int(ids.shape[0]) if ids.ndim >= 2 else 1
            tensors += [v for v in value.values() if isinstance(v, torch.Tensor)]
        elif isinstance(value, torch.Tensor):
            tensors.append(value)
    for tensor in tensors:
        if tensor.ndim >= 2 and not tensor.is_floating_point() and not tensor.is_complex():
            return int(tensor.numel()), int(tensor.shape[0])
    first = next((t for t in tensors if t.ndim >= 1), None)
    return 0, int(first.shape[0]) if first is not None else 0
