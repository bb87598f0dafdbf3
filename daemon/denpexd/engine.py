"""The correlation engine: events of one job in, a diagnosis out (docs/diagnosis-json.md).

Pure and incremental: `Engine.add()` folds each event into bounded per-(node, rank, rule)
aggregates and per-rank progress tracks (`analysis.tracks`); `Engine.diagnose()` can be called at
any time and composes the analyses of `denpexd.analysis` over that state: clock offsets
(`clock`), ranks for unranked events (`ranks`), the initiator and its rivals (`story`), the hang
suspect (`hang`), the job-wide check (`scope`), the collateral, the NaN fingerprint, stragglers,
the evidence and the index of every rule that matched (`matches`). `denpexd diagnose` feeds it
from files and `denpexd serve` from MQTT — the same code either way.

Order does not matter: the state after a set of events is the same whatever order they were
added in (every "first" is the least by `event_order`, every tie has one rule), so the live
daemon, which gets the nodes' events interleaved by the network, and `diagnose`, which reads file
after file, reach the same diagnosis from the same events. Events that name no global rank are
kept apart with their file and local rank and given a rank at each diagnosis (`analysis.ranks`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable
from typing import Any

from denpex_agent.attribution import tee_echo
from denpex_agent.events import Event
from denpex_agent.rules import SEVERITIES, RuleSet
from denpexd.analysis import ranks
from denpexd.analysis.chain import chain
from denpexd.analysis.checkpoint import CHECKPOINT_STALL_RULE, SaveMarks, add_save, checkpoint_stall
from denpexd.analysis.collateral import collateral
from denpexd.analysis.evidence import candidate_dict, evidence, rank_table, root_cause
from denpexd.analysis.fingerprints import LOSS_SCALE_DROPS_DEGRADED, drops_scale, nan_fingerprint, scale_drops
from denpexd.analysis.hang import HANG_RULE, hang_suspect, stopped_rank, unresolved_stalls
from denpexd.analysis.identity import DUPLICATE_RULE, Claims, add_claim, duplicate_ranks
from denpexd.analysis.matches import matches, notices
from denpexd.analysis.quiet import PAUSES, LogTimes, logged_stall, note_log_time, note_pause
from denpexd.analysis.scope import job_wide
from denpexd.analysis.story import (
    KILLED_RULE,
    MAX_CANDIDATES_SHOWN,
    candidates,
    rank_candidates,
    witnessed_rank,
    witnesses,
)
from denpexd.analysis.stragglers import STRAGGLER_RULE, stragglers
from denpexd.analysis.tracks import (
    JOB_SERIES,
    Aggregate,
    Aggregates,
    NodeProgress,
    RankTrack,
    Shared,
    StepFields,
    StepMax,
    aligned_order,
    at_planned_end,
    compact_step,
    event_order,
    share_empties,
)
from denpexd.analysis.trends import scale_fall, step_at, trends
from denpexd.analysis.workers import WorkerPids, note_worker, pid_ranks
from denpexd.clock import ClockEstimate, align
from denpexd.stall import STALL_RULE

ECHO = "\x1fecho"  # the aggregate key suffix of a launcher's echoes of a rule

__all__ = ["HANG_RULE", "KILLED_RULE", "LOOKBACK_S", "STRAGGLER_RULE", "Engine"]

ERROR = SEVERITIES.index("error")
LOOKBACK_S = 300.0
# Bounds of one job's state (a flood of distinct ranks, files or rules cannot grow it further):
MAX_CANDIDATE_AGGREGATES = 16_384  # first events of causes and symptoms (rank, rule)
MAX_OTHER_AGGREGATES = 32_768  # first events of collateral (rank, rule)
MAX_TRACKS = 65_536  # ranks whose progress is followed
MAX_SCALE_LEVELS = 256  # distinct loss scales remembered (halvings give a few dozen)
KEPT_TEXT = 300  # chars of a collateral event's text kept in memory (its context is dropped)


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
        self.marker_rules: set[str] = set()  # the marker rules (pause, end of training) that matched
        self.rank_claims: Claims = {}  # global rank announced at start-up -> who announced it
        self.save_marks: SaveMarks = {}  # each (node, rank)'s newest checkpoint-save announcements
        self.curves: dict[str, StepMax] = {}  # loss, grad norm: the largest value per step
        self.min_scale: float | None = None  # the smallest loss scale any line reported
        self.min_drop: float | None = None  # ... and the smallest one an overflow left
        self.scale_levels: dict[float, Event] = {}  # each loss scale reported -> its first line
        self.log_times: LogTimes = {}  # each node's newest timestamp and quiet_since (heartbeats)
        self.pauses: dict[str, float] = {}  # each node's newest announced pause (evaluation, save)
        self.worker_pids: WorkerPids = {}  # the worker processes launchers listed (analysis.workers)
        self._trend_cache: tuple[Any, list[dict[str, Any]]] | None = None
        self.events_seen = 0
        # rule events per (node, rank) of ranks without a track (their tracks count the others)
        self.rank_events: dict[tuple[str, int | None], int] = {}
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
            if ev.ts.__class__ is float:
                note_log_time(self.log_times, ev.node, ev.ts, ev.fields.get("quiet_since"))
            return
        rule = ev.rule
        if rule is None:
            return
        if ev.role == "marker":  # not failures; `finished` and the duplicate-rank check read them
            self.marker_rules.add(rule)
            announced = ev.fields.get("announced_rank")
            if isinstance(announced, int) and not (ev.local_rank is not None and tee_echo(ev.text)):
                add_claim(self.rank_claims, announced, ev.node, ev.rank, ev.ts)
            marker = self.rules.get(rule)
            if marker is not None and marker.marker == "checkpoint":
                add_save(self.save_marks, _kept(ev))  # its line, not its context
            if marker is not None and marker.marker in PAUSES and ev.ts is not None:
                note_pause(self.pauses, ev.node, ev.ts)
            return
        scale = ev.fields.get("scale")
        if isinstance(scale, float) and math.isfinite(scale):
            self._scale(scale, ev)
        worker = ev.fields.get("worker_pid")
        if worker.__class__ is int:
            note_worker(self.worker_pids, ev.node, ev.file, worker, ev.offset)
        if ev.local_rank is not None and tee_echo(ev.text):
            rule += ECHO  # a launcher's echo of a worker's line: its own aggregate (see _unechoed)
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
        # the track's rank number (equal to the event's): one int object per rank, not one per key
        key = (ev.node, track.rank if track is not None else ev.rank, rule)
        agg = self.aggs.get(key)
        if agg is None:
            if not self._room_for(ev):
                return
            self._count_rank_event(track, ev)
            self.aggs[key] = Aggregate(first=ev, last_ts=ev.ts)
            self._count_new(ev)
            return
        self._count_rank_event(track, ev)
        agg.add(ev)

    def _count_rank_event(self, track: RankTrack | None, ev: Event) -> None:
        """One more rule event of the rank: on its track (beyond MAX_TRACKS, in `rank_events`)."""
        if track is not None:
            track.rule_events += 1
        else:
            nr = (ev.node, ev.rank)
            self.rank_events[nr] = self.rank_events.get(nr, 0) + 1

    def _trends(self) -> list[dict[str, Any]]:
        """`analysis.trends.trends`, recomputed only when a curve or the loss scale changed."""
        key = (tuple((n, c.version) for n, c in sorted(self.curves.items())), self.min_scale, self.min_drop)
        if self._trend_cache is None or self._trend_cache[0] != key:
            self._trend_cache = (key, trends(self.curves, self.min_scale, self.min_drop))
        return [dict(t) for t in self._trend_cache[1]]

    def _scale_levels(
        self, aligned: Callable[[str, float | None], float | None]
    ) -> list[tuple[float, int | None, float]]:
        """Each distinct loss scale's first report: (aligned time, its node's step then, scale), in
        time order (reports without a time are left out)."""
        out = []
        for scale, ev in self.scale_levels.items():
            at = aligned(ev.node, ev.ts)
            if at is None or ev.ts is None:
                continue
            progress = self.progress.get(ev.node)
            out.append((at, step_at(progress.curve(), ev.ts) if progress is not None else None, scale))
        out.sort(key=lambda x: (x[0], -x[2]))
        return out

    def _finished(self, tracks: dict[tuple[str, int | None], RankTrack]) -> bool | None:
        """Whether a rank logged the end of training or its planned last step (None: no rank
        logged a step)."""
        if not tracks:
            return None
        if any(
            t.last_progress is not None
            and t.last_step is not None
            and at_planned_end(t.last_step, t.last_progress.fields)
            for t in tracks.values()
        ):
            return True
        return any(
            (r := self.rules.get(rule_id)) is not None and r.marker == "end" for rule_id in self.marker_rules
        )

    def _scale(self, scale: float, ev: Event) -> None:
        """Keep the smallest loss scale and, per distinct scale (a few dozen powers of two), the
        line that first reported it."""
        if self.min_scale is None or scale < self.min_scale:
            self.min_scale = scale
        if (self.min_drop is None or scale < self.min_drop) and drops_scale(self.rules.get(ev.rule or "")):
            self.min_drop = scale
        old = self.scale_levels.get(scale)
        if old is None:
            if len(self.scale_levels) < MAX_SCALE_LEVELS:
                self.scale_levels[scale] = _kept(ev)
        elif event_order(ev) < event_order(old):
            self.scale_levels[scale] = _kept(ev)

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
        fields = ev.fields
        if "tip" in fields:
            return
        curves = self.curves
        for name in JOB_SERIES:
            v = fields.get(name)
            if v.__class__ is float and -math.inf < v < math.inf:  # finite (NaN compares False)
                curve = curves.get(name)
                if curve is None:
                    curve = curves[name] = StepMax()
                old = curve.by_step.get(step)
                if old is None or v > old:  # most ranks log the value another rank logged already
                    curve.add(step, v)

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

    def compact(self) -> None:
        """Hold less of what the analyses never read, the diagnosis unchanged (`denpexd serve`
        calls it after each diagnosis: a job of thousands of ranks keeps an event or two per
        rank): each rank's newest step line keeps only its step and planned total of its fields;
        kept events share one empty context, one empty fields map, their rank's number and file
        name, and equal texts, times, offsets and line numbers (`analysis.tracks.Shared`:
        thousands of ranks log the same step line or the same consequence)."""
        shared = Shared()
        for (_node, rank), t in self.tracks.items():
            ev = t.last_progress
            if ev is not None and ev.fields.__class__ is not StepFields:
                t.last_progress = compact_step(ev, rank, t.file, shared)
        tracks = self.tracks
        for (node, rank, _rule), agg in self.aggs.items():
            own = tracks.get((node, rank))
            share_empties(agg.first, rank, own.file if own is not None else None, shared)
            agg.last_ts = shared.time(agg.last_ts)

    def track_keys(self) -> dict[tuple[str, int | None], tuple[str, int | None]]:
        """Each rank's track key, by an equal key: what a holder of equal (node, rank) tuples
        needs to hold the engine's instead (the stall watch: one tuple per rank, not two)."""
        return {k: k for k in self.tracks}

    def kept_step(self, ev: Event) -> Event:
        """The step line as its rank's track keeps it, if it is the track's newest (the stall
        watch then holds the same object), else ``ev``."""
        t = self.tracks.get((ev.node, ev.rank)) if ev.rank is not None else None
        kept = t.last_progress if t is not None else None
        return kept if kept is not None and kept.id == ev.id else ev

    # -- ranks ----------------------------------------------------------------------------------

    def resolve_rank(self, node: str, file: str, local_rank: int | None) -> int | None:
        """The global rank of an event that named none (`analysis.ranks.resolve_rank`)."""
        return ranks.resolve_rank(node, file, local_rank, self.tracks)

    # -- diagnosis ------------------------------------------------------------------------------

    def nodes(self) -> list[str]:
        return sorted(
            {n for n, _ in self.tracks}
            | {n for n, _, _ in self.aggs}
            | {n for n, _, _, _ in self.unranked}
            | {n for n, _, _ in self.unranked_tracks}
        )

    def clocks(self, nodes: list[str] | None = None) -> dict[str, ClockEstimate]:
        """Every node's clock estimate (``nodes``: `nodes()`, when the caller has it already)."""
        curves = {node: p.curve() for node, p in self.progress.items()}
        ref = min((n for (n, r) in self.tracks if r == 0), default=None)
        return align(
            curves,
            self.nodes() if nodes is None else nodes,
            reference=ref,
            agent_offsets=self.agent_offsets,
            precomputed=True,
        )

    def diagnose(self) -> dict[str, Any]:
        rules = self.rules
        nodes = self.nodes()
        clocks = self.clocks(nodes)
        given = pid_ranks(self.unranked, self.worker_pids, self.tracks, nodes) if self.worker_pids else None
        aggs, tracks = ranks.resolved(
            self.aggs, self.unranked, self.tracks, self.unranked_tracks, given, nodes
        )
        aggs = _unechoed(aggs)

        def aligned(node: str, ts: float | None) -> float | None:
            return None if ts is None else ts - clocks[node].offset_s if node in clocks else ts

        def sev(agg: Aggregate) -> int:
            return SEVERITIES.index(agg.first.severity or "info")

        failing = [a for a in aggs.values() if sev(a) >= ERROR]
        if not failing:
            # a hang report naming the rank the others wait for, with no step line after it
            failing = unresolved_stalls(aggs, tracks)
        failure_start = min(
            (t for a in failing if (t := aligned(a.first.node, a.first.ts)) is not None), default=None
        )

        weak = functools.partial(_is_fallback, rules)
        generic = functools.partial(_is_generic, rules)
        # asked of a task-naming event only: it looks at every aggregate of a 4,096-rank job
        srun_tasks = functools.cache(functools.partial(ranks.tasks_are_ranks, aggs, tracks))
        pool = candidates(
            aggs,
            tracks,
            failing,
            failure_start,
            aligned,
            lookback_s=self.lookback_s,
            nodes=nodes,
            weak=weak,
            generic=generic,
            srun_tasks=srun_tasks,
        )
        tied = 0
        if failing and not pool:
            pool, tied = hang_suspect(aggs, tracks, aligned)
        if failing and not pool:
            pool = witnesses(failing, tracks, aligned, nodes)
        # every rank an aggregate names has a track (beyond MAX_TRACKS there are many): a second
        # ranked track is a second rank in the logs
        lone = sum(1 for _ in itertools.islice((k for k in tracks if k[1] is not None), 2)) <= 1
        ranked = rank_candidates(pool, clocks, tied, weak=weak, generic=generic, lone=lone)
        initiator = ranked[0] if ranked else None
        if initiator is not None and initiator[0].rank is None and initiator[0].kind == "event":
            rank = witnessed_rank(initiator[0], failing, tracks, aligned, nodes, pool)
            if rank is None:
                rank = stopped_rank(initiator[0], aggs, tracks, aligned)
            if rank is not None:
                initiator = (dataclasses.replace(initiator[0], rank=rank), initiator[1])
                ranked = [initiator, *ranked[1:]]
        erring = {(node, rank) for (node, rank, _), a in aggs.items() if rank is not None and sev(a) >= ERROR}
        # the failure every rank shares, when no single rank broke first
        shared = job_wide(initiator[0], pool, ranked, erring, clocks, rules) if initiator else None

        slow = stragglers(tracks)
        drops_of = scale_drops(aggs, rules)
        drops = sum(a.count for a in drops_of)
        trend = self._trends()
        if not any(t["kind"] == "collapse" for t in trend):
            fall = scale_fall(self._scale_levels(aligned))
            if fall is not None:
                trend.append(fall)
        # many drops are the scaler settling unless the scale's values say otherwise (collapse)
        drops_degrade = drops >= LOSS_SCALE_DROPS_DEGRADED and self.min_scale is None
        cause = shared or (initiator[0] if initiator else None)
        explained = root_cause(rules, cause.rule, cause.category) if cause else None
        # failed, and no rank stands out (every rank only waited, alike): the failure's story,
        # from its earliest error, belongs to the job
        alike = cause is None and bool(failing)
        if alike:
            first_error = min((a.first for a in failing), key=lambda ev: aligned_order(ev, aligned))
            explained = root_cause(rules, first_error.rule or "", first_error.category or "")
        # a loss scale below 1 leaves every step skipped or worthless: the job no longer trains
        collapsed = next((t for t in trend if t["kind"] == "collapse"), None)
        # two processes took the same global rank: the launch itself is wrong, whatever followed
        dups = duplicate_ranks(self.rank_claims, aligned, failure_start)
        finished = self._finished(tracks)
        # no error, but the logs went on long after the last step: stuck without a word
        quiet = (
            logged_stall(
                self.log_times, aligned, (p.curve() for p in self.progress.values()), finished, self.pauses
            )
            if not failing and collapsed is None
            else None
        )
        if dups:
            verdict = "failed"
            explained = root_cause(rules, DUPLICATE_RULE, "configuration")
            shared = initiator = None
        elif failing:
            verdict = "failed"
        elif collapsed is not None:
            verdict = "failed"
            explained = root_cause(rules, collapsed["rule"], "numerical-instability")
        elif quiet is not None:
            verdict = "failed"
            explained = root_cause(rules, STALL_RULE, "hang")
            # the rank whose progress stopped at an earlier step than the others', if one did (as
            # for a hang that timed out); ranks that all stopped alike name nobody
            stalled, tied = hang_suspect(aggs, tracks, aligned)
            ranked = rank_candidates(stalled, clocks, tied, weak=weak, generic=generic)
            initiator = ranked[0] if ranked else None
        elif slow or trend or drops_degrade:
            verdict = "degraded"
            if trend:
                explained = root_cause(rules, trend[0]["rule"], "numerical-instability")
            elif slow:
                explained = root_cause(rules, slow[0]["rule"], "dataloader")
            else:
                first = min(drops_of, key=lambda a: event_order(a.first)).first
                explained = root_cause(rules, first.rule or "", first.category or "")
        else:
            verdict = "healthy"
        # a hang whose stuck collective began as a rank went to write a checkpoint: the write held it
        ckpt = None
        if (
            verdict == "failed"
            and explained is not None
            and explained["category"] == "hang"
            and self.save_marks
        ):
            spread = max((c.uncertainty_s for c in clocks.values()), default=0.0)
            ckpt = checkpoint_stall(self.save_marks, aggs, tracks, aligned, spread)
            if ckpt is not None:
                explained = root_cause(rules, CHECKPOINT_STALL_RULE, "checkpoint-io")
                if initiator is not None:
                    lead, conf = initiator
                    if lead.kind == "hang" and (lead.node, lead.rank) == (ckpt["node"], ckpt["rank"]):
                        # the rank that stopped first is the writer: its story is the write, not a hang
                        fixed = dataclasses.replace(
                            lead, rule=CHECKPOINT_STALL_RULE, category="checkpoint-io"
                        )
                        initiator = (fixed, conf)
                        ranked = [initiator, *ranked[1:]]

        shown = initiator if shared is None else None
        found = matches(aggs, aligned)
        rows = (
            collateral(aggs, shown[0] if shown else None, aligned, shared.rule if shared else None)
            if failing
            else []
        )
        job_scope = (
            shared is not None
            or alike
            or bool(dups)
            or (not failing and (collapsed is not None or (quiet is not None and initiator is None)))
        )
        out: dict[str, Any] = {
            "job": self.job,
            "verdict": verdict,
            "initiator": candidate_dict(shown) if shown else None,
            "scope": "job" if job_scope else "rank",
            "root_cause": explained,
            "candidates": [candidate_dict(c) for c in ranked[:MAX_CANDIDATES_SHOWN]],
            "collateral": rows,
            "collateral_ranks": sorted({c["rank"] for c in rows if c["rank"] is not None}),
            "suppressed": sum(c["count"] for c in rows),
            "clock": {n: c.to_dict() for n, c in sorted(clocks.items())},
            "fingerprints": {"nan": nan_fingerprint(aggs, tracks, aligned, rules)},
            "evidence": evidence(initiator[0]) if initiator else None,
            "duplicate_ranks": dups,
            "checkpoint_stall": ckpt,
            "logged_stall": quiet,
            "chain": chain(shown[0], aggs, aligned, self.progress) if shown else None,
            "stragglers": slow,
            "trends": trend,
            "finished": finished,
            "loss_scale_drops": drops,
            "loss_scale_min": self.min_scale,
            "ranks": rank_table(tracks, aligned, self.rank_events),
            "matches": found,
            "notices": notices(found, rules),
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


def _unechoed(aggs: Aggregates) -> Aggregates:
    """A launcher's echo of a worker's line (torchrun --tee's ``[defaultN]:`` copy) is the
    worker's event, once: where the worker's own file gave the same rule on the same rank, that
    aggregate stands (its first line is the worker's own) and counts the larger of the two;
    echoes of lines only the launcher's log holds stand for them. Decided on the whole set of
    events, so in any order."""
    if not any(rule.endswith(ECHO) for _n, _r, rule in aggs):
        return aggs
    out: Aggregates = {k: a for k, a in aggs.items() if not k[2].endswith(ECHO)}
    for (node, rank, rule), echo in sorted(
        ((k, a) for k, a in aggs.items() if k[2].endswith(ECHO)),
        key=lambda kv: (kv[0][0], kv[0][1] is None, kv[0][1] or 0, kv[0][2]),
    ):
        key = (node, rank, rule[: -len(ECHO)])
        own = out.get(key)
        out[key] = echo if own is None else Aggregate(own.first, max(own.count, echo.count), own.last_ts)
    return out


def _is_generic(rules: RuleSet, rule_id: str) -> bool:
    """A traceback whose exception no rule classifies (the traceback rule itself)."""
    rule = rules.get(rule_id)
    return rule is not None and rule.fold == "python-traceback"


def _is_fallback(rules: RuleSet, rule_id: str) -> bool:
    rule = rules.get(rule_id)
    return rule is not None and rule.fallback


def carried(ev: Event) -> Event:
    """An event without what `Engine.add` would drop unread: the context of a match whose
    aggregate keeps none (see `_kept`; the text stays whole, `add` reads it first). `diagnose -j N`
    workers send events in this form: a tenth of the bytes, the same diagnosis."""
    if ev.kind != "match" or not ev.context or may_initiate(ev):
        return ev
    return ev.but(context=[])


def keeps_context(role: str | None, fields: dict[str, Any]) -> bool:
    """Whether the engine keeps a match event's context (see `_kept`), by its role and fields:
    `diagnose` asks the reader for no other context."""
    return role in ("root-cause", "symptom") or "signal" in fields or "exitcode" in fields


def may_initiate(ev: Event) -> bool:
    """Whether an event may be the initiator's own (a cause, a symptom, or a launcher's report of
    an exit code or signal), the events the engine keeps whole; the other initiators are inferred
    (a hang, a stall) and have none."""
    return keeps_context(ev.role, ev.fields)


def _kept(ev: Event) -> Event:
    """What an aggregate keeps of an event: a cause's or a symptom's whole event (its context is
    the evidence), and a launcher's report of an exit code or signal (it may name a killed
    worker); of other collateral the start of its text and no context (memory: thousands of
    ranks report the same consequence)."""
    if may_initiate(ev):
        return ev
    if not ev.context and len(ev.text) <= KEPT_TEXT:
        return ev
    return ev.but(text=ev.text[:KEPT_TEXT], context=[])
