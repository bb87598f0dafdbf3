"""How the failure unfolded: the initiator's first related warning, its first error, and when and
how the other ranks followed.

All times are on the reference clock. Steps come from the nodes' progress curves: the step a node
had reached when an event was written (the last step line before it), so a lead can be said in
steps as well as in seconds ("rank 5 warned 2 steps before every other rank failed").
"""

from __future__ import annotations

import bisect
from typing import Any

from denpex_agent.events import Event
from denpex_agent.rules import SEVERITIES
from denpexd.analysis.evidence import format_iso
from denpexd.analysis.story import Candidate
from denpexd.analysis.tracks import Aggregates, Aligned, NodeProgress, aligned_order

ERROR = SEVERITIES.index("error")
TEXT_CHARS = 200


def chain(
    first: Candidate,
    aggs: Aggregates,
    aligned: Aligned,
    progress: dict[str, NodeProgress],
) -> dict[str, Any] | None:
    """The chain of a failure whose initiator is ``first`` (an event candidate), or None when the
    initiator has no line of its own (an inferred hang, or a launcher's report of its exit, which
    comes after the others noticed)."""
    if first.event is None or first.kind != "event" or _reported(first.event):
        return None
    mine = (first.node, first.rank)
    # each rank's earliest error (the initiator's own too), on the reference clock
    earliest: dict[tuple[str, int | None], tuple[tuple[bool, float, Any], Event]] = {}
    for (node, rank, _rule), agg in aggs.items():
        ev = agg.first
        if SEVERITIES.index(ev.severity or "info") < ERROR or (rank is None and (node, rank) != mine):
            continue
        key = aligned_order(ev, aligned)
        cur = earliest.get((node, rank))
        if not key[0] and (cur is None or key < cur[0]):
            earliest[(node, rank)] = (key, ev)
    out: dict[str, Any] = {"first_warning": _step(first.event, first.rank, first.aligned, progress)}
    own = earliest.pop(mine, None)
    if own is not None and own[1].id != first.event.id:
        out["first_error"] = _step(own[1], first.rank, own[0][1], progress)
    if earliest:
        after = sorted(((key, ev, rank) for (_n, rank), (key, ev) in earliest.items()), key=lambda i: i[0])
        (_none, t0, _order), ev0, rank0 = after[0]
        spread: dict[str, Any] = {
            "ranks": len(after),
            "first": _step(ev0, rank0, t0, progress),
            "rules": sorted({ev.rule or "" for _k, ev, _r in after}),
        }
        if first.aligned is not None:
            spread["lag_s"] = round(t0 - first.aligned, 3)
        s0, s1 = out["first_warning"].get("step"), spread["first"].get("step")
        if isinstance(s0, int) and isinstance(s1, int):
            spread["lag_steps"] = s1 - s0
        out["then"] = spread
    out["summary"] = _summary(first, out)
    return out


def _reported(ev: Event) -> bool:
    """A launcher's report of a worker's exit (an exit code or signal), not the worker's line."""
    return "exitcode" in ev.fields or "signal" in ev.fields


def _step(ev: Event, rank: int | None, at: float | None, progress: dict[str, NodeProgress]) -> dict[str, Any]:
    d: dict[str, Any] = {
        "node": ev.node,
        "rank": rank,
        "rule": ev.rule,
        "time": format_iso(at) if at is not None else None,
        "text": ev.text.strip().splitlines()[-1][:TEXT_CHARS] if ev.text.strip() else "",
    }
    step = _step_at(progress.get(ev.node), ev.ts)
    if step is not None:
        d["step"] = step
    return d


def _step_at(p: NodeProgress | None, ts: float | None) -> int | None:
    """The last step the node's curve shows at or before ``ts`` (its own clock)."""
    if p is None or ts is None:
        return None
    curve = p.curve()
    times = [t for _s, t in curve]
    i = bisect.bisect_right(times, ts)
    return curve[i - 1][0] if i > 0 else None


def _summary(first: Candidate, out: dict[str, Any]) -> str:
    who = f"rank {first.rank}" if first.rank is not None else f"node {first.node}"
    fw = out["first_warning"]
    text = f"{who} logged {fw['rule']} first"
    if "step" in fw:
        text += f" (step {fw['step']})"
    err = out.get("first_error")
    if err is not None:
        text += f", then its own error {err['rule']}"
    then = out.get("then")
    if then is not None:
        lead = []
        if then.get("lag_steps"):
            lead.append(f"{then['lag_steps']} step(s)")
        if "lag_s" in then:
            lead.append(f"{then['lag_s']:.3f} s")
        text += f"; {' / '.join(lead) + ' later ' if lead else ''}{then['ranks']} other rank(s) failed"
        text += f" ({', '.join(then['rules'][:4])})"
    return text
