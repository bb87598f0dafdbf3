"""The stall watch: a job whose ranks stopped logging progress, seen live long before any
collective timeout fires.

A rank stuck in a collective, a read that never returns or an evaluation with no timeout prints
nothing; NCCL's watchdog speaks 10 to 30 minutes later. The daemon already receives every rank's
progress, so it notices the silence itself: per open job it keeps each rank's newest step, when
that step arrived (the daemon's monotonic clock: no node clock is involved) and the line that
said it, and the job's recent step interval (from the step lines' own timestamps, or from their
arrival when they have none).

The job is stalled when no rank has advanced for longer than its threshold:
``max(stall_floor_s, stall_factor x the median recent step interval)``, or ``stall_pause_s``
while a marker line announced an expected pause (an evaluation, a checkpoint being written)
that no step has ended yet. A rank that logged the end of training, or its planned last step (``step 30/30``,
``iteration 30/ 30``), is done; once one has, the job only counts as stalled when another rank's
last step is behind the finished rank's (the classic uneven last batch: the others wait for it in
a collective forever). Any later step line is activity, also one with a lower number (a counter
that restarts every epoch).

The suspect: the rank whose last step is behind the others' (evidence: it stopped first), when
the ranks behind are at most half of them (else the ranks ahead are the odd ones). When every
rank stopped at the same step, no rank is named: the collective they all wait in does not say
who is missing.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from denpex_agent.events import Event
from denpex_agent.timestamps import format_iso
from denpexd.analysis.tracks import StepFields, at_planned_end

STALL_RULE = "job-progress-stalled"
INTERVALS = 64  # recent step intervals the threshold is based on
MIN_INTERVALS = 3  # ... and how many are needed before it adapts (the floor applies until then)
MAX_LISTED = 16  # ranks listed in the stall's evidence (the ones behind first)
Key = tuple[str, int | str]  # a rank: (node, global rank), or (node, file) for a file naming none


@dataclass(slots=True)
class Pace:
    """One rank's newest step, when it arrived, and its line."""

    step: int
    at: float  # monotonic arrival of the advance to `step`
    ts: float | None  # that line's own timestamp
    event: Event


class StallWatch:
    """One job's progress as time passes (see the module's docstring). Not thread-safe."""

    __slots__ = ("ended", "factor", "floor_s", "intervals", "last_advance", "pause", "pause_s", "ranks")

    def __init__(self, *, factor: float, floor_s: float, pause_s: float) -> None:
        self.factor, self.floor_s, self.pause_s = factor, floor_s, pause_s
        self.ranks: dict[Key, Pace] = {}
        self.intervals: deque[float] = deque(maxlen=INTERVALS)
        self.last_advance = 0.0
        self.pause: tuple[Event, float] | None = None  # the announcement, and when it arrived
        self.ended: dict[Key, int] = {}  # a finished rank -> its last step

    @staticmethod
    def _key(ev: Event) -> Key:
        return ev.node, ev.rank if ev.rank is not None else ev.file

    def progress(self, ev: Event, now: float) -> None:
        step = ev.fields.get("step")
        if step.__class__ is not int:
            return
        key = self._key(ev)
        if at_planned_end(step, ev.fields):
            self.ended[key] = step
        pace = self.ranks.get(key)
        if pace is None:
            self.ranks[key] = Pace(step, now, ev.ts, ev)
            self.last_advance = max(self.last_advance, now)
            return
        if not _newer(ev, pace.event):
            return
        if step > pace.step:
            if ev.ts is not None and pace.ts is not None and ev.ts > pace.ts:
                self.intervals.append((ev.ts - pace.ts) / (step - pace.step))
            elif now > pace.at:
                self.intervals.append((now - pace.at) / (step - pace.step))
        # a later step line is activity even when its number is lower (a counter per epoch)
        pace.step, pace.at, pace.ts, pace.event = step, now, ev.ts, ev
        self.last_advance = now
        if self.pause is not None and now > self.pause[1]:
            self.pause = None  # a step after the announcement: the pause is over

    def compact(self, kept: Callable[[Event], Event], keys: Mapping[Any, Any] | None = None) -> None:
        """Hold each rank's line as ``kept`` gives it (the engine's compacted copy of the same
        line: one object for both, and its time), and each rank's key as ``keys`` maps it (the
        engine's equal key of the rank's track: one tuple for both; a job holds thousands)."""
        for pace in self.ranks.values():
            ev = pace.event
            if ev.fields.__class__ is not StepFields:
                pace.event = kept(ev)
                pace.ts = pace.event.ts
        if keys is not None and any(keys.get(k, k) is not k for k in self.ranks):
            self.ranks = {keys.get(k, k): pace for k, pace in self.ranks.items()}

    def marker(self, ev: Event, kind: str, now: float) -> None:
        if kind in ("pause", "checkpoint"):
            self.pause = (ev, now)
        elif kind == "end":
            key = self._key(ev)
            pace = self.ranks.get(key)
            self.ended[key] = pace.step if pace is not None else -1

    def interval(self) -> float | None:
        return statistics.median(self.intervals) if len(self.intervals) >= MIN_INTERVALS else None

    def threshold(self) -> float:
        interval = self.interval()
        t = max(self.floor_s, self.factor * interval) if interval is not None else self.floor_s
        return max(t, self.pause_s) if self.pause is not None else t

    def _behind_finished(self) -> list[Key]:
        done = max(self.ended.values())
        return [k for k, p in self.ranks.items() if k not in self.ended and p.step < done]

    def check(self, now: float, wall: float) -> dict[str, Any] | None:
        """The stall, if the job is stalled at ``now`` (monotonic; ``wall``: the same instant on
        the wall clock, for the document's times), else None."""
        if not self.ranks:
            return None
        if self.ended and not self._behind_finished():
            return None
        silent = now - self.last_advance
        threshold = self.threshold()
        if silent <= threshold:
            return None
        top = max(p.step for p in self.ranks.values())
        behind = sorted((p.step, k) for k, p in self.ranks.items() if p.step < top)
        listed = [k for _, k in behind] + sorted(
            (k for k, p in self.ranks.items() if p.step == top), key=lambda k: (k[0], str(k[1]))
        )
        interval = self.interval()
        return {
            "since": format_iso(wall - silent),
            "silent_s": round(silent, 3),
            "threshold_s": round(threshold, 3),
            "interval_s": round(interval, 4) if interval is not None else None,
            "pause": self.pause[0].text if self.pause is not None else None,
            "ranks": len(self.ranks),
            "last_step": top,
            "behind": [self._rank_dict(k) for _, k in behind[:MAX_LISTED]],
            "behind_total": len(behind),
            "last_steps": [self._rank_dict(k) for k in listed[:MAX_LISTED]],
        }

    def _rank_dict(self, key: Key) -> dict[str, Any]:
        p = self.ranks[key]
        ev = p.event
        return {
            "node": ev.node,
            "rank": ev.rank,
            "step": p.step,
            "file": ev.file,
            "line_no": ev.line_no,
            "text": ev.text,
            "local_time": format_iso(ev.ts) if ev.ts is not None else None,
        }


def _newer(ev: Event, last: Event) -> bool:
    """Whether a step line comes after the last one seen of its rank: further in the same file,
    else (another file: a launcher's copy) later by its own time, or with a higher step."""
    if ev.file == last.file:
        return ev.offset > last.offset
    if ev.ts is not None and last.ts is not None:
        return ev.ts > last.ts
    return int(ev.fields.get("step", 0)) > int(last.fields.get("step", 0))


def overlay(doc: dict[str, Any], stall: dict[str, Any] | None, explained: dict[str, Any]) -> None:
    """Put a live stall into a job's diagnosis (``stall``: `StallWatch.check`'s answer, None when
    the job is not stalled). A failure the engine found stands; a stall turns a job that has not
    failed into a failed one, category hang, named after the rank behind the others if one is,
    else the whole job (every rank stopped alike); the evidence is each rank's last step line."""
    doc["stall"] = stall
    if stall is None or doc.get("verdict") == "failed":
        return
    doc["verdict"] = "failed"
    doc["root_cause"] = explained
    behind = stall["behind"]
    # the ranks behind stand out only as a minority (else the ranks ahead are the odd ones)
    named = bool(behind) and stall["behind_total"] <= stall["ranks"] / 2
    doc["scope"] = "rank" if named else "job"
    doc["initiator"] = _suspect(stall) if named else None
    first = (behind or stall["last_steps"])[0]
    doc["evidence"] = {
        "file": first["file"],
        "line": first["line_no"],
        "before": [],
        "text": first["text"],
        "last_steps": stall["last_steps"],
    }


def _suspect(stall: dict[str, Any]) -> dict[str, Any]:
    b = stall["behind"][0]
    lone = len(stall["behind"]) == 1 or stall["behind"][1]["step"] > b["step"]
    return {
        "node": b["node"],
        "rank": b["rank"],
        "rule": STALL_RULE,
        "category": "hang",
        "time": None,
        "file": b["file"],
        "line": b["line_no"],
        "text": (
            f"rank {b['rank']} stopped first: its last step line is step {b['step']} while others reached "
            f"step {stall['last_step']}, and no rank advanced for {stall['silent_s']:.0f} s "
            f"({b['text'].strip()[:300]})"
        ),
        "confidence": 0.8 if lone else 0.5,
        "local_time": b["local_time"],
        "kind": "stall",
    }
