"""Many values into one SDK histogram series at once: one aggregation step per flush, not per value.

Merges count, sum, min, max and bucket counts into each reader's aggregation (SDK internals),
falling back to one public `record()` per value when anything is unexpected.
Design: docs/design/core.md#histogram-feed.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from typing import Any

from otel_train.interval import finite

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
    """Explicit-bucket counts of sorted values, as the SDK buckets each one (`bisect_left(bounds,
    value)`: bucket i holds bounds[i-1] < v <= bounds[i]): one binary search per boundary, not
    one per value."""
    counts, below = [], 0
    for bound in bounds:
        upto = bisect_right(ordered, bound)  # values <= bound
        counts.append(upto - below)
        below = upto
    counts.append(len(ordered) - below)
    return counts


def _targets(histogram: Any, attributes: dict[str, Any]) -> list[tuple[Any, Any, dict[str, Any]]] | None:
    """(view match, hashed attributes, attributes) for every reader, or None if not mergeable."""
    try:
        from opentelemetry.sdk.metrics._internal._view_instrument_match import _hash_attributes

        if not histogram._is_enabled():
            return None
        storages = list(histogram._measurement_consumer._reader_storages.values())
        targets = []
        for storage in storages:
            for match in storage._get_or_init_view_instrument_match(histogram):
                keys = match._view._attribute_keys
                attrs = attributes if keys is None else {k: v for k, v in attributes.items() if k in keys}
                targets.append((match, _hash_attributes(attrs), attrs))
        return targets
    except (ImportError, AttributeError, TypeError):  # the SDK's internals moved: use record()
        return None


def _merge(histogram: Any, values: list[float], attributes: dict[str, Any]) -> bool:
    from opentelemetry.sdk.metrics._internal.aggregation import _ExplicitBucketHistogramAggregation

    targets = _targets(histogram, attributes)
    if targets is None:
        return False
    aggregations = []
    for match, key, attrs in targets:
        with match._lock:
            aggregation = match._get_or_create_aggregation(key, attrs)
        if type(aggregation) is not _ExplicitBucketHistogramAggregation or not all(
            hasattr(aggregation, name) for name in _FIELDS
        ):
            return False
        aggregations.append((match, key, attrs))
    ordered = sorted(values)
    total, low, high = math.fsum(ordered), ordered[0], ordered[-1]
    counts_by_bounds: dict[tuple[float, ...], list[int]] = {}
    for match, key, attrs in aggregations:
        # Held like record() holds it when collect() discards aggregations (delta readers).
        with match._lock:
            aggregation = match._get_or_create_aggregation(key, attrs)
            bounds = aggregation._boundaries
            counts = counts_by_bounds.get(bounds)
            if counts is None:
                counts = counts_by_bounds[bounds] = bucket_counts_of(ordered, bounds)
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
