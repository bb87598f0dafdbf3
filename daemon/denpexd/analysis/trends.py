"""Numerical trouble that prints no error: a loss that spikes or diverges, a gradient norm that
explodes, a loss scale that collapses.

The loss and gradient-norm curves are the job's (the largest value any rank logged per step, see
`tracks.StepMax`), judged against their own history rather than a fixed number. A point is
anomalous when it stands above the median of the `WINDOW` points before it both by a robust
z-score (the median absolute deviation, floored at `REL_FLOOR` of the median so that a flat
history does not turn every wiggle into infinity) and by a ratio (`RATIO`: a loss 1.5 times its
recent median, a gradient norm 10 times). The first anomalous point is the detection; the episode
starts at the first point of the unbroken climb before it (each point above the baseline by
`ONSET_Z` spreads), so a loss that crept up before it shot up is dated from the creep. When the
curve's last `TAIL` points are still anomalous against the baseline before the start, the value
diverged; otherwise it spiked and recovered at the first point back below the ratio.

Dynamic loss scaling halves the scale on every overflow. Many halvings right after the start are
the scaler settling from its deliberately high initial value (2^16 to 2^32) and are healthy; a
scale below 1 is not: the loss is then scaled *down* and the gradients still overflow, so every
step is skipped or worthless (DeepSpeed stops at its minimum of 1 for this reason). Nor is an
overflow that leaves the scale at 1 or less (`Attempted loss scale: 1, reducing to 1`): the
scaler is at DeepSpeed's floor and the gradients overflow unscaled, so every step is skipped.
A logged value of 1 is no drop (bf16 runs log `loss scale: 1.0` on every iteration).
"""

from __future__ import annotations

import bisect
import statistics
from typing import Any

from denpexd.analysis.tracks import StepMax

WINDOW = 32  # points of history a point is judged against
MIN_HISTORY = 5  # points needed before the first judgement
Z = 8.0  # robust z-score of an anomalous point
RATIO = {"loss": 1.5, "grad_norm": 10.0}  # ... and how many times its baseline it must be
REL_FLOOR = 0.01  # the deviation's floor, as a fraction of the baseline's magnitude
TAIL = 3  # the last points that decide "still diverging"
ONSET_Z = 2.0  # the climb began at the first of the points before the detection above this
MIN_SCALE = 1.0  # a loss scale below this has collapsed

DIVERGENCE_RULE = "loss-divergence"
SPIKE_RULES = {"loss": "loss-spike", "grad_norm": "grad-norm-spike"}
SCALE_RULE = "loss-scale-collapse"


def _baseline(history: list[float]) -> tuple[float, float]:
    """The median of ``history`` and its robust spread (scaled MAD, floored)."""
    med = statistics.median(history)
    mad = statistics.median(abs(h - med) for h in history)
    return med, max(1.4826 * mad, REL_FLOOR * abs(med), 1e-12)


def _anomalous(value: float, med: float, spread: float, ratio: float) -> bool:
    excess = value - med
    return excess > Z * spread and excess > (ratio - 1.0) * abs(med)


def episode(curve: list[tuple[int, float]], metric: str) -> dict[str, Any] | None:
    """The first anomalous episode of one curve (``(step, value)`` in step order), or None."""
    ratio = RATIO[metric]
    values = [v for _, v in curve]
    for i in range(MIN_HISTORY, len(curve)):
        med, spread = _baseline(values[max(0, i - WINDOW) : i])
        if not _anomalous(values[i], med, spread, ratio):
            continue
        step, value = curve[i]
        onset = i
        while onset > 0 and values[onset - 1] > med + ONSET_Z * spread:
            onset -= 1
        after = curve[i + 1 :]
        tail = [v for _, v in curve[-TAIL:]] if len(after) >= TAIL else []
        diverged = bool(tail) and all(_anomalous(v, med, spread, ratio) for v in tail)
        back = None if diverged else next((s for s, v in after if v < med * ratio), None)
        peak_step, peak = max(curve[i:], key=lambda sv: sv[1])
        return {
            "metric": metric,
            "kind": "divergence" if diverged and metric == "loss" else "spike",
            "start_step": curve[onset][0],
            "detected_step": step,
            "value": _round(value),
            "baseline": _round(med),
            "ratio": _round(value / med) if med > 0 else None,
            "robust_z": round((value - med) / spread, 1),
            "peak_step": peak_step,
            "peak": _round(peak),
            "recovered_step": back,
            "last_value": _round(values[-1]),
        }
    return None


def trends(
    curves: dict[str, StepMax], min_scale: float | None, min_drop: float | None = None
) -> list[dict[str, Any]]:
    """Every curve's first episode and the loss scale's collapse (``min_scale``: the smallest
    scale any line gave; ``min_drop``: the smallest an overflow left), earliest step first (a
    collapse has no step of its own and comes last); each names the rule that explains it."""
    out = []
    for metric in ("loss", "grad_norm"):
        c = curves.get(metric)
        got = episode(c.curve(), metric) if c is not None else None
        if got is not None:
            got["rule"] = DIVERGENCE_RULE if got["kind"] == "divergence" else SPIKE_RULES[metric]
            out.append(got)
    out.sort(key=lambda e: (e["start_step"], e["metric"] != "loss"))
    if (min_scale is not None and min_scale < MIN_SCALE) or (min_drop is not None and min_drop <= MIN_SCALE):
        out.append({"metric": "loss_scale", "kind": "collapse", "value": min_scale, "rule": SCALE_RULE})
    return out


def _round(v: float) -> float:
    return float(f"{v:.6g}")


WARMUP_GAP_STEPS = 2  # the scaler settling halves on (nearly) consecutive steps
FALL_LOWS = 3  # new lowest scales after the settling that make a fall ...
FALL_WINDOW_STEPS = 500  # ... within this many steps
FALL_RULE = "loss-scale-falling"


def step_at(curve: list[tuple[int, float]], ts: float) -> int | None:
    """The last step a node had logged by local time ``ts`` (its progress curve), or None."""
    i = bisect.bisect_right([t for _, t in curve], ts)
    return curve[i - 1][0] if i else None


def scale_fall(levels: list[tuple[float, int | None, float]]) -> dict[str, Any] | None:
    """Repeated loss-scale drops after the settling: ``levels`` are the distinct scales reported,
    each with the aligned time and the step of its first report, in time order. The settling is
    the initial descent, each new lower scale within `WARMUP_GAP_STEPS` of the previous; after it,
    a healthy scaler comes back to the level it settled at (no new low), so `FALL_LOWS` new lows
    within `FALL_WINDOW_STEPS` steps are a fall: every few steps overflow again (the NaN
    fingerprint's early warning). Without steps nothing can be told apart: None."""
    low: float | None = None
    low_step: int | None = None
    settled: float | None = None
    lows: list[tuple[int, float]] = []
    for _, step, scale in levels:
        if low is None:
            low, low_step = scale, step
            continue
        if scale >= low:
            continue
        if step is None or low_step is None:
            return None
        if settled is None and step - low_step <= WARMUP_GAP_STEPS:
            low, low_step = scale, step
            continue
        if settled is None:
            settled = low
        lows.append((step, scale))
        low, low_step = scale, step
    for i in range(len(lows) - FALL_LOWS + 1):
        first, last = lows[i], lows[i + FALL_LOWS - 1]
        if last[0] - first[0] <= FALL_WINDOW_STEPS:
            return {
                "metric": "loss_scale",
                "kind": "falling",
                "start_step": first[0],
                "detected_step": last[0],
                "value": last[1],
                "baseline": settled,
                "rule": FALL_RULE,
            }
    return None
