"""Value resolution, on the worker: a flush batch's raw values as host floats, bad ones dropped
and counted; durations reach their SDK histograms in one aggregation step per series
(`record_many`: docs/design/core.md#histogram-feed)."""

from __future__ import annotations

import math
import numbers
import random
import sys
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import replace
from itertools import groupby
from operator import attrgetter, itemgetter, sub
from typing import Any

from otel_train.core.buffer import FlushBatch, finite
from otel_train.goodput import DATA_PHASES


def has_data(tensor: Any) -> bool:
    """False for a `meta` tensor or a FakeTensor: copying one raises from deep in C++, slowly, and
    a worker still inside that at interpreter exit aborts the process (SIGABRT)."""
    if getattr(tensor, "is_meta", False):
        return False
    fake = sys.modules.get("torch._subclasses.fake_tensor")
    return fake is None or not isinstance(tensor, fake.FakeTensor)


# More values than this make a histogram a sample of this many (`_sample_positions`), with the
# exact min and max among them. The backends show them binned (64 bins), where 100,000 values give
# a bin holding a tenth of them its share within about 1 %, and the bridge process gets a frame
# under a megabyte: one 4096 x 8192 weight's 33.5M values, as a list of floats, pickle to ~300 MB,
# over the pipe's frame limit, and cost the worker GBs of Python floats.
MAX_HISTOGRAM_VALUES = 100_000


def histogram_values(values: Any) -> list[float]:
    """A distribution as finite floats, at most MAX_HISTOGRAM_VALUES of them (a tensor or array
    is sampled before its copy to the host)."""
    if hasattr(values, "detach") and (not has_data(values) or str(values.dtype) == "torch.bool"):
        return []
    if hasattr(values, "detach"):
        values = _bounded_tensor(values.detach().reshape(-1)).double().cpu().tolist()
    elif hasattr(values, "tolist"):
        values = (
            _bounded_array(values.reshape(-1)).tolist() if hasattr(values, "reshape") else values.tolist()
        )
    if isinstance(values, (int, float)):  # one number: a distribution of one value
        values = [values]
    out: list[float] = []
    if isinstance(values, (str, bytes)):  # not "123" read as 1, 2, 3
        return out
    try:
        values = values if isinstance(values, (list, tuple)) else list(values)
    except TypeError:  # not a sequence (a dict is one: of its keys): nothing to plot
        return out
    for value in values:
        cls = value.__class__
        if cls is not float and cls is not int and (cls is bool or _not_real(value)):
            continue  # a bool or complex number is dropped, as a recorded one is
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(number):
            out.append(number)
    if len(out) > MAX_HISTOGRAM_VALUES:
        out = [min(out), max(out), *(out[i] for i in _sample_positions(len(out)))]
    return out


def _sample_positions(size: int) -> list[int]:
    """MAX_HISTOGRAM_VALUES - 2 of `size` positions, uniformly, in order: the same ones for the same
    size, from a seeded generator of its own (the training's random state is never touched)."""
    return sorted(random.Random(0).sample(range(size), MAX_HISTOGRAM_VALUES - 2))


def _bounded_tensor(flat: Any) -> Any:
    """A 1-d tensor, or past MAX_HISTOGRAM_VALUES its finite values' min, max and sample (on its device)."""
    if flat.numel() <= MAX_HISTOGRAM_VALUES:
        return flat
    import torch

    if flat.is_complex():
        flat = flat.real  # as `double()` reads a complex tensor
    finite = flat.isfinite()
    if not bool(finite.all()):
        flat = flat[finite]
    if flat.numel() <= MAX_HISTOGRAM_VALUES:
        return flat
    low, high = flat.aminmax()
    positions = torch.tensor(_sample_positions(flat.numel()), device=flat.device)
    return torch.cat([low.reshape(1), high.reshape(1), flat[positions]])


def _bounded_array(flat: Any) -> Any:
    """`_bounded_tensor` for a numpy array (one of non-numbers: a sample); other arrays as they are."""
    np = sys.modules.get("numpy")
    if np is None or not isinstance(flat, np.ndarray) or flat.size <= MAX_HISTOGRAM_VALUES:
        return flat
    if not (np.issubdtype(flat.dtype, np.floating) or np.issubdtype(flat.dtype, np.integer)):
        # objects, bools, complex numbers: kept or dropped by the loop, as ever
        return flat[np.asarray(_sample_positions(flat.size))]
    finite = np.isfinite(flat)
    if not finite.all():
        flat = flat[finite]
    if flat.size <= MAX_HISTOGRAM_VALUES:
        return flat
    ends = np.array([flat.min(), flat.max()], dtype=flat.dtype)
    return np.concatenate([ends, flat[np.asarray(_sample_positions(flat.size))]])


def resolve_values(values: Sequence[Any]) -> tuple[list[float | None], dict[str, int]]:
    """Recorded values as finite floats, position by position (None where dropped), and the drop
    counts. Device tensors are copied in one transfer."""
    dropped: dict[str, int] = {}
    stacked = _stacked_scalars(values)
    if stacked is not None:
        return _finite_only(stacked, dropped), dropped
    out: list[float | None] = [None] * len(values)
    tensors: list[tuple[int, Any]] = []
    for i, value in enumerate(values):
        # One value at a time: whatever a value does (10**400, a __float__ that raises anything),
        # only that value is dropped and counted, never the flush.
        try:
            if getattr(value, "ndim", 0) and hasattr(value, "item") and not hasattr(value, "detach"):
                # a numpy array: one element is its value, as a 1-element tensor's is
                if value.size != 1:
                    dropped["non_scalar_tensor"] = dropped.get("non_scalar_tensor", 0) + 1
                    continue
                value = value.item()  # a Python number (bool, complex: refused below, as Python's)
            cls = value.__class__
            if cls is float:
                out[i] = value
            elif cls is int:
                out[i] = float(value)
            elif cls is bool or value is None or isinstance(value, (str, bytes)) or _not_real(value):
                dropped["invalid_type"] = dropped.get("invalid_type", 0) + 1
            elif hasattr(value, "numel") and hasattr(value, "detach"):
                if not has_data(value):
                    dropped["no_data_tensor"] = dropped.get("no_data_tensor", 0) + 1
                elif value.is_complex() or str(value.dtype) == "torch.bool":  # as Python's
                    dropped["invalid_type"] = dropped.get("invalid_type", 0) + 1
                elif value.numel() == 1:
                    tensors.append((i, value))
                else:
                    dropped["non_scalar_tensor"] = dropped.get("non_scalar_tensor", 0) + 1
            else:
                out[i] = float(value)  # numpy scalars and 0-d arrays, Decimal, ...
        except OverflowError:
            dropped["overflow"] = dropped.get("overflow", 0) + 1
        except Exception:  # the value's own code (its __float__, __class__, a tensor subclass's)
            dropped["invalid_type"] = dropped.get("invalid_type", 0) + 1
    if tensors:
        for (i, _), resolved in zip(tensors, tensors_to_host([t for _, t in tensors]), strict=True):
            if resolved is None:  # a dtype that cannot convert (complex, ...)
                dropped["invalid_type"] = dropped.get("invalid_type", 0) + 1
            else:
                out[i] = resolved[0]
    return _finite_only(out, dropped), dropped


def _finite_only(values: list[float | None], dropped: dict[str, int]) -> list[float | None]:
    if None not in values and all(map(math.isfinite, values)):  # type: ignore[arg-type]  # usual case, C speed
        return values
    for i, value in enumerate(values):
        if value is not None and not math.isfinite(value):
            values[i] = None
            dropped["nonfinite"] = dropped.get("nonfinite", 0) + 1
    return values


def _not_real(value: Any) -> bool:
    """A complex number or a numpy bool, which float() would not refuse."""
    if isinstance(value, numbers.Complex) and not isinstance(value, numbers.Real):
        return True
    dtype = getattr(value, "dtype", None)
    return dtype is not None and dtype == bool  # noqa: E721  (a numpy dtype equals the type bool)


# What torch raises for a tensor it cannot stack, cast or copy (sparse, quantized, nested, mixed
# devices; NotImplementedError is a RuntimeError), or a tensor-like object without those methods.
TORCH_ERRORS = (RuntimeError, TypeError, ValueError, AttributeError)
_is_meta = attrgetter("is_meta")
_dtype = attrgetter("dtype")


def _stacked_scalars(values: Sequence[Any]) -> list[float | None] | None:
    """The common interval (one loss tensor per step: plain, real, one-element tensors of one shape,
    device and dtype) with one stack and one copy, ~3x cheaper than `resolve_values`' checks; None
    for anything else, which takes the careful path to the same result."""
    torch = sys.modules.get("torch")
    if torch is None or not values:
        return None
    # type(), not __class__ (a proxy may claim to be a Tensor); both checks at C speed
    if set(map(type, values)) != {torch.Tensor} or any(map(_is_meta, values)):
        return None
    if len(set(map(_dtype, values))) != 1:  # stacking would promote (int64 with fp16: 70000 -> inf)
        return None
    try:
        with torch.no_grad():
            joined = torch.stack(list(values))  # raises on mixed shapes or devices
            if joined.numel() != len(values) or joined.is_complex() or joined.dtype is torch.bool:
                return None
            if joined.device.type == "mps":  # Metal has no float64: convert on the host
                joined = joined.cpu()
            resolved: list[float | None] = joined.reshape(-1).to(torch.float64).cpu().tolist()
            return resolved
    except TORCH_ERRORS:
        return None


def tensors_to_host(tensors: Sequence[Any]) -> list[list[float] | None]:
    """Each tensor's values as floats, copied to the host in one transfer per device and dtype;
    None for a tensor that could not be converted."""
    import torch

    by_device: dict[Any, list[int]] = {}  # by device and dtype: a stack would promote mixed dtypes
    for i, tensor in enumerate(tensors):
        try:
            if has_data(tensor):
                by_device.setdefault((tensor.device, tensor.dtype), []).append(i)
        except TORCH_ERRORS:  # a tensor-like object without a usable device: left as None
            continue
    out: list[list[float] | None] = [None] * len(tensors)
    for positions in by_device.values():
        try:
            with torch.no_grad():  # one stack/cat and one cast per device, not one per tensor
                group = [tensors[i] for i in positions]
                shape = group[0].shape
                if all(t.shape == shape for t in group):  # e.g. one 0-dim loss per step: 4x cheaper
                    joined = torch.stack(group)
                else:
                    joined = torch.cat([t.reshape(-1) for t in group])
                if joined.device.type == "mps":  # Metal has no float64: convert on the host
                    joined = joined.cpu()
                flat = joined.reshape(-1).to(torch.float64).cpu().tolist()
        except TORCH_ERRORS:  # one odd tensor (sparse, quantized, nested, ...): each on its own, so
            for i in positions:  # only the odd ones are dropped, not the whole device's values
                out[i] = _one_to_host(tensors[i])
            continue
        offset = 0
        for i in positions:
            size = tensors[i].numel()
            out[i] = flat[offset : offset + size]
            offset += size
    return out


def _one_to_host(tensor: Any) -> list[float] | None:
    import torch

    try:
        with torch.no_grad():
            # to the host first: Metal (MPS) has no float64
            return [float(x) for x in tensor.reshape(-1).cpu().to(torch.float64).tolist()]
    except TORCH_ERRORS:
        return None


def value_owners(
    step_indices: Sequence[int], after_step: int | None, previous: int | None, count: int
) -> Sequence[int]:
    """The steps an instrument's `count` values belong to, in order, for `value_steps`. Where its
    first value came between steps, after `after_step` of the interval's steps had ended (`None`:
    it came in a step), and each later one after the next step (`ot.record(name, train_step(b))`
    with `@ot.step`): the step that ended before each value, `previous` (the last step of the
    interval before) for a first value ahead of this interval's steps. Else `step_indices`."""
    if after_step is None:
        return step_indices
    ended = [previous, *step_indices] if previous is not None else list(step_indices)
    first = after_step if previous is not None else after_step - 1
    # one value after each step from the first's on, the interval's last step's value included or
    # not (it comes after the flush, except at the final one)
    if first < 0 or first + count not in (len(ended) - 1, len(ended)):
        return step_indices
    return ended[first : first + count]


def value_steps(
    resolved: Sequence[float | None], step_indices: Sequence[int], merged: bool
) -> list[int] | None:
    """The step of each kept value when they were recorded k times in every step of the interval;
    None when that cannot be told."""
    per_step = _values_per_step(resolved, step_indices, merged)
    if not per_step:
        return None
    if per_step == 1 and None not in resolved:  # once a step, nothing dropped: the usual loss
        return list(step_indices)
    return [step_indices[i // per_step] for i, v in enumerate(resolved) if v is not None]


def dropped_steps(
    resolved: Sequence[float | None], step_indices: Sequence[int], merged: bool
) -> list[int] | None:
    """The step of each dropped value (None in `resolved`), as `value_steps` tells them."""
    per_step = _values_per_step(resolved, step_indices, merged)
    if not per_step:
        return None
    return [step_indices[i // per_step] for i, v in enumerate(resolved) if v is None]


def _values_per_step(resolved: Sequence[float | None], step_indices: Sequence[int], merged: bool) -> int:
    """k when the interval's values were recorded k times in every one of its steps; 0 when that
    cannot be told (merged from several lists, no steps, a count that does not divide)."""
    if merged or not step_indices or len(resolved) % len(step_indices):
        return 0
    return len(resolved) // len(step_indices)


def column_of(rows: Sequence[tuple[Any, ...]], k: int) -> list[Any]:
    """Item k of every row, in C. Not `zip(*rows)`: that makes an iterator per row, and so many
    GC-tracked objects set off the collector several times per flush."""
    return list(map(itemgetter(k), rows))


_NS = 1e-9  # seconds per clock tick: `_NS.__mul__(ticks)` is `ticks * 1e-9`, bit for bit


def seconds_between(starts: Sequence[int], ends: Sequence[int]) -> list[float]:
    """[(end - start) * 1e-9 ...] in C, the same floats as a span's `_seconds`, so exemplars match."""
    return list(map(_NS.__mul__, map(sub, ends, starts)))


_timer_name = itemgetter(0)  # of a timer event: C, not a Python call per event

# One timer's events in the interval, in order: (name, starts, ends, its steps' starts (0: outside a step))
TimerColumns = tuple[str, Sequence[int], Sequence[int], Sequence[int]]


def timer_columns(events: Sequence[tuple[str, int, int, int]]) -> list[TimerColumns]:
    """The events grouped by timer name, in name order, each name's in their order. The usual loop
    ends the same distinct timers in the same order every step; that periodic pattern is found and
    split with strided slices (C speed, no Python code per event); any other takes a stable sort."""
    if not events:
        return []
    names, starts, ends, began = (column_of(events, k) for k in range(4))
    period = _period(names)
    if period:
        groups = [(names[k], starts[k::period], ends[k::period], began[k::period]) for k in range(period)]
        return sorted(groups, key=_timer_name)
    out: list[TimerColumns] = []
    for name, group in groupby(sorted(events, key=_timer_name), key=_timer_name):
        readings = list(group)
        out.append((name, column_of(readings, 1), column_of(readings, 2), column_of(readings, 3)))
    return out


def _period(names: Sequence[str]) -> int:
    """P when names[k::P] is one name for every k < P and names[:P] are distinct; 0 otherwise."""
    try:
        period = names.index(names[0], 1)
    except ValueError:
        period = len(names)
    if len(set(names[:period])) != period:
        return 0
    for k in range(period):
        column = names[k::period]
        if column.count(names[k]) != len(column):
            return 0
    return period


def _arrivals(began: Sequence[int], ends: Sequence[int], inside: bool) -> list[float]:
    """One arrival per step (from its start to the timer's end): a timer run several times in a
    step arrives at its LAST end there (why: docs/design/crossrank.md#verdicts)."""
    if inside and len(set(began)) == len(began):  # the usual case: once per step
        return seconds_between(began, ends)
    last = dict(zip(began, ends, strict=True))  # per step start, its latest end (ends come in order)
    last.pop(0, None)  # outside a step: no arrival
    return seconds_between(list(last), list(last.values()))


def timer_phases(
    batch: FlushBatch, rerun_starts: Set[int] = frozenset()
) -> tuple[dict[str, list[float]], dict[str, list[float]], float]:
    """(phase durations, arrivals, data seconds): `ot.phase` values and each timer's durations (at
    most `batch.value_cap` a name), arrivals of timers inside a step, and goodput's data cause:
    data-phase timers inside steps that re-ran no earlier step (`rerun_starts`: their starts)."""
    phases = {name: list(values) for name, values in batch.phases.items()}
    arrivals: dict[str, list[float]] = {}
    cap = batch.value_cap or len(batch.timer_events)
    over = data_ns = 0
    for name, starts, ends, began in timer_columns(batch.timer_events):
        inside = all(began)  # the usual case: every one inside a step
        if name in DATA_PHASES:
            if inside and not rerun_starts:
                data_ns += sum(map(sub, ends, starts))
            else:
                readings = zip(starts, ends, began, strict=True)
                data_ns += sum([e - s for s, e, b in readings if b and b not in rerun_starts])

        durations = phases.setdefault(name, [])
        room = max(0, cap - len(durations))
        if len(starts) > room:
            over += len(starts) - room
            starts, ends, began = starts[:room], ends[:room], began[:room]
        durations.extend(seconds_between(starts, ends))
        arrived = _arrivals(began, ends, inside)
        if arrived:
            arrivals[name] = arrived
    if over:
        batch.dropped["too_many_values"] = batch.dropped.get("too_many_values", 0) + over
    return phases, arrivals, data_ns * 1e-9


def same_tensor_twice(values: Sequence[Any]) -> bool:
    """Is one tensor object among `values` more than once (recorded again after in-place changes)?"""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    seen: set[int] = set()
    for value in values:
        if isinstance(value, torch.Tensor):
            if id(value) in seen:
                return True
            seen.add(id(value))
    return False


def drop_bad_timer_names(batch: FlushBatch) -> None:
    """The hot path does not check timer names: here a str subclass (a `str` Enum) becomes its
    plain string and any other name is dropped and counted, wherever a timer's name went."""
    events = batch.timer_events
    if events and set(map(type, map(_timer_name, events))) != {str}:
        batch.timer_events = [
            (plain, start, end, began)
            for name, start, end, began in events
            if (plain := _plain_name(batch, name)) is not None
        ]

    if any(name.__class__ is not str for name, _ in batch.phase_errors):
        errors: dict[tuple[str, str], list[float]] = {}
        for (name, error), values in batch.phase_errors.items():
            plain = _plain_name(batch, name, len(values))
            if plain is not None:
                errors.setdefault((plain, error), []).extend(values)
        batch.phase_errors = errors
    if any(name.__class__ is not str for name, _, _ in batch.cuda_timers):
        batch.cuda_timers = [
            (plain, start, end)
            for name, start, end in batch.cuda_timers
            if (plain := _plain_name(batch, name)) is not None
        ]
    if any(name.__class__ is not str for name in batch.phases):
        phases: dict[str, list[float]] = {}
        for name, values in batch.phases.items():
            plain = _plain_name(batch, name, len(values))
            if plain is not None:
                phases.setdefault(plain, []).extend(values)
        batch.phases = phases
    if any(record.name.__class__ is not str for record in batch.spans):  # a raising timer's span
        batch.spans = [  # (its phase error was counted above)
            replace(record, name=str.__str__(record.name)) if record.name.__class__ is not str else record
            for record in batch.spans
            if isinstance(record.name, str)
        ]


def _plain_name(batch: FlushBatch, name: Any, count: int = 1) -> str | None:
    """A timer's name as a plain str, or None (its `count` values dropped) when it is not a str."""
    if isinstance(name, str):
        return str.__str__(name)
    batch.dropped["invalid_timer_name"] = batch.dropped.get("invalid_timer_name", 0) + count
    batch.problems["invalid_timer_name", repr(name)] = None
    return None


# --- many values into one SDK histogram series at once: one aggregation step per flush, not per
# value; falls back to one public record() per value when the SDK's internals are not as expected
# (docs/design/core.md#histogram-feed). The job series add their bucket counts the same way. ---
_FIELDS = (
    "_lock",
    "_value",
    "_sum",
    "_min",
    "_max",
    "_boundaries",
    "_record_min_max",
    "_get_empty_bucket_counts",
)


def record_many(histogram: Any, values: Sequence[float], attributes: Mapping[str, Any] | None = None) -> None:
    """Like `for v in values: histogram.record(v, attributes)` (finite values), in one step."""
    kept = finite(values)
    if not kept:
        return
    if len(kept) == 1 or not _merge(histogram, kept, dict(attributes or {})):
        for value in kept:
            histogram.record(value, attributes)


def bucket_counts_of(ordered: Sequence[float], bounds: Sequence[float]) -> list[int]:
    """Explicit-bucket counts of sorted values as the SDK buckets them (bounds[i-1] < v <= bounds[i]),
    one binary search per boundary."""
    counts, below = [], 0
    for bound in bounds:
        upto = bisect_right(ordered, bound)  # values <= bound
        counts.append(upto - below)
        below = upto
    counts.append(len(ordered) - below)
    return counts


def _merge(histogram: Any, values: list[float], attributes: dict[str, Any]) -> bool:
    try:
        if not histogram._is_enabled():
            return False
    except (AttributeError, TypeError):  # not the SDK's histogram: use record()
        return False
    ordered = sorted(values)

    def counts_for(bounds: Sequence[float]) -> list[int]:
        return bucket_counts_of(ordered, bounds)

    return add_bucket_counts(histogram, attributes, counts_for, math.fsum(ordered), ordered[0], ordered[-1])


def add_bucket_counts(
    histogram: Any,
    attributes: dict[str, Any],
    counts_for: Callable[[Sequence[float]], Sequence[int] | None],
    total: float,
    low: float,
    high: float,
) -> bool:
    """Add bucket counts (`counts_for(a reader's bounds)`; None: none for those), a sum, a min and a
    max to `histogram`'s series of `attributes` in every reader, as the SDK's own `record()` of the
    values would; False, with nothing added, when the SDK's internals are not the expected ones."""
    targets = []
    try:
        from opentelemetry.sdk.metrics._internal._view_instrument_match import _hash_attributes
        from opentelemetry.sdk.metrics._internal.aggregation import _ExplicitBucketHistogramAggregation

        for storage in list(histogram._measurement_consumer._reader_storages.values()):
            for match in storage._get_or_init_view_instrument_match(histogram):
                keys = match._view._attribute_keys
                attrs = attributes if keys is None else {k: v for k, v in attributes.items() if k in keys}
                key = _hash_attributes(attrs)
                with match._lock:
                    aggregation = match._get_or_create_aggregation(key, attrs)
                if type(aggregation) is not _ExplicitBucketHistogramAggregation or not all(
                    hasattr(aggregation, name) for name in _FIELDS
                ):
                    return False
                counts = counts_for(aggregation._boundaries)
                if counts is None:
                    return False
                targets.append((match, key, attrs, counts))
    except (ImportError, AttributeError, TypeError):  # the SDK's internals moved
        return False
    for match, key, attrs, counts in targets:  # all checked above, before anything is added
        # Held like record() holds it when collect() discards aggregations (delta readers).
        with match._lock:
            aggregation = match._get_or_create_aggregation(key, attrs)
            with aggregation._lock:
                if aggregation._value is None:
                    aggregation._value = aggregation._get_empty_bucket_counts()
                aggregation._sum += total
                if aggregation._record_min_max:
                    aggregation._min = min(aggregation._min, low)
                    aggregation._max = max(aggregation._max, high)
                bucket_counts = aggregation._value
                for index, count in enumerate(counts):
                    if count:
                        bucket_counts[index] += count
    return True
