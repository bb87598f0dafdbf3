"""What the engine keeps of a job's events: per-(node, rank, rule) aggregates of first events,
per-rank progress tracks and per-node progress samples, and the one order of events.

Every "first" is the least by `event_order` and every tie has one rule, so the state after a set
of events is the same whatever order they were added in.
"""

from __future__ import annotations

import math
import statistics
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from denpex_agent.events import Event

# the progress values a rank's track keeps samples of (stragglers), and those the job keeps the
# largest value per step of (trends)
SERIES = ("data_time", "step_time")
JOB_SERIES = ("loss", "grad_norm")
MAX_RANK_SAMPLES = 256  # samples kept per rank and value (see Series)
MAX_SAMPLES = 1024  # steps kept per node curve or per rank's data times (see StepSamples)


def event_order(ev: Event) -> tuple[bool, float, str, int, str]:
    """The one order of events: local time (unknown last), then file, offset and id."""
    ts = ev.ts
    return (ts is None, ts if ts is not None else 0.0, ev.file, ev.offset, ev.id)


def aligned_order(
    ev: Event, aligned: Callable[[str, float | None], float | None]
) -> tuple[bool, float, tuple[bool, float, str, int, str]]:
    """Events on the reference clock (unknown last), equal times by `event_order`."""
    at = aligned(ev.node, ev.ts)
    return (at is None, at if at is not None else 0.0, event_order(ev))


def progress_order(step: int, ev: Event) -> tuple[int, bool, float, str, int, str]:
    """Which of two step lines is further along: the higher step, then the later line."""
    ts = ev.ts
    return (step, ts is not None, ts if ts is not None else 0.0, ev.file, ev.offset, ev.id)


@dataclass(slots=True)
class Aggregate:
    """The first event (by `event_order`) of one rule on one rank, and how often it recurred."""

    first: Event
    count: int = 1
    last_ts: float | None = None

    def add(self, ev: Event) -> None:
        self.count += 1
        if ev.ts is not None and (self.last_ts is None or ev.ts > self.last_ts):
            self.last_ts = ev.ts
        if event_order(ev) < event_order(self.first):
            self.first = ev

    def merged(self, other: Aggregate) -> Aggregate:
        first = other.first if event_order(other.first) < event_order(self.first) else self.first
        lasts = [t for t in (self.last_ts, other.last_ts) if t is not None]
        return Aggregate(first, self.count + other.count, max(lasts) if lasts else None)


def at_planned_end(step: int, fields: dict[str, Any]) -> bool:
    """Whether a step line is its run's planned last step (``step 30/30``: the ``total`` field)."""
    total = fields.get("total")
    return total.__class__ is int and step >= total


class StepSamples:
    """Values per step, bounded to `MAX_SAMPLES` steps: beyond that only steps that are multiples
    of a doubled stride are kept. The kept steps are the multiples of the smallest power-of-two
    stride that leaves at most `MAX_SAMPLES` of the steps seen, whatever order they came in."""

    __slots__ = ("by_step", "stride")

    def __init__(self) -> None:
        self.by_step: dict[int, array[float]] = {}
        self.stride = 1

    def add(self, step: int, value: float) -> bool:
        """Keep ``value`` for ``step``; False when the step is thinned out."""
        values = self.by_step.get(step)
        if values is None:
            if step % self.stride:
                return False
            values = self.by_step[step] = array("d")
            if len(self.by_step) > MAX_SAMPLES:
                self._thin()
                values = self.by_step.get(step)
                if values is None:
                    return False
        values.append(value)
        return True

    def _thin(self) -> None:
        while len(self.by_step) > MAX_SAMPLES:
            self.stride *= 2
            self.by_step = {s: v for s, v in self.by_step.items() if s % self.stride == 0}

    def values(self) -> list[float]:
        return [v for vs in self.by_step.values() for v in vs]


class Series:
    """One rank's samples of one value, compact (two arrays), bounded to `MAX_RANK_SAMPLES`:
    beyond that only samples of steps that are multiples of a doubled stride are kept, so the
    kept samples are the same whatever order they came in."""

    __slots__ = ("steps", "stride", "vals")

    def __init__(self) -> None:
        self.steps = array("q")
        self.vals = array("d")
        self.stride = 1

    def add(self, step: int, value: float) -> None:
        if step % self.stride:
            return
        self.steps.append(step)
        self.vals.append(value)
        while len(self.steps) > MAX_RANK_SAMPLES:
            self.stride *= 2
            keep = [i for i, s in enumerate(self.steps) if s % self.stride == 0]
            self.steps = array("q", (self.steps[i] for i in keep))
            self.vals = array("d", (self.vals[i] for i in keep))

    def values(self) -> list[float]:
        return list(self.vals)

    def recent_median(self) -> float:
        """The median of the later half of the samples (by step)."""
        pairs = self.pairs()
        return statistics.median(v for _, v in pairs[len(pairs) // 2 :]) if pairs else math.nan

    def pairs(self) -> list[tuple[int, float]]:
        """(step, value) in step order (values of one step in ascending order)."""
        return sorted(zip(self.steps, self.vals, strict=True))

    def __len__(self) -> int:
        return len(self.steps)


class StepMax:
    """The largest value seen per step (of any rank), bounded to `MAX_SAMPLES` steps like
    `StepSamples`: a job's loss or gradient-norm curve. The largest, because it does not depend
    on the order values arrive in and a spike on any rank shows."""

    __slots__ = ("by_step", "stride", "version")

    def __init__(self) -> None:
        self.by_step: dict[int, float] = {}
        self.stride = 1
        self.version = 0  # changes whenever the curve does

    def add(self, step: int, value: float) -> None:
        if step % self.stride:
            return
        old = self.by_step.get(step)
        if old is None or value > old:
            self.by_step[step] = value
            self.version += 1
            while len(self.by_step) > MAX_SAMPLES:
                self.stride *= 2
                self.by_step = {s: v for s, v in self.by_step.items() if s % self.stride == 0}

    def curve(self) -> list[tuple[int, float]]:
        return sorted(self.by_step.items())


class NodeProgress(StepSamples):
    """One node's progress samples, pooled over its ranks: step -> local times (one per sample).

    Clock alignment only needs the node's curve (the median time per step over its ranks), so
    samples are kept per node, not per rank: memory grows with nodes and steps, bounded as
    `StepSamples` bounds it. The curve is cached; a step that gets a sample afterwards is marked,
    and only the marked steps' medians are computed again (a long job's node holds up to
    `MAX_SAMPLES` steps, and a live job is diagnosed every second or so while a few of them move).
    """

    __slots__ = ("_curve", "_dirty")

    def __init__(self) -> None:
        super().__init__()
        self._curve: list[tuple[int, float]] | None = None
        self._dirty: set[int] | None = None  # steps sampled since `_curve` was computed

    def add(self, step: int, value: float) -> bool:
        if not super().add(step, value):
            return False
        if self._curve is not None:
            dirty = self._dirty
            if dirty is None:
                self._dirty = {step}
            else:
                dirty.add(step)
        return True

    def _thin(self) -> None:
        super()._thin()
        self._curve, self._dirty = None, None

    def samples(self) -> list[tuple[int, float]]:
        return [(s, t) for s, times in self.by_step.items() for t in times]

    def curve(self) -> list[tuple[int, float]]:
        """The node's curve, as `clock.node_curve` computes it from `samples()` (a new list
        whenever it changed: a caller may keep the one it got)."""
        by_step, curve, dirty = self.by_step, self._curve, self._dirty
        if curve is None:
            curve = [(s, statistics.median(by_step[s])) for s in sorted(by_step)]
        elif dirty:
            old = dict(curve)  # every step not marked was in the curve (new steps are marked)
            curve = [(s, statistics.median(by_step[s]) if s in dirty else old[s]) for s in sorted(by_step)]
        else:
            return curve
        self._curve, self._dirty = curve, None
        return curve


# What kept events share instead of one empty container each (a job keeps thousands of events):
# never mutated.
NO_CONTEXT: list[str] = []
NO_FIELDS: dict[str, Any] = {}
STEP_FIELDS = ("step", "total")  # what the analyses read of a rank's newest step line's fields


class StepFields(dict[str, Any]):
    """The fields a compacted step line keeps (`STEP_FIELDS`), shared by the ranks at the same
    step; never mutated. Its class marks a line as compacted."""

    __slots__ = ()


class Shared:
    """One object for each distinct value among the events one compaction keeps (`compact_step`,
    `share_empties`), instead of one per event: the ranks of a job run one program, so their
    kept lines often have the same text, time (a second's resolution), line number or offset,
    and a job keeps thousands of such lines. Values are shared only with values of their own
    class, and no zero time (equal is not enough: 1 == 1.0, -0.0 == 0.0)."""

    __slots__ = ("fields", "numbers", "texts", "times")

    def __init__(self) -> None:
        self.fields: dict[Any, StepFields] = {}
        self.texts: dict[str, str] = {}
        self.times: dict[float, float] = {}
        self.numbers: dict[int, int] = {}

    def step_fields(self, fields: dict[str, Any]) -> StepFields:
        """The `STEP_FIELDS` of a step line's fields, as a map shared by equal ones."""
        key = tuple((k, fields[k].__class__, fields[k]) for k in STEP_FIELDS if k in fields)
        got = self.fields.get(key)
        if got is None:
            got = self.fields[key] = StepFields((k, v) for k, _, v in key)
        return got

    def text(self, text: str) -> str:
        return self.texts.setdefault(text, text) if text.__class__ is str else text

    def time(self, ts: float | None) -> float | None:
        return self.times.setdefault(ts, ts) if ts.__class__ is float and ts else ts

    def number(self, n: int) -> int:
        return self.numbers.setdefault(n, n) if n.__class__ is int else n


def compact_step(ev: Event, rank: int | None, file: str | None, shared: Shared) -> Event:
    """A rank's newest step line as the analyses read it: its fields cut to `STEP_FIELDS`, an
    empty context shared, the rank's number and file name (``rank``, ``file``: equal values the
    track holds already) instead of copies, and its text, time, offset and line number shared
    with equal ones (``shared``), and so is its job's name."""
    return Event(
        ev.id, ev.kind, shared.text(ev.job), ev.node, rank if rank == ev.rank else ev.rank, ev.local_rank,
        file if file == ev.file and file is not None else ev.file, shared.number(ev.offset),
        shared.number(ev.line_no), shared.time(ev.ts), ev.ts_source, ev.rule, ev.severity, ev.role,
        ev.category, shared.text(ev.text), ev.context or NO_CONTEXT, shared.step_fields(ev.fields),
    )  # fmt: skip


def share_empties(ev: Event, rank: int | None, file: str | None, shared: Shared) -> None:
    """Make a kept event hold the shared empty containers, the track's rank number and file name
    where its own are equal, and the job's name, text, time, offset and line number equal events
    hold (``shared``): in place, since nothing a reader sees changes."""
    if not ev.context and ev.context is not NO_CONTEXT:
        ev.context = NO_CONTEXT
    if not ev.fields and ev.fields is not NO_FIELDS:
        ev.fields = NO_FIELDS
    if file is not None and ev.file is not file and ev.file == file:
        ev.file = file
    if rank is not None and ev.rank is not rank and ev.rank == rank:
        ev.rank = rank
    ev.job, ev.text, ev.ts = shared.text(ev.job), shared.text(ev.text), shared.time(ev.ts)
    ev.offset, ev.line_no = shared.number(ev.offset), shared.number(ev.line_no)


@dataclass(slots=True)
class RankTrack:
    """What hang detection, stragglers and the rank table need of one rank (no sample history).

    Every progress event moves the rank's last step (the furthest by `progress_order`); only
    samples, not tips, feed the node's clock curve and the rank's data times."""

    node: str
    rank: int | None
    progress: NodeProgress
    last_step: int | None = None
    last_step_ts: float | None = None
    last_progress: Event | None = None
    # per value name (`SERIES`): the finite values of this rank's progress samples, by step
    series: dict[str, Series] | None = None
    # how many of this rank's events came from each file and under each local rank: the votes
    # that give an event naming no global rank its rank (see analysis.ranks). The first file and
    # the first local rank are counted in the track itself, others in a dict made for a second
    # one (memory: a rank almost always writes one file under one local rank, and a job holds a
    # track per rank, so two counting objects per track would be most of a track)
    file: str | None = None  # the first file (None: no vote yet)
    file_votes: int = 0
    other_files: dict[str, int] | None = None
    local: int | None = None  # the first local rank (None: no vote yet)
    local_votes: int = 0
    other_locals: dict[int, int] | None = None
    rule_events: int = 0  # rule events that named this rank (the rank table's count)

    def vote(self, ev: Event) -> None:
        # the common case first (every step line): the rank's first file and local rank again
        file, local = ev.file, ev.local_rank
        if self.file_votes and file == self.file:
            self.file_votes += 1
        else:
            self.vote_file(file)
        if local is not None:
            if self.local_votes and local == self.local:
                self.local_votes += 1
            else:
                self.vote_local(local)

    def vote_file(self, file: str, n: int = 1) -> None:
        if not self.file_votes:
            self.file = file
        if file == self.file:
            self.file_votes += n
        else:
            if self.other_files is None:
                self.other_files = {}
            self.other_files[file] = self.other_files.get(file, 0) + n

    def vote_local(self, local: int, n: int = 1) -> None:
        if not self.local_votes:
            self.local = local
        if local == self.local:
            self.local_votes += n
        else:
            if self.other_locals is None:
                self.other_locals = {}
            self.other_locals[local] = self.other_locals.get(local, 0) + n

    def votes_for_file(self, file: str) -> int:
        """How many of this rank's events came from ``file`` (0: none)."""
        if self.file_votes and file == self.file:
            return self.file_votes
        return self.other_files.get(file, 0) if self.other_files is not None else 0

    def votes_for_local(self, local: int) -> int:
        """How many of this rank's events named local rank ``local`` (0: none)."""
        if self.local_votes and local == self.local:
            return self.local_votes
        return self.other_locals.get(local, 0) if self.other_locals is not None else 0

    def votes(self) -> tuple[dict[str, int], dict[int, int]]:
        """Every file's and every local rank's votes, as two maps."""
        files = {self.file: self.file_votes} if self.file_votes and self.file is not None else {}
        locals_ = {self.local: self.local_votes} if self.local_votes and self.local is not None else {}
        return files | (self.other_files or {}), locals_ | (self.other_locals or {})

    @property
    def samples(self) -> list[tuple[int, float]]:
        """The node curve this rank's samples feed (its own samples are not kept)."""
        return self.progress.curve()

    def add(self, step: int, ts: float | None, ev: Event) -> None:
        last_step = self.last_step
        if (
            last_step is None
            or step > last_step
            or (
                step == last_step
                and self.last_progress is not None
                and progress_order(step, ev) > progress_order(step, self.last_progress)
            )
        ):
            self.last_step, self.last_step_ts, self.last_progress = step, ts, ev
        fields = ev.fields
        if fields.get("tip"):
            return
        if self.rank is not None:
            self.vote(ev)
        if "data_time" in fields or "step_time" in fields:
            for name in SERIES:
                v = fields.get(name)
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self.series_of(name).add(step, float(v))
        if ts is not None:
            self.progress.add(step, ts)

    def series_of(self, name: str) -> Series:
        """This rank's samples of one progress value (`SERIES`), made on first use."""
        if self.series is None:
            self.series = {}
        got = self.series.get(name)
        if got is None:
            got = self.series[name] = Series()
        return got

    @property
    def data_times(self) -> Series | None:
        return self.series.get("data_time") if self.series is not None else None

    def copy(self) -> RankTrack:
        dup = RankTrack(
            self.node, self.rank, self.progress, self.last_step, self.last_step_ts, self.last_progress
        )
        dup.merge(self)
        dup.file, dup.file_votes, dup.other_files = self.file, self.file_votes, self.other_files
        dup.local, dup.local_votes, dup.other_locals = self.local, self.local_votes, self.other_locals
        dup.rule_events = self.rule_events
        return dup

    def merge(self, other: RankTrack) -> None:
        """Take in what another track of the same rank saw (an unranked file resolved to it)."""
        if other.last_progress is not None and other.last_step is not None:
            last = self.last_progress
            if last is None or progress_order(other.last_step, other.last_progress) > progress_order(
                self.last_step or 0, last
            ):
                self.last_step, self.last_step_ts = other.last_step, other.last_step_ts
                self.last_progress = other.last_progress
        for name, samples in (other.series or {}).items():
            mine = self.series_of(name)
            for step, v in zip(samples.steps, samples.vals, strict=True):
                mine.add(step, v)


# The keys the engine's state and every analysis use.
AggKey = tuple[str, int | None, str]  # (node, rank, rule)
TrackKey = tuple[str, int | None]  # (node, rank)
Aggregates = dict[AggKey, Aggregate]
Tracks = dict[TrackKey, RankTrack]
# A node's local time -> the reference clock's (None stays None), from the clock estimates.
Aligned = Callable[[str, float | None], float | None]
