"""The text report: what a person reads in ten seconds, most important first."""

from __future__ import annotations

import textwrap
from typing import Any

from denpexd.docview import (
    chain_lag,
    checkpoint_stall_line,
    job_failure,
    logged_stall_line,
    shared_failure_line,
    who,
)

EVIDENCE_LINES = 12
DIVERGENT_RANKS_SHOWN = 8


def _wrap(label: str, text: str) -> list[str]:
    if not text:
        return []
    body = textwrap.wrap(text, width=96, subsequent_indent=" " * 12) or [""]
    return [f"{label:<11} {body[0]}", *body[1:]]


def _chain(chain: dict[str, Any] | None) -> list[str]:
    """The failure's chain: the first related warning, the rank's first error, the others."""
    if not chain:
        return []
    out = ["", "CHAIN"]

    def at(step: dict[str, Any]) -> str:
        where = step.get("time") or "unknown time"
        return where + (f" (step {step['step']})" if "step" in step else "")

    fw = chain["first_warning"]
    out.append(f"  first      {at(fw)}  {fw['rule']}")
    err = chain.get("first_error")
    if err:
        out.append(f"  its error  {at(err)}  {err['rule']}")
    then = chain.get("then")
    if then:
        lag = chain_lag(then)
        out.append(
            f"  then       {at(then['first'])}  {then['ranks']} other rank(s) failed"
            + (f", {lag} later" if lag else "")
            + f": {', '.join(then['rules'][:4])}"
        )
    return out


def _stall_line(stall: dict[str, Any]) -> str:
    since = stall.get("since") or "unknown time"
    pause = f", in an announced pause ({stall['pause'].strip()[:60]})" if stall.get("pause") else ""
    return (
        f"STALLED  no rank advanced past step {stall['last_step']} for {stall['silent_s']:.0f} s (since {since}; "
        f"threshold {stall['threshold_s']:.1f} s{pause}), and no process reported an error"
    )


def _trends(trends: list[dict[str, Any]]) -> list[str]:
    if not trends:
        return []
    out = ["", "TRENDS  (judged against the job's own history)"]
    for t in trends:
        if t["kind"] == "falling":
            out.append(
                f"  loss scale falling after it had settled at {t['baseline']:.6g}: new lows from step "
                f"{t['start_step']} to {t['detected_step']}, down to {t['value']:.6g} (overflows keep coming)"
            )
            continue
        if t["kind"] == "collapse":
            out.append(
                f"  loss scale collapsed to {t['value']:.3g} (below 1: the loss is scaled down and still overflows)"
            )
            continue
        end = (
            f"recovered at step {t['recovered_step']}"
            if t.get("recovered_step") is not None
            else f"still {t['last_value']:.4g} at the end"
        )
        out.append(
            f"  {t['metric']} {t['kind']} from step {t['start_step']} (detected at {t['detected_step']}): "
            f"{t['value']:.4g} vs a recent median of {t['baseline']:.4g}, peak {t['peak']:.4g} at step "
            f"{t['peak_step']}; {end}"
        )
    return out


def _straggler(s: dict[str, Any]) -> str:
    if s.get("metric") == "step_time":
        since = f" since step {s['since_step']}" if s.get("since_step") is not None else ""
        return (
            f"  {who(s)}  own step time {s['ratio']:.3f}x its peers' median ({s['median_s']:.4f}s vs "
            f"{s['typical_s']:.4f}s){since}, confidence {s['confidence']:.4f} over {s['samples']} samples"
        )
    return f"  {who(s)}  data_time {s['data_time_s']:.3f}s vs typical {s['typical_s']:.3f}s"


def _divergence(div: dict[str, Any] | None) -> list[str]:
    """Where the run first logged what the healthy run never did, and each rank's first such line."""
    if div is None:
        return []
    ctl = div.get("control") or {}
    out = [
        "",
        f"FIRST DIVERGENCE FROM THE HEALTHY RUN  (control: {ctl.get('files', 0)} file(s), "
        f"{ctl.get('lines', 0)} lines, {ctl.get('templates', 0)} templates)",
    ]
    first = div.get("first")
    if first is None:
        out.append("  none       every line's template occurs in the healthy run")
        return out
    out.append(f"  first      {who(first)}  at {first.get('time') or 'unknown time'}")
    out.append(f"  where      {first['file']}:{first['line']}")
    out.append(f"  line       {first['text'][:200]}")
    per_rank = div.get("per_rank") or []
    out.append(f"  per rank   {len(per_rank)} stream(s), earliest first")
    for e in per_rank[:DIVERGENT_RANKS_SHOWN]:
        out.append(f"    {e.get('time') or 'unknown time':<24}  {who(e):<20}  {e['text'][:100]}")
    if len(per_rank) > DIVERGENT_RANKS_SHOWN:
        out.append(f"    +{len(per_rank) - DIVERGENT_RANKS_SHOWN} more")
    return out


def _node_history(record: dict[str, Any] | None) -> list[str]:
    """The note of a node that keeps starting hardware/communication failures (live only)."""
    note = (record or {}).get("note")
    if not note:
        return []
    return ["", *textwrap.wrap(note, width=108, initial_indent="NODE HISTORY  ", subsequent_indent="  ")]


def _notices(notices: list[dict[str, Any]], *, why: bool) -> list[str]:
    """Known harmless lines: what each is, how often and its first line, and (``why``: when the job
    did not fail, and the notices are the answer to "is this a problem?") why it is no failure."""
    if not notices:
        return []
    out = ["", f"KNOWN HARMLESS  {len(notices)} kind(s) of line that look alarming and are not failures"]
    for n in notices:
        first = n.get("first") or {}
        where = f"{first.get('file')}:{first.get('line')}" if first.get("file") else ""
        ranks = f"on {n['ranks']} rank(s)  " if n.get("ranks") else ""
        out.append(f"  {n['count']:>5} x {n['rule']:<40} {ranks}first {where}".rstrip())
        out.append(f"          {n.get('title', '')}")
        if first.get("text"):
            out.append(f"          line  {first['text'][:160]}")
        if why:
            out.extend("          " + line for line in _wrap("why", n.get("why", "")))
    return out


def render_text(d: dict[str, Any]) -> str:
    out: list[str] = []
    verdict = d["verdict"].upper()
    out.append(f"job {d['job']}: {verdict}")
    ini = d.get("initiator")
    rc = d.get("root_cause") or {}
    if ini and ini.get("kind") == "stall":
        out.append("")
        out.append(_stall_line(d["stall"]))
        out.append(f"  suspect    {who(ini)}: {ini['text'][:200]}  (confidence {ini['confidence']:.0%})")
    elif ini:
        conf = ini.get("confidence", 1.0)
        out.append("")
        out.append(
            f"FIRST FAILURE  {who(ini)}  at {ini.get('time') or 'unknown time'}  (confidence {conf:.0%})"
        )
        out.append(f"  rule       {ini['rule']}  [{ini['category']}]")
        if ini.get("file"):
            out.append(f"  where      {ini['file']}:{ini.get('line')}")
        first_text = (ini.get("text") or "").strip().splitlines()
        if first_text:
            out.append(f"  line       {first_text[-1][:200]}")
        out.extend(_chain(d.get("chain")))
        out.extend(_node_history(d.get("node_history")))
    elif d["verdict"] == "failed" and d.get("scope") == "job" and not d.get("stall"):
        shared = [c for c in d.get("candidates", []) if c.get("rule") == rc.get("rule")]
        ranks = sorted({c["rank"] for c in shared if c.get("rank") is not None})
        out.append("")
        if (whole := job_failure(d)) is not None:
            out.append(f"NO SINGLE RANK  {whole}")
        elif shared:
            out.append(f"NO SINGLE RANK  {shared_failure_line(rc.get('rule'), ranks)}")
        else:
            out.append(
                f"NO SINGLE RANK  every rank only waited alike ({rc.get('rule')}): no rank stopped earlier, "
                "stayed silent or was named, so none is a suspect"
            )
    elif d["verdict"] == "failed" and d.get("stall"):
        out.append("")
        out.append(_stall_line(d["stall"]))
    elif d["verdict"] == "failed":
        out.append("")
        out.append("FIRST FAILURE  could not be attributed to a rank (see collateral below)")
    if rc:
        out.append("")
        out.append(f"ROOT CAUSE  {rc.get('title', '')}")
        out.extend("  " + line for line in _wrap("why", rc.get("root_cause", "")))
        out.extend("  " + line for line in _wrap("fix", rc.get("fix", "")))
        out.extend("  " + line for line in _wrap("verify", rc.get("verify", "")))
    others = [c for c in d.get("candidates", [])[1:] if c.get("confidence", 0) >= 0.01]
    if others:
        out.append("")
        out.append("OTHER CANDIDATES (too close to call by clock)")
        for c in others[:5]:
            out.append(f"  {who(c)}  {c['rule']}  at {c.get('time')}  confidence {c['confidence']:.0%}")
    stall = d.get("stall")
    if stall and stall.get("last_steps"):
        out.append("")
        out.append(f"LAST STEPS  ({stall['ranks']} rank(s), the ones behind first)")
        for r in stall["last_steps"][:8]:
            out.append(f"  {who(r)}  step {r['step']:<8} {r['text'].strip()[:120]}")
    out.extend(_trends(d.get("trends") or []))
    ckpt = d.get("checkpoint_stall")
    if ckpt:
        out.append("")
        out.append(f"CHECKPOINT STALL  {checkpoint_stall_line(ckpt)}")
        out.append(f"  {ckpt['time']}  {ckpt['text'][:160]}")
    quiet = d.get("logged_stall")
    if quiet:
        out.append("")
        out.append(f"STALLED  {logged_stall_line(quiet)}")
    dups = d.get("duplicate_ranks") or []
    if dups:
        out.append("")
        out.append(f"DUPLICATE RANKS  {len(dups)} global rank(s) announced by more than one process")
        for dup in dups[:8]:
            claimants = ", ".join(who(c) for c in dup["claimed_by"])
            out.append(f"  global rank {dup['rank']:<6} announced by {claimants}")
    stragglers = d.get("stragglers") or []
    if stragglers:
        out.append("")
        out.append("STRAGGLERS")
        for s in stragglers:
            out.append(_straggler(s))
    if d["verdict"] == "healthy" and d.get("finished") is False:
        out.append("")
        out.append(
            "NOT FINISHED  no rank logged the end of training and nothing failed: the logs stop at step "
            f"{max((r.get('last_step') or 0) for r in d.get('ranks') or [{}])} (a job still running, a silent "
            "stall, or logs cut short; `denpexd serve` reports a stall while it happens)"
        )
    coll = d.get("collateral") or []
    if coll:
        ranks = d.get("collateral_ranks", [])
        out.append("")
        out.append(
            f"COLLATERAL  {d.get('suppressed', 0)} event(s) on {len(ranks)} other rank(s) "
            f"{ranks if ranks else ''} suppressed as consequences"
        )
        by_rule: dict[str, list[dict[str, Any]]] = {}
        for c in coll:
            by_rule.setdefault(c["rule"], []).append(c)
        for rule, items in sorted(by_rule.items(), key=lambda kv: -sum(i["count"] for i in kv[1])):
            ranks_of = sorted({i["rank"] for i in items if i["rank"] is not None})
            launcher = any(i["rank"] is None for i in items)
            where = f"ranks {ranks_of}" if ranks_of else ""
            if launcher:
                where = (where + " + launcher").strip(" +")
            out.append(f"  {sum(i['count'] for i in items):>5} x {rule:<40} {where}")
    out.extend(_notices(d.get("notices") or [], why=d["verdict"] != "failed"))
    nan = (d.get("fingerprints") or {}).get("nan") or {}
    if nan.get("stage") in ("warn", "error"):
        out.append("")
        out.append(
            f"NAN FINGERPRINT  stage {nan['stage']}, first on rank {nan.get('first_rank')}, ranks {nan.get('ranks')}"
        )
    out.extend(_divergence(d.get("divergence")))
    clock = d.get("clock") or {}
    if clock:
        out.append("")
        out.append("CLOCKS (aligned time = local time - offset)")
        for node, c in clock.items():
            out.append(
                f"  {node:<16} offset {c['offset_s']:+9.3f}s  ±{c['uncertainty_s']:.3f}s  {c['method']}"
            )
    ev = d.get("evidence")
    if ev and ev.get("before"):
        out.append("")
        out.append(
            f"EVIDENCE  {len(ev['before'])} line(s) before {ev['file']}:{ev['line']} (last {EVIDENCE_LINES} shown)"
        )
        for line in ev["before"][-EVIDENCE_LINES:]:
            out.append(f"  | {line[:160]}")
        first = (ev.get("text") or "").splitlines()
        for line in first[:EVIDENCE_LINES]:
            out.append(f"  > {line[:160]}")
    read = d.get("read")
    if read:
        out.append("")
        out.append(
            f"read {read['files']} file(s), {read['bytes'] / 1e6:.1f} MB, {read['lines']} lines, "
            f"{read['events']} matches, {len(read['warnings'])} warning(s)"
        )
        for w in read["warnings"][:10]:
            out.append(f"  warning: {w}")
    return "\n".join(out) + "\n"
