"""Secret masking applied to every text before it leaves the reader."""

from __future__ import annotations

import re
from typing import Any

from denpex_agent.matcher import HAVE_HYPERSCAN, PatternDatabase

MASK = "***"

_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # scheme://user:password@host
    (re.compile(r"(?P<pre>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s:@]+:)[^@\s/]+(?=@)"), rf"\g<pre>{MASK}"),
    # Authorization: Bearer xxx / Basic xxx
    (re.compile(r"(?i)(?P<pre>\b(?:bearer|basic)\s+)[A-Za-z0-9._~+/=-]{8,}"), rf"\g<pre>{MASK}"),
    # key=value, key: value, "key": "value" for secret-looking keys
    (
        re.compile(
            r"(?i)(?P<pre>\b[\w.-]*(?:password|passwd|pwd|secret|token|api[_-]?key|access[_-]?key|private[_-]?key)"
            r"[\"']?[ \t]*[:=][ \t]*[\"']?)(?P<val>[^\s\"',;&}]+)"
        ),
        rf"\g<pre>{MASK}",
    ),
    # well-known token shapes
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), MASK),
    (re.compile(r"\bhf_[A-Za-z0-9]{30,}\b"), MASK),
    (re.compile(r"\bgh[pousr]_[A-Za-z0-9]{30,}\b"), MASK),
    (re.compile(r"\bsk-[A-Za-z0-9_-]{20,}\b"), MASK),
    (re.compile(r"\bxox[abprs]-[A-Za-z0-9-]{10,}\b"), MASK),
)

# One cheap search decides whether any of the substitutions above can apply. Each alternative
# below is implied by one of them (case-insensitively); a context of a hundred lines is checked at
# once. Hyperscan does it in microseconds; Python's re, the fallback, needs the text lowercased
# first (a case-insensitive alternation is an order of magnitude slower) and about 0.1 ms per KiB.
_QUICK_PARTS = (
    r"://[^/\s:@]+:",
    r"bearer[^a-z0-9_]",  # not \s: hyperscan's \s is ASCII only, Python's is not
    r"basic[^a-z0-9_]",
    r"passw",
    r"pwd",
    r"secret",
    r"token[\"']?[ \t]*[:=]",
    r"key[\"']?[ \t]*[:=]",
    r"akia",
    r"asia",
    r"hf_",
    r"gh[pousr]_",
    r"sk-",
    r"xox",
)
_QUICK = re.compile("|".join(_QUICK_PARTS))
_quick_db: Any = None


def _may_hold_secret(text: str) -> bool:
    global _quick_db
    if not HAVE_HYPERSCAN:
        return _QUICK.search(text.lower()) is not None
    if _quick_db is None:
        # compiled once per machine, then loaded from the matcher's cache (compiling costs the
        # agent ~9 MB of peak memory, loading ~0.3 MB)
        _quick_db = PatternDatabase([(i, p, True) for i, p in enumerate(_QUICK_PARTS)])
    # lower(): Unicode letters whose lowercase is ASCII (the Kelvin sign) match as re does
    data = (text if text.isascii() else text.lower()).encode("utf-8", "surrogatepass")
    return bool(_quick_db.any_match(data))


def mask(text: str) -> str:
    """Replace passwords in URLs, bearer tokens, key=value secrets and known token shapes."""
    if not _may_hold_secret(text):
        return text
    for rx, repl in _PATTERNS:
        text = rx.sub(repl, text)
    return text


def mask_lines(lines: list[str]) -> list[str]:
    """`mask` over many lines at once (one search instead of one per line); none of the
    substitutions crosses a line break."""
    if not lines:
        return lines
    joined = "\n".join(lines)
    masked = mask(joined)
    return lines if masked is joined else masked.split("\n")
