"""Stragglers: ranks whose own share of a step is persistently slower than their peers'.

After a collective every rank's wall-clock step time is the same (the fast ones wait for the slow
one), so the honest per-rank signals are the times a rank spends on its own: ``step_time`` (its
compute and data, measured before the collective, when the training code logs it) and
``data_time`` (its data loading).

``step_time``: a rank is slow when its median exceeds the median of the other ranks' medians by at least
`MIN_EXCESS` (5 %) *and* the excess is no accident: by a sign test, the share of its samples above
the job's typical value is too large for a rank no slower than the others (one-sided binomial tail
below `ALPHA` divided by the number of ranks compared, so a job with thousands of ranks does not
find one by chance). The diagnosis gives the ratio, the statistical confidence (1 - p) and the
step from which the rank stayed slow.

``data_time``: a rank whose median data time is more than `DATA_RATIO` times the others' and
`DATA_MIN_S` above it (slow storage, too few loader workers).

At least `MIN_SAMPLES` samples per rank and two ranks are needed to compare.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from denpexd.analysis.tracks import Series, Tracks

STRAGGLER_RULE = "straggler-slow-rank"  # data loading
SLOW_RANK_RULE = "slow-rank-compute"  # its own compute
DATA_RATIO = 3.0
DATA_MIN_S = 0.05
MIN_SAMPLES = 3  # data-time samples a rank needs to be compared
MIN_STEP_SAMPLES = 10  # step-time samples a rank needs for the sign test
MIN_EXCESS = 0.05
ALPHA = 0.01


def stragglers(tracks: Tracks) -> list[dict[str, Any]]:
    """The slow ranks in order of node and rank: the data-time stragglers (their median data time
    and the typical one, in seconds), then the step-time ones (ratio, confidence, since)."""
    return _data_time(tracks) + _step_time(tracks)


def _medians(tracks: Tracks, name: str, least: int) -> dict[tuple[str, int | None], tuple[float, Series]]:
    out = {}
    for k, t in tracks.items():
        s = t.series.get(name) if t.series is not None else None
        if s is not None and len(s) >= least:
            out[k] = (statistics.median(s.vals), s)
    return out


def _order(kv: tuple[tuple[str, int | None], Any]) -> tuple[str, int]:
    return kv[0][0], kv[0][1] if kv[0][1] is not None else -1


def _data_time(tracks: Tracks) -> list[dict[str, Any]]:
    medians = _medians(tracks, "data_time", MIN_SAMPLES)
    if len(medians) < 2:
        return []
    out = []
    for (node, rank), (m, _) in sorted(medians.items(), key=_order):
        typical = statistics.median(v for k, (v, _) in medians.items() if k != (node, rank))
        if m > DATA_RATIO * typical and m - typical > DATA_MIN_S:
            out.append(
                {
                    "node": node,
                    "rank": rank,
                    "metric": "data_time",
                    "data_time_s": round(m, 4),
                    "typical_s": round(typical, 4),
                    "rule": STRAGGLER_RULE,
                }
            )
    return out


def _step_time(tracks: Tracks) -> list[dict[str, Any]]:
    medians = _medians(tracks, "step_time", MIN_STEP_SAMPLES)
    if len(medians) < 2:
        return []
    ms = sorted(m for m, _ in medians.values())
    alpha = ALPHA / len(medians)
    out = []
    for (node, rank), (m, series) in sorted(medians.items(), key=_order):
        if max(m, series.recent_median()) < ms[0] * (1 + MIN_EXCESS):
            continue
        others = list(ms)
        others.remove(m)
        typical = statistics.median(others)  # the others', so that two ranks can be compared
        got = _slow_since(series.pairs(), typical, alpha) if typical > 0 else None
        if got is None:
            continue
        since, window, p = got
        mw = statistics.median(window)
        out.append(
            {
                "node": node,
                "rank": rank,
                "metric": "step_time",
                "ratio": round(mw / typical, 4),
                "median_s": round(mw, 6),
                "typical_s": round(typical, 6),
                "confidence": round(1.0 - p, 6),
                "samples": len(window),
                "since_step": since,
                "rule": SLOW_RANK_RULE,
            }
        )
    return out


def _slow_since(
    pairs: list[tuple[int, float]], typical: float, alpha: float
) -> tuple[int, list[float], float] | None:
    """From which step a rank is slow, its samples since then and the sign test's p-value; None
    when it is not slow by `MIN_EXCESS` with significance ``alpha``."""
    since = _since(pairs, typical * (1 + MIN_EXCESS / 2))
    if since is None:
        return None
    window = [v for s, v in pairs if s >= since]
    if len(window) < MIN_STEP_SAMPLES or statistics.median(window) < typical * (1 + MIN_EXCESS):
        return None
    p = binomial_tail(len(window), sum(1 for v in window if v > typical))
    return (since, window, p) if p < alpha else None


def binomial_tail(n: int, k: int) -> float:
    """P(X >= k) for X ~ Binomial(n, 1/2): how likely a rank no slower than the others has at
    least ``k`` of ``n`` samples above their median."""
    if k <= 0:
        return 1.0
    total = sum(math.comb(n, i) for i in range(k, n + 1))
    return min(1.0, math.ldexp(float(total), -n)) if n < 1000 else _normal_tail(n, k)


def _normal_tail(n: int, k: int) -> float:
    z = (k - 0.5 - n / 2) / math.sqrt(n / 4)
    return 0.5 * math.erfc(z / math.sqrt(2))


def _since(pairs: list[tuple[int, float]], bar: float) -> int | None:
    """The step where the rank turned slow: the start of the suffix with the most samples above
    ``bar`` in excess of half its length (a change point: before it about as many samples are
    above as below, after it most are above); None when no suffix has more above than below."""
    best, since, score = 0.0, None, 0.0
    for i in range(len(pairs) - 1, -1, -1):
        score += 0.5 if pairs[i][1] > bar else -0.5
        if score >= best and score > 0:
            best, since = score, pairs[i][0]
    return since
