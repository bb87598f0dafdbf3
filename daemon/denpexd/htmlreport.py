"""The picture of a failure: one self-contained HTML page drawn from the diagnosis document.

`render_html(doc)` takes the document that `diagnose --format json`, `query --json` and the HTTP
API give (docs/diagnosis-json.md) and returns a page that needs nothing else: CSS and SVG inline,
no script, no font, image or link that would reach the network, and a print stylesheet. The same
function can serve a live page, since it reads only the document.

The heart of it is the swimlanes: one lane per rank, grouped by node, on the job's aligned clock
(every time in the document already has its node's `clock` offset taken off). A lane shows how far
the rank got (a bar to its last step line), the initiator's first related warning and first error
(the `chain`; for an initiator with no line of its own, the initiator's time), the other
candidates, and each collateral entry (node, rank, rule) at its `first_time`, greyed. A node's
launcher, and lines that name no rank, get a lane of their own. Marks without a time sit in a
gutter at the right end. Each rank's NaN-fingerprint stage colours its label.

Lanes are the ranks of `ranks[]`, `candidates`, `collateral` and `stragglers`, plus a launcher
lane for each node with entries that name no rank. Past `MAX_LANES` ranks only the interesting ones
are drawn (the initiator, the first candidates, the ranks whose collateral came earliest, the ones
that stopped behind, the stragglers and the NaN fingerprint's first rank) and the rest are counted:
"+N more ranks". The initiator's node comes first and the initiator's lane first in it.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from denpex_agent.timestamps import format_iso
from denpexd.docview import (
    collateral_by_rule,
    evidence_lines,
    last_line,
    offset,
    prose,
    rank_ranges,
    stage_ranks,
    when,
    who,
)

MAX_LANES = 64
INTERESTING_CANDIDATES = 8
INTERESTING_COLLATERAL = 16
INTERESTING_BEHIND = 8
INTERESTING_STRAGGLERS = 16
TABLE_ROWS = 16
GUTTER_PCT = 5.0
SYMLOG_RATIO = 100.0
QUIET_SPAN_S = 10.0  # the least span of an axis with nothing on it but last steps
LANE_HEIGHT = 22
STAGES = ("none", "info", "warn", "error")


def esc(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


@dataclass(slots=True)
class Mark:
    """One thing that happened on a lane: ``kind`` is its class (warning, error, initiator,
    candidate, collateral), ``t`` its aligned epoch time or None."""

    kind: str
    t: float | None
    title: str
    rule: str = ""


@dataclass(slots=True)
class Lane:
    node: str
    rank: int | None
    last_step: int | None = None
    last_step_t: float | None = None
    stage: str = "none"
    marks: list[Mark] = field(default_factory=list)
    badges: list[str] = field(default_factory=list)
    initiator: bool = False

    @property
    def key(self) -> tuple[str, int | None]:
        return (self.node, self.rank)


@dataclass(slots=True)
class Axis:
    """Aligned epoch times to percentages of a track's width.

    ``ref`` is the time labelled 0 (the first failure's line). A failure's events bunch up around
    it (the other ranks a few milliseconds later, the launchers seconds later), so when the times
    span more than `SYMLOG_RATIO` times the smallest gap from ``ref`` the axis is symmetric-log:
    linear within ``tau`` seconds of ``ref``, logarithmic beyond, and the ticks are decades.
    """

    ref: float
    tau: float | None
    lo: float
    hi: float
    timed_pct: float

    def f(self, t: float) -> float:
        d = t - self.ref
        if self.tau is None:
            return d
        return math.copysign(math.log1p(abs(d) / self.tau), d)

    def pct(self, t: float) -> float:
        return (self.f(t) - self.lo) / (self.hi - self.lo) * self.timed_pct

    def at(self, d: float) -> float:
        """`pct` of the time ``d`` seconds from ``ref``."""
        return self.pct(self.ref + d)

    def rel(self, t: float) -> str:
        return f"{t - self.ref:+.3f} s"

    def ticks(self) -> list[float]:
        """Tick positions, in seconds from ``ref``."""
        return _log_ticks(self) if self.tau is not None else _linear_ticks(self)


@dataclass(slots=True)
class Picture:
    lanes: list[Lane]
    hidden_by_node: dict[str, int]
    ranks_total: int
    collateral_total: int


# -- lanes ------------------------------------------------------------------------------------------


def _natural(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _lane(lanes: dict[tuple[str, int | None], Lane], node: Any, rank: Any) -> Lane:
    key = (str(node), rank if isinstance(rank, int) else None)
    lane = lanes.get(key)
    if lane is None:
        lane = lanes[key] = Lane(*key)
    return lane


def _who_short(d: dict[str, Any]) -> str:
    rank = d.get("rank")
    return f"rank {rank} ({d.get('node')})" if rank is not None else f"launcher of {d.get('node')}"


def _chain_marks(doc: dict[str, Any], lanes: dict[tuple[str, int | None], Lane]) -> None:
    ini = doc.get("initiator")
    if not ini:
        return
    lane = _lane(lanes, ini.get("node"), ini.get("rank"))
    lane.initiator = True
    chain = doc.get("chain") or {}
    steps = [("warning", "first related warning", chain.get("first_warning"))]
    steps.append(("error", "first error", chain.get("first_error")))
    drawn = False
    for kind, label, step in steps:
        if step:
            at = f" (step {step['step']})" if step.get("step") is not None else ""
            title = f"{label}: {step.get('rule')} at {step.get('time') or 'unknown time'}{at}\n{last_line(step.get('text'))[:300]}"
            lane.marks.append(Mark(kind, when(step.get("time")), title, str(step.get("rule") or "")))
            drawn = True
    if not drawn:
        title = f"initiator: {ini.get('rule')} at {ini.get('time') or 'unknown time'}\n{last_line(ini.get('text'))[:300]}"
        lane.marks.append(Mark("initiator", when(ini.get("time")), title, str(ini.get("rule") or "")))


def _candidate_marks(doc: dict[str, Any], lanes: dict[tuple[str, int | None], Lane]) -> None:
    cands = doc.get("candidates") or []
    skip = 1 if doc.get("initiator") else 0
    for c in cands[skip:]:
        lane = _lane(lanes, c.get("node"), c.get("rank"))
        title = (
            f"candidate ({float(c.get('confidence') or 0):.0%}): {c.get('rule')} at "
            f"{c.get('time') or 'unknown time'}\n{last_line(c.get('text'))[:300]}"
        )
        lane.marks.append(Mark("candidate", when(c.get("time")), title, str(c.get("rule") or "")))


def _collateral_marks(doc: dict[str, Any], lanes: dict[tuple[str, int | None], Lane]) -> None:
    for c in doc.get("collateral") or []:
        lane = _lane(lanes, c.get("node"), c.get("rank"))
        title = (
            f"collateral: {c.get('rule')} x{c.get('count')} on {_who_short(c)}, "
            f"first at {c.get('first_time') or 'unknown time'} ({c.get('role')})"
        )
        lane.marks.append(Mark("collateral", when(c.get("first_time")), title, str(c.get("rule") or "")))


def build_lanes(doc: dict[str, Any]) -> dict[tuple[str, int | None], Lane]:
    """Every lane the document calls for, with its marks, progress, stage and badges."""
    lanes: dict[tuple[str, int | None], Lane] = {}
    for row in doc.get("ranks") or []:
        lane = _lane(lanes, row.get("node"), row.get("rank"))
        lane.last_step = row.get("last_step")
        lane.last_step_t = when(row.get("last_step_time"))
    _chain_marks(doc, lanes)
    _candidate_marks(doc, lanes)
    _collateral_marks(doc, lanes)
    for s in doc.get("stragglers") or []:
        lane = _lane(lanes, s.get("node"), s.get("rank"))
        ratio = s.get("ratio")
        lane.badges.append(f"slow {ratio:.2f}x" if isinstance(ratio, (int, float)) else "slow data")
    per_rank = ((doc.get("fingerprints") or {}).get("nan") or {}).get("per_rank") or {}
    for lane in lanes.values():
        if lane.rank is not None:
            stage = per_rank.get(str(lane.rank), "none")
            lane.stage = stage if stage in STAGES else "none"
    return lanes


def _interesting(
    doc: dict[str, Any], lanes: dict[tuple[str, int | None], Lane]
) -> set[tuple[str, int | None]]:
    """The rank lanes worth drawing when there are too many to draw them all."""
    keep: set[tuple[str, int | None]] = {k for k, lane in lanes.items() if lane.initiator}
    keep |= {
        (str(c.get("node")), c.get("rank")) for c in (doc.get("candidates") or [])[:INTERESTING_CANDIDATES]
    }
    then = ((doc.get("chain") or {}).get("then") or {}).get("first")
    if then:
        keep.add((str(then.get("node")), then.get("rank")))
    coll = sorted(
        (c for c in doc.get("collateral") or [] if c.get("rank") is not None),
        key=lambda c: (c.get("first_time") is None, c.get("first_time") or "", c.get("rank")),
    )
    earliest: set[tuple[str, int | None]] = set()
    for c in coll:
        if len(earliest) >= INTERESTING_COLLATERAL:
            break
        earliest.add((str(c.get("node")), c.get("rank")))
    keep |= earliest
    keep |= {
        (str(s.get("node")), s.get("rank")) for s in (doc.get("stragglers") or [])[:INTERESTING_STRAGGLERS]
    }
    keep |= _behind(lanes)
    first = ((doc.get("fingerprints") or {}).get("nan") or {}).get("first_rank")
    keep |= {k for k in lanes if first is not None and k[1] == first}
    return {k for k in keep if k in lanes and k[1] is not None}


def _behind(lanes: dict[tuple[str, int | None], Lane]) -> set[tuple[str, int | None]]:
    steps = [
        lane.last_step for lane in lanes.values() if lane.rank is not None and lane.last_step is not None
    ]
    if not steps or min(steps) == max(steps):
        return set()
    top = max(steps)
    behind = sorted(
        (
            lane
            for lane in lanes.values()
            if lane.rank is not None and lane.last_step is not None and lane.last_step < top
        ),
        key=lambda lane: (lane.last_step, lane.last_step_t or math.inf, lane.rank),
    )
    return {lane.key for lane in behind[:INTERESTING_BEHIND]}


def _order(lanes: Iterable[Lane], first_node: str | None) -> list[Lane]:
    def key(lane: Lane) -> tuple[Any, ...]:
        return (
            lane.node != first_node,
            _natural(lane.node),
            not lane.initiator,
            lane.rank is None,
            lane.rank if lane.rank is not None else 0,
        )

    return sorted(lanes, key=key)


def picture(doc: dict[str, Any], max_lanes: int = MAX_LANES) -> Picture:
    """The lanes to draw, in order, and what was left out of them."""
    lanes = build_lanes(doc)
    rank_keys = [k for k in lanes if k[1] is not None]
    shown = set(lanes)
    if len(rank_keys) > max_lanes:
        keep = _interesting(doc, lanes)
        kept_nodes = {k[0] for k in keep}
        shown = keep | {
            k for k, lane in lanes.items() if lane.initiator or (k[1] is None and k[0] in kept_nodes)
        }
    hidden: dict[str, int] = {}
    for k in rank_keys:
        if k not in shown:
            hidden[k[0]] = hidden.get(k[0], 0) + 1
    ini = doc.get("initiator") or {}
    ordered = _order((lanes[k] for k in shown), str(ini["node"]) if ini.get("node") is not None else None)
    return Picture(ordered, hidden, len(rank_keys), len(doc.get("collateral") or []))


# -- the time axis ----------------------------------------------------------------------------------


def _axis(doc: dict[str, Any], lanes: list[Lane]) -> Axis | None:
    times = [m.t for lane in lanes for m in lane.marks if m.t is not None]
    times += [lane.last_step_t for lane in lanes if lane.last_step_t is not None]
    if not times:
        return None
    ini = doc.get("initiator") or {}
    first = ((doc.get("chain") or {}).get("first_warning") or {}).get("time") or ini.get("time")
    found = when(first)
    ref = found if found is not None else min(times)
    gaps = [abs(t - ref) for t in times if abs(t - ref) >= 0.0005]
    tau = _nice_floor(min(1.0, max(0.001, min(gaps) / 2))) if gaps else None
    if tau is not None and max(gaps) / tau <= SYMLOG_RATIO:
        tau = None
    untimed = any(m.t is None for lane in lanes for m in lane.marks)
    axis = Axis(ref, tau, 0.0, 1.0, 100.0 - GUTTER_PCT if untimed else 100.0)
    lo, hi = min(axis.f(t) for t in times), max(axis.f(t) for t in times)
    if not any(lane.marks for lane in lanes) and hi - lo < QUIET_SPAN_S:
        lo, hi = hi - QUIET_SPAN_S, hi  # only last steps: a millisecond apart is "together"
    span = hi - lo if hi > lo else 1.0
    axis.lo, axis.hi = lo - span * 0.03, hi + span * 0.03
    return axis


def _nice_floor(x: float) -> float:
    """The largest 1, 2 or 5 times a power of ten not above ``x``."""
    mag = 10.0 ** math.floor(math.log10(x))
    return max(m * mag for m in (1, 2, 5) if m * mag <= x * (1 + 1e-9))


def _inverse(axis: Axis, x: float) -> float:
    if axis.tau is None:
        return axis.ref + x
    return axis.ref + math.copysign(math.expm1(abs(x)) * axis.tau, x)


def _linear_ticks(axis: Axis) -> list[float]:
    span = axis.hi - axis.lo
    raw = span / 8
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    k0, k1 = math.ceil(axis.lo / step), math.floor(axis.hi / step)
    return [k * step for k in range(k0, k1 + 1)][:40]


def _log_ticks(axis: Axis) -> list[float]:
    """0 and the decades (with their 2s and 5s where there is room) inside the axis."""
    lo, hi = _inverse(axis, axis.lo) - axis.ref, _inverse(axis, axis.hi) - axis.ref
    out = [0.0] if lo <= 0 <= hi else []
    tau = axis.tau or 0.0
    for k in range(-3, 7):
        for m in (1, 2, 5):
            for d in (m * 10.0**k, -m * 10.0**k):
                if lo <= d <= hi and abs(d) >= tau * 0.99:
                    out.append(d)
    out.sort()
    kept: list[float] = []
    for d in out:
        if not kept or axis.at(d) - axis.at(kept[-1]) >= 6.0:
            kept.append(d)
    return kept


def _tick_label(seconds: float) -> str:
    if abs(seconds) < 1e-9:
        return "0"
    if abs(seconds) >= 1:
        return f"{seconds:+.6g} s"
    return f"{seconds * 1000:+.6g} ms"


def _pct(value: float) -> str:
    return f"{value:.3f}%"


# -- SVG --------------------------------------------------------------------------------------------

_SYMBOLS = """<svg class="defs" width="0" height="0" aria-hidden="true"><defs>
<path id="m-diamond" d="M0,-7 L7,0 L0,7 L-7,0 Z"/>
<path id="m-triangle" d="M0,-7 L7,6 L-7,6 Z"/>
<circle id="m-ring" r="5"/>
<circle id="m-dot" r="4"/>
</defs></svg>"""

_SHAPE = {
    "warning": "m-diamond",
    "error": "m-diamond",
    "initiator": "m-triangle",
    "candidate": "m-ring",
    "collateral": "m-dot",
}


def _mark_svg(mark: Mark, axis: Axis | None, untimed_slot: int) -> str:
    y = LANE_HEIGHT // 2
    if mark.t is not None and axis is not None:
        x = _pct(axis.pct(mark.t))
        title = f"{mark.title}\n{axis.rel(mark.t)} from the first failure"
    else:
        x = _pct(100.0 - GUTTER_PCT / 2 + (untimed_slot % 3 - 1) * 1.2)
        title = f"{mark.title}\n(no time)"
    return (
        f'<g class="mark {mark.kind}" data-rule="{esc(mark.rule)}"><title>{esc(title)}</title>'
        f'<use href="#{_SHAPE[mark.kind]}" x="{x}" y="{y}"/></g>'
    )


def _grid_svg(axis: Axis | None) -> str:
    if axis is None:
        return ""
    lines = [
        f'<line class="grid" x1="{_pct(axis.at(d))}" x2="{_pct(axis.at(d))}" y1="0" y2="{LANE_HEIGHT}"/>'
        for d in axis.ticks()
    ]
    if axis.timed_pct < 100.0:
        x = _pct(axis.timed_pct + GUTTER_PCT * 0.1)
        lines.append(
            f'<rect class="gutter" x="{x}" y="0" width="{_pct(GUTTER_PCT * 0.9)}" height="{LANE_HEIGHT}"/>'
        )
    return "".join(lines)


def _progress_svg(lane: Lane, axis: Axis | None) -> str:
    if lane.last_step_t is None or axis is None:
        return ""
    x = _pct(axis.pct(lane.last_step_t))
    y = LANE_HEIGHT // 2
    title = f"last step {lane.last_step} at {axis.rel(lane.last_step_t)} from the first failure"
    return (
        f'<line class="alive" x1="0%" x2="{x}" y1="{y}" y2="{y}"/>'
        f'<line class="laststep" x1="{x}" x2="{x}" y1="3" y2="{LANE_HEIGHT - 3}"><title>{esc(title)}</title></line>'
    )


def _track_svg(lane: Lane, axis: Axis | None, grid: str) -> str:
    order = {"collateral": 0, "candidate": 1, "initiator": 2, "warning": 3, "error": 4}
    marks = sorted(lane.marks, key=lambda m: order[m.kind])
    untimed = 0
    body = []
    for m in marks:
        body.append(_mark_svg(m, axis, untimed))
        untimed += m.t is None or axis is None
    return (
        f'<svg class="track" width="100%" height="{LANE_HEIGHT}" aria-hidden="true">'
        f"{grid}{_progress_svg(lane, axis)}{''.join(body)}</svg>"
    )


def _axis_html(doc: dict[str, Any], axis: Axis | None) -> str:
    if axis is None:
        return (
            '<div class="axis-row"><div class="label muted">no times in the document</div><div></div></div>'
        )
    ticks = axis.ticks()
    labels = [
        f'<line x1="{_pct(axis.at(d))}" x2="{_pct(axis.at(d))}" y1="18" y2="26"/>'
        f'<text x="{_pct(axis.at(d))}" y="13" text-anchor="middle">{esc(_tick_label(d))}</text>'
        for d in ticks
    ]
    if axis.timed_pct < 100.0:
        x = _pct(axis.timed_pct + GUTTER_PCT / 2)
        labels.append(f'<text x="{x}" y="13" text-anchor="middle">no time</text>')
    labels.append(_lag_svg(doc, axis))
    svg = f'<svg class="axis" width="100%" height="28" aria-hidden="true">{"".join(labels)}</svg>'
    return f'<div class="axis-row"><div class="label muted">aligned time</div>{svg}</div>'


# -- page parts -------------------------------------------------------------------------------------


def _lane_html(lane: Lane, axis: Axis | None, grid: str) -> str:
    is_rank = lane.rank is not None
    attrs = [
        'class="lane' + (" initiator" if lane.initiator else "") + '"',
        f'data-lane="{"rank" if is_rank else "launcher"}"',
        f'data-node="{esc(lane.node)}"',
    ]
    if is_rank:
        attrs += [f'data-rank="{lane.rank}"', f'data-stage="{lane.stage}"']
    if lane.initiator:
        attrs.append('data-initiator="true"')
    name = f"rank {lane.rank}" if is_rank else "launcher / no rank"
    label = [f'<span class="who">{esc(name)}</span>']
    if lane.initiator:
        label.append('<span class="badge first">initiator</span>')
    if is_rank:
        label.append(f'<span class="stage s-{lane.stage}" title="NaN fingerprint stage">{lane.stage}</span>')
    if lane.last_step is not None:
        label.append(f'<span class="step">step {lane.last_step}</span>')
    label += [f'<span class="badge slow">{esc(b)}</span>' for b in lane.badges]
    return f'<div {" ".join(attrs)}><div class="label">{"".join(label)}</div>{_track_svg(lane, axis, grid)}</div>'


def _node_html(node: str, clock: dict[str, Any]) -> str:
    c = clock.get(node)
    note = ""
    if c:
        note = f' <span class="muted">clock offset {esc(offset(c.get("offset_s")))} ±{float(c.get("uncertainty_s") or 0):.3f} s ({esc(c.get("method"))})</span>'
    return f'<div class="node" data-node="{esc(node)}"><b>{esc(node)}</b>{note}</div>'


def _more_html(n: int, where: str) -> str:
    return f'<div class="more" data-more="{n}">+{n} more rank{"s" if n != 1 else ""} {esc(where)}</div>'


def _lag_svg(doc: dict[str, Any], axis: Axis) -> str:
    """A band on the axis from the initiator's first warning to the first other rank's failure."""
    chain = doc.get("chain") or {}
    then = chain.get("then") or {}
    a = when((chain.get("first_warning") or {}).get("time"))
    b = when((then.get("first") or {}).get("time"))
    if a is None or b is None:
        return ""
    x0, x1 = axis.pct(min(a, b)), axis.pct(max(a, b))
    title = f"the other ranks followed {then.get('lag_s')} s later"
    return (
        f'<rect class="lag" x="{_pct(x0)}" y="20" width="{_pct(max(x1 - x0, 0.4))}" height="6">'
        f"<title>{esc(title)}</title></rect>"
    )


def _timeline(doc: dict[str, Any]) -> str:
    pic = picture(doc)
    axis = _axis(doc, pic.lanes)
    grid = _grid_svg(axis)
    clock = doc.get("clock") or {}
    rows: list[str] = [_axis_html(doc, axis)]
    node: str | None = None
    for lane in pic.lanes:
        if lane.node != node:
            if node is not None and pic.hidden_by_node.get(node):
                rows.append(_more_html(pic.hidden_by_node[node], f"on {node}"))
            node = lane.node
            rows.append(_node_html(node, clock))
        rows.append(_lane_html(lane, axis, grid))
    if node is not None and pic.hidden_by_node.get(node):
        rows.append(_more_html(pic.hidden_by_node[node], f"on {node}"))
    shown_nodes = {lane.node for lane in pic.lanes}
    elsewhere = sum(n for nd, n in pic.hidden_by_node.items() if nd not in shown_nodes)
    if elsewhere:
        nodes = sum(1 for nd in pic.hidden_by_node if nd not in shown_nodes)
        rows.append(_more_html(elsewhere, f"on {nodes} other node(s)"))
    shown_ranks = sum(1 for lane in pic.lanes if lane.rank is not None)
    shown_coll = sum(1 for lane in pic.lanes for m in lane.marks if m.kind == "collateral")
    head = (
        f"{shown_ranks} of {pic.ranks_total} rank(s) drawn"
        + (", the interesting ones" if shown_ranks < pic.ranks_total else "")
        + f"; {shown_coll} of {pic.collateral_total} collateral entries."
    )
    ref = ""
    if axis is not None:
        ref = f" Time 0 is {esc(_zero(axis.ref, doc))} on the job's aligned clock (local time - the node's offset)"
        ref += (
            f"; the scale is logarithmic beyond {_tick_label(axis.tau).lstrip('+')} of it, so that what follows within "
            "milliseconds and what follows seconds later both show."
            if axis.tau is not None
            else "."
        )
    return (
        '<section id="timeline"><h2>Timeline</h2>'
        f'<p class="muted">{esc(head)}{ref}</p>{_legend()}'
        f'<div class="lanes" data-lanes="{len(pic.lanes)}" data-ranks-total="{pic.ranks_total}" '
        f'data-collateral-total="{pic.collateral_total}" data-collateral-shown="{shown_coll}">'
        + "".join(rows)
        + "</div></section>"
    )


def _zero(t: float, doc: dict[str, Any]) -> str:
    what = "the first failure's line" if doc.get("initiator") else "the earliest time drawn"
    return f"{what}, {format_iso(t)},"


def _legend() -> str:
    items = [
        ("warning", "m-diamond", "initiator's first related warning"),
        ("error", "m-diamond", "initiator's first error"),
        ("initiator", "m-triangle", "initiator (no line of its own)"),
        ("candidate", "m-ring", "other candidate"),
        ("collateral", "m-dot", "collateral (first occurrence)"),
    ]
    marks = "".join(
        f'<span class="key"><svg width="16" height="16" aria-hidden="true"><g class="mark {k}">'
        f'<use href="#{shape}" x="8" y="8"/></g></svg>{esc(text)}</span>'
        for k, shape, text in items
    )
    stages = "".join(f'<span class="stage s-{s}">{s}</span>' for s in STAGES)
    return (
        f'<div class="legend">{marks}<span class="key"><svg width="16" height="16" aria-hidden="true">'
        f'<line class="laststep" x1="8" x2="8" y1="2" y2="14"/></svg>last step line</span>'
        f'<span class="key">NaN fingerprint: {stages}</span></div>'
    )


def _rich(value: str) -> str:
    return "".join(f"<code>{esc(part)}</code>" if is_code else esc(part) for is_code, part in prose(value))


def _summary(doc: dict[str, Any]) -> str:
    ini = doc.get("initiator") or {}
    rc = doc.get("root_cause") or {}
    verdict = str(doc.get("verdict", ""))
    rows = [
        ("job", f"<code>{esc(doc.get('job'))}</code>"),
        ("verdict", f'<span class="verdict v-{esc(verdict)}">{esc(verdict)}</span>'),
    ]
    if ini:
        rows += [
            (
                "initiator",
                f"node <code>{esc(ini.get('node'))}</code>, rank <b>{esc(ini.get('rank') if ini.get('rank') is not None else '-')}</b>",
            ),
            ("rule", f"<code>{esc(ini.get('rule'))}</code> [{esc(ini.get('category'))}]"),
            ("confidence", f"{float(ini.get('confidence') or 0):.0%}"),
            ("first failure at", esc(ini.get("time") or "unknown time")),
        ]
        if ini.get("file"):
            rows.append(("where", f"<code>{esc(ini['file'])}:{esc(ini.get('line'))}</code>"))
    else:
        rows.append(("initiator", "none"))
    rows.append(("scope", esc(doc.get("scope", "rank"))))
    if rc:
        rows.append(("root cause", esc(rc.get("title", ""))))
    body = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows)
    line = f'<p class="line"><code>{esc(last_line(ini.get("text"))[:500])}</code></p>' if ini else ""
    return f'<table class="summary">{body}</table>{line}{_headline(doc)}'


def _headline(doc: dict[str, Any]) -> str:
    stall = doc.get("stall")
    rc = doc.get("root_cause") or {}
    out = []
    if stall:
        out.append(
            f"<p><b>Stalled:</b> no rank advanced past step {esc(stall.get('last_step'))} for "
            f"{float(stall.get('silent_s') or 0):.0f} s (since {esc(stall.get('since') or 'unknown time')}; "
            f"threshold {float(stall.get('threshold_s') or 0):.1f} s), and no process reported an error.</p>"
        )
    if (
        doc.get("verdict") == "failed"
        and doc.get("scope") == "job"
        and not doc.get("initiator")
        and not stall
    ):
        out.append(
            f"<p><b>No single rank:</b> every rank failed or waited alike (<code>{esc(rc.get('rule'))}</code>): "
            "no one rank is to blame.</p>"
        )
    if doc.get("verdict") == "healthy" and doc.get("finished") is False:
        out.append("<p><b>Not finished:</b> no rank logged the end of training and nothing failed.</p>")
    note = (doc.get("node_history") or {}).get("note")
    if note:
        out.append(f"<p><b>Node history:</b> {esc(note)}</p>")
    return "".join(out)


def _chain(chain: dict[str, Any] | None) -> str:
    if not chain:
        return ""
    items = []

    def step_html(label: str, s: dict[str, Any]) -> str:
        at = f", step {esc(s['step'])}" if s.get("step") is not None else ""
        return (
            f"<li><b>{esc(label)}</b> {esc(s.get('time') or 'unknown time')}{at}: {esc(_who_short(s))}, "
            f'<code>{esc(s.get("rule"))}</code><br><code class="logline">{esc(last_line(s.get("text"))[:300])}</code></li>'
        )

    items.append(step_html("first related warning", chain["first_warning"]))
    if chain.get("first_error"):
        items.append(step_html("its first error", chain["first_error"]))
    then = chain.get("then")
    if then:
        lag = f", {esc(then.get('lag_s'))} s later" if "lag_s" in then else ""
        items.append(step_html(f"then {then['ranks']} other rank(s) failed{lag}; the first", then["first"]))
    summary = f"<p>{esc(chain['summary'])}</p>" if chain.get("summary") else ""
    return f'<section id="chain"><h2>Chain of events</h2><ol class="chain">{"".join(items)}</ol>{summary}</section>'


def _root_cause(rc: dict[str, Any] | None) -> str:
    if not rc:
        return ""
    parts = []
    for label, key in (("Why", "root_cause"), ("Fix", "fix"), ("Verify", "verify")):
        if rc.get(key):
            parts.append(f"<dt>{label}</dt><dd>{_rich(' '.join(str(rc[key]).split()))}</dd>")
    refs = rc.get("references") or []
    if refs:
        parts.append(
            "<dt>References</dt><dd><ul>"
            + "".join(f"<li><code>{esc(r)}</code></li>" for r in refs)
            + "</ul></dd>"
        )
    return f'<section id="cause"><h2>Root cause: {esc(rc.get("title", ""))}</h2><dl>{"".join(parts)}</dl></section>'


def _table(section_id: str, title: str, head: list[str], rows: list[list[str]], note: str = "") -> str:
    if not rows:
        return ""
    thead = "".join(f"<th>{esc(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    extra = f'<p class="muted">{note}</p>' if note else ""
    return f'<section id="{section_id}"><h2>{esc(title)}</h2>{extra}<table><thead><tr>{thead}</tr></thead><tbody>{body}</tbody></table></section>'


def _rank_cell(value: Any) -> str:
    return "launcher" if value is None else esc(value)


def _num(value: Any, spec: str = ".4g") -> str:
    return esc(format(value, spec)) if isinstance(value, (int, float)) else ""


def _candidates(doc: dict[str, Any]) -> str:
    others = [c for c in (doc.get("candidates") or [])[1:] if c.get("confidence", 0) >= 0.01]
    rows = [
        [
            f"<code>{esc(c.get('node'))}</code>",
            _rank_cell(c.get("rank")),
            f"<code>{esc(c.get('rule'))}</code>",
            esc(c.get("time") or ""),
            f"{float(c.get('confidence') or 0):.0%}",
        ]
        for c in others[:TABLE_ROWS]
    ]
    return _table(
        "candidates",
        "Other candidates (too close to call by clock)",
        ["node", "rank", "rule", "time (aligned)", "confidence"],
        rows,
    )


def _stall(stall: dict[str, Any] | None) -> str:
    rows = [
        [
            f"<code>{esc(r.get('node'))}</code>",
            _rank_cell(r.get("rank")),
            esc(r.get("step")),
            f'<code class="logline">{esc(str(r.get("text", "")).strip()[:200])}</code>',
        ]
        for r in ((stall or {}).get("last_steps") or [])[:TABLE_ROWS]
    ]
    note = f"{esc((stall or {}).get('ranks'))} rank(s) followed; the ones behind first."
    return _table(
        "stall", "Stall: each rank's last step", ["node", "rank", "step", "last step line"], rows, note
    )


def _trends(trends: list[dict[str, Any]]) -> str:
    rows = []
    for t in trends:
        rec = t.get("recovered_step")
        end = (
            f"recovered at step {rec}"
            if rec is not None
            else (f"still {_num(t.get('last_value'))} at the end" if "last_value" in t else "")
        )
        peak = f"{_num(t.get('peak'))} at step {esc(t['peak_step'])}" if "peak_step" in t else ""
        rows.append(
            [
                esc(t.get("metric")),
                esc(t.get("kind")),
                f"<code>{esc(t.get('rule'))}</code>",
                esc(t.get("start_step", "")),
                esc(t.get("detected_step", "")),
                _num(t.get("value"), ".6g"),
                _num(t.get("baseline"), ".6g"),
                peak,
                esc(end),
            ]
        )
    head = ["metric", "kind", "rule", "from step", "detected at", "value", "baseline", "peak", "end"]
    return _table("trends", "Trends (against the job's own history)", head, rows)


def _stragglers(stragglers: list[dict[str, Any]]) -> str:
    rows = []
    for s in stragglers[:TABLE_ROWS]:
        if s.get("metric") == "step_time":
            how = f"own step time {_num(s.get('ratio'), '.3f')}x its peers' median ({_num(s.get('median_s'), '.4f')} s vs {_num(s.get('typical_s'), '.4f')} s), confidence {_num(s.get('confidence'), '.4f')}"
            since = esc(s.get("since_step", ""))
        else:
            how = f"data_time {_num(s.get('data_time_s'), '.3f')} s vs typical {_num(s.get('typical_s'), '.3f')} s"
            since = ""
        rows.append(
            [
                f"<code>{esc(s.get('node'))}</code>",
                _rank_cell(s.get("rank")),
                f"<code>{esc(s.get('rule'))}</code>",
                how,
                since,
            ]
        )
    return _table("stragglers", "Stragglers", ["node", "rank", "rule", "how slow", "since step"], rows)


def _collateral(doc: dict[str, Any]) -> str:
    coll = doc.get("collateral") or []
    rows = [
        [f"<code>{esc(rc.rule)}</code>", esc(rc.count), esc(rc.where())] for rc in collateral_by_rule(coll)
    ]
    note = f"{esc(doc.get('suppressed', 0))} event(s) on {len(doc.get('collateral_ranks') or [])} other rank(s), consequences, not causes."
    return _table("collateral", "Collateral", ["rule", "count", "where"], rows, note)


def _notices(doc: dict[str, Any]) -> str:
    notices = doc.get("notices") or []
    if not notices:
        return ""
    rows = [
        [
            f"<code>{esc(n.get('rule'))}</code>",
            esc(n.get("count")),
            esc(n.get("title")),
            f"<code>{esc((n.get('first') or {}).get('text'))}</code>",
        ]
        for n in notices
    ]
    note = "Lines that look alarming and that the rule library knows are not failures."
    return _table("notices", "Known harmless", ["rule", "count", "what", "first line"], rows, note)


def _nan(doc: dict[str, Any]) -> str:
    nan = (doc.get("fingerprints") or {}).get("nan") or {}
    if nan.get("stage") not in ("warn", "error"):
        return ""
    by_stage = stage_ranks(nan.get("per_rank") or {})
    rows = [
        [f'<span class="stage s-{s}">{s}</span>', esc(len(by_stage[s])), esc(rank_ranges(by_stage[s]))]
        for s in reversed(STAGES)
        if s in by_stage
    ]
    note = f"Stage <b>{esc(nan['stage'])}</b>, first on rank <b>{_rank_cell(nan.get('first_rank'))}</b>."
    return _table("nan", "NaN fingerprint", ["stage", "ranks", "which"], rows, note)


def _divergence(div: dict[str, Any] | None) -> str:
    if div is None:
        return ""
    rows = [
        [
            esc(e.get("time") or ""),
            f"<code>{esc(e.get('node'))}</code>",
            _rank_cell(e.get("rank")),
            f'<code class="logline">{esc(str(e.get("text", ""))[:200])}</code>',
        ]
        for e in (div.get("per_rank") or [])[:TABLE_ROWS]
    ]
    ctl = div.get("control") or {}
    note = f"Control: {esc(ctl.get('files', 0))} file(s), {esc(ctl.get('lines', 0))} lines, {esc(ctl.get('templates', 0))} templates."
    if not rows:
        return f'<section id="divergence"><h2>First divergence from the healthy run</h2><p class="muted">{note} Every line\'s template occurs in the healthy run.</p></section>'
    return _table(
        "divergence",
        "First divergence from the healthy run",
        ["time (aligned)", "node", "rank", "first new line"],
        rows,
        note,
    )


def _clocks(clock: dict[str, Any]) -> str:
    rows = [
        [
            f"<code>{esc(n)}</code>",
            esc(offset(c.get("offset_s"))),
            f"±{float(c.get('uncertainty_s') or 0):.3f} s",
            esc(c.get("method")),
            esc(c.get("samples")),
        ]
        for n, c in sorted(clock.items(), key=lambda kv: _natural(kv[0]))
    ]
    shown = rows[: TABLE_ROWS * 4]
    note = "Every time on this page is aligned: local time - the node's offset."
    if len(rows) > len(shown):
        note += f" {len(shown)} of {len(rows)} nodes listed."
    return _table("clocks", "Clocks", ["node", "offset", "uncertainty", "method", "samples"], shown, note)


def _evidence(ev: dict[str, Any] | None) -> str:
    before, own = evidence_lines(ev)
    if not before and not own:
        return ""
    assert ev is not None
    lines = [esc(x) for x in before] + [f"<mark>{esc(x)}</mark>" for x in own]
    where = f"{ev.get('file')}:{ev.get('line')}"
    return (
        f'<section id="evidence"><h2>Evidence</h2><p class="muted">{len(before)} line(s) before '
        f"<code>{esc(where)}</code>, then the line itself (highlighted).</p>"
        f'<pre class="evidence" data-lines="{len(lines)}">' + "\n".join(lines) + "</pre></section>"
    )


def _read(read: dict[str, Any] | None) -> str:
    if not read:
        return ""
    warnings = read.get("warnings") or []
    items = "".join(f"<li><code>{esc(w)}</code></li>" for w in warnings[:10])
    return (
        f'<p class="muted">Read {esc(read.get("files"))} file(s), {float(read.get("bytes") or 0) / 1e6:.1f} MB, '
        f"{esc(read.get('lines'))} lines, {esc(read.get('events'))} matches, {len(warnings)} warning(s).</p>"
        + (f"<ul>{items}</ul>" if items else "")
    )


_CSS = """
:root{--fg:#1d2939;--muted:#667085;--line:#eaecf0;--bg:#fff;--red:#d92d20;--amber:#f79009;--purple:#7a5af8;--grey:#98a2b3}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--fg);font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif}
main{max-width:1280px;margin:0 auto;padding:16px 24px 48px}
h1{font-size:20px;margin:8px 0 12px}h2{font-size:16px;margin:28px 0 8px;border-bottom:1px solid var(--line);padding-bottom:4px}
code,pre{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,"Liberation Mono",monospace;font-size:12.5px}
code.logline{white-space:pre-wrap;word-break:break-all;color:#344054}
.muted{color:var(--muted)}
table{border-collapse:collapse;margin:4px 0}th,td{text-align:left;vertical-align:top;padding:3px 10px 3px 0;border-bottom:1px solid var(--line)}
table.summary th{color:var(--muted);font-weight:500;padding-right:18px}
.verdict{font-weight:700;text-transform:uppercase;padding:1px 8px;border-radius:4px}
.v-failed{background:#fee4e2;color:#b42318}.v-degraded{background:#fef0c7;color:#b54708}.v-healthy{background:#d1fadf;color:#067647}
.legend{display:flex;flex-wrap:wrap;gap:6px 16px;margin:6px 0 10px;color:var(--muted);font-size:12.5px}
.legend .key{display:inline-flex;align-items:center;gap:4px}
.lanes{border-top:1px solid var(--line)}
.axis-row,.lane{display:grid;grid-template-columns:17rem 1fr;align-items:center}
.axis text{font-size:11px;fill:var(--muted)}.axis line{stroke:var(--grey)}.axis .lag{fill:var(--amber);opacity:.6}
.node{padding:6px 0 2px;border-top:1px solid #d0d5dd;margin-top:2px}
.lane{min-height:24px}.lane:nth-child(even){background:#fcfcfd}
.lane.initiator{background:#fff4f2;box-shadow:inset 3px 0 0 var(--red)}
.label{display:flex;gap:6px;align-items:center;padding-left:10px;white-space:nowrap;overflow:hidden}
.who{min-width:5.5rem}.step{color:var(--muted);font-size:12px}
.badge{font-size:11px;padding:0 5px;border-radius:3px}.badge.first{background:var(--red);color:#fff}.badge.slow{background:#e9d7fe;color:#6941c6}
.stage{font-size:11px;padding:0 5px;border-radius:3px}
.s-none{background:#f2f4f7;color:#475467}.s-info{background:#d1fadf;color:#067647}.s-warn{background:#fef0c7;color:#b54708}.s-error{background:#fee4e2;color:#b42318}
.lane[data-stage=warn] .who{color:#b54708}.lane[data-stage=error] .who{color:#b42318}
svg.track{display:block;overflow:visible}
.grid{stroke:#f2f4f7}.gutter{fill:#f9fafb}
.alive{stroke:#d0d5dd;stroke-width:4;stroke-linecap:round}.laststep{stroke:#344054;stroke-width:2}
.mark use{stroke:#fff;stroke-width:1}
.mark.collateral use{fill:var(--grey);opacity:.75}
.mark.candidate use{fill:none;stroke:var(--purple);stroke-width:2}
.mark.warning use{fill:var(--amber);stroke:#7a2e0e}
.mark.error use,.mark.initiator use{fill:var(--red);stroke:#55160c}
.more{padding:3px 10px;color:var(--muted);font-style:italic}
.chain li{margin:4px 0}
dl dt{font-weight:600;margin-top:8px}dl dd{margin:2px 0 0 0;max-width:80ch}
p.line{margin:6px 0}
pre.evidence{background:#f9fafb;border:1px solid var(--line);padding:8px;overflow:auto;max-height:32rem;white-space:pre}
pre.evidence mark{background:#fee4e2;color:#7a271a;display:inline-block;min-width:100%}
footer{margin-top:32px;color:var(--muted);font-size:12px}
@media (max-width:800px){.axis-row,.lane{grid-template-columns:11rem 1fr}.step{display:none}}
@media print{
  @page{margin:12mm}
  body{font-size:10pt;color:#000}main{max-width:none;padding:0}
  *{-webkit-print-color-adjust:exact;print-color-adjust:exact}
  .lane,.node,tr,.chain li{break-inside:avoid}
  h2{break-after:avoid}
  pre.evidence{max-height:none;overflow:visible;white-space:pre-wrap;word-break:break-all}
  .axis-row,.lane{grid-template-columns:13rem 1fr}
}
"""


# The live page (`denpexd serve` at /jobs/<id>): every few seconds it asks for itself again with
# the version it shows (If-None-Match); an unchanged job answers 304, a changed one the new page,
# whose <main> replaces the old. Same origin, the browser's own credentials (the token cookie).
_LIVE_JS = """
(function () {
  var main = document.querySelector("main"), version = main.dataset.version;
  function poll() {
    fetch(location.pathname, {headers: {"If-None-Match": version}, credentials: "same-origin",
                              cache: "no-store"})
      .then(function (r) {
        if (r.status !== 200) { return null; }
        return r.text();
      })
      .then(function (text) {
        if (text) {
          var next = new DOMParser().parseFromString(text, "text/html").querySelector("main");
          if (next) { main.replaceWith(next); main = next; version = next.dataset.version; }
        }
      })
      .catch(function () {})
      .finally(function () { setTimeout(poll, POLL_MS); });
  }
  setTimeout(poll, POLL_MS);
})();
"""


def render_html(doc: dict[str, Any], *, live: dict[str, Any] | None = None) -> str:
    """The whole page for one diagnosis document. ``live``: served by `denpexd serve`, the page
    polls for its newer versions (``version``: this one's, ``poll_ms``: how often), with a link
    to the job list."""
    job = str(doc.get("job", ""))
    verdict = str(doc.get("verdict", ""))
    ini = doc.get("initiator")
    lede = f"{esc(who(ini))} broke first: <code>{esc(ini.get('rule'))}</code>" if ini else esc(verdict)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{esc(job)}: {esc(verdict)} (Denpex)</title>",
        f"<style>{_CSS}</style></head><body>",
        _SYMBOLS,
        f'<main data-job="{esc(job)}" data-verdict="{esc(verdict)}"'
        + (f' data-version="{esc(live["version"])}" data-live="1">' if live else ">"),
        '<nav><a href="/jobs">all jobs</a> · updates itself while the job runs</nav>' if live else "",
        f'<h1>Job <code>{esc(job)}</code> <span class="verdict v-{esc(verdict)}">{esc(verdict)}</span></h1>',
        f'<p class="lede">{lede}</p>' if ini else "",
        _summary(doc),
        _timeline(doc),
        _chain(doc.get("chain")),
        _root_cause(doc.get("root_cause")),
        _candidates(doc),
        _stall(doc.get("stall")),
        _trends(doc.get("trends") or []),
        _stragglers(doc.get("stragglers") or []),
        _collateral(doc),
        _notices(doc),
        _nan(doc),
        _divergence(doc.get("divergence")),
        _clocks(doc.get("clock") or {}),
        _evidence(doc.get("evidence")),
        f"<footer>{_read(doc.get('read'))}<p>Denpex diagnosis of job <code>{esc(job)}</code>.</p></footer>",
        "</main>",
        f"<script>{_LIVE_JS.replace('POLL_MS', str(int(live['poll_ms'])))}</script>" if live else "",
        "</body></html>",
    ]
    return "\n".join(p for p in parts if p) + "\n"


def render_job_list(rows: list[dict[str, Any]]) -> str:
    """The live job list (`denpexd serve` at /jobs): newest first, each linked to its page."""
    body = "".join(
        "<tr>"
        f'<td><a href="/jobs/{esc(r.get("job"))}"><code>{esc(r.get("job"))}</code></a></td>'
        f'<td><span class="verdict v-{esc(r.get("verdict"))}">{esc(r.get("verdict"))}</span></td>'
        f"<td>{esc(_initiator_cell(r))}</td>"
        f"<td>{'open' if r.get('open') else 'closed'}</td>"
        "</tr>"
        for r in rows
    )
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>Jobs (Denpex)</title><style>{_CSS}</style></head><body><main>"
        f'<h1>Jobs</h1><table class="jobs"><thead><tr><th>job</th><th>verdict</th><th>first failure</th>'
        f"<th>state</th></tr></thead><tbody>{body}</tbody></table></main></body></html>\n"
    )


def _initiator_cell(row: dict[str, Any]) -> str:
    if row.get("initiator_node") is None:
        return ""
    return f"node {row['initiator_node']} rank {row.get('initiator_rank')} ({row.get('category') or '?'})"
