"""Robust statistics of one list of seconds (a rank's step or timer durations or arrivals over one
flush), as each up row carries them: count, lower median, max and MAD, in STATS_LEN floats."""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from otel_train.core.buffer import finite

STATS_LEN = 4  # count, lower median, max, MAD


@dataclass(frozen=True)
class Spread:
    """Robust statistics of a list of seconds over one interval.

    `median` is the LOWER median (the middle value, the lower of the two for an even count), so one
    outlier never moves it even with two values; `max` keeps the one-off; `mad` (median absolute
    deviation from `median`) is the rank's own noise."""

    count: int = 0
    median: float = math.nan
    max: float = math.nan
    mad: float = math.nan

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread:
        ordered = sorted(finite(values))
        if not ordered:
            return cls()
        middle = (len(ordered) - 1) // 2
        median = ordered[middle]
        return cls(len(ordered), median, ordered[-1], _kth_deviation(ordered, median, middle))

    def encode(self) -> list[float]:
        return [float(self.count), self.median, self.max, self.mad]

    @classmethod
    def decode(cls, values: Sequence[float]) -> Spread:
        count = int(values[0])
        if count <= 0 or not all(math.isfinite(v) for v in values[1:STATS_LEN]):
            return cls()
        return cls(count, values[1], values[2], values[3])


def _kth_deviation(ordered: Sequence[float], center: float, k: int) -> float:
    """The k-th smallest (from 0) of |v - center| over the sorted `ordered`, in O(log n) rather than
    a list and a sort per timer and flush (the worker's time per value bounds its share of a 1-2 ms
    step): the deviations of the values up to `center` and of those above it are two sorted runs,
    and a binary search finds how many of the k + 1 smallest come from the first. Each deviation is
    computed as `abs(v - center)` computes it, so the result is the same float."""
    split = bisect_right(ordered, center)  # ordered[:split] <= center < ordered[split:]

    def below(t: int) -> float:  # the t-th smallest deviation of the values <= center
        return center - ordered[split - 1 - t]

    def above(t: int) -> float:  # ... of the values > center
        return ordered[split + t] - center

    lo, hi = max(0, k + 1 - (len(ordered) - split)), min(k + 1, split)
    while lo < hi:  # the fewest taken from `below` such that its next one is not smaller
        taken = (lo + hi) // 2
        if below(taken) < above(k - taken):
            lo = taken + 1
        else:
            hi = taken
    last_below = below(lo - 1) if lo > 0 else -math.inf
    last_above = above(k - lo) if k - lo >= 0 else -math.inf
    return max(last_below, last_above) + 0.0  # never -0.0 (center - 0.0 with center -0.0)
