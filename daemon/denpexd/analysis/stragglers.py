"""Stragglers: ranks whose data loading is much slower than the others'.

A rank with at least three data-time samples (``data_time`` of its step lines) is a straggler
when its median is more than STRAGGLER_RATIO times the median of the other ranks' medians and
more than STRAGGLER_MIN_S above it. At least two ranks with samples are needed to compare.
"""

from __future__ import annotations

import statistics
from typing import Any

from denpexd.analysis.tracks import Tracks

STRAGGLER_RULE = "straggler-slow-rank"
STRAGGLER_RATIO = 3.0
STRAGGLER_MIN_S = 0.05
MIN_SAMPLES = 3  # data-time samples a rank needs to be compared


def stragglers(tracks: Tracks) -> list[dict[str, Any]]:
    """The stragglers in order of node and rank, each with its median data time and the typical
    one (the others' median), in seconds."""
    medians = {}
    for k, t in tracks.items():
        values = t.data_times.values() if t.data_times is not None else []
        if len(values) >= MIN_SAMPLES:
            medians[k] = statistics.median(values)
    if len(medians) < 2:
        return []
    out = []
    for (node, rank), m in sorted(medians.items(), key=lambda kv: (kv[0][0], kv[0][1] or -1)):
        others = [v for k, v in medians.items() if k != (node, rank)]
        typical = statistics.median(others)
        if m > STRAGGLER_RATIO * typical and m - typical > STRAGGLER_MIN_S:
            out.append(
                {"node": node, "rank": rank, "data_time_s": round(m, 4), "typical_s": round(typical, 4)}
            )
    return out
