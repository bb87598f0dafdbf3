"""The report as GitHub-flavoured Markdown, ready to paste into an issue.

It says what the text report (report.py) says, from the same diagnosis document
(docs/diagnosis-json.md), laid out for a page rather than a terminal: a summary table, the chain
of events, the root cause, the collateral counted by rule, the clocks, the sections that appear
only when the engine found something (a stall, trends, slow ranks, a divergence), and the evidence
in a collapsed ``<details>`` block.

Log text is never taken for Markdown. A table cell is one line; in it, and in prose, every
character Markdown could read as syntax is backslash-escaped, and log lines and identifiers sit
in code spans whose backtick runs are longer than any run inside them (``|`` escaped there too,
as GFM tables require). The evidence's fence is longer than the longest backtick run in the
lines it holds, so no log line can close it.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterable
from typing import Any

from denpexd.docview import (
    chain_lag,
    checkpoint_stall_line,
    collateral_by_rule,
    evidence_lines,
    job_failure,
    last_line,
    logged_stall_line,
    offset,
    prose,
    rank_ranges,
    shared_failure_line,
    stage_ranks,
    who,
)

CELL_CHARS = 200
CANDIDATES_SHOWN = 8
DIVERGENT_RANKS_SHOWN = 8
LAST_STEPS_SHOWN = 16

_ESCAPE = re.compile(r"([\\`*_\[\]<>|~&#!])")
_BACKTICKS = re.compile(r"`+")


def text(value: Any) -> str:
    """Plain text, escaped so that Markdown shows it as it is, on one line."""
    flat = " ".join(str(value).split())
    return _ESCAPE.sub(r"\\\1", flat)


def code(value: Any, limit: int = CELL_CHARS) -> str:
    """A code span for a table cell: ``value`` on one line, at most ``limit`` characters, its pipes
    escaped (GFM splits a row at every unescaped pipe, code spans included)."""
    return _span(value, limit, in_table=True)


def span(value: Any, limit: int = CELL_CHARS) -> str:
    """A code span for prose, where a backslash before a pipe would show."""
    return _span(value, limit, in_table=False)


def _span(value: Any, limit: int, *, in_table: bool) -> str:
    flat = " ".join(str(value).split())
    if len(flat) > limit:
        flat = flat[: limit - 1] + "…"
    if not flat:
        return ""
    ticks = "`" * (max((len(m) for m in _BACKTICKS.findall(flat)), default=0) + 1)
    body = flat.replace("|", "\\|") if in_table else flat
    if body.startswith("`") or body.endswith("`"):
        body = f" {body} "
    return f"{ticks}{body}{ticks}"


def fence(lines: list[str], info: str = "text") -> list[str]:
    """A fenced code block no line of ``lines`` can close."""
    longest = max((len(m) for line in lines for m in _BACKTICKS.findall(line)), default=0)
    mark = "`" * max(3, longest + 1)
    return [f"{mark}{info}", *lines, mark]


def table(header: list[str], rows: Iterable[list[str]]) -> list[str]:
    """A GFM table; cells are already escaped Markdown."""
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out.extend("| " + " | ".join(row) + " |" for row in rows)
    return out


def rich(value: str) -> str:
    """A rule's prose: its backtick spans stay code, the rest is escaped text."""
    return "".join(
        span(part, limit=10_000) if is_code else _keep_edges(part) for is_code, part in prose(value)
    )


def _keep_edges(part: str) -> str:
    core = text(part)
    return (" " if part[:1].isspace() else "") + core + (" " if part[-1:].isspace() and core else "")


def _where(d: dict[str, Any]) -> str:
    return f"{d.get('file')}:{d.get('line')}"


def _rank(value: Any) -> str:
    return "launcher" if value is None else str(value)


def _time(value: Any) -> str:
    return code(value) if value else "unknown"


def _summary(d: dict[str, Any]) -> list[str]:
    ini = d.get("initiator") or {}
    rc = d.get("root_cause") or {}
    head = [
        "job",
        "verdict",
        "initiator node",
        "rank",
        "rule",
        "category",
        "confidence",
        "scope",
        "root cause",
    ]
    row = [
        code(d.get("job")),
        f"**{text(d.get('verdict', ''))}**",
        code(ini.get("node")) if ini else "none",
        f"**{_rank(ini.get('rank'))}**" if ini else "",
        code(ini.get("rule")) if ini else "",
        text(ini.get("category", "")),
        f"{float(ini.get('confidence') or 0):.0%}" if ini else "",
        text(d.get("scope", "rank")),
        text(rc.get("title", "")),
    ]
    out = table(head, [row])
    if ini:
        where = f" in {span(_where(ini))}" if ini.get("file") else ""
        out += [
            "",
            f"**First failure** at {span(ini.get('time') or 'unknown time')}{where}: {span(last_line(ini.get('text')), 400)}",
        ]
    return out


def _headline(d: dict[str, Any]) -> list[str]:
    """What the summary table cannot say: a stall, a failure no single rank started."""
    ini = d.get("initiator")
    rc = d.get("root_cause") or {}
    stall = d.get("stall")
    out: list[str] = []
    if stall:
        since = stall.get("since") or "unknown time"
        out.append(
            f"**Stalled:** no rank advanced past step {stall['last_step']} for {stall['silent_s']:.0f} s "
            f"(since {text(since)}; threshold {stall['threshold_s']:.1f} s), and no process reported an error."
        )
    if d.get("verdict") == "failed" and d.get("scope") == "job" and not ini and not stall:
        shared = [c for c in d.get("candidates") or [] if c.get("rule") == rc.get("rule")]
        ranks = sorted({c["rank"] for c in shared if c.get("rank") is not None})
        if (whole := job_failure(d)) is not None:
            out.append(f"**No single rank:** {text(whole)}.")
        elif shared:
            out.append(f"**No single rank:** {text(shared_failure_line(rc.get('rule'), ranks))}.")
        else:
            out.append(
                f"**No single rank:** every rank only waited alike ({span(rc.get('rule'))}): no rank "
                "stopped earlier, stayed silent or was named, so none is a suspect."
            )
    elif d.get("verdict") == "failed" and not ini and not stall and d.get("scope") != "job":
        out.append("**First failure:** could not be attributed to a rank (see the collateral).")
    return _section(None, out)


def _section(title: str | None, body: list[str]) -> list[str]:
    if not body:
        return []
    return ["", f"### {title}", "", *body] if title else ["", *body]


def _chain_row(label: str, step: dict[str, Any]) -> list[str]:
    return [
        label,
        _time(step.get("time")),
        str(step["step"]) if step.get("step") is not None else "",
        code(step.get("node")),
        _rank(step.get("rank")),
        code(step.get("rule")),
        code(last_line(step.get("text")), 120),
    ]


def _chain(chain: dict[str, Any] | None) -> list[str]:
    if not chain:
        return []
    rows = [_chain_row("first related warning", chain["first_warning"])]
    if chain.get("first_error"):
        rows.append(_chain_row("its first error", chain["first_error"]))
    then = chain.get("then")
    if then:
        lag = chain_lag(then)
        label = f"then {then['ranks']} other rank(s) failed" + (f", {lag} later" if lag else "")
        rows.append(_chain_row(label, then["first"]))
    body = table(["", "time (aligned)", "step", "node", "rank", "rule", "line"], rows)
    if chain.get("summary"):
        body += ["", f"_{text(chain['summary'])}_"]
    return _section("Chain of events", body)


def _root_cause(rc: dict[str, Any] | None) -> list[str]:
    if not rc:
        return []
    body: list[str] = []
    for label, key in (("Why", "root_cause"), ("Fix", "fix"), ("Verify", "verify")):
        if rc.get(key):
            body += [f"**{label}.** {rich(' '.join(str(rc[key]).split()))}", ""]
    refs = rc.get("references") or []
    if refs:
        body += ["**References**", ""] + [f"- {_reference(r)}" for r in refs] + [""]
    return _section(f"Root cause: {text(rc.get('title', ''))}", body[:-1] if body else [])


def _reference(ref: str) -> str:
    if re.fullmatch(r"https?://[^\s<>`]+", ref):
        return f"<{ref}>"
    return rich(ref)


def _candidates(d: dict[str, Any]) -> list[str]:
    others = [c for c in (d.get("candidates") or [])[1:] if c.get("confidence", 0) >= 0.01]
    rows = [
        [
            code(c.get("node")),
            _rank(c.get("rank")),
            code(c.get("rule")),
            _time(c.get("time")),
            f"{c['confidence']:.0%}",
        ]
        for c in others[:CANDIDATES_SHOWN]
    ]
    body = table(["node", "rank", "rule", "time (aligned)", "confidence"], rows) if rows else []
    if len(others) > CANDIDATES_SHOWN:
        body += ["", f"+{len(others) - CANDIDATES_SHOWN} more"]
    return _section("Other candidates (too close to call by clock)", body)


def _stall(stall: dict[str, Any] | None) -> list[str]:
    steps = (stall or {}).get("last_steps") or []
    if not steps:
        return []
    rows = [
        [code(r.get("node")), _rank(r.get("rank")), str(r.get("step")), code(r.get("text", ""), 160)]
        for r in steps[:LAST_STEPS_SHOWN]
    ]
    assert stall is not None
    body = [
        f"{stall['ranks']} rank(s) followed; the ones behind first.",
        "",
        *table(["node", "rank", "step", "last step line"], rows),
    ]
    return _section("Stall: each rank's last step", body)


def _num(value: Any, spec: str = ".4g") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else ""


def _trends(trends: list[dict[str, Any]]) -> list[str]:
    rows = []
    for t in trends:
        recovered = t.get("recovered_step")
        end = (
            f"recovered at step {recovered}"
            if recovered is not None
            else (f"still {_num(t.get('last_value'))} at the end" if "last_value" in t else "")
        )
        rows.append(
            [
                text(t.get("metric", "")),
                text(t.get("kind", "")),
                code(t.get("rule")),
                str(t.get("start_step", "")),
                str(t.get("detected_step", "")),
                _num(t.get("value"), ".6g"),
                _num(t.get("baseline"), ".6g"),
                f"{_num(t.get('peak'))} at step {t['peak_step']}" if "peak_step" in t else "",
                text(end),
            ]
        )
    head = ["metric", "kind", "rule", "from step", "detected at", "value", "baseline", "peak", "end"]
    return _section("Trends (against the job's own history)", table(head, rows) if rows else [])


def _sentence(line: str) -> str:
    """A docview sentence (lower case first) as a paragraph of its own."""
    return text(line[:1].upper() + line[1:])


def _logged_stall(quiet: dict[str, Any] | None) -> list[str]:
    if not quiet:
        return []
    return _section("Stalled without an error", [_sentence(logged_stall_line(quiet))])


def _checkpoint_stall(ckpt: dict[str, Any] | None) -> list[str]:
    if not ckpt:
        return []
    body = [
        _sentence(checkpoint_stall_line(ckpt)),
        "",
        f"> {text(ckpt['time'])} {span(ckpt['text'])}",
    ]
    return _section("Hung in a checkpoint save", body)


def _duplicates(dups: list[dict[str, Any]]) -> list[str]:
    rows = [
        [
            text(str(dup["rank"])),
            text(", ".join(f"{c['node']} rank {_rank(c.get('rank'))}" for c in dup["claimed_by"])),
        ]
        for dup in dups
    ]
    return _section(
        "Global ranks announced twice", table(["global rank", "announced by"], rows) if rows else []
    )


def _stragglers(stragglers: list[dict[str, Any]]) -> list[str]:
    rows = []
    for s in stragglers:
        if s.get("metric") == "step_time":
            how = f"own step time {_num(s.get('ratio'), '.3f')}x its peers' median ({_num(s.get('median_s'), '.4f')} s vs {_num(s.get('typical_s'), '.4f')} s)"
            extra = f"confidence {_num(s.get('confidence'), '.4f')} over {s.get('samples')} samples"
            since = str(s["since_step"]) if s.get("since_step") is not None else ""
        else:
            how = f"data_time {_num(s.get('data_time_s'), '.3f')} s vs typical {_num(s.get('typical_s'), '.3f')} s"
            extra, since = "", ""
        rows.append(
            [
                code(s.get("node")),
                _rank(s.get("rank")),
                code(s.get("rule", "")),
                text(how),
                since,
                text(extra),
            ]
        )
    head = ["node", "rank", "rule", "how slow", "since step", "evidence"]
    return _section("Stragglers", table(head, rows) if rows else [])


def _not_finished(d: dict[str, Any]) -> list[str]:
    if d.get("verdict") != "healthy" or d.get("finished") is not False:
        return []
    top = max((r.get("last_step") or 0) for r in d.get("ranks") or [{}])
    return _section(
        None,
        [
            f"**Not finished:** no rank logged the end of training and nothing failed: the logs stop at step {top} "
            "(a job still running, a silent stall, or logs cut short)."
        ],
    )


def _collateral(d: dict[str, Any]) -> list[str]:
    coll = d.get("collateral") or []
    if not coll:
        return []
    ranks = d.get("collateral_ranks") or []
    rows = [[code(rc.rule), str(rc.count), text(rc.where())] for rc in collateral_by_rule(coll)]
    body = [
        f"{d.get('suppressed', 0)} event(s) on {len(ranks)} other rank(s) suppressed as consequences.",
        "",
        *table(["rule", "count", "where"], rows),
    ]
    return _section("Collateral", body)


def _notices(notices: list[dict[str, Any]]) -> list[str]:
    if not notices:
        return []
    rows = [
        [
            code(n.get("rule")),
            str(n.get("count")),
            text(n.get("title")),
            code((n.get("first") or {}).get("text")),
        ]
        for n in notices
    ]
    body = [
        "Lines that look alarming and that the rule library knows are not failures:",
        "",
        *table(["rule", "count", "what", "first line"], rows),
    ]
    return _section("Known harmless", body)


def _nan(d: dict[str, Any]) -> list[str]:
    nan = (d.get("fingerprints") or {}).get("nan") or {}
    if nan.get("stage") not in ("warn", "error"):
        return []
    by_stage = stage_ranks(nan.get("per_rank") or {})
    rows = [
        [text(stage), str(len(by_stage[stage])), text(rank_ranges(by_stage[stage]))]
        for stage in ("error", "warn", "info", "none")
        if stage in by_stage
    ]
    body = [
        f"Stage **{text(nan['stage'])}**, first on rank **{_rank(nan.get('first_rank'))}**.",
        "",
        *table(["stage", "ranks", "which"], rows),
    ]
    return _section("NaN fingerprint", body)


def _divergence(div: dict[str, Any] | None) -> list[str]:
    if div is None:
        return []
    ctl = div.get("control") or {}
    body = [
        f"Control: {ctl.get('files', 0)} file(s), {ctl.get('lines', 0)} lines, {ctl.get('templates', 0)} templates.",
        "",
    ]
    first = div.get("first")
    if first is None:
        body.append("Every line's template occurs in the healthy run.")
        return _section("First divergence from the healthy run", body)
    body += [
        f"First: {text(who(first))} at {span(first.get('time') or 'unknown time')}, {span(_where(first))}",
        "",
    ]
    per_rank = div.get("per_rank") or []
    rows = [
        [_time(e.get("time")), code(e.get("node")), _rank(e.get("rank")), code(e.get("text", ""), 160)]
        for e in per_rank[:DIVERGENT_RANKS_SHOWN]
    ]
    body += table(["time (aligned)", "node", "rank", "first new line"], rows)
    if len(per_rank) > DIVERGENT_RANKS_SHOWN:
        body += ["", f"+{len(per_rank) - DIVERGENT_RANKS_SHOWN} more"]
    return _section("First divergence from the healthy run", body)


def _node_history(record: dict[str, Any] | None) -> list[str]:
    note = (record or {}).get("note")
    return _section(None, [f"**Node history:** {text(note)}"]) if note else []


def _clocks(clock: dict[str, Any]) -> list[str]:
    rows = [
        [
            code(node),
            offset(c.get("offset_s")),
            f"±{c.get('uncertainty_s', 0):.3f} s",
            text(c.get("method", "")),
            str(c.get("samples", "")),
        ]
        for node, c in clock.items()
    ]
    body = [
        "Aligned time = local time - offset.",
        "",
        *table(["node", "offset", "uncertainty", "method", "samples"], rows),
    ]
    return _section("Clocks", body) if rows else []


def _evidence(ev: dict[str, Any] | None) -> list[str]:
    before, own = evidence_lines(ev)
    if not own and not before:
        return []
    assert ev is not None
    lines = [f"  {x}" for x in before] + [f"> {x}" for x in own]
    where = _where(ev)
    summary = f"Evidence: {len(before)} line(s) before {where}, then the line itself (marked >)"
    return [
        "",
        "<details>",
        f"<summary>{html.escape(summary, quote=False)}</summary>",
        "",
        *fence(lines),
        "",
        "</details>",
    ]


def _read(read: dict[str, Any] | None) -> list[str]:
    if not read:
        return []
    warnings = read.get("warnings") or []
    body = [
        f"Read {read['files']} file(s), {read['bytes'] / 1e6:.1f} MB, {read['lines']} lines, "
        f"{read['events']} matches, {len(warnings)} warning(s)."
    ]
    if warnings:
        body += [""] + [f"- {span(w, 300)}" for w in warnings[:10]]
    return _section(None, body)


def render_markdown(d: dict[str, Any]) -> str:
    out = [f"## Denpex: job {span(d.get('job'))}: {text(str(d.get('verdict', '')).upper())}", ""]
    out += _summary(d)
    out += _headline(d)
    out += _chain(d.get("chain"))
    out += _root_cause(d.get("root_cause"))
    out += _candidates(d)
    out += _stall(d.get("stall"))
    out += _trends(d.get("trends") or [])
    out += _checkpoint_stall(d.get("checkpoint_stall"))
    out += _logged_stall(d.get("logged_stall"))
    out += _duplicates(d.get("duplicate_ranks") or [])
    out += _stragglers(d.get("stragglers") or [])
    out += _not_finished(d)
    out += _collateral(d)
    out += _notices(d.get("notices") or [])
    out += _nan(d)
    out += _divergence(d.get("divergence"))
    out += _node_history(d.get("node_history"))
    out += _clocks(d.get("clock") or {})
    out += _evidence(d.get("evidence"))
    out += _read(d.get("read"))
    return "\n".join(out) + "\n"
