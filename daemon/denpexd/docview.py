"""What the Markdown and HTML pictures read off the diagnosis document alike.

Both renderers take the document (docs/diagnosis-json.md) and nothing else, so they agree with the
text report and with each other by construction. The few derivations they share live here: who a
line belongs to, the collateral counted by rule, rank lists written as ranges, the evidence lines,
and a rule's prose split at its backtick code spans.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from denpex_agent.timestamps import parse_iso

EVIDENCE_MAX_LINES = 100
_CODE_SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")


def who(d: dict[str, Any]) -> str:
    rank = d.get("rank")
    return f"node {d['node']} rank {rank if rank is not None else '-'}"


def job_failure(d: dict[str, Any]) -> str | None:
    """The sentence for a job that failed as a whole by what the engine inferred rather than by a
    line every rank logged, or None."""
    if d.get("duplicate_ranks"):
        return (
            "the launch gave the same global rank to several processes (duplicate-global-rank): "
            "the job's set-up, not one rank, is the cause"
        )
    if any(t.get("kind") == "collapse" for t in d.get("trends") or []) and not d.get("candidates"):
        return (
            "the loss scale collapsed below 1 (loss-scale-collapse): every step overflows on the "
            "all-reduced gradients, so the job, not one rank, stopped training"
        )
    return None


def shared_failure_line(rule: str | None, ranks: list[int]) -> str:
    """Why no single rank is named when the decisive error is the job's: the ranks that logged it
    all failed the same way, or, when only one rank's line is in the logs, the rule says the
    message is about the job's set-up (the rank that printed it only noticed it)."""
    if len(ranks) == 1:
        return (
            f"a failure of the job's set-up ({rule}, logged by rank {ranks[0]}): "
            "the rank that printed it noticed it, it did not cause it"
        )
    return (
        f"every rank failed the same way ({rule}" + (f", ranks {rank_ranges(ranks)}" if ranks else "") + "): "
        "the job's set-up, not one rank, is the cause"
    )


def checkpoint_stall_line(ckpt: dict[str, Any]) -> str:
    """What `checkpoint_stall` says, in one sentence (it ends with a colon: the save line follows)."""
    return (
        f"the collective that timed out began {ckpt['collective_entered']} (timeout {ckpt['timeout_s']:g} s, "
        f"{who(ckpt['waiting'])} waiting), as {who(ckpt)} announced a checkpoint save and logged no step "
        "after it:"
    )


def logged_stall_line(quiet: dict[str, Any]) -> str:
    """What `logged_stall` says, in one sentence."""
    silent = float(quiet["silent_s"])
    span = f"{silent / 3600:.1f} h" if silent >= 5400 else f"{silent / 60:.0f} min"
    return (
        f"no rank logged a step after {quiet['since']}, yet the logs went on until {quiet['until']} "
        f"({span}; stalled beyond {quiet['threshold_s']:g} s)"
    )


def last_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    return lines[-1] if lines else ""


def when(iso: Any) -> float | None:
    """Epoch seconds of a document time (None for a missing or malformed one)."""
    return parse_iso(iso) if isinstance(iso, str) else None


def offset(seconds: Any) -> str:
    """A clock offset, signed, to the millisecond (never ``-0.000``)."""
    value = float(seconds) if isinstance(seconds, (int, float)) else 0.0
    return f"{0.0 if abs(value) < 0.0005 else value:+.3f} s"


def rank_ranges(ranks: list[int], limit: int = 24) -> str:
    """``[0, 1, 2, 5, 7, 8]`` → ``0-2, 5, 7-8``; past ``limit`` runs, ``… (+N more)``."""
    runs: list[tuple[int, int]] = []
    for r in sorted(set(ranks)):
        if runs and r == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], r)
        else:
            runs.append((r, r))
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in runs[:limit]]
    if len(runs) > limit:
        rest = sum(b - a + 1 for a, b in runs[limit:])
        parts.append(f"… (+{rest} more)")
    return ", ".join(parts)


@dataclass(frozen=True, slots=True)
class RuleCount:
    """One rule's collateral: how often it occurred, on which ranks, and in which launchers."""

    rule: str
    count: int
    ranks: list[int]
    launchers: list[str]

    def where(self, limit: int = 24) -> str:
        parts = [f"ranks {rank_ranges(self.ranks, limit)}"] if self.ranks else []
        if self.launchers:
            parts.append(f"launcher of {len(self.launchers)} node(s)")
        return "; ".join(parts)


def collateral_by_rule(collateral: list[dict[str, Any]]) -> list[RuleCount]:
    """The collateral entries summed per rule, the most frequent first."""
    counts: dict[str, int] = {}
    ranks: dict[str, set[int]] = {}
    launchers: dict[str, set[str]] = {}
    for c in collateral:
        rule = str(c.get("rule"))
        counts[rule] = counts.get(rule, 0) + int(c.get("count") or 0)
        if c.get("rank") is None:
            launchers.setdefault(rule, set()).add(str(c.get("node")))
        else:
            ranks.setdefault(rule, set()).add(int(c["rank"]))
    return [
        RuleCount(rule, n, sorted(ranks.get(rule, ())), sorted(launchers.get(rule, ())))
        for rule, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    ]


def evidence_lines(
    evidence: dict[str, Any] | None, limit: int = EVIDENCE_MAX_LINES
) -> tuple[list[str], list[str]]:
    """The lines before the initiator's and the initiator's own, together at most ``limit``: the
    initiator's lines first, then as many of the latest lines before them as fit."""
    if not evidence:
        return [], []
    own = [_clean(x) for x in str(evidence.get("text") or "").splitlines()][:limit]
    room = limit - len(own)
    before = [_clean(str(x)) for x in (evidence.get("before") or [])]
    return (before[-room:] if room > 0 else []), own


def _clean(line: str) -> str:
    return line.replace("\r", "").replace("\x00", "\ufffd")


def prose(text: str) -> list[tuple[bool, str]]:
    """A rule's explanation split into plain runs and backtick code spans, ``(is_code, text)``."""
    out: list[tuple[bool, str]] = []
    pos = 0
    for m in _CODE_SPAN.finditer(text):
        if m.start() > pos:
            out.append((False, text[pos : m.start()]))
        out.append((True, m.group(1)))
        pos = m.end()
    if pos < len(text):
        out.append((False, text[pos:]))
    return out


def stage_ranks(per_rank: dict[str, str]) -> dict[str, list[int]]:
    """The NaN fingerprint's ``per_rank`` inverted: stage → its ranks."""
    out: dict[str, list[int]] = {}
    for rank, stage in per_rank.items():
        if rank.lstrip("-").isdigit():
            out.setdefault(stage, []).append(int(rank))
    return {stage: sorted(ranks) for stage, ranks in out.items()}


def chain_lag(then: dict[str, Any]) -> str:
    """How much later the other ranks failed, in steps and seconds ("" when unknown)."""
    lag = []
    if then.get("lag_steps"):
        lag.append(f"{then['lag_steps']} step(s)")
    if "lag_s" in then:
        lag.append(f"{then['lag_s']:.3f} s")
    return " / ".join(lag)
