"""Every rule that matched in the job, once: how often, on how many ranks, and where first.

The candidates and the collateral list what bears on the failure; neither says whether a rule
matched at all (a warning in a job that did not fail is in neither). This index does, whatever
the rule's severity or role, so "is this signature still there?" has an answer from the
diagnosis alone (`denpexd verify`). One entry per rule: bounded by the library, not the job.

Of these, the notices (rules of role "notice") are listed again on their own, with the rule's
title and why the library holds them harmless: lines that look alarming (an NCCL WARN, a warning
that speaks of a hang) and that are known not to be failures. They are never a candidate, a
related warning or collateral (they are info-severity and of no story), so they are what a reader
who searched the log for "WARN" should stop worrying about.
"""

from __future__ import annotations

from typing import Any

from denpex_agent.events import Event
from denpex_agent.rules import RuleSet
from denpexd.analysis.evidence import format_iso
from denpexd.analysis.tracks import Aggregate, Aggregates, Aligned, aligned_order

TEXT_CHARS = 200


def matches(aggs: Aggregates, aligned: Aligned) -> list[dict[str, Any]]:
    """One entry per rule, by rule id: its category, the events counted, the distinct ranks that
    logged it, and its earliest line on the reference clock (of a folded record, its last line
    with words: a traceback's exception, not the rule under a launcher's summary)."""
    by_rule: dict[str, list[tuple[int | None, Aggregate]]] = {}
    for (_node, rank, rule), agg in aggs.items():
        by_rule.setdefault(rule, []).append((rank, agg))
    return [_entry(rule, group, aligned) for rule, group in sorted(by_rule.items())]


def notices(found: list[dict[str, Any]], rules: RuleSet) -> list[dict[str, Any]]:
    """The entries of ``found`` (`matches`' output) whose rule is a notice, each with the rule's
    title, why it is harmless and what to do to be rid of it."""
    out = []
    for m in found:
        rule = rules.get(m["rule"])
        if rule is not None and rule.role == "notice":
            out.append({**m, "title": rule.title, "why": rule.root_cause, "fix": rule.fix})
    return out


def _entry(rule: str, group: list[tuple[int | None, Aggregate]], aligned: Aligned) -> dict[str, Any]:
    first = min((agg.first for _, agg in group), key=lambda ev: aligned_order(ev, aligned))
    return {
        "rule": rule,
        "category": first.category,
        "severity": first.severity,
        "count": sum(agg.count for _, agg in group),
        "ranks": len({rank for rank, _ in group if rank is not None}),
        "first": _where(first, aligned),
    }


def _where(ev: Event, aligned: Aligned) -> dict[str, Any]:
    at = aligned(ev.node, ev.ts)
    lines = [line for line in ev.text.splitlines() if any(c.isalnum() for c in line)]
    return {
        "node": ev.node,
        "rank": ev.rank,
        "time": format_iso(at) if at is not None else None,
        "file": ev.file,
        "line": ev.line_no,
        "text": lines[-1].strip()[:TEXT_CHARS] if lines else "",
    }
