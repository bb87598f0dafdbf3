"""A job whose logs went on while no rank logged a step: stalled, by its own clock.

The live stall watch (`denpexd.stall`) measures silence on the daemon's clock, so it can only see
a job that is running now. A log read after the fact tells the same thing when the lines after
the last step carry times: a launcher's pulses, a monitor's lines, warnings of a rank still alive.
For every file, the agent's heartbeats (and `diagnose`, once per file read) report its newest
timestamp and `quiet_since`, the time of the first line at or after its last step line — an
upper bound on when that step was logged (`LineScanner.quiet_since`). Per node the engine keeps
the newest of each; the job logged its last step at the latest node's ``quiet_since`` at most,
and its logs reach to the latest node's newest timestamp, both aligned.

The job is stalled when the logs went on for longer than the threshold after that:
``max(FLOOR_S, FACTOR x the median time between logged step lines)``, or `PAUSE_S` when a pause
was announced (an evaluation, a checkpoint save: the `marker` rules) at or after that time, as the
live watch allows it; and no rank logged the end of training or its planned last step. The floor is NCCL's default collective timeout: a job that
took no step for that long, with lines still being written, is not merely slow. The silence is a
lower bound (both ends are chosen to shorten it), so the verdict never rests on an overestimate.
Each node's heartbeats carry the values it reached, and the newest wins: the live answer, once
every line is read, equals the post-mortem one.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Iterable
from typing import Any

from denpex_agent.timestamps import format_iso

FLOOR_S = 600.0  # no step for this long, while the logs go on: stalled
FACTOR = 10.0  # ... or this many times the usual time between step lines, if longer
PAUSE_S = 1800.0  # ... or this long in an announced pause (the live watch's stall_pause_s default)
PAUSES = ("pause", "checkpoint")  # the marker kinds that announce one

LogTimes = dict[str, tuple[float, float | None]]  # node -> (newest timestamp, newest quiet_since)


def note_log_time(times: LogTimes, node: str, ts: float, quiet: object) -> None:
    """Fold one file's report (a heartbeat's ``ts`` and ``quiet_since``) into its node's."""
    end, since = times.get(node, (ts, None))
    if isinstance(quiet, int | float) and not isinstance(quiet, bool) and (since is None or quiet > since):
        since = float(quiet)
    times[node] = (max(end, ts), since)


def note_pause(pauses: dict[str, float], node: str, ts: float) -> None:
    """Keep each node's newest announced pause."""
    if ts > pauses.get(node, -math.inf):
        pauses[node] = ts


def step_interval(curves: Iterable[list[tuple[int, float]]]) -> float | None:
    """The median time between consecutive logged step lines (samples), over every node's curve
    of (step, local time); None with fewer than two."""
    gaps = [t1 - t0 for curve in curves for (_, t0), (_, t1) in itertools.pairwise(curve) if t1 > t0]
    return statistics.median(gaps) if gaps else None


def logged_stall(
    times: LogTimes,
    aligned: Callable[[str, float | None], float | None],
    curves: Iterable[list[tuple[int, float]]],
    finished: bool | None,
    pauses: dict[str, float] | None = None,
) -> dict[str, Any] | None:
    """The stall the logs show (see the module's docstring), or None. ``curves``: every node's
    step curve (`step_interval`, read only for a silence past the floor); ``pauses``: each
    node's newest announced pause (local time)."""
    if finished or not times:
        return None
    quiet = [q for node, (_end, since) in times.items() if (q := aligned(node, since)) is not None]
    if not quiet:
        return None
    since = max(quiet)
    until = max(t for node, (end, _since) in times.items() if (t := aligned(node, end)) is not None)
    silent = until - since
    if silent <= FLOOR_S:  # the threshold is never lower: the step gaps need not be looked at
        return None
    interval = step_interval(curves)
    threshold = max(FLOOR_S, FACTOR * interval) if interval is not None else FLOOR_S
    paused = any((t := aligned(node, ts)) is not None and t >= since for node, ts in (pauses or {}).items())
    if paused:
        threshold = max(threshold, PAUSE_S)
    if silent <= threshold:
        return None
    return {
        "silent_s": round(silent, 1),
        "threshold_s": round(threshold, 1),
        "since": format_iso(since),
        "until": format_iso(until),
    }
