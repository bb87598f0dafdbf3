"""Whether the failure belongs to the job rather than to the rank that logged it first.

Two ways: an event about the job's set-up (a rule with ``scope = "job"``) among the first
rank's events of that moment, or the first event's rule logged by (nearly) every rank that
logged an error, so close together that the clocks cannot order them, and the first of them not
apart from the others (as a rank whose warning a collective then spread to every rank is). The diagnosis then says
``"scope": "job"``, names no initiator, and does not count that rule as collateral.
"""

from __future__ import annotations

from denpex_agent.rules import RuleSet
from denpexd.analysis.story import Candidate, candidate_order
from denpexd.clock import ClockEstimate

# "Every rank failed the same way": the first event's rule reported by at least this share of
# the ranks that logged an error (and by two or more), all within the clocks' uncertainty (or
# this many seconds, whichever is larger) of the first, or without times to tell them apart.
JOB_SCOPE_SHARE = 0.8
JOB_SCOPE_WINDOW_S = 1.0
# ... unless the first of three or more stands apart: ahead of the second by more than the clocks
# can blur (and this many seconds) and by more than the rest are apart from each other.
LEAD_MIN_S = 0.01


def job_wide(
    first: Candidate,
    pool: list[Candidate],
    ranked: list[tuple[Candidate, float]],
    erring: set[tuple[str, int]],
    clocks: dict[str, ClockEstimate],
    rules: RuleSet,
) -> Candidate | None:
    """The failure no single rank broke first by, or None.

    ``first`` is the initiator `story.rank_candidates` chose, ``pool`` every candidate,
    ``ranked`` the candidates one per rank and ``erring`` the (node, rank) pairs that logged an
    error. Returns the job-scoped candidate, or ``first`` when every rank shares its failure."""
    if first.kind != "event":
        return None
    mine = [c for c in pool if (c.node, c.rank) == (first.node, first.rank) and c.kind == "event"]
    for c in sorted(mine, key=candidate_order):  # the first rank's events only, not the pool
        moment = c.aligned is None or (
            first.aligned is not None and c.aligned - first.aligned <= JOB_SCOPE_WINDOW_S
        )
        rule = rules.get(c.rule)
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
    uncertainty = max((clocks[n].uncertainty_s for n in nodes if n in clocks), default=0.0)
    window = max(JOB_SCOPE_WINDOW_S, 2 * uncertainty)
    if max(times) - min(times) > window:
        return None
    if len(times) >= 3:
        # the first rank stands apart from the rest (it said it before the others, which then
        # said it together, as a collective spreads a value): that rank, not the job
        t = sorted(times)
        lead, rest = t[1] - t[0], t[-1] - t[1]
        if lead > max(2 * uncertainty, LEAD_MIN_S) and lead > rest:
            return None
    return first
