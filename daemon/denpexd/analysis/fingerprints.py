"""The NaN fingerprint and loss-scale drops: how far numerical trouble went, and on which ranks.

Each rank is at one stage: ``none``, ``info`` (it logged progress), ``warn`` (a warning of a
rule with ``fingerprint = "nan"``, e.g. a non-finite grad norm or a loss-scale drop) or ``error``
(such a rule's error, e.g. a NaN loss). The job is at its furthest rank's stage; the first rank
is the one whose first NaN-fingerprint event came earliest on the reference clock. Repeated
loss-scale drops without a failure make a job ``degraded``.
"""

from __future__ import annotations

from typing import Any

from denpex_agent.rules import SEVERITIES, Rule, RuleSet
from denpexd.analysis.tracks import Aggregate, Aggregates, Aligned, Tracks

ERROR = SEVERITIES.index("error")
SCALE_REPORT_RULE = "loss-scale-reported-below-one"  # a logged value, not a drop
LOSS_SCALE_DROPS_DEGRADED = 3  # drops (all ranks together) that make a job without failure degraded
STAGES = ("none", "info", "warn", "error")


def nan_fingerprint(aggs: Aggregates, tracks: Tracks, aligned: Aligned, rules: RuleSet) -> dict[str, Any]:
    """The job's stage, its first rank, the ranks at ``warn`` or further and every rank's stage."""
    per_rank: dict[int, int] = {}
    first: tuple[float, int, str] | None = None
    for (node, rank, rule_id), a in aggs.items():
        rule = rules.get(rule_id)
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
        "stage": STAGES[stage],
        "first_rank": first[1] if first else None,
        "ranks": sorted(r for r, s in per_rank.items() if s >= 2),
        "per_rank": {str(r): STAGES[s] for r, s in sorted(per_rank.items())},
    }


def is_scale_drop(a: Aggregate, rules: RuleSet) -> bool:
    """Whether the aggregate is of a loss-scale drop (`drops_scale`)."""
    return drops_scale(rules.get(a.first.rule or ""))


def drops_scale(rule: Rule | None) -> bool:
    """Whether a rule's lines are loss-scale drops: a NaN-fingerprint warning about the scale
    (not a logged value of it)."""
    return (
        rule is not None
        and rule.fingerprint == "nan"
        and rule.severity == "warning"
        and "scale" in rule.id
        and rule.id != SCALE_REPORT_RULE
    )


def scale_drops(aggs: Aggregates, rules: RuleSet) -> list[Aggregate]:
    """The aggregates of loss-scale drops (their counts sum to the job's drops)."""
    return [a for a in aggs.values() if is_scale_drop(a, rules)]
