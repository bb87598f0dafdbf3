"""The hang suspect: when something failed but no rank names a cause (ranks only time out), the
rank whose progress stopped first.

Ranks are ordered by: most often named as the culprit by hang or communication reports
(``culprit_rank``), then silent before those that logged anything, then the lowest last step,
then the earliest time of that step on the reference clock, then rank and node. Every rank that
ties with the first on the first three is a suspect, and they share the confidence. A suspect
needs evidence: named as the culprit, silent while others report the hang, or stopped at an
earlier step than another rank. When every rank we know only waits alike, the suspects are the
ranks never heard from (a gap in the rank numbers below the highest), if few; else there is none.
A rank named as the culprit more often than any rank we have a log of is the suspect even without
a log of its own (the report of the rank that waits for it is the evidence).

A hang report that names the ranks the others wait for (a warning such as Horovod's stall
inspector) is a failure of its own when no step line follows it (`unresolved_stalls`): the job
stopped, or is, in that collective. One that names a single rank names the suspect; one that
names several (ranks waiting in different collectives for each other: a deadlock) names none.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from denpex_agent.rules import SEVERITIES
from denpexd.analysis.story import ABSENT_RULE, MAX_CANDIDATES_SHOWN, Candidate, names_culprit
from denpexd.analysis.tracks import Aggregate, Aggregates, Aligned, RankTrack, Tracks

HANG_RULE = "hang-rank-stopped-progress"
ERROR = SEVERITIES.index("error")


def hang_suspect(aggs: Aggregates, tracks: Tracks, aligned: Aligned) -> tuple[list[Candidate], int]:
    """The first MAX_CANDIDATES_SHOWN of the tied suspects (kind ``hang``) and how many are tied;
    ([], 0) when no track has a rank."""
    ranks = [t for t in tracks.values() if t.rank is not None]
    hints = _hints(aggs)
    named = _named_without_log(hints, ranks, tracks)
    if named:
        return named
    if not ranks:
        return [], 0
    # what a rank said beyond its steps (a known harmless notice says nothing about the hang)
    loud = {
        (n, r)
        for (n, r, _rule), a in aggs.items()
        if r is not None and a.first.role not in ("progress", "notice")
    }
    # a report that lists several ranks as missing (each from collectives the others wait in) says
    # the rank that printed it is stuck too: keeping quiet is then no sign of being the one
    deadlock = not hints and any(_lists_several(a) for a in aggs.values())

    def key(t: RankTrack) -> tuple[int, int, int, float, int, str]:
        hinted = -hints.get(t.rank if t.rank is not None else -1, 0)
        silent = 0 if deadlock or (t.node, t.rank) not in loud else 1
        step = t.last_step if t.last_step is not None else -1
        at = aligned(t.node, t.last_step_ts)
        return (hinted, silent, step, at if at is not None else math.inf, t.rank or 0, t.node)

    keyed = sorted((key(t), i) for i, t in enumerate(ranks))
    best = keyed[0][0][:3]
    hinted, silent, step = best
    evidence = (
        hinted < 0  # named as the culprit
        or (silent == 0 and len(loud) > 0 and not deadlock)  # quiet while others report the hang
        or any(k[2] > step for k, _ in keyed)  # its progress stopped at an earlier step
    )
    if not evidence:
        return _absent(ranks, loud)  # every rank we know only waits, alike
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


def stopped_rank(lead: Candidate, aggs: Aggregates, tracks: Tracks, aligned: Aligned) -> int | None:
    """The rank of a first failure that names none and that no launcher witnessed (a node's
    `nvidia-smi` or kernel log saying that a GPU is lost): the one rank of the same node that the
    hang analysis singles out, absent from the collective the others timed out in or stopped at an
    earlier step. A fault that takes a GPU away stops its rank without a word; the others only wait.
    Tied suspects, or a suspect on another node, name nobody."""
    suspects, tied = hang_suspect(aggs, tracks, aligned)
    if len(suspects) != 1 or tied > 1:
        return None
    only = suspects[0]
    return only.rank if only.node == lead.node else None


def _lists_several(a: Aggregate) -> bool:
    """Whether a hang report lists several ranks as missing (`missing_ranks`, no single culprit)."""
    listed = a.first.fields.get("missing_ranks")
    return a.first.category == "hang" and listed.__class__ is str and "," in listed


def _hints(aggs: Aggregates) -> dict[int, int]:
    """How often hang and communication reports name each rank as the culprit."""
    hints: dict[int, int] = {}
    for a in aggs.values():
        if names_culprit(a.first):
            cr = a.first.fields["culprit_rank"]
            hints[cr] = hints.get(cr, 0) + a.count
    return hints


def _named_without_log(
    hints: dict[int, int], ranks: list[RankTrack], tracks: Tracks
) -> tuple[list[Candidate], int] | None:
    """The ranks named as the culprit most often, when no rank we have a log of is named as often:
    the reports of the ranks that wait for them are all there is (their own logs are missing)."""
    if not hints:
        return None
    top = max(hints.values())
    logged = {t.rank for t in ranks}
    if any(hints.get(r, 0) == top for r in logged if r is not None):
        return None  # a rank we follow is named as often: the ordering below decides
    named = sorted(r for r, n in hints.items() if n == top)
    node = _only_node(tracks.values())
    return [
        Candidate(node, r, HANG_RULE, "hang", None, None, None, "hang") for r in named[:MAX_CANDIDATES_SHOWN]
    ], len(named)


def unresolved_stalls(aggs: Aggregates, tracks: Tracks) -> list[Aggregate]:
    """Hang reports below error severity that name the ranks the others wait for
    (``culprit_rank``, or several in ``missing_ranks``) and that no step line is known to follow:
    on no rank a later step by time, nor a step further in the same file. A step line that cannot
    be placed (another file, no times) is taken as a later one: only a report known to be the
    last word counts as a failure."""
    out = []
    for a in aggs.values():
        ev = a.first
        named = ev.fields.get("missing_ranks")
        if ev.category != "hang" or not (
            isinstance(ev.fields.get("culprit_rank"), int) or (named.__class__ is str and named)
        ):
            continue
        if SEVERITIES.index(ev.severity or "info") >= ERROR:
            continue  # an error already is a failure
        if not any(_progress_after(t, a) for t in tracks.values()):
            out.append(a)
    return out


def _progress_after(t: RankTrack, a: Aggregate) -> bool:
    last = t.last_progress
    if last is None:
        return False
    latest = a.last_ts if a.last_ts is not None else a.first.ts
    if latest is not None and t.last_step_ts is not None:
        return t.last_step_ts > latest
    if last.file == a.first.file:
        return last.offset > a.first.offset
    return True


def _absent(ranks: list[RankTrack], loud: set[tuple[str, int]]) -> tuple[list[Candidate], int]:
    """Every rank we know waits alike. Ranks are numbered from 0 without gaps, so the numbers
    missing below the highest one are ranks that were never heard from: absent from the collective
    the others wait in, they are the suspects, when they are few next to those waiting (at most
    half as many: a log that shows one waiter of many names nobody), under `ABSENT_RULE`: trusted
    less than a rank seen stopping, since their lines may only be missing. Else no suspect (a
    guess is not an answer)."""
    known = {t.rank for t in ranks if t.rank is not None}
    missing = sorted(set(range(max(known) + 1)) - known) if known else []
    waiting = len(loud)
    if not missing or 2 * len(missing) > waiting:
        return [], 0
    node = _only_node(ranks)
    return [
        Candidate(node, r, ABSENT_RULE, "hang", None, None, None, "hang")
        for r in missing[:MAX_CANDIDATES_SHOWN]
    ], len(missing)


def _only_node(tracks: Iterable[RankTrack]) -> str:
    """The node of a suspect we have no log of: the job's only node, else unknown ("")."""
    nodes = {t.node for t in tracks}
    return next(iter(nodes)) if len(nodes) == 1 else ""
