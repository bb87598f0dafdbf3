"""The correlation engine: events of one job in, a diagnosis out (docs/diagnosis-json.md).

Pure and incremental: `Engine.add()` folds each event into bounded per-(node, rank, rule)
aggregates and per-rank progress tracks; `Engine.diagnose()` can be called at any time and
computes clock offsets, the initiator and its rivals, the hang suspect, the collateral, the NaN
fingerprint and the evidence from those aggregates. `denpexd diagnose` feeds it from files and
`denpexd serve` from MQTT — the same code either way.

Order does not matter: the state after a set of events is the same whatever order they were
added in (every "first" is the least by `event_order`, every tie has one rule), so the live
daemon, which gets the nodes' events interleaved by the network, and `diagnose`, which reads file
after file, reach the same diagnosis from the same events.

Ranks. An event whose line and path name no global rank is kept apart with its file and local
rank, and given a rank when the diagnosis is made: the global rank that events of the same node
and local rank name (torchrun's ``[defaultN]:`` echo, its ``attempt_0/N/`` directories), else the
rank that ≥ 90 % of the ranked events of its file name. Deciding this at the end, from all events,
keeps it independent of which lines happened to be read first.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from denpex_agent.events import Event
from denpex_agent.rules import SEVERITIES, Rule, RuleSet
from denpex_agent.timestamps import format_iso as _format_iso
from denpexd.clock import ClockEstimate, align

ERROR = SEVERITIES.index("error")
WARNING = SEVERITIES.index("warning")
LOOKBACK_S = 300.0
MAX_SAMPLES = 1024
MAX_DATA_TIMES = 1024
STRAGGLER_RATIO = 3.0
STRAGGLER_MIN_S = 0.05
LOSS_SCALE_DROPS_DEGRADED = 3
HANG_RULE = "hang-rank-stopped-progress"
KILLED_RULE = "torchrun-worker-sigkill"
STRAGGLER_RULE = "straggler-slow-rank"
# Bounds of one job's state (a flood of distinct ranks, files or rules cannot grow it further):
MAX_CANDIDATE_AGGREGATES = 16_384  # first events of causes and symptoms (rank, rule)
MAX_OTHER_AGGREGATES = 32_768  # first events of collateral (rank, rule)
MAX_TRACKS = 65_536  # ranks whose progress is followed
MAX_CANDIDATES_SHOWN = 64  # candidates listed in a diagnosis (best first)
KEPT_TEXT = 300  # chars of a collateral event's text kept in memory (its context is dropped)

_STAGES = ("none", "info", "warn", "error")

# Thousands of ranks share a handful of step and failure times: format each distinct time once.
format_iso = functools.lru_cache(maxsize=65_536)(_format_iso)


# "Every rank failed the same way": the first event's rule reported by at least this share of
# the ranks that logged an error (and by two or more), all within the clocks' uncertainty (or
# this many seconds, whichever is larger) of the first, or without times to tell them apart.
JOB_SCOPE_SHARE = 0.8
JOB_SCOPE_WINDOW_S = 1.0
DOMINANT_SHARE = 0.9  # a file "is" rank r when this share of its ranked events name r


def event_order(ev: Event) -> tuple[bool, float, str, int, str]:
    """The one order of events: local time (unknown last), then file, offset and id."""
    ts = ev.ts
    return (ts is None, ts if ts is not None else 0.0, ev.file, ev.offset, ev.id)


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


class NodeProgress(StepSamples):
    """One node's progress samples, pooled over its ranks: step -> local times (one per sample).

    Clock alignment only needs the node's curve (the median time per step over its ranks), so
    samples are kept per node, not per rank: memory grows with nodes and steps, bounded as
    `StepSamples` bounds it. The curve is cached until the node changes.
    """

    __slots__ = ("_curve",)

    def __init__(self) -> None:
        super().__init__()
        self._curve: list[tuple[int, float]] | None = None

    def add(self, step: int, value: float) -> bool:
        kept = super().add(step, value)
        if kept:
            self._curve = None
        return kept

    def _thin(self) -> None:
        super()._thin()
        self._curve = None

    def samples(self) -> list[tuple[int, float]]:
        return [(s, t) for s, times in self.by_step.items() for t in times]

    def curve(self) -> list[tuple[int, float]]:
        """The node's curve, as `clock.node_curve` computes it from `samples()`."""
        if self._curve is None:
            self._curve = [(s, statistics.median(self.by_step[s])) for s in sorted(self.by_step)]
        return self._curve


def _progress_order(step: int, ev: Event) -> tuple[int, bool, float, str, int, str]:
    """Which of two step lines is further along: the higher step, then the later line."""
    ts = ev.ts
    return (step, ts is not None, ts if ts is not None else 0.0, ev.file, ev.offset, ev.id)


@dataclass(slots=True)
class RankTrack:
    """What hang detection, stragglers and the rank table need of one rank (no sample history).

    Every progress event moves the rank's last step (the furthest by `_progress_order`); only
    samples, not tips, feed the node's clock curve and the rank's data times."""

    node: str
    rank: int | None
    progress: NodeProgress
    last_step: int | None = None
    last_step_ts: float | None = None
    last_progress: Event | None = None
    data_times: StepSamples | None = None
    # how many of this rank's events came from each file and under each local rank: the votes
    # that give an event naming no global rank its rank (see Engine.resolve_rank)
    files: dict[str, int] = field(default_factory=dict)
    locals: dict[int, int] = field(default_factory=dict)

    def vote(self, ev: Event) -> None:
        files = self.files
        files[ev.file] = files.get(ev.file, 0) + 1
        local = ev.local_rank
        if local is not None:
            self.locals[local] = self.locals.get(local, 0) + 1

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
                and _progress_order(step, ev) > _progress_order(step, self.last_progress)
            )
        ):
            self.last_step, self.last_step_ts, self.last_progress = step, ts, ev
        if ev.fields.get("tip"):
            return
        if self.rank is not None:
            self.vote(ev)
        if ts is None:
            return
        self.progress.add(step, ts)
        dt = ev.fields.get("data_time")
        if isinstance(dt, (int, float)) and not isinstance(dt, bool) and math.isfinite(dt):
            if self.data_times is None:
                self.data_times = StepSamples()
            self.data_times.add(step, float(dt))

    def copy(self) -> RankTrack:
        dup = RankTrack(
            self.node, self.rank, self.progress, self.last_step, self.last_step_ts, self.last_progress
        )
        dup.merge(self)
        dup.files, dup.locals = self.files, self.locals  # read-only from here on
        return dup

    def merge(self, other: RankTrack) -> None:
        """Take in what another track of the same rank saw (an unranked file resolved to it)."""
        if other.last_progress is not None and other.last_step is not None:
            last = self.last_progress
            if last is None or _progress_order(other.last_step, other.last_progress) > _progress_order(
                self.last_step or 0, last
            ):
                self.last_step, self.last_step_ts = other.last_step, other.last_step_ts
                self.last_progress = other.last_progress
        if other.data_times is not None:
            if self.data_times is None:
                self.data_times = StepSamples()
            for step, values in other.data_times.by_step.items():
                for v in values:
                    self.data_times.add(step, v)


@dataclass(frozen=True, slots=True)
class Candidate:
    node: str
    rank: int | None
    rule: str
    category: str
    ts: float | None
    aligned: float | None
    event: Event | None
    kind: str  # event | hang | killed


def _most_named(counts: dict[int, int]) -> int | None:
    """The rank named most often (the lowest of equals), or None when none is."""
    if not counts:
        return None
    return min(counts, key=lambda r: (-counts[r], r))


def _dominant(counts: dict[int, int]) -> int | None:
    """The rank that at least DOMINANT_SHARE of the votes name, if any."""
    rank = _most_named(counts)
    if rank is None:
        return None
    return rank if counts[rank] >= DOMINANT_SHARE * sum(counts.values()) else None


class Engine:
    """One job's correlator. Not thread-safe; feed it from one task or thread."""

    def __init__(
        self,
        job: str,
        rules: RuleSet,
        *,
        lookback_s: float = LOOKBACK_S,
        now: Callable[[], float] | None = None,
    ) -> None:
        self.job = job
        self.rules = rules
        self.lookback_s = lookback_s
        self._now = now
        self.aggs: dict[tuple[str, int | None, str], Aggregate] = {}
        # events that name no global rank, until the diagnosis gives them one
        self.unranked: dict[tuple[str, str, int | None, str], Aggregate] = {}
        self.tracks: dict[tuple[str, int | None], RankTrack] = {}
        self.unranked_tracks: dict[tuple[str, str, int | None], RankTrack] = {}
        self.progress: dict[str, NodeProgress] = {}  # node -> its ranks' pooled progress samples
        self.agent_offsets: dict[str, tuple[float, float]] = {}
        self.events_seen = 0
        self.rank_events: dict[tuple[str, int | None], int] = {}  # rule events per (node, rank)
        self.overflow: dict[str, int] = {}  # events of aggregates not kept (the bounds), by rule
        self.tracks_dropped = 0  # events of ranks beyond MAX_TRACKS (no track: no progress kept)
        self.failing_aggs = 0  # aggregates whose first event is an error or worse
        self.candidate_aggs = 0  # aggregates whose first event may name the initiator

    # -- input ----------------------------------------------------------------------------------

    def add(self, ev: Event) -> None:
        """Fold one event in (in any order: see the module's docstring)."""
        if ev.kind == "progress":
            self.add_progress(ev)
            return
        self.events_seen += 1
        if ev.kind == "heartbeat":
            off = ev.fields.get("clock_offset_s")
            unc = ev.fields.get("clock_uncertainty_s")
            if isinstance(off, (int, float)) and isinstance(unc, (int, float)):
                # the agent reports daemon-minus-agent; a node's offset is local-minus-reference.
                # The most certain estimate wins (ties: the smaller offset), whatever the order.
                cand = (-float(off), float(unc))
                cur = self.agent_offsets.get(ev.node)
                if cur is None or (cand[1], cand[0]) < (cur[1], cur[0]):
                    self.agent_offsets[ev.node] = cand
            return
        rule = ev.rule
        if rule is None:
            return
        ev = _kept(ev)
        if ev.rank is None:
            ukey = (ev.node, ev.file, ev.local_rank, rule)
            uagg = self.unranked.get(ukey)
            if uagg is None:
                if self._room_for(ev):
                    self.unranked[ukey] = Aggregate(first=ev, last_ts=ev.ts)
                    self._count_new(ev)
            else:
                uagg.add(ev)
            return
        track = self._track(ev.node, ev.rank)
        if track is not None:
            track.vote(ev)
        key = (ev.node, ev.rank, rule)
        nr = (ev.node, ev.rank)
        agg = self.aggs.get(key)
        if agg is None:
            if not self._room_for(ev):
                return
            self.rank_events[nr] = self.rank_events.get(nr, 0) + 1
            self.aggs[key] = Aggregate(first=ev, last_ts=ev.ts)
            self._count_new(ev)
            return
        self.rank_events[nr] = self.rank_events.get(nr, 0) + 1
        agg.add(ev)

    def _room_for(self, ev: Event) -> bool:
        """Whether a new aggregate may be kept (see the bounds above); if not, the event is
        counted in `overflow` by rule (the diagnosis says so): a flood of distinct collateral
        cannot push a cause out, nor grow the job without bound."""
        if ev.role in ("root-cause", "symptom"):
            room = self.candidate_aggs < MAX_CANDIDATE_AGGREGATES
        else:
            room = len(self.aggs) + len(self.unranked) - self.candidate_aggs < MAX_OTHER_AGGREGATES
        if not room:
            rule = ev.rule or "?"
            self.overflow[rule] = self.overflow.get(rule, 0) + 1
        return room

    def _count_new(self, ev: Event) -> None:
        if ev.role in ("root-cause", "symptom"):
            self.candidate_aggs += 1
        if SEVERITIES.index(ev.severity or "info") >= ERROR:
            self.failing_aggs += 1

    def add_progress(self, ev: Event) -> None:
        """`add(ev)` for an event known to be of kind "progress" (the bulk of live traffic)."""
        self.events_seen += 1
        step = ev.fields.get("step")
        if not isinstance(step, int):
            return
        if ev.rank is None:
            ukey = (ev.node, ev.file, ev.local_rank)
            track = self.unranked_tracks.get(ukey)
            if track is None:
                track = self.unranked_tracks[ukey] = RankTrack(ev.node, None, self._node(ev.node))
        else:
            track = self.tracks.get((ev.node, ev.rank))
            if track is None:
                track = self._track(ev.node, ev.rank)
                if track is None:
                    return
        track.add(step, ev.ts, ev)

    def _node(self, node: str) -> NodeProgress:
        p = self.progress.get(node)
        if p is None:
            p = self.progress[node] = NodeProgress()
        return p

    def _track(self, node: str, rank: int | None) -> RankTrack | None:
        """The rank's track, made on first sight (None beyond MAX_TRACKS ranks: counted)."""
        t = self.tracks.get((node, rank))
        if t is None:
            if len(self.tracks) >= MAX_TRACKS:
                self.tracks_dropped += 1
                return None
            t = self.tracks[(node, rank)] = RankTrack(node=node, rank=rank, progress=self._node(node))
        return t

    # -- ranks ----------------------------------------------------------------------------------

    def resolve_rank(self, node: str, file: str, local_rank: int | None) -> int | None:
        """The global rank of an event that named none (see the module's docstring)."""
        if local_rank is not None:
            rank = self._by_local(node, local_rank, self.tracks)
            if rank is not None:
                return rank
        by_file = {
            r: t.files[file]
            for (n, r), t in self.tracks.items()
            if n == node and r is not None and file in t.files
        }
        return _dominant(by_file)

    @staticmethod
    def _by_local(node: str, local_rank: int, tracks: dict[tuple[str, int | None], RankTrack]) -> int | None:
        """The global rank the node's events name most often under this local rank."""
        counts = {
            r: t.locals[local_rank]
            for (n, r), t in tracks.items()
            if n == node and r is not None and local_rank in t.locals
        }
        return _most_named(counts)

    def _resolved(
        self,
    ) -> tuple[dict[tuple[str, int | None, str], Aggregate], dict[tuple[str, int | None], RankTrack]]:
        """Aggregates and tracks with the unranked ones given their rank (new objects where
        anything merges; the engine's own state is never changed by a diagnosis)."""
        aggs = self.aggs
        if self.unranked:
            aggs = dict(aggs)
            for (node, file, local, rule), ua in sorted(
                self.unranked.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or -1, kv[0][3])
            ):
                key = (node, self.resolve_rank(node, file, local), rule)
                cur = aggs.get(key)
                aggs[key] = ua if cur is None else cur.merged(ua)
        tracks = self.tracks
        if self.unranked_tracks:
            tracks = dict(tracks)
            copied: set[tuple[str, int | None]] = set()
            for (node, file, local), ut in sorted(
                self.unranked_tracks.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or -1)
            ):
                nr = (node, self.resolve_rank(node, file, local))
                t = tracks.get(nr)
                if nr not in copied:
                    t = tracks[nr] = t.copy() if t is not None else RankTrack(node, nr[1], ut.progress)
                    copied.add(nr)
                assert t is not None
                t.merge(ut)
        return aggs, tracks

    # -- analysis -------------------------------------------------------------------------------

    def nodes(self) -> list[str]:
        return sorted(
            {n for n, _ in self.tracks}
            | {n for n, _, _ in self.aggs}
            | {n for n, _, _, _ in self.unranked}
            | {n for n, _, _ in self.unranked_tracks}
        )

    def clocks(self) -> dict[str, ClockEstimate]:
        curves = {node: p.curve() for node, p in self.progress.items()}
        ref = min((n for (n, r) in self.tracks if r == 0), default=None)
        return align(curves, self.nodes(), reference=ref, agent_offsets=self.agent_offsets, precomputed=True)

    def _rule(self, rule_id: str) -> Rule | None:
        return self.rules.get(rule_id)

    def _global_rank(
        self, node: str, local_rank: int, tracks: dict[tuple[str, int | None], RankTrack]
    ) -> int | None:
        rank = self._by_local(node, local_rank, tracks)
        if rank is not None:
            return rank
        ranks = sorted(r for (n, r) in tracks if n == node and r is not None)
        if local_rank < len(ranks):
            return ranks[local_rank]
        if not ranks and self.nodes() == [node]:
            return local_rank  # a single-node job: its local ranks are its global ranks
        return None

    def diagnose(self) -> dict[str, Any]:
        clocks = self.clocks()
        aggs, tracks = self._resolved()

        def aligned(node: str, ts: float | None) -> float | None:
            return None if ts is None else ts - clocks[node].offset_s if node in clocks else ts

        def sev(agg: Aggregate) -> int:
            return SEVERITIES.index(agg.first.severity or "info")

        failing = [a for a in aggs.values() if sev(a) >= ERROR]
        failure_start = min(
            (t for a in failing if (t := aligned(a.first.node, a.first.ts)) is not None), default=None
        )

        candidates = self._candidates(aggs, tracks, failing, failure_start, aligned)
        tied = 0
        if failing and not candidates:
            candidates, tied = self._hang_suspect(aggs, tracks, aligned)
        ranked = self._rank_candidates(candidates, clocks, tied)
        initiator = ranked[0] if ranked else None
        erring = {(node, rank) for (node, rank, _), a in aggs.items() if rank is not None and sev(a) >= ERROR}
        # the failure every rank shares, when no single rank broke first
        shared = self._job_wide(initiator[0], candidates, ranked, erring, clocks) if initiator else None

        stragglers = self._stragglers(tracks)
        scale_drops = [a for a in aggs.values() if self._is_scale_drop(a)]
        drops = sum(a.count for a in scale_drops)
        cause = shared or (initiator[0] if initiator else None)
        root_cause = self._root_cause(cause.rule, cause.category) if cause else None
        if failing:
            verdict = "failed"
        elif stragglers or drops >= LOSS_SCALE_DROPS_DEGRADED:
            verdict = "degraded"
            if stragglers:
                root_cause = self._root_cause(STRAGGLER_RULE, "dataloader")
            else:
                first = min(scale_drops, key=lambda a: event_order(a.first)).first
                root_cause = self._root_cause(first.rule or "", first.category or "")
        else:
            verdict = "healthy"

        shown = initiator if shared is None else None
        collateral = (
            self._collateral(aggs, shown[0] if shown else None, aligned, shared.rule if shared else None)
            if failing
            else []
        )
        out: dict[str, Any] = {
            "job": self.job,
            "verdict": verdict,
            "initiator": self._candidate_dict(shown) if shown else None,
            "scope": "job" if shared is not None else "rank",
            "root_cause": root_cause,
            "candidates": [self._candidate_dict(c) for c in ranked[:MAX_CANDIDATES_SHOWN]],
            "collateral": collateral,
            "collateral_ranks": sorted({c["rank"] for c in collateral if c["rank"] is not None}),
            "suppressed": sum(c["count"] for c in collateral),
            "clock": {n: c.to_dict() for n, c in sorted(clocks.items())},
            "fingerprints": {"nan": self._nan_fingerprint(aggs, tracks, aligned)},
            "evidence": self._evidence(initiator[0]) if initiator else None,
            "stragglers": stragglers,
            "loss_scale_drops": drops,
            "ranks": self._rank_table(tracks, aligned),
            "stats": {"events": self.events_seen, "aggregates": len(self.aggs) + len(self.unranked)},
        }
        if max(len(ranked), tied) > MAX_CANDIDATES_SHOWN:
            out["candidates_total"] = max(len(ranked), tied)
        if self.overflow or self.tracks_dropped:
            out["overflow"] = {
                "events_not_kept": sum(self.overflow.values()),
                "by_rule": dict(sorted(self.overflow.items())),
                "events_of_ranks_not_followed": self.tracks_dropped,
            }
        return out

    def _job_wide(
        self,
        first: Candidate,
        pool: list[Candidate],
        ranked: list[tuple[Candidate, float]],
        erring: set[tuple[str, int]],
        clocks: dict[str, ClockEstimate],
    ) -> Candidate | None:
        """The failure no single rank broke first by, or None: an event about the job's set-up
        (a rule with `scope = "job"`) among the first rank's events of that moment, or the first
        event's rule logged by (nearly) every rank that logged an error, so close together that
        the clocks cannot order them."""
        if first.kind != "event":
            return None
        mine = [c for c in pool if (c.node, c.rank) == (first.node, first.rank) and c.kind == "event"]
        for c in sorted(mine, key=_candidate_order):  # the first rank's events only, not the pool
            moment = c.aligned is None or (
                first.aligned is not None and c.aligned - first.aligned <= JOB_SCOPE_WINDOW_S
            )
            rule = self._rule(c.rule)
            if moment and rule is not None and rule.scope == "job":
                return c
        same = [c for c, _ in ranked if c.rule == first.rule and c.kind == "event" and c.rank is not None]
        ranks = {(c.node, c.rank) for c in same if c.rank is not None}
        if len(ranks) < 2 or len(ranks) < JOB_SCOPE_SHARE * len(erring | ranks):
            return None
        times = [c.aligned for c in same if c.aligned is not None]
        if not times:
            return first  # nothing tells them apart
        if len(times) < len(same):
            return None  # some have times, some not: the timed ones are not known to be together
        nodes = {c.node for c in same}
        window = max(
            JOB_SCOPE_WINDOW_S,
            2 * max((clocks[n].uncertainty_s for n in nodes if n in clocks), default=0.0),
        )
        return first if max(times) - min(times) <= window else None

    def _candidates(
        self,
        aggs: dict[tuple[str, int | None, str], Aggregate],
        tracks: dict[tuple[str, int | None], RankTrack],
        failing: list[Aggregate],
        failure_start: float | None,
        aligned: Callable[[str, float | None], float | None],
    ) -> list[Candidate]:
        if not failing:
            return []
        root_categories = {a.first.category for a in aggs.values() if a.first.role == "root-cause"}
        pool: list[Candidate] = []
        for (node, rank, _rule), a in aggs.items():
            ev = a.first
            if ev.role not in ("root-cause", "symptom"):
                continue
            if ev.role == "symptom" and root_categories and ev.category not in root_categories:
                continue  # a symptom of another story (e.g. a NET warning before an OOM)
            at = aligned(node, ev.ts)
            if at is not None and failure_start is not None and at < failure_start - self.lookback_s:
                continue
            if rank is None and isinstance(ev.fields.get("local_rank"), int):
                rank = self._global_rank(node, ev.fields["local_rank"], tracks)
            pool.append(Candidate(node, rank, ev.rule or "", ev.category or "", ev.ts, at, ev, "event"))
        if not pool:
            # torchrun saw a worker die by SIGKILL and nothing else names a cause: that worker.
            for a in failing:
                ev = a.first
                f = ev.fields
                if f.get("signal") == 9 or f.get("exitcode") == -9:
                    rank = f.get("culprit_rank")
                    if not isinstance(rank, int) and isinstance(f.get("local_rank"), int):
                        rank = self._global_rank(ev.node, f["local_rank"], tracks)
                    at = aligned(ev.node, ev.ts)
                    pool.append(
                        Candidate(ev.node, rank, KILLED_RULE, "process-killed", ev.ts, at, ev, "killed")
                    )
        return pool

    def _hang_suspect(
        self,
        aggs: dict[tuple[str, int | None, str], Aggregate],
        tracks: dict[tuple[str, int | None], RankTrack],
        aligned: Callable[[str, float | None], float | None],
    ) -> tuple[list[Candidate], int]:
        """No rank names a cause but ranks time out: the rank whose progress stopped first (the
        first MAX_CANDIDATES_SHOWN of those tied, and how many are)."""
        ranks = [t for t in tracks.values() if t.rank is not None]
        if not ranks:
            return [], 0
        loud = {(n, r) for (n, r, _rule), a in aggs.items() if r is not None and a.first.role != "progress"}
        hints: dict[int, int] = {}
        for a in aggs.values():
            cr = a.first.fields.get("culprit_rank")
            if isinstance(cr, int) and a.first.category in ("hang", "communication"):
                hints[cr] = hints.get(cr, 0) + a.count

        def key(t: RankTrack) -> tuple[int, int, int, float, int, str]:
            hinted = -hints.get(t.rank if t.rank is not None else -1, 0)
            silent = 0 if (t.node, t.rank) not in loud else 1
            step = t.last_step if t.last_step is not None else -1
            at = aligned(t.node, t.last_step_ts)
            return (hinted, silent, step, at if at is not None else math.inf, t.rank or 0, t.node)

        keyed = sorted((key(t), i) for i, t in enumerate(ranks))
        best = keyed[0][0][:3]
        tied = [ranks[i] for k, i in keyed if k[:3] == best]
        return [
            Candidate(
                t.node,
                t.rank,
                HANG_RULE,
                "hang",
                t.last_step_ts,
                aligned(t.node, t.last_step_ts),
                t.last_progress,
                "hang",
            )
            for t in tied[:MAX_CANDIDATES_SHOWN]
        ], len(tied)

    def _rank_candidates(
        self, pool: list[Candidate], clocks: dict[str, ClockEstimate], tied: int = 0
    ) -> list[tuple[Candidate, float]]:
        """Earliest candidate per rank, best first (highest confidence, then earliest), each with
        a confidence; the confidences sum to 1."""
        best: dict[tuple[str, int | None], Candidate] = {}
        for c in pool:
            k = (c.node, c.rank)
            cur = best.get(k)
            if cur is None or _candidate_order(c) < _candidate_order(cur):
                best[k] = c
        ordered = sorted(best.values(), key=_candidate_order)
        if not ordered:
            return []
        first = ordered[0]
        if first.kind == "hang":
            share = 1.0 / max(len(ordered), tied)
            return [(c, share) for c in ordered]
        weights = []
        for c in ordered:
            if first.aligned is None:
                # No times to order them by (all are without, as they sort last): alike.
                weights.append(1.0)
                continue
            if c.aligned is None:
                weights.append(0.0)
                continue
            u0 = clocks[first.node].uncertainty_s if first.node in clocks else 0.001
            u1 = clocks[c.node].uncertainty_s if c.node in clocks else 0.001
            sigma = 0.001 if c.node == first.node else max(math.hypot(u0, u1), 0.001)
            weights.append(math.exp(-(c.aligned - first.aligned) / sigma))
        total = sum(weights) or 1.0
        return [(c, w / total) for c, w in zip(ordered, weights, strict=True)]

    def _candidate_dict(self, item: tuple[Candidate, float]) -> dict[str, Any]:
        c, conf = item
        ev = c.event
        text = ev.text if ev is not None else ""
        if c.kind == "hang":
            text = f"rank {c.rank} stopped making progress (last step line: {text.strip()[:300]})"
        return {
            "node": c.node,
            "rank": c.rank,
            "rule": c.rule,
            "category": c.category,
            "time": format_iso(c.aligned) if c.aligned is not None else None,
            "file": ev.file if ev is not None else None,
            "line": ev.line_no if ev is not None else None,
            "text": text,
            "confidence": round(conf, 3),
            "local_time": format_iso(c.ts) if c.ts is not None else None,
            "kind": c.kind,
        }

    def _root_cause(self, rule_id: str, category: str) -> dict[str, Any]:
        """What a rule (or an inferred diagnosis: hang, killed, straggler) says about the cause."""
        found = self.rules.explanation(rule_id)
        if found is None:
            return {
                "rule": rule_id,
                "title": rule_id,
                "category": category,
                "root_cause": "",
                "fix": "",
                "verify": "",
            }
        return {
            "rule": found.id,
            "title": found.title,
            "category": found.category,
            "root_cause": found.root_cause,
            "fix": found.fix,
            "verify": found.verify,
            "references": list(found.references),
        }

    def _collateral(
        self,
        aggs: dict[tuple[str, int | None, str], Aggregate],
        initiator: Candidate | None,
        aligned: Callable[[str, float | None], float | None],
        shared_rule: str | None = None,
    ) -> list[dict[str, Any]]:
        out = []
        for (node, rank, rule_id), a in aggs.items():
            ev = a.first
            if SEVERITIES.index(ev.severity or "info") < WARNING:
                continue
            if rule_id == shared_rule:
                continue  # the failure itself, on every rank: not a consequence of it
            if (
                initiator is not None
                and rank is not None
                and (node, rank) == (initiator.node, initiator.rank)
            ):
                continue
            at = aligned(node, ev.ts)
            out.append(
                {
                    "node": node,
                    "rank": rank,
                    "rule": rule_id,
                    "category": ev.category,
                    "role": ev.role,
                    "first_time": format_iso(at) if at is not None else None,
                    "count": a.count,
                }
            )
        out.sort(
            key=lambda d: (
                d["first_time"] or "~",
                d["node"],
                d["rank"] if d["rank"] is not None else -1,
                d["rule"],
            )
        )
        return out

    def _nan_fingerprint(
        self,
        aggs: dict[tuple[str, int | None, str], Aggregate],
        tracks: dict[tuple[str, int | None], RankTrack],
        aligned: Callable[[str, float | None], float | None],
    ) -> dict[str, Any]:
        per_rank: dict[int, int] = {}
        first: tuple[float, int, str] | None = None
        for (node, rank, rule_id), a in aggs.items():
            rule = self._rule(rule_id)
            if rule is None or rule.fingerprint != "nan" or rank is None:
                continue
            stage = 3 if rule.severity_level >= ERROR else 2
            per_rank[rank] = max(per_rank.get(rank, 0), stage)
            at = aligned(node, a.first.ts)
            if at is not None and (first is None or (at, rank, node) < first):
                first = (at, rank, node)
        for (_node, rank), t in tracks.items():
            if rank is not None and t.last_step is not None:
                per_rank[rank] = max(per_rank.get(rank, 0), 1)
        stage = max(per_rank.values(), default=0)
        return {
            "stage": _STAGES[stage],
            "first_rank": first[1] if first else None,
            "ranks": sorted(r for r, s in per_rank.items() if s >= 2),
            "per_rank": {str(r): _STAGES[s] for r, s in sorted(per_rank.items())},
        }

    def _evidence(self, c: Candidate) -> dict[str, Any] | None:
        ev = c.event
        if ev is None:
            return None
        return {"file": ev.file, "line": ev.line_no, "before": list(ev.context), "text": ev.text}

    def _stragglers(self, tracks: dict[tuple[str, int | None], RankTrack]) -> list[dict[str, Any]]:
        medians = {}
        for k, t in tracks.items():
            values = t.data_times.values() if t.data_times is not None else []
            if len(values) >= 3:
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

    def _is_scale_drop(self, a: Aggregate) -> bool:
        rule = self._rule(a.first.rule or "")
        return (
            rule is not None
            and rule.fingerprint == "nan"
            and rule.severity == "warning"
            and "scale" in rule.id
        )

    def _rank_table(
        self,
        tracks: dict[tuple[str, int | None], RankTrack],
        aligned: Callable[[str, float | None], float | None],
    ) -> list[dict[str, Any]]:
        rows = []
        for (node, rank), t in sorted(
            tracks.items(), key=lambda kv: (kv[0][1] is None, kv[0][1] or 0, kv[0][0])
        ):
            at = aligned(node, t.last_step_ts)
            rows.append(
                {
                    "node": node,
                    "rank": rank,
                    "last_step": t.last_step,
                    "last_step_time": format_iso(at) if at is not None else None,
                    "events": self.rank_events.get((node, rank), 0),
                }
            )
        return rows


def _kept(ev: Event) -> Event:
    """What an aggregate keeps of an event: a cause's or a symptom's whole event (its context is
    the evidence), and a launcher's report of an exit code or signal (it may name a killed
    worker); of other collateral the start of its text and no context (memory: thousands of
    ranks report the same consequence)."""
    if ev.role in ("root-cause", "symptom") or "signal" in ev.fields or "exitcode" in ev.fields:
        return ev
    if not ev.context and len(ev.text) <= KEPT_TEXT:
        return ev
    return dataclasses.replace(ev, text=ev.text[:KEPT_TEXT], context=[])


def _candidate_order(c: Candidate) -> tuple[bool, float, bool, int, str, tuple[bool, float, str, int, str]]:
    """Earliest aligned time first; at equal times a named rank before an unknown one, then by
    rank, node and the event's own order: one rule, whatever the arrival order."""
    ev_key = event_order(c.event) if c.event is not None else (True, 0.0, "", 0, "")
    return (
        c.aligned is None,
        c.aligned if c.aligned is not None else 0.0,
        c.rank is None,
        c.rank if c.rank is not None else 0,
        c.node,
        ev_key,
    )
