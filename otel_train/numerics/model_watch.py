"""watch(model): per-layer gradient, parameter and activation statistics without host syncs.
Design: docs/design/hardware-and-numerics.md#model-watch.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from otel_train import semconv
from otel_train.core.buffer import SCALER_FOUND_INF, LayerStats
from otel_train.crossrank import FINGERPRINT

if TYPE_CHECKING:
    from otel_train.core.buffer import Buffer

log = logging.getLogger("otel_train")

# Wrapper attributes that would otherwise appear in every label (torch.compile, FSDP1, checkpointing).
_WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
ROOT_LABEL = "(root)"
HISTOGRAM_SAMPLE = 1024  # values per layer and histogram, strided over the layer's tensors
UNAPPLIED_WARNING = 10  # scaled watched steps in a row without an optimizer step before a warning


def clean_name(name: str, ddp: bool) -> str:
    """`module._orig_mod.blocks.0.attn` -> `blocks.0.attn` (`ddp`: drop DDP's leading `module.`)."""
    parts = [part for part in name.split(".") if part not in _WRAPPER_SEGMENTS]
    if ddp and parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def is_ddp_wrapped(model: Any) -> bool:
    """DistributedDataParallel, possibly inside torch.compile's wrapper."""
    return any(
        type(m).__name__ == "DistributedDataParallel" for m in (model, getattr(model, "_orig_mod", None))
    )


def layer_groups(param_names: Sequence[str], max_layers: int) -> tuple[list[str], list[int]]:
    """(labels, group per parameter): by owning module path, at the deepest depth with <= max_layers."""
    modules = [name.rpartition(".")[0] for name in param_names]
    depth = max((m.count(".") + 1 for m in modules if m), default=0)
    while True:
        prefixes = [".".join(m.split(".")[:depth]) if m else "" for m in modules]
        if depth == 0 or len(set(prefixes)) <= max_layers:
            break
        depth -= 1
    labels = list(dict.fromkeys(prefix or ROOT_LABEL for prefix in prefixes))
    index = {label: i for i, label in enumerate(labels)}
    return labels, [index[prefix or ROOT_LABEL] for prefix in prefixes]


class ModelWatch:
    """Handle returned by `ot.watch(model)`; `remove()` stops watching. It writes into `buffer` and
    calls `on_remove(self)` once when removed, so its owner can stop calling `begin_step`/`end_step`."""

    def __init__(
        self,
        buffer: Buffer,
        model: Any,
        every: int,
        grads: bool,
        params: bool,
        activations: bool,
        histograms: bool,
        max_layers: int,
        on_remove: Callable[[ModelWatch], None] | None = None,
        scaled: bool = False,
    ) -> None:
        self.model = model
        self.every = every
        self.grads = grads
        self.params = params
        self.activations = activations
        self.histograms = histograms
        self._buffer: Buffer | None = buffer  # None once removed
        self._on_remove = on_remove
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]  # some: checked
        self._params = [p for _, p in named]
        self._ddp = is_ddp_wrapped(model)
        self.labels, self._groups = layer_groups([clean_name(n, self._ddp) for n, _ in named], max_layers)
        self._members: list[list[int]] = [[] for _ in self.labels]
        for position, group in enumerate(self._groups):
            self._members[group].append(position)
        # values per tensor in a histogram: its layer's HISTOGRAM_SAMPLE shared among its tensors
        self._sample_sizes = [max(1, HISTOGRAM_SAMPLE // len(self._members[g])) for g in self._groups]
        self._reads = GradientReads(self._params, self._sample_sizes, self._fail, scaled)
        self._place_on(self._params[0].device)
        # Each parameter's owning module and the layers it marks as run when its forward runs.
        owners: dict[str, set[int]] = {}
        for (name, _), group in zip(named, self._groups, strict=True):
            owners.setdefault(name.rpartition(".")[0], set()).add(group)
        self._compiled = compiled_modules(model)  # hooks there would make Dynamo recompile
        modules = {} if self._compiled else dict(model.named_modules())
        self._owners = [(modules[n], tuple(sorted(g))) for n, g in owners.items() if n in modules]
        self._zero_stage = 0  # DeepSpeed's ZeRO stage once seen on the parameters (deepspeed_zero)
        self._ran: set[int] = set()  # layers whose module ran in this watched step
        self._hooks: list[Any] = []
        self._activations: dict[int, tuple[Any, Any]] = {}
        self._fingerprint: Any | None = None  # this watched step's batch fingerprint (device tensor)
        self._step: int | None = None  # the open step while it is a watched one not yet read
        self._read: int | None = None  # the step whose statistics `read_now` already took
        # Fingerprint batches only where an exchange compares them (ot.watch turns it off for a
        # single process or cross_rank=False): otherwise a float64 pass over the input for nothing.
        self.fingerprints = True
        self._warned: set[str] = set()
        self._params_checked = False  # see stale_parameters

    def _place_on(self, device: Any) -> None:
        """Index tensors on the parameters' device, built off the step path (a host-to-device copy
        would sync); again only if the model moves (`watch()` before `.cuda()`)."""
        self._device = device
        self._reads.device = device
        self._group_index = torch.tensor(self._groups, dtype=torch.long, device=device)
        self._zero = torch.zeros((), dtype=torch.float32, device=device)
        # Sharded parameters (FSDP2): a layer smaller than the world can have no elements on this
        # rank; its norms here would read 0, a false `no_gradient`. Such layers are left out.
        held = [
            g
            for g, members in enumerate(self._members)
            if any(_local(self._params[i]).numel() for i in members)
        ]
        self._held: tuple[Any, tuple[str, ...]] | None = None
        if len(held) < len(self.labels):
            index = torch.tensor(held, dtype=torch.long, device=device)
            self._held = (index, tuple(self.labels[g] for g in held))

    # --- called by the session on the training thread (never raises into the loop) ---------------
    def begin_step(self, index: int) -> None:
        self._step = None
        if index % self.every == 0:
            if self._hooks:  # a watched step begun and never ended (ot.begin_step without end_step)
                self._remove_step_hooks()
            self._activations, self._fingerprint, self._read = {}, None, None
            self._ran = set()
            self._step = index
            try:
                self._see_zero()
                if self.grads and not self._zero_stage:
                    for module, marks in self._owners:
                        self._hooks.append(module.register_forward_hook(partial(self._ran_hook, marks)))
                    self._reads.begin(self._hooks, self.histograms)
                if self.fingerprints and id(self.model) not in self._compiled:  # replicas.py
                    self._hooks.append(
                        self.model.register_forward_pre_hook(self._fingerprint_hook, with_kwargs=True)
                    )
                if self.activations:
                    self._add_activation_hooks()
            except Exception as exc:  # the user's modules' own hook registration (and ZeRO's state)
                self._fail(exc)

    def end_step(self, index: int, failed: bool) -> None:
        if self._hooks:
            self._remove_step_hooks()
        self._step = None
        if failed or index % self.every != 0 or self._buffer is None or self._read == index:
            self._activations, self._fingerprint, self._read = {}, None, None
            self._reads.clear()
            return
        self._collect_or_skip(index, self._buffer)

    def read_now(self) -> None:
        """`ot.watch_read`: take this watched step's statistics now, not when the step ends (for
        frameworks that clear the gradients before then)."""
        index, buffer = self._step, self._buffer
        if index is None or buffer is None:
            return
        self._step, self._read = None, index
        self._remove_step_hooks()
        self._collect_or_skip(index, buffer)

    def see_batch(self, batch: Any) -> None:
        """`ot.watch_batch`: fingerprint `batch` unless the step has a fingerprint, for steps whose
        batch never reaches the watched module's forward (Lightning's `training_step`)."""
        if self._step is None or not self.fingerprints or self._fingerprint is not None:
            return
        try:
            self._fingerprint = _fingerprint(_batch_tensors(batch))
        except (RuntimeError, TypeError, ValueError) as exc:  # torch on an odd batch tensor
            self._fail(exc)

    def _collect_or_skip(self, index: int, buffer: Buffer) -> None:
        try:
            self._collect(index, buffer)
        except Exception as exc:  # torch on the user's parameters and gradients (any device, DTensor, ...)
            self._activations, self._fingerprint = {}, None
            self._reads.clear()
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        self._warn_once("failed", f"ot.watch: could not compute layer statistics ({exc!r}); skipped.")
        if self._buffer is not None:
            self._buffer.drop("watch_failed")

    def _collect(self, index: int, buffer: Buffer) -> None:
        if self._params[0].device != self._device:
            self._place_on(self._params[0].device)
        if not self._params_checked:
            self._params_checked = True
            if (stale := stale_parameters(self.model, self._params)) is not None:
                self._warn_once("stale", stale)
        records: list[LayerStats] = []
        if self.grads and not self._zero_stage and self._reads.skipped_by_scaler():
            if self._reads.unapplied == UNAPPLIED_WARNING:
                self._warn_once(
                    "unapplied",
                    f"ot.watch: no optimizer step ran inside the last {UNAPPLIED_WARNING} watched steps "
                    f"(through step {index}), so they have no gradient statistics: with scaler=, only "
                    "the gradients an optimizer step applies are read. Call scaler.step(optimizer) inside "
                    "the step, or the GradScaler is skipping every step (its loss scale keeps overflowing).",
                )
        elif self.grads and not self._zero_stage:
            found_inf = self._reads.found_inf
            norms, samples = self._reads.final()
            if all(n is None for n in norms):
                self._warn_once(
                    "no_grads",
                    f"ot.watch: no gradients in step {index}: no backward pass inside the step reached "
                    "the watched parameters, so the step has no gradient statistics. Run the backward "
                    "pass (and the optimizer step) inside the step.",
                )
            else:
                per_layer, total = self._group_norms(norms)
                if found_inf is not None:  # a fused optimizer's step the scaler may have skipped
                    per_layer, total, mark = scaler_skip(found_inf, self._device, per_layer, total, index)
                    records.append(mark)
                ran = self._ran_only(per_layer, norms)
                if ran is not None:
                    records.append(LayerStats(semconv.LAYER_GRAD_NORM.name, *ran, index))
                if not buffer.has_user_name_for(semconv.GRAD_NORM.name):  # the user's own grad_norm wins
                    buffer.add_internal(semconv.GRAD_NORM.name, total)
                if self.histograms:
                    self._add_histograms(buffer, "gradients", samples, index)
        if self.params and self._zero_stage != 3:
            per_layer, total = self._group_norms(foreach_norms(self._params, self._device))
            records.append(LayerStats(semconv.LAYER_PARAM_NORM.name, *self._held_only(per_layer), index))
            buffer.add_internal(semconv.PARAM_NORM.name, total)
            if self.histograms:
                samples = [sample(t, size) for t, size in zip(self._params, self._sample_sizes, strict=True)]
                self._add_histograms(buffer, "parameters", samples, index)
        if self._activations:
            groups = sorted(self._activations)
            rms = torch.stack([self._activations[g][0] for g in groups])
            absmax = torch.stack([self._activations[g][1] for g in groups])
            labels = tuple(self.labels[g] for g in groups)
            records.append(LayerStats(semconv.LAYER_ACTIVATION_RMS.name, labels, rms, index))
            records.append(LayerStats(semconv.LAYER_ACTIVATION_ABSMAX.name, labels, absmax, index))
            self._activations = {}
        if self._fingerprint is not None:
            records.append(LayerStats(FINGERPRINT, FINGERPRINT_LABELS, self._fingerprint, index))
            self._fingerprint = None
        buffer.add_layer_stats(records)

    def _see_zero(self) -> None:
        if not self._zero_stage and (stage := deepspeed_zero(self._params)):
            self._zero_stage = stage
            log.info(
                "ot.watch: DeepSpeed ZeRO-%s holds the gradients in its own partitioned buffers (p.grad "
                "is None after backward by design): no per-layer gradient norms%s; the global gradient "
                "norm comes from the DeepSpeed adapter (otel_train.integrations.deepspeed.instrument).",
                "3" if stage == 3 else "1/2",
                " and no parameter statistics (the parameters are partitioned too)" if stage == 3 else "",
            )

    def _ran_only(self, per_layer: Any, norms: Sequence[Any]) -> tuple[tuple[str, ...], Any] | None:
        """(labels, values) of the held layers that ran, or None. When no forward hook fired (a
        compiled model runs none), the layers that got a gradient are the ones that ran."""
        ran, self._ran = self._ran, set()
        if not ran:
            ran = {g for g, members in enumerate(self._members) if any(norms[i] is not None for i in members)}
        held = self._held[1] if self._held is not None else self.labels
        frozen = frozen_groups(self._members, self._params)
        if not frozen and len(ran) == len(self.labels):
            return self._held_only(per_layer)
        groups = [g for g, label in enumerate(self.labels) if g in ran and label in held and g not in frozen]
        if not groups:
            return None
        # views and one stack: no index tensor (a host-to-device copy would sync)
        return tuple(self.labels[g] for g in groups), torch.stack([per_layer[g] for g in groups])

    def _held_only(self, per_layer: Any) -> tuple[tuple[str, ...], Any]:
        """(labels, per-layer values) of the layers with elements on this rank (all, unsharded)."""
        if self._held is None:
            return tuple(self.labels), per_layer
        index, labels = self._held
        return labels, per_layer.index_select(0, index)

    def remove(self) -> None:
        """Stop watching (idempotent; also called by `ot.shutdown()`)."""
        self._remove_step_hooks()
        buffer, self._buffer = self._buffer, None
        if buffer is not None and self._on_remove is not None:
            self._on_remove(self)

    # --- device math (no host sync: results stay device tensors) ----------------------------------
    def _group_norms(self, norms: Sequence[Any]) -> tuple[Any, Any]:
        """(per-layer L2 norms, global L2 norm) from one norm per watched parameter (None = 0)."""
        stacked = torch.stack([self._zero if n is None else n for n in norms]).square_()
        per_layer = torch.zeros(len(self.labels), dtype=torch.float32, device=self._device)
        per_layer.index_add_(0, self._group_index, stacked)
        return per_layer.sqrt_(), stacked.sum().sqrt()

    def _add_histograms(self, buffer: Buffer, kind: str, samples: Sequence[Any], index: int) -> None:
        """One histogram per layer from its parameters' samples (at most HISTOGRAM_SAMPLE values)."""
        for group, members in enumerate(self._members):
            present = [samples[i] for i in members if samples[i] is not None]
            if present:
                buffer.add_histogram(f"{kind}/{self.labels[group]}", index, torch.cat(present))

    # --- activation hooks (only during watched steps) ---------------------------------------------
    def _add_activation_hooks(self) -> None:
        by_label = {clean_name(name, self._ddp): module for name, module in self.model.named_modules()}
        for group, label in enumerate(self.labels):
            module = by_label.get(label)
            if module is None or label == ROOT_LABEL:
                continue
            if id(module) in self._compiled:
                self._warn_once("compiled", "ot.watch: no activation statistics of compiled modules "
                                "(a hook there would make torch.compile recompile).")  # fmt: skip
                continue
            self._hooks.append(module.register_forward_hook(partial(self._activation_hook, group)))

    def _activation_hook(self, group: int, module: Any, args: Any, output: Any) -> None:
        tensor = _first_tensor(output)
        if tensor is None or not tensor.is_floating_point() or tensor.numel() == 0:
            return
        t = _local(tensor.detach())
        rms = torch.linalg.vector_norm(t, dtype=torch.float32) / math.sqrt(t.numel())
        low, high = torch.aminmax(t)  # an inf-norm is ~40x slower on CPU
        absmax = torch.maximum(high, -low).to(torch.float32)
        if rms.device != self._device:
            rms, absmax = rms.to(self._device), absmax.to(self._device)
        self._activations[group] = (rms, absmax)  # the last call of the step wins

    def _ran_hook(self, groups: tuple[int, ...], module: Any, args: Any, output: Any) -> None:
        self._ran.update(groups)

    def _fingerprint_hook(self, module: Any, args: Any, kwargs: Any) -> None:
        """The fingerprint of the tensor arguments of the step's first forward."""
        if self._fingerprint is not None:
            return
        tensors = [a for a in (*(args or ()), *kwargs.values()) if hasattr(a, "is_floating_point")]
        try:  # inside the user's forward: never raise there
            self._fingerprint = _fingerprint(tensors)
        except (RuntimeError, TypeError, ValueError) as exc:  # torch on an odd input tensor
            self._fail(exc)

    def _remove_step_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)


class GradientReads:
    """A watched step's gradients, read at the last point they exist (design page, model-watch):
    an optimizer step pre-hook's read, else the last backward's gradient, else `.grad` at the end."""

    def __init__(
        self,
        params: Sequence[Any],
        sample_sizes: Sequence[int],
        fail: Callable[[Exception], None],
        scaled: bool = False,
    ):
        self.params = params
        self.scaled = scaled  # watched with a GradScaler (ot.watch(scaler=)): see skipped_by_scaler
        self.unapplied = 0  # scaled steps in a row whose optimizer step did not run
        self.sample_sizes = sample_sizes
        self.device: Any = None
        self.histograms = False
        self._fail = fail
        self._position = {id(p): i for i, p in enumerate(params)}
        self._keep_hooks = [partial(self._keep_hook, i) for i in range(len(params))]
        self.clear()

    def clear(self) -> None:
        self.applied = False  # an optimizer step pre-hook read this step's gradients
        self.found_inf: Any = None  # a GradScaler's found_inf handed to a fused optimizer's step
        self._norms: list[Any] = []
        self._samples: list[Any] = []
        self._kept: list[Any] = []

    def begin(self, handles: list[Any], histograms: bool) -> None:
        """Start a watched step: its reads empty, the hooks' handles appended to `handles`."""
        n = len(self.params)
        self._norms, self._samples, self._kept = [None] * n, [None] * n, [None] * n
        self.applied = False
        self.found_inf = None
        self.histograms = histograms
        handles.append(register_optimizer_step_pre_hook(self._before_optimizer_step))
        for param, keep in zip(self.params, self._keep_hooks, strict=True):
            if param.requires_grad:  # one frozen since watch() gets no gradient (and takes no hook)
                handles.append(param.register_post_accumulate_grad_hook(keep))

    def _keep_hook(self, position: int, param: Any) -> None:
        # a reference, not a copy: the loop may set .grad to None before the step ends
        if position < len(self._kept):
            self._kept[position] = param.grad

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Global optimizer step pre-hook: read the watched gradients this optimizer will apply."""
        try:
            positions = [
                i
                for group in optimizer.param_groups
                for p in group["params"]
                if (i := self._position.get(id(p))) is not None
            ]
            if positions and len(self._norms) == len(self.params):
                self.applied = True
                # set by GradScaler.step on optimizers that unscale inside their own (fused) step,
                # which runs even when the scaler found inf/NaN gradients (it skips on the device)
                found_inf = getattr(optimizer, "found_inf", None)
                if isinstance(found_inf, torch.Tensor):
                    self.found_inf = found_inf if self.found_inf is None else self.found_inf + found_inf
                scale = getattr(optimizer, "grad_scale", None)
                self._read(positions, scale if isinstance(scale, torch.Tensor) else None)
        except Exception as exc:  # inside the user's optimizer step (its param_groups): never raise there
            self._fail(exc)

    def _read(self, positions: Sequence[int], scale: Any) -> None:
        """Norms (and samples) of the gradients at `positions`, unscaled by `scale` when given."""
        grads = [self.params[i].grad for i in positions]
        norms = foreach_norms(grads, self.device)
        if scale is not None and any(norm is not None for norm in norms):
            inverse = scale.to(self.device, torch.float32).reciprocal()
            norms = [None if norm is None else norm * inverse for norm in norms]
        for i, grad, norm in zip(positions, grads, norms, strict=True):
            if norm is None:
                continue
            self._norms[i], self._kept[i] = norm, None  # read: the tensor may be freed by zero_grad
            if self.histograms:
                values = sample(grad, self.sample_sizes[i])
                self._samples[i] = values if scale is None else values / scale.to(values.device)

    def skipped_by_scaler(self) -> bool:
        """Whether the GradScaler skipped this scaled step's optimizer step (inf/NaN gradients): its
        gradients are still scaled and discarded, so no statistics (and no `nonfinite_grad`)."""
        if not self.scaled or self.applied:
            self.unapplied = 0
            return False
        self.clear()
        self.unapplied += 1
        return True

    def final(self) -> tuple[list[Any], list[Any]]:
        """Per watched parameter, (norm, histogram sample) of its gradient as last seen in the step;
        (None, None) where it had none. Clears the step's reads."""
        norms, samples, kept = self._norms, self._samples, self._kept
        self.clear()
        if len(norms) != len(self.params):  # a watch added inside the step: only what is there now
            norms, samples, kept = ([None] * len(self.params) for _ in range(3))
        last = [p.grad if p.grad is not None else kept[i] for i, p in enumerate(self.params)]
        unread = [None if norms[i] is not None else grad for i, grad in enumerate(last)]
        for i, norm in enumerate(foreach_norms(unread, self.device)):
            if norm is not None:
                norms[i] = norm
                if self.histograms:
                    samples[i] = sample(unread[i], self.sample_sizes[i])
        return norms, samples


def scaler_skip(
    found_inf: Any, device: Any, per_layer: Any, total: Any, index: int
) -> tuple[Any, Any, LayerStats]:
    """A fused optimizer (`fused=True`) runs its step even when the GradScaler found inf/NaN
    gradients, and skips the update on the device: the step's norms are NaN then, and its
    found_inf goes to the worker (the returned record), which drops them as the scaler's business.
    No host sync here."""
    skipped = found_inf.to(device).reshape(()) > 0
    mark = LayerStats(SCALER_FOUND_INF, ("found_inf",), found_inf.reshape(1).float(), index)
    return per_layer.masked_fill(skipped, math.nan), total.masked_fill(skipped, math.nan), mark


def stale_parameters(model: Any, params: Sequence[Any]) -> str | None:
    """What to say when watched parameters are no longer the model's (it was wrapped or sharded
    after `watch()`: FSDP2's fully_shard replaces its parameters), else None."""
    current = {id(p) for p in model.parameters()}
    stale = sum(id(p) not in current for p in params)
    if not stale:
        return None
    return (
        f"ot.watch: {stale} of the {len(params)} watched parameters are no longer the model's (it was "
        "wrapped or sharded after ot.watch: FSDP2's fully_shard replaces its parameters): their "
        "statistics are stale. Call ot.watch(model) after wrapping it."
    )


def frozen_groups(members: Sequence[Sequence[int]], params: Sequence[Any]) -> set[int]:
    """The layers whose parameters were all frozen after `watch()` (`requires_grad_(False)`): they
    have no gradient by design, so they are left out rather than read as a layer without one."""
    return {g for g, group in enumerate(members) if not any(params[i].requires_grad for i in group)}


def foreach_norms(tensors: Sequence[Any], device: Any) -> list[Any]:
    """Each tensor's local float32 L2 norm on `device` (no sync); None for a None or sparse one."""
    present = [i for i, t in enumerate(tensors) if t is not None and not t.is_sparse]
    norms: list[Any] = [None] * len(tensors)
    if present:
        found = torch._foreach_norm([_local(tensors[i]) for i in present], 2, dtype=torch.float32)
        for i, norm in zip(present, found, strict=True):
            norms[i] = norm if norm.device == device else norm.to(device)
    return norms


def sample(tensor: Any, size: int) -> Any:
    """A strided float32 copy (so the optimizer or zero_grad cannot change it before the worker
    reads it) of at most `size` of the tensor's local values."""
    flat = _local(tensor).detach().reshape(-1)
    stride = max(1, flat.numel() // size)
    return flat[::stride][:size].to(torch.float32, copy=True)


class NullWatch:
    """What `ot.watch()` returns before `init()`: nothing to remove."""

    def remove(self) -> None:
        pass


def compiled_modules(model: Any) -> set[int]:
    """ids of the modules whose forward runs inside a torch.compile'd region: an OptimizedModule's
    own and its original's, and those of a module compiled in place (`module.compile()`) and below."""
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if type(module).__name__ == "OptimizedModule" or getattr(module, "_compiled_call_impl", None):
            inside.update(id(m) for m in module.modules())
    return inside


def deepspeed_zero(params: Iterable[Any]) -> int:
    """3 where DeepSpeed ZeRO-3 partitions the parameters (`ds_id`), 1 where a ZeRO-1/2 (or bf16)
    optimizer holds their gradients (`_hp_mapping`), else 0 (DeepSpeed 0.19's attributes)."""
    stage = 0
    for param in params:
        if hasattr(param, "ds_id"):
            return 3
        if hasattr(param, "_hp_mapping"):
            stage = 1
    return stage


def _local(tensor: Any) -> Any:
    """The rank-local shard of a DTensor (FSDP2, tensor parallel): never a collective here."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


# The batch fingerprint: docs/design/hardware-and-numerics.md#batch-fingerprint.
FINGERPRINT_LABELS = ("position_weighted_sum", "position_weighted_sum_of_squares")
FINGERPRINT_TENSORS = 4  # tensors of a batch that go into its fingerprint
FINGERPRINT_ELEMENTS = 1 << 20  # elements per tensor; larger ones are sampled at a stride
_WEIGHTS = ((40503, 65521), (10007, 65519))  # weight(p) = (p * a) % m + 1, m prime


def _fingerprint(tensors: Sequence[Any]) -> Any:
    """[sum of x * w1(p), sum of x^2 * w2(p)] in float64 over the first FINGERPRINT_TENSORS non-empty
    real `tensors` on the first one's device (positions p counted across them), or None."""
    device, parts = None, []
    for tensor in tensors:
        if tensor is None or tensor.numel() == 0 or tensor.is_complex():
            continue
        flat = _local(tensor.detach()).reshape(-1)
        if device is None:
            device = flat.device
        if flat.device != device:
            continue  # a copy to another device could sync
        if flat.numel() > FINGERPRINT_ELEMENTS:
            flat = flat[:: -(-flat.numel() // FINGERPRINT_ELEMENTS)]
        parts.append(flat)
        if len(parts) == FINGERPRINT_TENSORS:
            break
    if device is None or not parts:
        return None
    # float64 makes equal sums mean equal batches; Metal (mps) has no float64
    dtype = torch.float32 if device.type == "mps" else torch.float64
    values = torch.cat([part.to(dtype) for part in parts])
    # stays on the batch's device (a copy to the parameters' could sync): one transfer per device
    position = torch.arange(values.numel(), device=device, dtype=torch.int64)
    (a1, m1), (a2, m2) = _WEIGHTS
    w1 = ((position * a1) % m1 + 1).to(dtype)
    w2 = ((position * a2) % m2 + 1).to(dtype)
    return torch.stack([torch.dot(values, w1), torch.dot(values * values, w2)])


def _batch_tensors(batch: Any, depth: int = 0) -> list[Any]:
    """The batch's first FINGERPRINT_TENSORS tensors: the tensor itself, else those found in a
    mapping's values or a sequence's items (in order, two levels deep)."""
    if hasattr(batch, "is_floating_point"):
        return [batch]
    if depth >= 2:
        return []
    items = (
        batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else ()
    )
    found: list[Any] = []
    for item in items:
        found += _batch_tensors(item, depth + 1)[: FINGERPRINT_TENSORS - len(found)]
        if len(found) >= FINGERPRINT_TENSORS:
            break
    return found


def _first_tensor(output: Any) -> Any:
    items = output if isinstance(output, (tuple, list)) else (output,)
    return next((item for item in items if hasattr(item, "is_floating_point")), None)


def check_watch_args(model: Any, every: int, max_layers: int, flags: Iterable[bool]) -> None:
    if not hasattr(model, "named_parameters") or not hasattr(model, "named_modules"):
        raise TypeError(f"ot.watch(model): expected a torch.nn.Module, got {type(model).__name__}.")
    if not isinstance(every, int) or isinstance(every, bool):  # "10", 2.0, True: the caller's bug
        raise TypeError(
            f"ot.watch(every={every!r}): needs an int (steps between watched steps), got {type(every).__name__}."
        )
    if every < 1:
        raise ValueError(f"ot.watch(every={every!r}): must be an integer >= 1 (steps between watched steps).")
    if not isinstance(max_layers, int) or isinstance(max_layers, bool) or max_layers < 1:
        raise ValueError(f"ot.watch(max_layers={max_layers!r}): must be an integer >= 1.")
    if not any(flags):
        raise ValueError("ot.watch(): grads, params and activations are all False; nothing to watch.")
    if not any(p.requires_grad for p in model.parameters()):  # before init() too: it never changes that
        raise ValueError("ot.watch(model): the model has no trainable parameters to watch.")
