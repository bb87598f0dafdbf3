"""The event type shared by the reader, the agent's wire format and the daemon's engine."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

KINDS = ("match", "progress", "heartbeat")
TS_SOURCES = ("line", "inherited", "read", "none")


@dataclass(slots=True)
class Event:
    """One matched line (or folded block), one progress sample, or one heartbeat.

    ``ts`` is the node-local epoch time parsed from the line (``ts_source="line"``), taken from
    the nearest earlier timestamped line (``"inherited"``), the agent's read time (``"read"``),
    or unknown (``None``, ``"none"``). ``text`` and ``context`` are already masked.
    """

    id: str
    kind: str
    job: str
    node: str
    rank: int | None
    local_rank: int | None
    file: str
    offset: int
    line_no: int
    ts: float | None
    ts_source: str
    rule: str | None = None
    severity: str | None = None
    role: str | None = None
    category: str | None = None
    text: str = ""
    context: list[str] = field(default_factory=list)
    fields: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def file_identity(dev: int, inode: int, head: bytes) -> str:
    """Identity of a file that survives renames: device, inode and a hash of its first bytes."""
    digest = hashlib.blake2b(head, digest_size=8).hexdigest()
    return f"{dev:x}:{inode:x}:{len(head)}:{digest}"


def identity_matches(identity: str, dev: int, inode: int, read_head: Callable[[int], bytes]) -> bool:
    """Whether ``identity`` names this (dev, inode) whose first bytes are still the same."""
    parts = identity.split(":")
    if len(parts) != 4 or parts[0] != f"{dev:x}" or parts[1] != f"{inode:x}":
        return False
    try:
        n = int(parts[2])
    except ValueError:
        return False
    head = read_head(n)
    return len(head) == n and hashlib.blake2b(head, digest_size=8).hexdigest() == parts[3]


def event_id(agent: str, identity: str, offset: int, kind: str = "match") -> str:
    """Stable id: the same line read again (after a crash or a replay) gets the same id."""
    raw = f"{agent}\x00{identity}\x00{offset}\x00{kind}".encode()
    return hashlib.blake2b(raw, digest_size=12).hexdigest()
