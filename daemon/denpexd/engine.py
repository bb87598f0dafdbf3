"""The correlation engine: events of one job in, a diagnosis out (DESIGN §6, §7).

Pure and incremental: `Engine.add()` folds each event into bounded per-(node, rank, rule)
aggregates and per-rank progress tracks; `Engine.diagnose()` can be called at any time and
computes clock offsets, the initiator and its rivals, the hang suspect, the collateral, the NaN
fingerprint and the evidence from those aggregates. `denpexd diagnose` feeds it from files and
`denpexd serve` from MQTT — the same code either way, so the two agree by construction.
"""

from __future__ import annotations

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

_STAGES = ("none", "info", "warn", "error")

# Thousands of ranks share a handful of step and failure times: format each distinct time once.
format_iso = functools.lru_cache(maxsize=65_536)(_format_iso)


@dataclass(slots=True)
class Aggregate:
    """The first event of one rule on one rank, and how often it recurred."""

    first: Event
    count: int = 1
    last_ts: float | None = None
    seq: int = 0  # arrival order of `first`, the tie-break when times are unknown


class NodeProgress:
    """One node's progress samples, pooled over its ranks: step -> local times (one per sample).

    Clock alignment only needs the node's curve (the median time per step over its ranks), so
    samples are kept per node, not per rank: memory grows with nodes and steps, bounded to
    `MAX_SAMPLES` steps per node (beyond that every other step is dropped and only steps that are
    multiples of the doubled stride are taken). The curve is cached until the node changes.
    """

    __slots__ = ("_curve", "by_step", "stride")

    def __init__(self) -> None:
        self.by_step: dict[int, array[float]] = {}
        self.stride = 1
        self._curve: list[tuple[int, float]] | None = None

    def add(self, step: int, ts: float) -> None:
        times = self.by_step.get(step)
        if times is None:
            if step % self.stride:
                return
            times = self.by_step[step] = array("d")
            if len(self.by_step) > MAX_SAMPLES:
                self._thin()
                times = self.by_step.get(step)
                if times is None:
                    return
        times.append(ts)
        self._curve = None

    def _thin(self) -> None:
        self.stride *= 2
        steps = sorted(self.by_step)
        self.by_step = {s: self.by_step[s] for s in steps[::2]}

    def samples(self) -> list[tuple[int, float]]:
        return [(s, t) for s, times in self.by_step.items() for t in times]

    def curve(self) -> list[tuple[int, float]]:
        """The node's curve, as `clock.node_curve` computes it from `samples()`."""
        if self._curve is None:
            self._curve = [(s, statistics.median(self.by_step[s])) for s in sorted(self.by_step)]
        return self._curve


@dataclass(slots=True)
class RankTrack:
    """What hang detection, stragglers and the rank table need of one rank (no sample history)."""

    node: str
    rank: int | None
    progress: NodeProgress
    last_step: int | None = None
    last_step_ts: float | None = None
    last_progress: Event | None = None
    data_times: array[float] = field(default_factory=lambda: array("d"))

    @property
    def samples(self) -> list[tuple[int, float]]:
        """The node curve this rank's samples feed (its own samples are not kept)."""
        return self.progress.curve()

    def add(self, step: int, ts: float | None, ev: Event) -> None:
        if self.last_step is None or step >= self.last_step:
            self.last_step, self.last_step_ts, self.last_progress = step, ts, ev
        elif ev.fields.get("last") and self.last_progress is not None:
            self.last_progress.context = ev.context or self.last_progress.context
        if ts is None:
            return
        self.progress.add(step, ts)
        dt = ev.fields.get("data_time")
        if (
            dt is not None
            and isinstance(dt, (int, float))
            and math.isfinite(dt)
            and len(self.data_times) < MAX_DATA_TIMES
        ):
            self.data_times.append(float(dt))


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
        self.tracks: dict[tuple[str, int | None], RankTrack] = {}
        self.progress: dict[str, NodeProgress] = {}  # node -> its ranks' pooled progress samples
        self.local_ranks: dict[tuple[str, int], int] = {}  # (node, local_rank) -> global rank
        self.agent_offsets: dict[str, tuple[float, float]] = {}
        self.events_seen = 0
        self.rank_events: dict[tuple[str, int | None], int] = {}  # rule events per (node, rank)
        self.failing_aggs = 0  # aggregates whose first event is an error or worse
        self.candidate_aggs = 0  # aggregates whose first event may name the initiator
        self._seq = 0

    # -- input ----------------------------------------------------------------------------------

    def add(self, ev: Event, *, place: bool = True) -> None:
        """Fold one event in. With `place=False` (a match event fed ahead of the events queued
        before it, see `denpexd.jobs`), what depends on arrival order among all kinds (the
        local-rank map and the order in which rank tracks appear) is left to `place(ev)`, which
        the caller runs at the event's original position; the end state is then the same as if
        every event had been added in arrival order."""
        if place and ev.kind == "progress":
            self.add_progress(ev)
            return
        self.events_seen += 1
        self._seq += 1
        if place and ev.rank is not None and ev.local_rank is not None:
            self.local_ranks[(ev.node, ev.local_rank)] = ev.rank
        if ev.kind == "heartbeat":
            off = ev.fields.get("clock_offset_s")
            unc = ev.fields.get("clock_uncertainty_s")
            if isinstance(off, (int, float)) and isinstance(unc, (int, float)):
                # the agent reports daemon-minus-agent; a node's offset is local-minus-reference
                self.agent_offsets[ev.node] = (-float(off), float(unc))
            return
        if ev.kind == "progress":
            self._add_step(ev)
            return
        if ev.rule is None:
            return
        if place and ev.rank is not None:
            self._track(ev.node, ev.rank)
        key = (ev.node, ev.rank, ev.rule)
        nr = (ev.node, ev.rank)
        self.rank_events[nr] = self.rank_events.get(nr, 0) + 1
        agg = self.aggs.get(key)
        if agg is None:
            self.aggs[key] = Aggregate(first=ev, last_ts=ev.ts, seq=self._seq)
            if ev.role in ("root-cause", "symptom"):
                self.candidate_aggs += 1
            if SEVERITIES.index(ev.severity or "info") >= ERROR:
                self.failing_aggs += 1
            return
        agg.count += 1
        if ev.ts is not None and (agg.last_ts is None or ev.ts > agg.last_ts):
            agg.last_ts = ev.ts
        if ev.ts is not None and (agg.first.ts is None or ev.ts < agg.first.ts):
            agg.first, agg.seq = ev, self._seq

    def add_progress(self, ev: Event) -> None:
        """`add(ev)` for an event known to be of kind "progress" (the bulk of live traffic)."""
        self.events_seen += 1
        self._seq += 1
        if ev.rank is not None and ev.local_rank is not None:
            self.local_ranks[(ev.node, ev.local_rank)] = ev.rank
        self._add_step(ev)

    def _add_step(self, ev: Event) -> None:
        step = ev.fields.get("step")
        if isinstance(step, int):
            track = self.tracks.get((ev.node, ev.rank))
            if track is None:
                track = self._track(ev.node, ev.rank)
            track.add(step, ev.ts, ev)

    def place(self, ev: Event) -> None:
        """The order-dependent part of `add(ev, place=False)`, run at the event's arrival position."""
        if ev.rank is not None and ev.local_rank is not None:
            self.local_ranks[(ev.node, ev.local_rank)] = ev.rank
        if ev.kind == "match" and ev.rule is not None and ev.rank is not None:
            self._track(ev.node, ev.rank)

    def _track(self, node: str, rank: int | None) -> RankTrack:
        t = self.tracks.get((node, rank))
        if t is None:
            p = self.progress.get(node)
            if p is None:
                p = self.progress[node] = NodeProgress()
            t = self.tracks[(node, rank)] = RankTrack(node=node, rank=rank, progress=p)
        return t

    # -- analysis -------------------------------------------------------------------------------

    def nodes(self) -> list[str]:
        return sorted({n for n, _ in self.tracks} | {n for n, _, _ in self.aggs})

    def clocks(self) -> dict[str, ClockEstimate]:
        curves = {node: p.curve() for node, p in self.progress.items()}
        ref = next(
            (n for (n, r) in sorted(self.tracks, key=lambda k: (k[1] is None, k[1] or 0)) if r == 0), None
        )
        return align(curves, self.nodes(), reference=ref, agent_offsets=self.agent_offsets, precomputed=True)

    def _rule(self, rule_id: str) -> Rule | None:
        return self.rules.get(rule_id)

    def _global_rank(self, node: str, local_rank: int) -> int | None:
        if (node, local_rank) in self.local_ranks:
            return self.local_ranks[(node, local_rank)]
        ranks = sorted(r for (n, r) in self.tracks if n == node and r is not None)
        if local_rank < len(ranks):
            return ranks[local_rank]
        return None

    def diagnose(self) -> dict[str, Any]:
        clocks = self.clocks()

        def aligned(node: str, ts: float | None) -> float | None:
            return None if ts is None else ts - clocks[node].offset_s if node in clocks else ts

        def sev(agg: Aggregate) -> int:
            return SEVERITIES.index(agg.first.severity or "info")

        failing = [a for a in self.aggs.values() if sev(a) >= ERROR]
        failure_start = min(
            (t for a in failing if (t := aligned(a.first.node, a.first.ts)) is not None), default=None
        )

        candidates = self._candidates(failing, failure_start, aligned)
        hang = None
        if failing and not candidates:
            hang = self._hang_suspect(aligned)
            if hang is not None:
                candidates = hang
        ranked = self._rank_candidates(candidates, clocks)
        initiator = ranked[0] if ranked else None

        stragglers = self._stragglers()
        scale_drops = sum(a.count for a in self.aggs.values() if self._is_scale_drop(a))
        if failing:
            verdict = "failed"
        elif stragglers or scale_drops >= LOSS_SCALE_DROPS_DEGRADED:
            verdict = "degraded"
        else:
            verdict = "healthy"

        collateral = self._collateral(initiator[0] if initiator else None, aligned) if failing else []
        out: dict[str, Any] = {
            "job": self.job,
            "verdict": verdict,
            "initiator": self._candidate_dict(initiator) if initiator else None,
            "root_cause": self._root_cause(initiator[0]) if initiator else None,
            "candidates": [self._candidate_dict(c) for c in ranked],
            "collateral": collateral,
            "collateral_ranks": sorted({c["rank"] for c in collateral if c["rank"] is not None}),
            "suppressed": sum(c["count"] for c in collateral),
            "clock": {n: c.to_dict() for n, c in sorted(clocks.items())},
            "fingerprints": {"nan": self._nan_fingerprint(aligned)},
            "evidence": self._evidence(initiator[0]) if initiator else None,
            "stragglers": stragglers,
            "loss_scale_drops": scale_drops,
            "ranks": self._rank_table(aligned),
            "stats": {"events": self.events_seen, "aggregates": len(self.aggs)},
        }
        return out

    def _candidates(
        self,
        failing: list[Aggregate],
        failure_start: float | None,
        aligned: Callable[[str, float | None], float | None],
    ) -> list[Candidate]:
        if not failing:
            return []
        roots = [a for a in self.aggs.values() if a.first.role == "root-cause"]
        root_categories = {a.first.category for a in roots}
        pool: list[Candidate] = []
        for a in self.aggs.values():
            ev = a.first
            if ev.role not in ("root-cause", "symptom"):
                continue
            if ev.role == "symptom" and root_categories and ev.category not in root_categories:
                continue  # a symptom of another story (e.g. a NET warning before an OOM)
            at = aligned(ev.node, ev.ts)
            if at is not None and failure_start is not None and at < failure_start - self.lookback_s:
                continue
            rank = ev.rank
            kind = "event"
            if rank is None and isinstance(ev.fields.get("local_rank"), int):
                rank = self._global_rank(ev.node, ev.fields["local_rank"])
            pool.append(Candidate(ev.node, rank, ev.rule or "", ev.category or "", ev.ts, at, ev, kind))
        if not pool:
            # torchrun saw a worker die by SIGKILL and nothing else names a cause: that worker.
            for a in failing:
                f = a.first.fields
                if f.get("signal") == 9 or f.get("exitcode") == -9:
                    rank = f.get("culprit_rank")
                    if not isinstance(rank, int) and isinstance(f.get("local_rank"), int):
                        rank = self._global_rank(a.first.node, f["local_rank"])
                    ev = a.first
                    pool.append(
                        Candidate(
                            ev.node,
                            rank,
                            KILLED_RULE,
                            "process-killed",
                            ev.ts,
                            aligned(ev.node, ev.ts),
                            ev,
                            "killed",
                        )
                    )
        return pool

    def _hang_suspect(self, aligned: Callable[[str, float | None], float | None]) -> list[Candidate] | None:
        """No rank names a cause but ranks time out: the rank whose progress stopped first."""
        ranks = [t for t in self.tracks.values() if t.rank is not None]
        if not ranks:
            return None
        loud = {
            (n, r) for (n, r, _rule), a in self.aggs.items() if r is not None and a.first.role != "progress"
        }
        hints: dict[int, int] = {}
        for a in self.aggs.values():
            cr = a.first.fields.get("culprit_rank")
            if isinstance(cr, int) and a.first.category in ("hang", "communication"):
                hints[cr] = hints.get(cr, 0) + a.count

        def key(t: RankTrack) -> tuple[int, int, int, float]:
            hinted = -hints.get(t.rank or -1, 0)
            silent = 0 if (t.node, t.rank) not in loud else 1
            step = t.last_step if t.last_step is not None else -1
            at = aligned(t.node, t.last_step_ts)
            return (hinted, silent, step, at if at is not None else math.inf)

        ordered = sorted(ranks, key=key)
        best = key(ordered[0])
        tied = [t for t in ordered if key(t)[:3] == best[:3]]
        out = []
        for t in tied:
            ev = t.last_progress
            out.append(
                Candidate(
                    t.node,
                    t.rank,
                    HANG_RULE,
                    "hang",
                    t.last_step_ts,
                    aligned(t.node, t.last_step_ts),
                    ev,
                    "hang",
                )
            )
        return out

    def _rank_candidates(
        self, pool: list[Candidate], clocks: dict[str, ClockEstimate]
    ) -> list[tuple[Candidate, float]]:
        """Earliest candidate per rank, best first, each with a confidence that sums to 1."""
        best: dict[tuple[str, int | None], Candidate] = {}
        for c in pool:
            k = (c.node, c.rank)
            cur = best.get(k)
            if cur is None or _before(c, cur):
                best[k] = c
        ordered = sorted(best.values(), key=_time_key)
        if not ordered:
            return []
        first = ordered[0]
        if first.kind == "hang":
            share = 1.0 / len(ordered)
            return [(c, share) for c in ordered]
        weights = []
        for c in ordered:
            if c.aligned is None or first.aligned is None:
                weights.append(0.0 if c is not first else 1.0)
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

    def _root_cause(self, c: Candidate) -> dict[str, Any]:
        rule = self._rule(c.rule)
        if rule is None:
            return {
                "rule": c.rule,
                "title": c.rule,
                "category": c.category,
                "root_cause": "",
                "fix": "",
                "verify": "",
            }
        return {
            "rule": rule.id,
            "title": rule.title,
            "category": rule.category,
            "root_cause": rule.root_cause,
            "fix": rule.fix,
            "verify": rule.verify,
            "references": list(rule.references),
        }

    def _collateral(
        self, initiator: Candidate | None, aligned: Callable[[str, float | None], float | None]
    ) -> list[dict[str, Any]]:
        out = []
        for (node, rank, rule_id), a in self.aggs.items():
            ev = a.first
            if SEVERITIES.index(ev.severity or "info") < WARNING:
                continue
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

    def _nan_fingerprint(self, aligned: Callable[[str, float | None], float | None]) -> dict[str, Any]:
        per_rank: dict[int, int] = {}
        first: tuple[float, int] | None = None
        for (node, rank, rule_id), a in self.aggs.items():
            rule = self._rule(rule_id)
            if rule is None or rule.fingerprint != "nan" or rank is None:
                continue
            stage = 3 if rule.severity_level >= ERROR else 2
            per_rank[rank] = max(per_rank.get(rank, 0), stage)
            at = aligned(node, a.first.ts)
            if at is not None and (first is None or at < first[0]):
                first = (at, rank)
        for (_node, rank), t in self.tracks.items():
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

    def _stragglers(self) -> list[dict[str, Any]]:
        medians = {
            k: statistics.median(t.data_times) for k, t in self.tracks.items() if len(t.data_times) >= 3
        }
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

    def _rank_table(self, aligned: Callable[[str, float | None], float | None]) -> list[dict[str, Any]]:
        rows = []
        for (node, rank), t in sorted(
            self.tracks.items(), key=lambda kv: (kv[0][1] is None, kv[0][1] or 0, kv[0][0])
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


def _time_key(c: Candidate) -> tuple[int, float, int]:
    return (0, c.aligned, 0) if c.aligned is not None else (1, 0.0, 0)


def _before(a: Candidate, b: Candidate) -> bool:
    return _time_key(a) < _time_key(b)
