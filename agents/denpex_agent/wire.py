"""The MQTT wire protocol between agents and the correlator: topics, payloads, validation.

Both sides use this module (the daemon imports it; the agent never imports the daemon), so an
encoder and its validator cannot drift apart. Payloads are JSON, versioned with ``"v": 1``, written
with orjson; a batch is read and validated in one pass by msgspec, into the typed structs below.
See agents/README.md for the prose description.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeGuard

import msgspec
import orjson
from msgspec import Meta

from denpex_agent.errors import DenpexAgentError
from denpex_agent.events import (  # noqa: F401  (the bounds are the protocol's, named here too)
    MAX_CONTEXT_LINES,
    MAX_COUNTER,
    MAX_FIELD_FLOAT,
    MAX_FIELD_INT,
    MAX_FIELD_TEXT,
    MAX_FIELDS,
    MAX_ID_LEN,
    MAX_TEXT,
    NOT_GIVEN,
    TS_MAX,
    TS_MIN,
    Event,
)

VERSION = 1
PREFIX = "denpex/v1"
MAX_BATCH_BYTES = 1 << 20  # hard limit a receiver enforces; senders aim well below
MAX_EVENTS = 10_000
MAX_BEHIND = 1 << 53  # bytes; any larger value is not a real backlog
# An event's own bounds (MAX_TEXT, MAX_FIELDS, TS_MIN, ...) are its type's: see denpex_agent.events
MAX_CLOCK_OFFSET_S = 86_400.0  # an agent's clock offset and its uncertainty: at most a day
_CLOCK_FIELDS = ("clock_offset_s", "clock_uncertainty_s")

# Job, node and agent ids: no '/', '+', '#' (topic levels and wildcards), no '..', no leading dot
_ID_PATTERN = r"^(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9._:@=-]{0,127}\Z"
_ID_RE = re.compile(_ID_PATTERN)
_ID_RULE = f"use 1-{MAX_ID_LEN} of A-Z a-z 0-9 . _ : @ = - (no '/', '+', '#', '..')"


class WireError(DenpexAgentError):
    """A payload or topic that does not follow the protocol; `reason` says which part, `code`
    (when set) which bound it broke, as a short label for counting."""

    def __init__(self, reason: str, code: str | None = None) -> None:
        self.reason = reason
        self.code = code
        super().__init__(reason)


def valid_id(value: object) -> bool:
    """Job, node and agent ids: 1-128 of ``[A-Za-z0-9._:@=-]``, no ``/ + #``, no leading dot."""
    return isinstance(value, str) and _ID_RE.match(value) is not None


def check_id(kind: str, value: object) -> str:
    if not valid_id(value):
        shown = repr(value)[:80]
        raise WireError(f"invalid {kind} id {shown}: {_ID_RULE}")
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
#
# One pass: msgspec decodes the JSON straight into the batch struct below and its events into
# `Event`s, checking types, bounds (`Meta`), enumerations (`Literal`s built from the rules'
# vocabularies) and, for events, that no unknown key is present. What a type cannot say is checked
# after, in the loop that gives each event its batch's job and node: the topic's job, `offset` and
# `line_no` being present, and the clock fields' bound (a day), which applies to two field names.
# A `msgspec.ValidationError` is turned into a `WireError` whose message and code keep
# `metrics.invalid_reason`'s labels.

WireId = Annotated[str, Meta(pattern=_ID_PATTERN)]
_FLOAT_MAX = sys.float_info.max  # a finite float: JSON has no NaN, and this refuses an overflow


class WireBatch(msgspec.Struct, kw_only=True, gc=False):
    """A batch as it travels; keys it does not know are ignored (a later revision may add some)."""

    v: Literal[1]  # VERSION
    agent: WireId
    job: WireId
    node: WireId
    sent_at: Annotated[float, Meta(ge=-_FLOAT_MAX, le=_FLOAT_MAX)]
    events: Annotated[list[Event], Meta(max_length=MAX_EVENTS)]  # job and node filled in after
    seq: Annotated[int, Meta(ge=0)] = 0
    behind: Annotated[int, Meta(ge=0, lt=MAX_BEHIND)] = 0


_DECODER = msgspec.json.Decoder(WireBatch)
_CLOCK_OFFSET, _CLOCK_UNCERTAINTY = _CLOCK_FIELDS


@dataclass(frozen=True, slots=True)
class Batch:
    agent: str
    job: str
    node: str
    sent_at: float
    seq: int
    events: list[Event]
    behind: int = 0  # bytes the agent had still to read when it read these events (catching up)


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
    """Parse and validate a batch in one pass; raise `WireError` naming the problem found."""
    if len(payload) > MAX_BATCH_BYTES:
        raise WireError(f"payload of {len(payload)} bytes exceeds {MAX_BATCH_BYTES}")
    try:
        doc = _DECODER.decode(payload)
    except msgspec.ValidationError as exc:
        raise _invalid(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise WireError(f"not JSON: {exc}") from None
    job, node = doc.job, doc.node
    if topic_job is not None and job != topic_job:
        raise WireError(f"job {job!r} does not match the topic's {topic_job!r}")
    events = doc.events
    rules = _RULE_IDS
    for i, ev in enumerate(events):
        # required on the wire; `Event` gives them a default to keep its positional order
        if ev.offset == NOT_GIVEN or ev.line_no == NOT_GIVEN:
            missing = "offset" if ev.offset == NOT_GIVEN else "line_no"
            raise WireError(f"event {i}: Object missing required field `{missing}`")
        if ev.job or ev.node:
            raise WireError(f"event {i}: Object contains unknown field `{'job' if ev.job else 'node'}`")
        ev.job, ev.node = job, node
        fields = ev.fields
        if fields and (_CLOCK_OFFSET in fields or _CLOCK_UNCERTAINTY in fields):
            _check_clock(i, fields)
        rule = ev.rule
        if rule is not None:
            ev.rule = rules.get(rule) or _rule_id(rule)
    return Batch(doc.agent, job, node, doc.sent_at, doc.seq, events, doc.behind)


# Rule ids decoded so far, each kept once: every event names one and a receiver keeps many
# events (one string per rule instead of one per event); bounded, since the wire is untrusted.
_RULE_IDS: dict[str, str] = {}
MAX_RULE_IDS = 4096


def _rule_id(rule: str) -> str:
    if len(_RULE_IDS) < MAX_RULE_IDS:
        _RULE_IDS[rule] = rule
    return rule


def _finite(x: object) -> TypeGuard[float]:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_clock(i: int, fields: Mapping[str, object]) -> None:
    """An agent's clock offset and its uncertainty: at most a day either way."""
    for key in _CLOCK_FIELDS:
        value = fields.get(key)
        if (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and abs(value) > MAX_CLOCK_OFFSET_S
        ):
            raise WireError(f"event {i}: {key} beyond a day", "range")


_EVENT_PATH = re.compile(r"\$\.events\[(\d+)\](?:\.(\w+))?")
_TYPES = ", got `"  # how msgspec words a wrong JSON type (a broken bound says what it expected)


def _invalid(message: str) -> WireError:
    """msgspec's "<problem> - at `<path>`" as a `WireError` with the old validator's wording where
    `metrics.invalid_reason` reads it (ids, version, not an object) and the bound's code (range,
    nesting, field) where it read the code."""
    problem, _, path = message.partition(" - at `")
    path = path.rstrip("`")
    key = path.startswith("key` in `")  # a field's name
    if key:
        path = path[len("key` in `") :]
    if not path:  # the payload itself
        if problem.startswith("Expected `object`"):
            return WireError("payload is not a JSON object")
        missing = problem.removeprefix("Object missing required field `").rstrip("`")
        if missing == "v":
            return WireError(f"unsupported version None (expected {VERSION})")
        if missing in ("agent", "job", "node"):
            return WireError(f"invalid {missing} id None: {_ID_RULE}")
        return WireError(f"batch: {problem}")
    if path == "$.v":
        return WireError(f"unsupported version ({problem}; expected {VERSION})")
    if path in ("$.agent", "$.job", "$.node"):
        return WireError(f"invalid {path[2:]} id ({problem}): {_ID_RULE}")
    m = _EVENT_PATH.match(path)
    if m is None:
        return WireError(f"{path[2:]}: {problem}")
    where, name = f"event {m[1]}", m[2]
    if name is None:  # the event itself: not an object, a key missing or unknown
        return WireError(f"{where}: {problem}")
    code = None
    if name == "fields" and (key or path != m[0]):  # a field's name or value, not the object
        if key:
            code = "field"
        elif problem.endswith((", got `array`", ", got `object`")):
            code = "nesting"
        elif problem.startswith("Expected `str` of length"):
            code = "field"
        elif _TYPES not in problem:
            code = "range"
    elif name == "ts" and _TYPES not in problem:
        code = "range"  # a number, but not a time between 2000 and 2100
    return WireError(f"{where}: {name}{' name' if key else ''}: {problem}", code)


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
