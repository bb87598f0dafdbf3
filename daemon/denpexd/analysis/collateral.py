"""The collateral: every warning or worse that is not the initiator's own, one row per
(node, rank, rule) with its first time on the reference clock and how often it recurred."""

from __future__ import annotations

from typing import Any

from denpex_agent.rules import SEVERITIES
from denpexd.analysis.evidence import format_iso
from denpexd.analysis.story import Candidate
from denpexd.analysis.tracks import Aggregates, Aligned

WARNING = SEVERITIES.index("warning")


def collateral(
    aggs: Aggregates,
    initiator: Candidate | None,
    aligned: Aligned,
    shared_rule: str | None = None,
) -> list[dict[str, Any]]:
    """Rows in order of first time (unknown last), node, rank and rule. The initiator's rank is
    left out, and so is ``shared_rule``, the failure every rank shares when the scope is the job
    (not a consequence of itself)."""
    out = []
    for (node, rank, rule_id), a in aggs.items():
        ev = a.first
        if SEVERITIES.index(ev.severity or "info") < WARNING:
            continue
        if rule_id == shared_rule:
            continue  # the failure itself, on every rank: not a consequence of it
        if initiator is not None and rank is not None and (node, rank) == (initiator.node, initiator.rank):
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
