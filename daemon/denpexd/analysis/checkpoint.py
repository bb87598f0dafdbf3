"""A hang that began while a checkpoint was being written: the writer, not the network, held the job.

A collective timeout tells when the stuck collective started: the watchdog's line gives its
timeout (`Timeout(ms)=1200000`), so the waiting ranks entered it at the line's time minus that.
When a rank announced a checkpoint save at that moment (rules with ``marker = "checkpoint"``:
`Saving model checkpoint to ...`, `saving checkpoint at iteration ...`) and logged no step
after it, the others were waiting for that rank to come back from writing: storage that
stalled (a remote or full filesystem, a slow object store), a save that itself waits for a
collective only some ranks entered, or a writer that died silently. The story is checkpoint I/O,
and the timeouts are its consequences.

"At that moment" is a window around the entry: the save may have been announced up to
`LEAD_S` before the others entered (they finished their own work first) or up to `LAG_S` after
(the writer logs once it starts), widened by the clocks' uncertainty. A rank that itself timed
out came back from its own save and waited for someone else: its save is not the one that held
the job (every rank may announce the same save; the writer is the one that never came back).
"""

from __future__ import annotations

import heapq
from typing import Any

from denpex_agent.events import Event
from denpexd.analysis.evidence import format_iso
from denpexd.analysis.tracks import Aggregates, Aligned, Tracks

CHECKPOINT_STALL_RULE = "hang-in-checkpoint-save"
LEAD_S = 120.0
LAG_S = 30.0
MARKS_KEPT = 8  # newest save announcements remembered per (node, rank)

SaveMarks = dict[tuple[str, int | None], list[tuple[float, str, Event]]]  # min-heaps of (ts, id, ev)


def add_save(marks: SaveMarks, ev: Event) -> None:
    """Remember a timed save announcement; each (node, rank) keeps its `MARKS_KEPT` newest (by
    time, then id: the same set whatever the order of arrival)."""
    if ev.ts is None:
        return
    heap = marks.setdefault((ev.node, ev.rank), [])
    item = (ev.ts, ev.id, ev)
    if len(heap) < MARKS_KEPT:
        heapq.heappush(heap, item)
    elif item[:2] > heap[0][:2]:
        heapq.heapreplace(heap, item)


def checkpoint_stall(
    marks: SaveMarks, aggs: Aggregates, tracks: Tracks, aligned: Aligned, uncertainty_s: float
) -> dict[str, Any] | None:
    """The save announcement the job's first timed-out collective waited on, or None."""
    entries = []
    waiters = set()
    for agg in aggs.values():
        ev = agg.first
        if ev.category != "hang":
            continue
        waiters.add((ev.node, ev.rank))
        timeout_ms = ev.fields.get("timeout_ms")
        at = aligned(ev.node, ev.ts)
        if isinstance(timeout_ms, int) and timeout_ms > 0 and at is not None:
            entries.append((at - timeout_ms / 1000.0, timeout_ms, ev))
    if not entries:
        return None
    entered, timeout_ms, waiter = min(entries, key=lambda e: (e[0], e[2].node, e[2].rank or 0))
    slack = 2.0 * uncertainty_s
    found = []
    for (node, rank), heap in marks.items():
        if rank is not None and (node, rank) in waiters:
            continue
        for ts, _id, ev in heap:
            at = aligned(node, ts)
            if at is None or not entered - LEAD_S - slack <= at <= entered + LAG_S + slack:
                continue
            track = tracks.get((node, rank)) if rank is not None else None
            moved_on = (
                track is not None and (after := aligned(node, track.last_step_ts)) is not None and after > at
            )
            if not moved_on:
                found.append((abs(at - entered), at, node, rank if rank is not None else -1, ev))
    if not found:
        return None
    _gap, at, _node, _rank, save = min(found, key=lambda f: f[:4])
    return {
        "node": save.node,
        "rank": save.rank,
        "time": format_iso(at),
        "text": save.text.strip()[:200],
        "collective_entered": format_iso(entered),
        "timeout_s": timeout_ms / 1000.0,
        "waiting": {"node": waiter.node, "rank": waiter.rank},
        "rule": CHECKPOINT_STALL_RULE,
    }
