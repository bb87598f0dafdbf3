"""Per-node clock offsets from content: data-parallel ranks pass a step at nearly the same time.

Every node's progress samples (step → local time, the median over its ranks) are compared with a
reference node's, interpolating the reference where the same step was not sampled. The offset is
the median of the differences and the uncertainty is a robust spread (1.4826 × MAD) plus the
timestamps' resolution. A node whose logs carry no progress keeps the offset its agent measured
live (NTP-style exchange), or none.

``aligned time = local time - offset``; the reference node has offset 0.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

RESOLUTION_S = 0.001
UNALIGNED_UNCERTAINTY_S = 10.0
MIN_COMMON = 3


@dataclass(frozen=True, slots=True)
class ClockEstimate:
    offset_s: float
    uncertainty_s: float
    method: str  # reference | progress | agent | none
    samples: int = 0

    def to_dict(self) -> dict[str, float | str | int]:
        return {
            "offset_s": round(self.offset_s, 6),
            "uncertainty_s": round(self.uncertainty_s, 6),
            "method": self.method,
            "samples": self.samples,
        }


def node_curve(samples: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """Collapse (step, ts) samples of all ranks of one node into one sorted curve (median ts)."""
    by_step: dict[int, list[float]] = {}
    for step, ts in samples:
        by_step.setdefault(step, []).append(ts)
    return [(s, statistics.median(v)) for s, v in sorted(by_step.items())]


def _interpolate(curve: list[tuple[int, float]], steps: list[int], step: int) -> float | None:
    i = bisect.bisect_left(steps, step)
    if i < len(steps) and steps[i] == step:
        return curve[i][1]
    if i == 0 or i == len(steps):
        return None
    (s0, t0), (s1, t1) = curve[i - 1], curve[i]
    return t0 + (t1 - t0) * (step - s0) / (s1 - s0)


class Reference:
    """A reference curve ready for `estimate_offset`: its steps in order, and its time at each
    (nodes mostly sample the reference's own steps: looked up, not searched)."""

    __slots__ = ("at", "curve", "steps")

    def __init__(self, curve: list[tuple[int, float]]) -> None:
        self.curve = curve
        self.steps = [s for s, _ in curve]
        self.at = dict(curve)


def estimate_offset(
    curve: list[tuple[int, float]], ref: list[tuple[int, float]] | Reference
) -> tuple[float, float, int] | None:
    """(offset, uncertainty, samples) of ``curve`` against ``ref``, or None with too little overlap."""
    if not isinstance(ref, Reference):
        ref = Reference(ref)
    at, ref_curve, ref_steps = ref.at, ref.curve, ref.steps
    diffs: list[float] = []
    for step, ts in curve:
        rts = at.get(step)
        if rts is None:  # between the reference's steps: interpolated; outside them: no sample
            rts = _interpolate(ref_curve, ref_steps, step)
            if rts is None:
                continue
        diffs.append(ts - rts)
    if len(diffs) < MIN_COMMON:
        return None
    offset = statistics.median(diffs)
    mad = statistics.median([abs(d - offset) for d in diffs])
    return offset, 1.4826 * mad + RESOLUTION_S, len(diffs)


def align(
    progress: Mapping[str, Sequence[tuple[int, float]]],
    nodes: Sequence[str],
    reference: str | None = None,
    agent_offsets: Mapping[str, tuple[float, float]] | None = None,
    *,
    precomputed: bool = False,
) -> dict[str, ClockEstimate]:
    """Offsets for every node in ``nodes``; ``progress`` maps node → (step, local ts) samples,
    or, with ``precomputed``, node → its curve as `node_curve` makes it from those samples."""
    if precomputed:
        curves = {n: list(progress.get(n, ())) for n in nodes}
    else:
        curves = {n: node_curve(progress.get(n, ())) for n in nodes}
    agent_offsets = agent_offsets or {}
    with_progress = [n for n in nodes if len(curves[n]) >= MIN_COMMON]
    if reference is None or reference not in with_progress:
        reference = max(with_progress, key=lambda n: (len(curves[n]), _neg(n)), default=None)
    out: dict[str, ClockEstimate] = {}
    ref = Reference(curves[reference]) if reference is not None else None
    for n in nodes:
        if n == reference:
            out[n] = ClockEstimate(0.0, RESOLUTION_S, "reference", len(curves[n]))
            continue
        est = estimate_offset(curves[n], ref) if ref is not None else None
        if est is not None:
            out[n] = ClockEstimate(est[0], est[1], "progress", est[2])
        elif n in agent_offsets and (reference is None or reference in agent_offsets):
            off, unc = agent_offsets[n]
            ref_off, ref_unc = agent_offsets.get(reference, (0.0, 0.0)) if reference else (0.0, 0.0)
            out[n] = ClockEstimate(off - ref_off, unc + ref_unc, "agent")
        else:
            out[n] = ClockEstimate(0.0, UNALIGNED_UNCERTAINTY_S, "none")
    return out


def _neg(name: str) -> tuple[int, ...]:
    """Sort key that prefers the alphabetically first node name among equals in max()."""
    return tuple(-ord(c) for c in name)
