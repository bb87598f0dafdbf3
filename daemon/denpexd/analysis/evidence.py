"""The diagnosis's descriptive parts: a candidate as JSON, what a rule says about the cause, the
initiator's evidence lines and the per-rank table (docs/diagnosis-json.md)."""

from __future__ import annotations

import functools
from typing import Any

from denpex_agent.rules import RuleSet
from denpex_agent.timestamps import format_iso as _format_iso
from denpexd.analysis.story import Candidate
from denpexd.analysis.tracks import Aligned, TrackKey, Tracks

# Thousands of ranks share a handful of step and failure times: format each distinct time once.
format_iso = functools.lru_cache(maxsize=65_536)(_format_iso)


def candidate_dict(item: tuple[Candidate, float]) -> dict[str, Any]:
    """One candidate with its confidence, as the diagnosis lists it."""
    c, conf = item
    ev = c.event
    text = ev.text if ev is not None else ""
    if c.kind == "hang" and ev is not None:
        text = f"rank {c.rank} stopped making progress (last step line: {text.strip()[:300]})"
    elif c.kind == "hang":
        text = (
            f"rank {c.rank} left no line in these logs; the other ranks' reports point at it "
            "(they name it, or it is missing from the collective they wait in)"
        )
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


def root_cause(rules: RuleSet, rule_id: str, category: str) -> dict[str, Any]:
    """What a rule (or an inferred diagnosis: hang, killed, straggler) says about the cause; a
    rule the library does not know is named with empty explanations."""
    found = rules.explanation(rule_id)
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


def evidence(c: Candidate) -> dict[str, Any] | None:
    """The candidate's line and the context lines before it, or None (no event)."""
    ev = c.event
    if ev is None:
        return None
    return {"file": ev.file, "line": ev.line_no, "before": list(ev.context), "text": ev.text}


def rank_table(tracks: Tracks, aligned: Aligned, rank_events: dict[TrackKey, int]) -> list[dict[str, Any]]:
    """One row per tracked rank (by rank, unknown last, then node): its last step, that step's
    time on the reference clock and how many rule events it logged (its track's count, plus
    ``rank_events``: those counted without a track)."""
    rows = []
    for (node, rank), t in sorted(tracks.items(), key=lambda kv: (kv[0][1] is None, kv[0][1] or 0, kv[0][0])):
        at = aligned(node, t.last_step_ts)
        rows.append(
            {
                "node": node,
                "rank": rank,
                "last_step": t.last_step,
                "last_step_time": format_iso(at) if at is not None else None,
                "events": t.rule_events + rank_events.get((node, rank), 0),
            }
        )
    return rows
