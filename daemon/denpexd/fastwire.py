"""A faster `wire.decode_batch` for the daemon's hot path, with exactly the same outcome.

`decode_batch(payload, topic_job)` accepts a batch only when every check of
`denpex_agent.wire.decode_batch` plainly holds for the way agents encode it (every event carries
all of its keys, with JSON types the validator accepts), and then builds the very same `Batch`.
Anything else (an invalid batch, or a valid one spelled unusually, e.g. with keys left out) goes to
`wire.decode_batch` itself, which returns the batch or raises the `WireError` naming the problem.
So the fast path can only be taken when the reference validator would have accepted the batch and
produced equal events; it never decides a rejection.
"""

from __future__ import annotations

import math
from typing import Any

import orjson

from denpex_agent import wire
from denpex_agent.events import KINDS, TS_SOURCES, Event
from denpex_agent.rules import CATEGORIES, PROGRESS_CATEGORY, ROLES, SEVERITIES

_KEYS = frozenset(wire._EVENT_KEYS)
_KINDS = frozenset(KINDS)
_TS_SOURCES = frozenset(TS_SOURCES)
_SEVERITIES = frozenset(SEVERITIES)
_ROLES = frozenset(ROLES)
_CATEGORIES = frozenset((*CATEGORIES, PROGRESS_CATEGORY))
_INT_MAX = 1 << 31
_NKEYS = len(_KEYS)
_MAX_ID, _MAX_TEXT, _MAX_FIELDS = wire.MAX_ID_LEN, wire.MAX_TEXT, wire.MAX_FIELDS
_MAX_CONTEXT = wire.MAX_CONTEXT_LINES
_isfinite = math.isfinite
_TS_MIN, _TS_MAX, _MAX_COUNTER = wire.TS_MIN, wire.TS_MAX, wire.MAX_COUNTER
_CLOCK_FIELDS = frozenset(("clock_offset_s", "clock_uncertainty_s"))


def _flat_ok(key: Any, value: Any) -> bool:
    """Whether `wire.check_field` accepts the field (checked the cheap way first)."""
    t = type(value)
    if type(key) is not str or len(key) > 64:
        return False
    if t is float:
        if not -wire.MAX_FIELD_FLOAT <= value <= wire.MAX_FIELD_FLOAT:
            return False
        return key not in _CLOCK_FIELDS or -wire.MAX_CLOCK_OFFSET_S <= value <= wire.MAX_CLOCK_OFFSET_S
    if t is int:
        if not -wire.MAX_FIELD_INT <= value <= wire.MAX_FIELD_INT:
            return False
        return key not in _CLOCK_FIELDS or -wire.MAX_CLOCK_OFFSET_S <= value <= wire.MAX_CLOCK_OFFSET_S
    if t is str:
        return len(value) <= wire.MAX_FIELD_TEXT
    return value is None or t is bool


def decode_batch(payload: bytes, topic_job: str | None = None) -> wire.Batch:
    batch = _fast(payload, topic_job)
    return batch if batch is not None else wire.decode_batch(payload, topic_job=topic_job)


def _fast(payload: bytes, topic_job: str | None) -> wire.Batch | None:
    if len(payload) > wire.MAX_BATCH_BYTES:
        return None
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    if type(doc) is not dict or doc.get("v") != wire.VERSION:
        return None
    agent: Any = doc.get("agent")
    job: Any = doc.get("job")
    node: Any = doc.get("node")
    if not (wire.valid_id(agent) and wire.valid_id(job) and wire.valid_id(node)):
        return None
    if topic_job is not None and job != topic_job:
        return None
    seq = doc.get("seq", 0)
    sent_at = doc.get("sent_at")
    if type(seq) is not int or seq < 0:
        return None
    behind = doc.get("behind", 0)
    if type(behind) is not int or not 0 <= behind < wire.MAX_BEHIND:
        return None
    if type(sent_at) is float:
        if not _isfinite(sent_at):
            return None
    elif type(sent_at) is not int:
        return None
    raw = doc.get("events")
    if type(raw) is not list or len(raw) > wire.MAX_EVENTS:
        return None
    try:
        events = [_event(job, node, e) for e in raw]
    except _Reject:
        return None
    return wire.Batch(
        agent=agent, job=job, node=node, sent_at=float(sent_at), seq=seq, events=events, behind=behind
    )


class _Reject(Exception):
    """An event the fast path does not vouch for: `wire.decode_batch` decides."""


def _event(job: str, node: str, e: Any) -> Event:
    # exactly the wire keys: as many keys as expected, and each expected one present
    if type(e) is not dict or len(e) != _NKEYS:
        raise _Reject
    try:
        eid, kind, rank, local_rank = e["id"], e["kind"], e["rank"], e["local_rank"]
        file, offset, line_no, ts, ts_source = e["file"], e["offset"], e["line_no"], e["ts"], e["ts_source"]
        rule, severity, role, category = e["rule"], e["severity"], e["role"], e["category"]
        text, context, fields = e["text"], e["context"], e["fields"]
    except KeyError:
        raise _Reject from None
    # JSON gives str, int, float, bool, None, list, dict: a value in a set of strings is a str,
    # and a list or dict is checked by type before any membership test (unhashable)
    if (
        type(eid) is not str
        or not 0 < len(eid) <= _MAX_ID
        or type(kind) is not str
        or kind not in _KINDS
        or type(ts_source) is not str
        or ts_source not in _TS_SOURCES
        or type(text) is not str
        or len(text) > _MAX_TEXT
        or type(file) is not str
        or len(file) > 4096
        or type(offset) is not int
        or not 0 <= offset < _MAX_COUNTER
        or type(line_no) is not int
        or not 0 <= line_no < _MAX_COUNTER
        or type(fields) is not dict
        or len(fields) > _MAX_FIELDS
        or type(context) is not list
    ):
        raise _Reject
    if ts is not None:
        if type(ts) is int:
            ts = float(ts)
        elif type(ts) is not float:
            raise _Reject
        if not _TS_MIN <= ts < _TS_MAX:  # also false for NaN
            raise _Reject
    if fields:
        for key, value in fields.items():
            if not _flat_ok(key, value):
                raise _Reject
    if severity is not None and (type(severity) is not str or severity not in _SEVERITIES):
        raise _Reject
    if role is not None and (type(role) is not str or role not in _ROLES):
        raise _Reject
    if category is not None and (type(category) is not str or category not in _CATEGORIES):
        raise _Reject
    if rule is not None and (type(rule) is not str or len(rule) > 64):
        raise _Reject
    if rank is not None and (type(rank) is not int or not -1 <= rank < _INT_MAX):
        raise _Reject
    if local_rank is not None and (type(local_rank) is not int or not -1 <= local_rank < _INT_MAX):
        raise _Reject
    if context:
        if len(context) > _MAX_CONTEXT:
            raise _Reject
        for c in context:
            if type(c) is not str or len(c) > _MAX_TEXT:
                raise _Reject
    # orjson built `context` and `fields` for this batch alone: no copy needed
    return Event(
        eid, kind, job, node, rank, local_rank, file, offset, line_no, ts, ts_source,
        rule, severity, role, category, text, context, fields,
    )  # fmt: skip
