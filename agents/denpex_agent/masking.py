"""Secret masking applied to every text before it leaves the reader."""

from __future__ import annotations

import re

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

# One cheap search decides whether any of the substitutions above can apply. It runs on the
# lowercased text: Python's re is an order of magnitude slower on a case-insensitive alternation.
_QUICK = re.compile(
    r"://[^/\s:@]+:|bearer\s|basic\s|passw|pwd|secret|token[\"']?[ \t]*[:=]|key[\"']?[ \t]*[:=]"
    r"|akia|asia|hf_|gh[pousr]_|sk-|xox"
)


def mask(text: str) -> str:
    """Replace passwords in URLs, bearer tokens, key=value secrets and known token shapes."""
    if _QUICK.search(text.lower()) is None:
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
