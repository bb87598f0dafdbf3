"""Which rank broke first: the candidates, their order and their confidence.

The rule of choice:

1. Candidates are the first event of every (rank, rule) whose rule is a root cause or a symptom,
   except symptoms of a category no root cause of the job has (a NET warning before an OOM is
   another story), and events more than the look-back before the failure's start (the earliest
   error, on the reference clock). An event naming only a local rank is given its global rank
   (`ranks.global_rank`); one naming only srun's task number, that task's rank when srun started
   the ranks itself (`ranks.tasks_are_ranks`).
2. Without any, torchrun's report of a worker killed by SIGKILL names that worker (`killed`).
3. Without any and with something failed, the engine asks `hang.hang_suspect` for the rank
   whose progress stopped first (`hang`), when there is evidence for one.
4. Without a suspect, the launcher is the witness (`witnesses`): the worker its report of an
   exit names (`witness`).
5. Each rank is represented by its earliest candidate, and ranks are ordered by
   `candidate_order`: aligned time (unknown last), a named rank before an unknown one, then rank,
   node and the event's own order. The first is the initiator.
6. Confidence: each rank weighs exp(-Δt / σ), Δt its lag behind the first and σ the two nodes'
   combined clock uncertainty (1 ms on the same node, at least 1 ms); a rank without a time
   weighs 0 (all alike when the first has none either); the weights are normalised to sum to 1.
   Hang suspects share it equally among all those tied. A first candidate whose rule is a
   vocabulary fallback is trusted at most WEAK_CONFIDENCE; so is the first of a job in whose logs
   no other rank shows at all (`LONE_CONFIDENCE`): "first" needs others to be first before, and a
   log that holds one rank's lines cannot tell its failure from every rank's alike.

A generic traceback (an exception no rule classifies) tells no story: it does not make other
stories' symptoms "another story" (step 1), and a rank's specific candidate represents the rank
before its generic one, whichever came first (step 5). One cut off before its exception line
whose rank is unknown is no candidate at all: it names neither a story nor a rank (it still
counts as a failure).

`scope.job_wide` then decides whether the failure belongs to the job rather than to that rank.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from denpex_agent.events import Event
from denpexd.analysis.ranks import global_rank
from denpexd.analysis.tracks import Aggregate, Aggregates, Aligned, TrackKey, Tracks, event_order
from denpexd.clock import ClockEstimate

# A frame of a launcher's own code: a traceback through it is the launcher's (raising its
# ChildFailedError after the workers failed), not a worker's.
LAUNCHER_FRAME = re.compile(
    r'File "[^"]*(?:/bin/(?:torchrun|accelerate|deepspeed)"|torch/distributed/(?:run|launch)\.py"'
    r'|torch/distributed/launcher/api\.py"|torch/distributed/elastic/agent/|deepspeed/launcher/'
    r"|accelerate/commands/)"
)
KILLED_RULE = "torchrun-worker-sigkill"
# A hang suspect known only by its absence from the logs (`hang._absent`), trusted at most
# ABSENT_CONFIDENCE: its lines may just be missing.
ABSENT_RULE = "hang-rank-never-heard-from"
ABSENT_CONFIDENCE = 0.5
WITNESS_RULE = "launcher-worker-failed-first"
MAX_CANDIDATES_SHOWN = 64  # candidates listed in a diagnosis (best first)
# The most a rank named by a vocabulary fallback alone (a WARN line in the training code's own
# words that no signature knows) is trusted, however far ahead of the others it is.
WEAK_CONFIDENCE = 0.5
LONE_CONFIDENCE = 0.5  # the most a rank is trusted to be first when no other rank shows


@dataclass(frozen=True, slots=True)
class Candidate:
    node: str
    rank: int | None
    rule: str
    category: str
    ts: float | None
    aligned: float | None
    event: Event | None
    kind: str  # event | hang | killed | witness


def candidate_order(c: Candidate) -> tuple[bool, float, bool, int, str, tuple[bool, float, str, int, str]]:
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


def candidates(
    aggs: Aggregates,
    tracks: Tracks,
    failing: list[Aggregate],
    failure_start: float | None,
    aligned: Aligned,
    *,
    lookback_s: float,
    nodes: list[str],
    weak: Callable[[str], bool] | None = None,
    generic: Callable[[str], bool] | None = None,
    srun_tasks: Callable[[], bool] | None = None,
) -> list[Candidate]:
    """Steps 1 and 2 above: every candidate (not yet one per rank), or none when nothing failed.
    ``nodes`` are all the job's nodes (a job of one node takes local ranks as global ranks);
    ``srun_tasks``: whether srun's task numbers are global ranks (`ranks.tasks_are_ranks`), asked
    only of an event that names a task and no rank (the answer looks at every aggregate)."""
    if not failing:
        return []
    # the failure's stories: the categories of its root causes; a generic traceback (an exception
    # no rule knows) tells no story of its own, so with only those any story's symptom may count
    roots = [a.first for a in aggs.values() if a.first.role == "root-cause"]
    root_categories = {e.category for e in roots if generic is None or not generic(e.rule or "")}
    # the ranks that reported their failure in words a rule knows (an error, a watchdog's timeout)
    told = (
        {(a.first.node, a.first.rank) for a in failing if not generic(a.first.rule or "")}
        if generic is not None
        else set()
    )
    pool: list[Candidate] = []
    for (node, rank, _rule), a in aggs.items():
        ev = a.first
        if ev.role not in ("root-cause", "symptom"):
            continue
        if ev.role == "symptom" and root_categories and ev.category not in root_categories:
            continue  # a symptom of another story (e.g. a NET warning before an OOM)
        at = aligned(node, ev.ts)
        if at is not None and failure_start is not None and at < failure_start - lookback_s:
            continue
        if rank is None and isinstance(ev.fields.get("local_rank"), int):
            rank = global_rank(node, ev.fields["local_rank"], tracks, nodes)
        if (
            rank is None
            and isinstance(ev.fields.get("task"), int)
            and srun_tasks is not None
            and srun_tasks()
        ):
            rank = ev.fields["task"]  # srun's report of the task it lost, srun starting the ranks
        if rank is None and weak is not None and weak(ev.rule or ""):
            continue  # a vocabulary line of nobody's rank (a launcher's report of it) names nobody
        if generic is not None and generic(ev.rule or ""):
            if LAUNCHER_FRAME.search(ev.text):
                continue  # the launcher's own traceback after its workers failed: collateral
            if "exception" not in ev.fields and (rank is None or (node, rank) in told):
                # cut off before its exception line: an exception was raised, which one is lost.
                # In nobody's stream it names nothing; on a rank that reported its failure in
                # words a rule knows (a watchdog's timeout) it is more likely that failure's own
                # traceback than a story of user code.
                continue
        pool.append(Candidate(node, rank, ev.rule or "", ev.category or "", ev.ts, at, ev, "event"))
    if not pool and not any(names_culprit(a.first) for a in failing):
        # torchrun saw a worker die by SIGKILL and nothing else names a cause: that worker. A
        # peer's report naming the rank it lost is evidence of who failed first, a launcher's
        # report of a worker it killed is not, then: the hang analysis weighs the named rank.
        for a in failing:
            ev = a.first
            f = ev.fields
            if f.get("signal") == 9 or f.get("exitcode") == -9:
                rank = f.get("culprit_rank")
                if not isinstance(rank, int) and isinstance(f.get("local_rank"), int):
                    rank = global_rank(ev.node, f["local_rank"], tracks, nodes)
                at = aligned(ev.node, ev.ts)
                pool.append(Candidate(ev.node, rank, KILLED_RULE, "process-killed", ev.ts, at, ev, "killed"))
    return pool


def witnessed_rank(
    lead: Candidate,
    failing: list[Aggregate],
    tracks: Tracks,
    aligned: Aligned,
    nodes: list[str],
    pool: Sequence[Candidate] = (),
) -> int | None:
    """The rank of a first failure that names none (an unprefixed traceback in a stream several
    workers share; slurmstepd's report of an OOM kill in the step): the worker its node's
    launcher reports as failed, when it reports exactly one (torchrun's `failed (exitcode: 1)
    local_rank: 0`, its summary's root cause); else the one rank that the node's other candidates
    of the same story name (srun's `task 3: Out Of Memory` beside slurmstepd's report)."""
    named = {c.rank for c in witnesses(failing, tracks, aligned, nodes) if c.node == lead.node}
    if not named:
        named = {
            c.rank for c in pool if c.rank is not None and c.node == lead.node and c.category == lead.category
        }
    return named.pop() if len(named) == 1 else None


def names_culprit(ev: Event) -> bool:
    """A hang or communication report that names the rank the others waited for or lost."""
    return isinstance(ev.fields.get("culprit_rank"), int) and ev.category in ("hang", "communication")


def witnesses(
    failing: list[Aggregate], tracks: Tracks, aligned: Aligned, nodes: list[str]
) -> list[Candidate]:
    """Step 4: nothing else points at a rank, and a launcher's report of a worker's exit (an exit
    code or the signal that ended it, with the worker's rank or local rank) is all there is: the
    worker it names first."""
    pool: list[Candidate] = []
    for a in failing:
        ev = a.first
        f = ev.fields
        if not isinstance(f.get("exitcode"), int) and not isinstance(f.get("signal"), int):
            continue
        rank = f.get("culprit_rank")
        if not isinstance(rank, int) and isinstance(f.get("local_rank"), int):
            rank = global_rank(ev.node, f["local_rank"], tracks, nodes)
        if isinstance(rank, int):
            at = aligned(ev.node, ev.ts)
            pool.append(
                Candidate(ev.node, rank, WITNESS_RULE, "user-code-exception", ev.ts, at, ev, "witness")
            )
    return pool


def rank_candidates(
    pool: list[Candidate],
    clocks: dict[str, ClockEstimate],
    tied: int = 0,
    weak: Callable[[str], bool] | None = None,
    generic: Callable[[str], bool] | None = None,
    lone: bool = False,
) -> list[tuple[Candidate, float]]:
    """Steps 5 and 6 above: the earliest candidate per rank, best first (highest confidence, then
    earliest), each with a confidence; the confidences sum to 1 (at most, when capped).
    ``tied``: how many hang suspects are tied when only the first of them are in ``pool``;
    ``lone``: no rank but the candidates' one shows in the job's logs."""

    def rank_key(c: Candidate) -> tuple[bool, tuple[Any, ...]]:
        # a rank's specific story beats its generic traceback, whatever their order
        return (generic is not None and generic(c.rule), candidate_order(c))

    best: dict[TrackKey, Candidate] = {}
    for c in pool:
        k = (c.node, c.rank)
        cur = best.get(k)
        if cur is None or rank_key(c) < rank_key(cur):
            best[k] = c
    ordered = sorted(best.values(), key=candidate_order)
    if not ordered:
        return []
    first = ordered[0]
    if first.kind == "hang":
        share = 1.0 / max(len(ordered), tied)
        if first.rule == ABSENT_RULE:
            share = min(share, ABSENT_CONFIDENCE)  # absence from a log is weak evidence
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
    out = [(c, w / total) for c, w in zip(ordered, weights, strict=True)]
    if weak is not None and weak(first.rule) and out[0][1] > WEAK_CONFIDENCE:
        out[0] = (first, WEAK_CONFIDENCE)  # the training code's own words, not a signature
    if lone and len(out) == 1 and out[0][1] > LONE_CONFIDENCE:
        out[0] = (first, LONE_CONFIDENCE)  # nobody to have been first before
    return out
