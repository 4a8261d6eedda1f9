"""Percentiles and summaries for ``llmgw ctl bench``: pure functions over lists of numbers.

Percentiles use the nearest-rank method: the p-th percentile of n sorted values is the value at
rank ceil(p/100 * n) (1-based). Every reported figure is then a latency that some request really
had, never an interpolation between two, and the definition needs no tuning for small samples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

QUANTILES = (50, 90, 99)


def percentile(values: Sequence[float], p: float) -> float:
    """The nearest-rank `p`-th percentile (0 < p <= 100) of a non-empty `values`."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 < p <= 100:
        raise ValueError(f"percentile {p} is outside (0, 100]")
    ordered = sorted(values)
    # max(1, ...): a tiny p over few values still names the smallest value, rank 1.
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


def summarize(values: Sequence[float]) -> dict[str, float] | None:
    """p50, p90, p99 and max of `values`; None for no values (a figure nobody measured)."""
    if not values:
        return None
    ordered = sorted(values)
    summary = {f"p{q}": percentile(ordered, q) for q in QUANTILES}
    summary["max"] = ordered[-1]
    return summary


def rate(count: float, seconds: float) -> float:
    """`count` per second over `seconds`; 0 for an empty interval rather than a division error."""
    return count / seconds if seconds > 0 else 0.0
