"""Did a change make a failure go away? Two diagnoses in (docs/diagnosis-json.md), a finding out.

OLD is the diagnosis of a run that failed; NEW, of the same input run again after a targeted
change. OLD's failure has a signature: its decisive rule (the initiator's, or when every rank
failed alike, the job's root cause) and that rule's category. NEW is verified when three checks
hold:

* **signature**: the rule is absent from NEW. Not one line of it (`matches`, whatever its
  severity), and no candidate or collateral entry naming it (a conclusion drawn without a line,
  such as a hang suspect, can only appear as a candidate).
* **category**: NEW did not fail the same way under another rule: its own failure (initiator, or
  the job's root cause) is not of the signature's category. Other rules of that category
  elsewhere in NEW are reported and not held against it: consequences of an unrelated failure
  fall in every category (a peer's crash shows up as communication errors everywhere).
* **progress**: NEW got further than OLD did. OLD's failure step is the furthest step any of its
  ranks logged, at or after the initiator's last step: the job broke before any rank got past it.
  NEW's furthest step over its ranks must exceed it, or the signature's absence proves nothing.
  When OLD logged no step line this is "not checkable", said so, and the verdict rests on the
  other two.

A NEW that failed differently, past OLD's failure step, is verified: the change did what it was
for, and the output names NEW's own failure. A `degraded` OLD (a loss divergence, a slow rank, a
falling loss scale) is verified the same way: its signature is the root cause's rule, looked for
also among NEW's `trends` and `stragglers`, and its failure step is where the trend started (a
slow rank has none: not checkable). An OLD that is healthy has nothing to verify
(`NothingToVerify`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class NothingToVerify(ValueError):
    """OLD did not fail: there is no signature to look for."""


@dataclass(frozen=True, slots=True)
class Check:
    """One check's outcome: `ok` is None when it cannot be checked."""

    check: str
    ok: bool | None
    text: str
    where: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"check": self.check, "ok": self.ok, "text": self.text}
        if self.where is not None:
            out["where"] = self.where
        return out


def verify(new: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    """The verification document: ``verified``, ``signature``, ``old``, ``new``, ``reasons``
    (every check, passed or not) and ``notes``. Raises `NothingToVerify`."""
    sig = signature(old)
    old_step = furthest_step(old) if old.get("verdict") == "failed" else _trend_start(old, sig["rule"])
    why = (
        "OLD logged no step line, so its failure step is unknown"
        if old.get("verdict") == "failed"
        else "OLD was degraded without a step it started at (a slow rank has none)"
    )
    checks = [signature_check(sig, new), category_check(sig, new), progress_check(old_step, new, why)]
    return {
        "verified": all(c.ok is not False for c in checks),
        "signature": sig,
        "old": {
            "job": old.get("job"),
            "verdict": old.get("verdict"),
            "failure_step": old_step,
            "initiator_step": _initiator_step(old),
        },
        "new": {
            "job": new.get("job"),
            "verdict": new.get("verdict"),
            "furthest_step": furthest_step(new),
            "failure": _failure(new),
            **({"open": new["open"]} if "open" in new else {}),
        },
        "reasons": [c.to_dict() for c in checks],
        "notes": _notes(new),
    }


def signature(old: dict[str, Any]) -> dict[str, Any]:
    """OLD's decisive rule and its category, and where OLD logged it."""
    if old.get("verdict") not in ("failed", "degraded"):
        raise NothingToVerify(
            f"{old.get('job')} did not fail (verdict {old.get('verdict')}): nothing to verify"
        )
    failure = _failure(old)
    if failure is None:
        raise NothingToVerify(f"{old.get('job')} failed without a rule to look for: nothing to verify")
    return failure


def _failure(doc: dict[str, Any]) -> dict[str, Any] | None:
    """What a failed (or degraded) diagnosis names as its failure: the initiator, or the job-wide
    root cause."""
    if doc.get("verdict") not in ("failed", "degraded"):
        return None
    ini = doc.get("initiator")
    if ini:
        return {
            "rule": ini["rule"],
            "category": ini["category"],
            "scope": "rank",
            **_place(ini),
            "kind": ini.get("kind"),
        }
    rc = doc.get("root_cause") or {}
    if not rc.get("rule"):
        return None
    slow = next((st for st in doc.get("stragglers") or [] if st.get("rule") == rc["rule"]), None)
    if slow is not None:  # a degraded run's slow rank
        return {"rule": rc["rule"], "category": rc.get("category"), "scope": "rank", **_place(slow)}
    return {"rule": rc["rule"], "category": rc.get("category"), "scope": "job"}


def _place(d: dict[str, Any]) -> dict[str, Any]:
    text = (d.get("text") or "").strip().splitlines()
    return {
        "node": d.get("node"),
        "rank": d.get("rank"),
        "file": d.get("file"),
        "line": d.get("line"),
        "text": text[-1][:200] if text else "",
    }


def furthest_step(doc: dict[str, Any]) -> int | None:
    """The highest step any rank of the diagnosis logged, or None."""
    steps = [r["last_step"] for r in doc.get("ranks") or [] if isinstance(r.get("last_step"), int)]
    return max(steps) if steps else None


def _trend_start(doc: dict[str, Any], rule: str) -> int | None:
    """Where a degraded run's trend of ``rule`` started (None: no trend of it, or no step)."""
    for t in doc.get("trends") or []:
        if t.get("rule") == rule and isinstance(t.get("start_step"), int):
            return int(t["start_step"])
    return None


def _initiator_step(doc: dict[str, Any]) -> int | None:
    ini = doc.get("initiator") or {}
    for row in doc.get("ranks") or []:
        if (row.get("node"), row.get("rank")) == (ini.get("node"), ini.get("rank")):
            step = row.get("last_step")
            return step if isinstance(step, int) else None
    return None


# -- the checks ---------------------------------------------------------------------------------


def signature_check(sig: dict[str, Any], new: dict[str, Any]) -> Check:
    rule = sig["rule"]
    found = occurrence(rule, new)
    if found is None:
        return Check("signature", True, f"{rule} is absent from NEW")
    count, ranks = found.get("count"), found.get("ranks")
    amount = f"{count} line(s)" if count is not None else "named as a candidate"
    if ranks:
        amount += f" on {ranks} rank(s)"
    return Check("signature", False, f"{rule} is still there: {amount}, first at {_at(found)}", found)


def occurrence(rule: str, doc: dict[str, Any]) -> dict[str, Any] | None:
    """Where ``rule`` appears in the diagnosis (its first line when it has one), or None."""
    for m in doc.get("matches") or []:
        if m.get("rule") == rule:
            return {**(m.get("first") or {}), "count": m.get("count"), "ranks": m.get("ranks")}
    for c in doc.get("candidates") or []:
        if c.get("rule") == rule:
            return _place(c)
    for c in doc.get("collateral") or []:
        if c.get("rule") == rule:
            return {"node": c.get("node"), "rank": c.get("rank"), "time": c.get("first_time"),
                    "count": c.get("count")}  # fmt: skip
    for t in doc.get("trends") or []:
        if t.get("rule") == rule:
            return {
                "text": f"{t.get('metric')} {t.get('kind')} from step {t.get('start_step')}",
                "count": None,
            }
    for st in doc.get("stragglers") or []:
        if st.get("rule") == rule:
            return {"node": st.get("node"), "rank": st.get("rank"), "text": f"slow rank ({st.get('metric')})"}
    lost = ((doc.get("overflow") or {}).get("by_rule") or {}).get(rule)
    if lost:
        return {"count": lost, "text": "beyond the job's bounds (overflow)"}
    return None


def category_check(sig: dict[str, Any], new: dict[str, Any]) -> Check:
    category = sig["category"]
    failure = _failure(new)
    others = [
        m
        for m in new.get("matches") or []
        if m.get("category") == category and m.get("rule") not in (sig["rule"], (failure or {}).get("rule"))
    ]
    aside = ""
    if others:
        listed = ", ".join(f"{m['rule']} x{m['count']}" for m in others[:6])
        aside = f"; other {category} lines in NEW, not its failure: {listed}"
    if failure is None:
        return Check("category", True, f"NEW did not fail{aside}")
    if failure.get("category") != category:
        return Check(
            "category",
            True,
            f"NEW failed otherwise: {failure['rule']} [{failure.get('category')}] at {_at(failure)}, "
            f"a different failure{aside}",
        )
    if failure["rule"] == sig["rule"]:
        return Check("category", False, f"NEW failed with {category} again, by the signature's rule{aside}")
    return Check(
        "category",
        False,
        f"NEW failed with {category} again, under another rule: {failure['rule']} at {_at(failure)}{aside}",
        failure,
    )


def progress_check(
    old_step: int | None,
    new: dict[str, Any],
    why: str = "OLD logged no step line, so its failure step is unknown",
) -> Check:
    if old_step is None:
        return Check(
            "progress", None, f"not checkable: {why}; verification rests on the signature and category checks"
        )
    new_step = furthest_step(new)
    if new_step is None:
        return Check("progress", False, f"NEW did not progress past step {old_step}: it logged no step line")
    if new_step > old_step:
        return Check("progress", True, f"NEW reached step {new_step}, past step {old_step} where OLD failed")
    return Check(
        "progress",
        False,
        f"NEW did not progress past step {old_step} where OLD failed: it got to step {new_step}",
    )


def _notes(new: dict[str, Any]) -> list[str]:
    notes = []
    if new.get("open"):
        notes.append("NEW is still open: its diagnosis may change as events arrive")
    if "matches" not in new:
        notes.append(
            "NEW's diagnosis has no `matches` (made by an older denpexd): the signature was looked "
            "for in its candidates and collateral only"
        )
    if new.get("broken"):
        notes.append("NEW is marked broken: a fault inside the daemon may have lost some of its events")
    return notes


def _at(d: dict[str, Any]) -> str:
    who = []
    if d.get("node"):
        rank = d.get("rank")
        who.append(f"node {d['node']} rank {rank if rank is not None else '-'}")
    if d.get("file"):
        who.append(f"{d['file']}:{d.get('line')}")
    elif d.get("time"):
        who.append(d["time"])
    return "  ".join(who) or "an unknown place"


# -- text ----------------------------------------------------------------------------------------


def render_text(result: dict[str, Any]) -> str:
    sig, old, new = result["signature"], result["old"], result["new"]
    failed = [r["check"] for r in result["reasons"] if r["ok"] is False]
    head = (
        f"VERIFIED  {old['job']}'s failure ({sig['rule']}) is gone from {new['job']}"
        if result["verified"]
        else f"NOT VERIFIED  {old['job']}'s failure ({sig['rule']}) in {new['job']}: "
        f"{', '.join(failed)} check{'s' if len(failed) > 1 else ''} failed"
    )
    out = [
        head,
        "",
        f"  signature  {sig['rule']}  [{sig['category']}]"
        + (f"  {_at(sig)}" if sig.get("scope") == "rank" else "  (every rank alike)"),
        f"  old        {old['job']}: {old['verdict']}, failure step {_step(old['failure_step'])}",
        f"  new        {new['job']}: {new['verdict']}, furthest step {_step(new['furthest_step'])}",
        "",
    ]
    for r in result["reasons"]:
        mark = {True: "ok", False: "FAIL", None: "n/a"}[r["ok"]]
        out.append(f"  {mark:<5} {r['check']:<10} {r['text']}")
        line = (r.get("where") or {}).get("text")
        if r["ok"] is False and line:
            out.append(f"  {'':<5} {'':<10} > {line}")
    out.extend(f"  note  {n}" for n in result["notes"])
    return "\n".join(out) + "\n"


def _step(step: int | None) -> str:
    return "unknown" if step is None else str(step)
