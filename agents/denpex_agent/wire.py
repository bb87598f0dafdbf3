"""The MQTT wire protocol between agents and the correlator: topics, payloads, validation.

Both sides use this module (the daemon imports it; the agent never imports the daemon), so an
encoder and its validator cannot drift apart. Payloads are orjson, versioned with ``"v": 1``.
See agents/README.md for the prose description.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

import orjson

from denpex_agent.errors import DenpexAgentError
from denpex_agent.events import KINDS, TS_SOURCES, Event
from denpex_agent.rules import CATEGORIES, PROGRESS_CATEGORY, ROLES, SEVERITIES
from denpex_agent.timestamps import SANE_MAX, SANE_MIN

VERSION = 1
PREFIX = "denpex/v1"
MAX_ID_LEN = 128
MAX_BATCH_BYTES = 1 << 20  # hard limit a receiver enforces; senders aim well below
MAX_EVENTS = 10_000
MAX_TEXT = 64 * 1024
MAX_CONTEXT_LINES = 200
MAX_FIELDS = 32
MAX_BEHIND = 1 << 53  # bytes; any larger value is not a real backlog
# Bounds at the edge: what no real agent sends, refused before it reaches an engine
TS_MIN, TS_MAX = SANE_MIN, SANE_MAX  # an event's timestamp: 2000-01-01 to 2100-01-01 (UTC)
MAX_COUNTER = 1 << 62  # offsets, line numbers, sequence numbers
MAX_FIELD_INT = 1 << 53  # an integer field (a step, a rank, a signal)
MAX_FIELD_FLOAT = 1e300  # a float field's magnitude (a loss may be huge, never infinite)
MAX_FIELD_TEXT = 1024
MAX_CLOCK_OFFSET_S = 86_400.0  # an agent's clock offset and its uncertainty: at most a day
_CLOCK_FIELDS = ("clock_offset_s", "clock_uncertainty_s")

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@=-]{0,127}$")


class WireError(DenpexAgentError):
    """A payload or topic that does not follow the protocol; `reason` says which part, `code`
    (when set) which bound it broke, as a short label for counting."""

    def __init__(self, reason: str, code: str | None = None) -> None:
        self.reason = reason
        self.code = code
        super().__init__(reason)


def valid_id(value: object) -> bool:
    """Job, node and agent ids: 1-128 of ``[A-Za-z0-9._:@=-]``, no ``/ + #``, no leading dot."""
    return isinstance(value, str) and _ID_RE.match(value) is not None and ".." not in value


def check_id(kind: str, value: object) -> str:
    if not valid_id(value):
        shown = repr(value)[:80]
        raise WireError(
            f"invalid {kind} id {shown}: use 1-{MAX_ID_LEN} of A-Z a-z 0-9 . _ : @ = - (no '/', '+', '#', '..')"
        )
    assert isinstance(value, str)
    return value


# Topics ------------------------------------------------------------------------------------------


def principal(agent: str, node: str) -> str:
    """Who an agent is on the broker: its agent id, followed by ``/<node>`` when the two differ.
    It is the agent's broker user name and a topic level (one or two) of everything it sends,
    so a broker ACL pattern on the user name (Mosquitto's ``%u``) pins both to the topic, and the
    daemon checks the payload against the topic."""
    check_id("agent", agent)
    return agent if agent == check_id("node", node) else f"{agent}/{node}"


def parse_principal(value: str) -> tuple[str, str]:
    """(agent, node) of a principal; `WireError` when it is not one."""
    parts = value.split("/")
    if len(parts) == 1:
        return check_id("agent", parts[0]), parts[0]
    if len(parts) == 2 and parts[0] != parts[1]:
        return check_id("agent", parts[0]), check_id("node", parts[1])
    raise WireError(f"invalid principal {value[:120]!r}: expected AGENT or AGENT/NODE (AGENT != NODE)")


def sender_topic(job: str, agent: str, node: str, kind: str) -> str:
    """Where an agent sends ``events``, ``clock`` requests and its retained ``status``:
    ``denpex/v1/jobs/<job>/from/<agent>[/<node>]/<kind>``."""
    assert kind in ("events", "clock", "status"), kind
    return f"{PREFIX}/jobs/{check_id('job', job)}/from/{principal(agent, node)}/{kind}"


def agent_topics(job: str, agent: str, node: str, style: str) -> dict[str, str]:
    """The topics one agent uses, by name (events, clock, status, clock_reply, receipt):
    ``sender`` style names the agent in each (brokers pin them to its credentials); ``job`` style
    sends a job's events on one topic (the first revision's), which a broker's shared
    subscription can hash to one daemon replica per job (deploy/broker/emqx.conf)."""
    if style == "job":
        return {
            "events": events_topic(job),
            "clock": clock_request_topic(job, agent),
            "status": status_topic(job, agent),
            "clock_reply": clock_reply_topic(agent),
            "receipt": receipt_topic(agent, node),
        }
    return {
        "events": sender_topic(job, agent, node, "events"),
        "clock": sender_topic(job, agent, node, "clock"),
        "status": sender_topic(job, agent, node, "status"),
        "clock_reply": clock_reply_topic(agent, node),
        "receipt": receipt_topic(agent, node),
    }


def events_topic(job: str) -> str:
    """The topic of the first protocol revision (no sender in it); still accepted where the
    broker lets agents publish there (see agents/README.md, "Topics")."""
    return f"{PREFIX}/jobs/{check_id('job', job)}/events"


def status_topic(job: str, agent: str) -> str:
    """First revision's status topic (still accepted); agents now use `sender_topic`."""
    return f"{PREFIX}/jobs/{check_id('job', job)}/agents/{check_id('agent', agent)}/status"


def clock_request_topic(job: str, agent: str) -> str:
    """First revision's clock request topic (still accepted); agents now use `sender_topic`."""
    return f"{PREFIX}/jobs/{check_id('job', job)}/clock/{check_id('agent', agent)}"


def clock_reply_topic(agent: str, node: str | None = None) -> str:
    """Where the daemon answers a clock request: ``denpex/v1/agents/<principal>/clock`` (the
    agent id alone for a request on a first-revision topic)."""
    who = check_id("agent", agent) if node is None else principal(agent, node)
    return f"{PREFIX}/agents/{who}/clock"


def diagnosis_topic(job: str) -> str:
    return f"{PREFIX}/jobs/{check_id('job', job)}/diagnosis"


def alerts_topic(job: str) -> str:
    return f"{PREFIX}/alerts/{check_id('job', job)}"


SUBSCRIPTIONS = (
    f"{PREFIX}/jobs/+/events",
    f"{PREFIX}/jobs/+/clock/+",
    f"{PREFIX}/jobs/+/agents/+/status",
    f"{PREFIX}/jobs/+/from/+/events",
    f"{PREFIX}/jobs/+/from/+/+/events",
    f"{PREFIX}/jobs/+/from/+/clock",
    f"{PREFIX}/jobs/+/from/+/+/clock",
    f"{PREFIX}/jobs/+/from/+/status",
    f"{PREFIX}/jobs/+/from/+/+/status",
)


@dataclass(frozen=True, slots=True)
class Topic:
    """An inbound topic: `kind` is events | clock | status; `agent` and `node` are what the topic
    says of the sender (``None`` where a first-revision topic does not say)."""

    kind: str
    job: str
    agent: str | None
    node: str | None


def parse_topic(topic: str) -> Topic:
    parts = topic.split("/")
    if len(parts) >= 5 and parts[0] == "denpex" and parts[1] == "v1" and parts[2] == "jobs":
        job = check_id("job", parts[3])
        if parts[4] == "from" and len(parts) in (7, 8) and parts[-1] in ("events", "clock", "status"):
            agent, node = parse_principal("/".join(parts[5:-1]))
            return Topic(parts[-1], job, agent, node)
        if len(parts) == 5 and parts[4] == "events":
            return Topic("events", job, None, None)
        if len(parts) == 6 and parts[4] == "clock":
            return Topic("clock", job, check_id("agent", parts[5]), None)
        if len(parts) == 7 and parts[4] == "agents" and parts[6] == "status":
            return Topic("status", job, check_id("agent", parts[5]), None)
    raise WireError(f"unexpected topic {topic[:120]!r}")


def check_sender(topic: Topic, agent: str, node: str) -> None:
    """The payload's agent and node must be those the topic names (which the broker's ACL ties
    to the sender's credentials)."""
    if topic.agent is not None and agent != topic.agent:
        raise WireError(f"invalid agent id {agent[:80]!r}: does not match the topic")
    if topic.node is not None and node != topic.node:
        raise WireError(f"invalid node id {node[:80]!r}: does not match the topic")


# Batches -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Batch:
    agent: str
    job: str
    node: str
    sent_at: float
    seq: int
    events: list[Event]
    behind: int = 0  # bytes the agent had still to read when it read these events (catching up)


_EVENT_KEYS = (
    "id", "kind", "rank", "local_rank", "file", "offset", "line_no", "ts", "ts_source",
    "rule", "severity", "role", "category", "text", "context", "fields",
)  # fmt: skip


def event_to_wire(ev: Event) -> dict[str, Any]:
    """An event as it travels: job and node are the batch's, not repeated per event."""
    return {
        "id": ev.id,
        "kind": ev.kind,
        "rank": ev.rank,
        "local_rank": ev.local_rank,
        "file": ev.file,
        "offset": ev.offset,
        "line_no": ev.line_no,
        "ts": ev.ts,
        "ts_source": ev.ts_source,
        "rule": ev.rule,
        "severity": ev.severity,
        "role": ev.role,
        "category": ev.category,
        "text": ev.text,
        "context": ev.context,
        "fields": ev.fields,
    }


def encode_batch(
    agent: str, job: str, node: str, seq: int, sent_at: float, events: Iterable[Event], behind: int = 0
) -> bytes:
    doc: dict[str, Any] = {
        "v": VERSION,
        "agent": agent,
        "job": job,
        "node": node,
        "seq": seq,
        "sent_at": sent_at,
        "events": [event_to_wire(e) for e in events],
    }
    if behind:
        doc["behind"] = behind
    return orjson.dumps(doc)


def decode_batch(payload: bytes, topic_job: str | None = None) -> Batch:
    """Parse and validate a batch; raise `WireError` naming the first problem found."""
    if len(payload) > MAX_BATCH_BYTES:
        raise WireError(f"payload of {len(payload)} bytes exceeds {MAX_BATCH_BYTES}")
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise WireError(f"not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise WireError("payload is not a JSON object")
    if doc.get("v") != VERSION:
        raise WireError(f"unsupported version {doc.get('v')!r} (expected {VERSION})")
    agent = check_id("agent", doc.get("agent"))
    job = check_id("job", doc.get("job"))
    node = check_id("node", doc.get("node"))
    if topic_job is not None and job != topic_job:
        raise WireError(f"job {job!r} does not match the topic's {topic_job!r}")
    seq = doc.get("seq", 0)
    sent_at = doc.get("sent_at")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise WireError("seq must be a non-negative integer")
    if not _finite(sent_at):
        raise WireError("sent_at must be a finite number")
    behind = doc.get("behind", 0)
    if not isinstance(behind, int) or isinstance(behind, bool) or not 0 <= behind < MAX_BEHIND:
        raise WireError(f"behind must be an integer from 0 to {MAX_BEHIND - 1}")
    raw_events = doc.get("events")
    if not isinstance(raw_events, list):
        raise WireError("events must be a list")
    if len(raw_events) > MAX_EVENTS:
        raise WireError(f"{len(raw_events)} events exceed {MAX_EVENTS}")
    events = [_event(job, node, i, e) for i, e in enumerate(raw_events)]
    return Batch(
        agent=agent, job=job, node=node, sent_at=float(sent_at), seq=seq, events=events, behind=behind
    )


def check_field(key: object, value: object, where: str) -> None:
    """A field is flat: a short name and a bounded scalar (no nesting); an agent's clock offset
    and its uncertainty at most a day."""
    if not isinstance(key, str) or len(key) > 64:
        raise WireError(f"{where}: a field name must be a string of at most 64 chars", "field")
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int):
        if not -MAX_FIELD_INT <= value <= MAX_FIELD_INT:
            raise WireError(f"{where}: field {key!r} is out of range", "range")
    elif isinstance(value, float):
        if not -MAX_FIELD_FLOAT <= value <= MAX_FIELD_FLOAT:  # also false for NaN
            raise WireError(f"{where}: field {key!r} is out of range", "range")
        if key in _CLOCK_FIELDS and not -MAX_CLOCK_OFFSET_S <= value <= MAX_CLOCK_OFFSET_S:
            raise WireError(f"{where}: {key} beyond a day", "range")
    elif isinstance(value, str):
        if len(value) > MAX_FIELD_TEXT:
            raise WireError(f"{where}: field {key!r} longer than {MAX_FIELD_TEXT} chars", "field")
    else:
        raise WireError(f"{where}: field {key!r} must be a number, a string, true/false or null", "nesting")
    if key in _CLOCK_FIELDS and isinstance(value, int) and abs(value) > MAX_CLOCK_OFFSET_S:
        raise WireError(f"{where}: {key} beyond a day", "range")


def _finite(x: object) -> TypeGuard[float]:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _opt_int(e: Mapping[str, Any], key: str, where: str) -> int | None:
    v = e.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not -1 <= v < 1 << 31:
        raise WireError(f"{where}: {key} must be an integer or null")
    return v


def _event(job: str, node: str, i: int, e: object) -> Event:
    where = f"event {i}"
    if not isinstance(e, dict):
        raise WireError(f"{where}: not an object")
    unknown = set(e) - set(_EVENT_KEYS)
    if unknown:
        raise WireError(f"{where}: unknown key(s) {sorted(unknown)[:5]}")
    eid = e.get("id")
    if not isinstance(eid, str) or not 1 <= len(eid) <= MAX_ID_LEN:
        raise WireError(f"{where}: id must be a string of 1-{MAX_ID_LEN} chars")
    kind = e.get("kind")
    if kind not in KINDS:
        raise WireError(f"{where}: kind must be one of {KINDS}")
    ts = e.get("ts")
    if ts is not None and not _finite(ts):
        raise WireError(f"{where}: ts must be a finite number or null")
    if ts is not None and not TS_MIN <= ts < TS_MAX:
        raise WireError(f"{where}: ts is not a time between 2000 and 2100", "range")
    ts_source = e.get("ts_source", "none")
    if ts_source not in TS_SOURCES:
        raise WireError(f"{where}: ts_source must be one of {TS_SOURCES}")
    for key, allowed in (
        ("severity", SEVERITIES),
        ("role", ROLES),
        ("category", (*CATEGORIES, PROGRESS_CATEGORY)),
    ):
        v = e.get(key)
        if v is not None and v not in allowed:
            raise WireError(f"{where}: {key} {str(v)[:40]!r} is not one of {allowed}")
    text = e.get("text", "")
    if not isinstance(text, str) or len(text) > MAX_TEXT:
        raise WireError(f"{where}: text must be a string of at most {MAX_TEXT} chars")
    context = e.get("context", [])
    if (
        not isinstance(context, list)
        or len(context) > MAX_CONTEXT_LINES
        or not all(isinstance(c, str) and len(c) <= MAX_TEXT for c in context)
    ):
        raise WireError(f"{where}: context must be a list of at most {MAX_CONTEXT_LINES} strings")
    fields = e.get("fields", {})
    if not isinstance(fields, dict) or len(fields) > MAX_FIELDS:
        raise WireError(f"{where}: fields must be an object with at most {MAX_FIELDS} keys")
    for key, value in fields.items():
        check_field(key, value, where)
    file = e.get("file", "")
    rule = e.get("rule")
    if not isinstance(file, str) or len(file) > 4096:
        raise WireError(f"{where}: file must be a string")
    if rule is not None and (not isinstance(rule, str) or len(rule) > 64):
        raise WireError(f"{where}: rule must be a short string or null")
    offset = e.get("offset")
    line_no = e.get("line_no")
    if not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v < MAX_COUNTER for v in (offset, line_no)
    ):
        raise WireError(f"{where}: offset and line_no must be non-negative integers below 2**62")
    assert isinstance(offset, int) and isinstance(line_no, int)
    return Event(
        id=eid,
        kind=kind,
        job=job,
        node=node,
        rank=_opt_int(e, "rank", where),
        local_rank=_opt_int(e, "local_rank", where),
        file=file,
        offset=offset,
        line_no=line_no,
        ts=float(ts) if ts is not None else None,
        ts_source=ts_source,
        rule=rule,
        severity=e.get("severity"),
        role=e.get("role"),
        category=e.get("category"),
        text=text,
        context=list(context),
        fields=dict(fields),
    )


# Clock exchange ----------------------------------------------------------------------------------


def encode_clock_request(agent: str, t0: float) -> bytes:
    return orjson.dumps({"v": VERSION, "agent": agent, "t0": t0})


def decode_clock_request(payload: bytes) -> tuple[str, float]:
    doc = _small_object(payload)
    agent = check_id("agent", doc.get("agent"))
    t0 = doc.get("t0")
    if not _finite(t0):
        raise WireError("t0 must be a finite number")
    return agent, float(t0)


def encode_clock_reply(t0: float, t1: float, t2: float, receipts: bool = False) -> bytes:
    """``receipts``: this daemon sends a receipt for every batch it has stored (`encode_receipt`)."""
    doc: dict[str, Any] = {"v": VERSION, "t0": t0, "t1": t1, "t2": t2}
    if receipts:
        doc["receipts"] = 1
    return orjson.dumps(doc)


def clock_reply_receipts(payload: bytes) -> bool:
    """Does the daemon that sent this (valid) clock reply send receipts?"""
    return _small_object(payload).get("receipts") == 1


def receipt_topic(agent: str, node: str) -> str:
    """Where the daemon tells an agent that it has stored (or refused) one of its batches."""
    return f"{PREFIX}/agents/{principal(agent, node)}/receipt"


@dataclass(frozen=True, slots=True)
class Receipt:
    job: str
    seq: int
    sent_at: float
    refused: str | None = None  # why the batch was refused for good (never to be sent again)


def encode_receipt(job: str, seq: int, sent_at: float, refused: str | None = None) -> bytes:
    doc: dict[str, Any] = {"v": VERSION, "job": job, "seq": seq, "sent_at": sent_at}
    if refused is not None:
        doc["refused"] = refused[:200]
    return orjson.dumps(doc)


def decode_receipt(payload: bytes) -> Receipt:
    doc = _small_object(payload)
    job, seq, sent_at, refused = doc.get("job"), doc.get("seq"), doc.get("sent_at"), doc.get("refused")
    if not valid_id(job) or not isinstance(seq, int) or isinstance(seq, bool) or not _finite(sent_at):
        raise WireError("a receipt needs job, seq (an integer) and sent_at (a number)")
    if refused is not None and not isinstance(refused, str):
        raise WireError("refused must be a string")
    assert isinstance(job, str)
    return Receipt(job, seq, float(sent_at), refused)


def decode_clock_reply(payload: bytes) -> tuple[float, float, float]:
    doc = _small_object(payload)
    vals = [doc.get(k) for k in ("t0", "t1", "t2")]
    if not all(_finite(v) for v in vals):
        raise WireError("t0, t1, t2 must be finite numbers")
    return float(vals[0]), float(vals[1]), float(vals[2])  # type: ignore[arg-type]


def encode_status(agent: str, node: str, state: str, at: float) -> bytes:
    return orjson.dumps({"v": VERSION, "agent": agent, "node": node, "state": state, "at": at})


def decode_status(payload: bytes) -> tuple[str, str, str]:
    agent, node, state, _lost = decode_status_full(payload)
    return agent, node, state


def decode_status_full(payload: bytes) -> tuple[str, str, str, bool]:
    """(agent, node, state, lost): ``lost`` for the last will (an ``offline`` the broker
    published for an agent that died, marked by its time 0), not an agent's own goodbye."""
    doc = _small_object(payload)
    state = doc.get("state")
    if state not in ("online", "offline"):
        raise WireError("state must be online or offline")
    lost = state == "offline" and doc.get("at") == 0
    return check_id("agent", doc.get("agent")), check_id("node", doc.get("node")), str(state), lost


def _small_object(payload: bytes) -> dict[str, Any]:
    if len(payload) > 4096:
        raise WireError("control message larger than 4096 bytes")
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise WireError(f"not JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("v") != VERSION:
        raise WireError(f"expected a JSON object with v={VERSION}")
    return doc


def clock_sample(t0: float, t1: float, t2: float, t3: float) -> tuple[float, float]:
    """NTP-style (offset of the daemon's clock minus the agent's, round-trip delay)."""
    offset = ((t1 - t0) + (t2 - t3)) / 2.0
    delay = (t3 - t0) - (t2 - t1)
    return offset, max(delay, 0.0)
