"""The event type shared by the reader, the agent's wire format and the daemon's engine.

An event's type is also its wire schema: the bounds a receiver enforces are written on its fields
(msgspec's `Meta`), and `denpex_agent.wire` decodes a batch's events straight into `Event`s,
validating as it parses. Building an event in code checks nothing; the bounds bind what arrives.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from msgspec import Meta

from denpex_agent.rules import CATEGORIES, PROGRESS_CATEGORY, ROLES, SEVERITIES
from denpex_agent.timestamps import SANE_MAX, SANE_MIN

KINDS = ("match", "progress", "heartbeat")
TS_SOURCES = ("line", "inherited", "read", "none")

MAX_ID_LEN = 128
MAX_FILE_LEN = 4096
MAX_RULE_LEN = 64
MAX_TEXT = 64 * 1024
MAX_CONTEXT_LINES = 200
MAX_FIELDS = 32
MAX_FIELD_NAME = 64
MAX_COUNTER = 1 << 62  # offsets, line numbers, sequence numbers
MAX_FIELD_INT = 1 << 53  # an integer field (a step, a rank, a signal)
MAX_FIELD_FLOAT = 1e300  # a float field's magnitude (a loss may be huge, never infinite)
MAX_FIELD_TEXT = 1024
TS_MIN, TS_MAX = SANE_MIN, SANE_MAX  # an event's timestamp: 2000-01-01 to 2100-01-01 (UTC)
NOT_GIVEN = -1  # `offset` and `line_no` of an event built without them; the wire refuses it

if TYPE_CHECKING:  # mypy sees plain strings; msgspec the enumerations
    Kind = str
    TsSource = str
    Severity = str
    Role = str
    Category = str
else:
    Kind = Literal[KINDS]
    TsSource = Literal[TS_SOURCES]
    Severity = Literal[SEVERITIES]
    Role = Literal[ROLES]
    Category = Literal[(*CATEGORIES, PROGRESS_CATEGORY)]

Count = Annotated[int, Meta(ge=0, lt=MAX_COUNTER)]
RankNo = Annotated[int, Meta(ge=-1, lt=1 << 31)]
Text = Annotated[str, Meta(max_length=MAX_TEXT)]
FieldName = Annotated[str, Meta(max_length=MAX_FIELD_NAME)]
if TYPE_CHECKING:  # code reads a field as whatever it expects; the wire checks the union
    FieldValue = Any
else:
    FieldValue = (
        bool
        | Annotated[int, Meta(ge=-MAX_FIELD_INT, le=MAX_FIELD_INT)]
        | Annotated[float, Meta(ge=-MAX_FIELD_FLOAT, le=MAX_FIELD_FLOAT)]
        | Annotated[str, Meta(max_length=MAX_FIELD_TEXT)]
        | None
    )


class Event(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """One matched line (or folded block), one progress sample, or one heartbeat.

    ``ts`` is the node-local epoch time parsed from the line (``ts_source="line"``), taken from
    the nearest earlier timestamped line (``"inherited"``), the agent's read time (``"read"``),
    or unknown (``None``, ``"none"``). ``text`` and ``context`` are already masked.

    On the wire an event carries every field but ``job`` and ``node`` (its batch's); ``id``,
    ``kind``, ``offset`` and ``line_no`` are required there. Events hold no reference back to
    anything that holds them, so the garbage collector does not track them (``gc=False``): a
    daemon keeps hundreds of thousands.
    """

    id: Annotated[str, Meta(min_length=1, max_length=MAX_ID_LEN)]
    kind: Kind
    job: str = ""
    node: str = ""
    rank: RankNo | None = None
    local_rank: RankNo | None = None
    file: Annotated[str, Meta(max_length=MAX_FILE_LEN)] = ""
    offset: Count = NOT_GIVEN
    line_no: Count = NOT_GIVEN
    ts: Annotated[float, Meta(ge=TS_MIN, lt=TS_MAX)] | None = None
    ts_source: TsSource = "none"
    rule: Annotated[str, Meta(max_length=MAX_RULE_LEN)] | None = None
    severity: Severity | None = None
    role: Role | None = None
    category: Category | None = None
    text: Text = ""
    context: Annotated[list[Text], Meta(max_length=MAX_CONTEXT_LINES)] = []
    fields: Annotated[dict[FieldName, FieldValue], Meta(max_length=MAX_FIELDS)] = {}

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)

    def but(self, **changes: Any) -> Event:
        """A copy with ``changes`` applied (`dataclasses.replace` for an event)."""
        return msgspec.structs.replace(self, **changes)


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
