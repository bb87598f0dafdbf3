"""Batch validation: the msgspec decoder (`wire.decode_batch`) against the two it replaced.

The baselines are copies, kept here and nowhere in the product, of the validator as it was before
msgspec: `hand_decode_batch` (orjson, then a hand check of every key and bound) and
`fastwire_decode_batch` (the daemon's faster copy of it, which fell back to the hand one for
anything unusual). All three decode the same realistic batches, as agents encode them:

* progress: 8 ranks x 5 steps of step lines (bench_serve.py's phase-1 batch, 40 events);
* match: 8 ranks' error lines with 20 lines of context each (bench_serve.py's failure cascade).

Each round times every decoder for `--seconds` of CPU on each batch, in interleaved order, and
the best of `--rounds` rounds counts (the least disturbed by a shared machine). Prints events per
CPU second and the ratios as JSON.

    python bench/bench_wire.py [--rounds 7] [--seconds 0.5] [--json OUT]

bench_serve.py takes `hand_decode_batch` as its machine-speed baseline (`reference_rate`).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeGuard

import orjson

from denpex_agent import wire
from denpex_agent.events import KINDS, TS_SOURCES, Event
from denpex_agent.rules import CATEGORIES, PROGRESS_CATEGORY, ROLES, SEVERITIES

# The hand validator (agents/denpex_agent/wire.py before msgspec) ---------------------------------

_EVENT_KEYS = (
    "id", "kind", "rank", "local_rank", "file", "offset", "line_no", "ts", "ts_source",
    "rule", "severity", "role", "category", "text", "context", "fields",
)  # fmt: skip
_CLOCK_FIELDS = ("clock_offset_s", "clock_uncertainty_s")
WireError = wire.WireError


def _check_id(kind: str, value: object) -> str:
    if not wire.valid_id(value):
        raise WireError(f"invalid {kind} id {repr(value)[:80]}: use 1-128 of A-Z a-z 0-9 . _ : @ = -")
    assert isinstance(value, str)
    return value


def hand_decode_batch(payload: bytes, topic_job: str | None = None) -> wire.Batch:
    if len(payload) > wire.MAX_BATCH_BYTES:
        raise WireError(f"payload of {len(payload)} bytes exceeds {wire.MAX_BATCH_BYTES}")
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise WireError(f"not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise WireError("payload is not a JSON object")
    if doc.get("v") != wire.VERSION:
        raise WireError(f"unsupported version {doc.get('v')!r} (expected {wire.VERSION})")
    agent = _check_id("agent", doc.get("agent"))
    job = _check_id("job", doc.get("job"))
    node = _check_id("node", doc.get("node"))
    if topic_job is not None and job != topic_job:
        raise WireError(f"job {job!r} does not match the topic's {topic_job!r}")
    seq = doc.get("seq", 0)
    sent_at = doc.get("sent_at")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise WireError("seq must be a non-negative integer")
    if not _finite(sent_at):
        raise WireError("sent_at must be a finite number")
    behind = doc.get("behind", 0)
    if not isinstance(behind, int) or isinstance(behind, bool) or not 0 <= behind < wire.MAX_BEHIND:
        raise WireError(f"behind must be an integer from 0 to {wire.MAX_BEHIND - 1}")
    raw_events = doc.get("events")
    if not isinstance(raw_events, list):
        raise WireError("events must be a list")
    if len(raw_events) > wire.MAX_EVENTS:
        raise WireError(f"{len(raw_events)} events exceed {wire.MAX_EVENTS}")
    events = [_hand_event(job, node, i, e) for i, e in enumerate(raw_events)]
    return wire.Batch(
        agent=agent, job=job, node=node, sent_at=float(sent_at), seq=seq, events=events, behind=behind
    )


def _check_field(key: object, value: object, where: str) -> None:
    if not isinstance(key, str) or len(key) > 64:
        raise WireError(f"{where}: a field name must be a string of at most 64 chars", "field")
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int):
        if not -wire.MAX_FIELD_INT <= value <= wire.MAX_FIELD_INT:
            raise WireError(f"{where}: field {key!r} is out of range", "range")
    elif isinstance(value, float):
        if not -wire.MAX_FIELD_FLOAT <= value <= wire.MAX_FIELD_FLOAT:
            raise WireError(f"{where}: field {key!r} is out of range", "range")
        if key in _CLOCK_FIELDS and not -wire.MAX_CLOCK_OFFSET_S <= value <= wire.MAX_CLOCK_OFFSET_S:
            raise WireError(f"{where}: {key} beyond a day", "range")
    elif isinstance(value, str):
        if len(value) > wire.MAX_FIELD_TEXT:
            raise WireError(f"{where}: field {key!r} longer than {wire.MAX_FIELD_TEXT} chars", "field")
    else:
        raise WireError(f"{where}: field {key!r} must be a number, a string, true/false or null", "nesting")
    if key in _CLOCK_FIELDS and isinstance(value, int) and abs(value) > wire.MAX_CLOCK_OFFSET_S:
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


def _hand_event(job: str, node: str, i: int, e: object) -> Event:
    where = f"event {i}"
    if not isinstance(e, dict):
        raise WireError(f"{where}: not an object")
    unknown = set(e) - set(_EVENT_KEYS)
    if unknown:
        raise WireError(f"{where}: unknown key(s) {sorted(unknown)[:5]}")
    eid = e.get("id")
    if not isinstance(eid, str) or not 1 <= len(eid) <= wire.MAX_ID_LEN:
        raise WireError(f"{where}: id must be a string of 1-{wire.MAX_ID_LEN} chars")
    kind = e.get("kind")
    if kind not in KINDS:
        raise WireError(f"{where}: kind must be one of {KINDS}")
    ts = e.get("ts")
    if ts is not None and not _finite(ts):
        raise WireError(f"{where}: ts must be a finite number or null")
    if ts is not None and not wire.TS_MIN <= ts < wire.TS_MAX:
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
    if not isinstance(text, str) or len(text) > wire.MAX_TEXT:
        raise WireError(f"{where}: text must be a string of at most {wire.MAX_TEXT} chars")
    context = e.get("context", [])
    if (
        not isinstance(context, list)
        or len(context) > wire.MAX_CONTEXT_LINES
        or not all(isinstance(c, str) and len(c) <= wire.MAX_TEXT for c in context)
    ):
        raise WireError(f"{where}: context must be a list of at most {wire.MAX_CONTEXT_LINES} strings")
    fields = e.get("fields", {})
    if not isinstance(fields, dict) or len(fields) > wire.MAX_FIELDS:
        raise WireError(f"{where}: fields must be an object with at most {wire.MAX_FIELDS} keys")
    for key, value in fields.items():
        _check_field(key, value, where)
    file = e.get("file", "")
    rule = e.get("rule")
    if not isinstance(file, str) or len(file) > 4096:
        raise WireError(f"{where}: file must be a string")
    if rule is not None and (not isinstance(rule, str) or len(rule) > 64):
        raise WireError(f"{where}: rule must be a short string or null")
    offset = e.get("offset")
    line_no = e.get("line_no")
    if not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v < wire.MAX_COUNTER
        for v in (offset, line_no)
    ):
        raise WireError(f"{where}: offset and line_no must be non-negative integers below 2**62")
    assert isinstance(offset, int) and isinstance(line_no, int)
    return Event(
        id=eid, kind=kind, job=job, node=node, rank=_opt_int(e, "rank", where),
        local_rank=_opt_int(e, "local_rank", where), file=file, offset=offset, line_no=line_no,
        ts=float(ts) if ts is not None else None, ts_source=ts_source, rule=rule,
        severity=e.get("severity"), role=e.get("role"), category=e.get("category"), text=text,
        context=list(context), fields=dict(fields),
    )  # fmt: skip


# fastwire (daemon/denpexd/fastwire.py before msgspec): the hand validator's fast path -------------

_KEYS = frozenset(_EVENT_KEYS)
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
_CLOCK = frozenset(_CLOCK_FIELDS)


def _flat_ok(key: Any, value: Any) -> bool:
    t = type(value)
    if type(key) is not str or len(key) > 64:
        return False
    if t is float:
        if not -wire.MAX_FIELD_FLOAT <= value <= wire.MAX_FIELD_FLOAT:
            return False
        return key not in _CLOCK or -wire.MAX_CLOCK_OFFSET_S <= value <= wire.MAX_CLOCK_OFFSET_S
    if t is int:
        if not -wire.MAX_FIELD_INT <= value <= wire.MAX_FIELD_INT:
            return False
        return key not in _CLOCK or -wire.MAX_CLOCK_OFFSET_S <= value <= wire.MAX_CLOCK_OFFSET_S
    if t is str:
        return len(value) <= wire.MAX_FIELD_TEXT
    return value is None or t is bool


def fastwire_decode_batch(payload: bytes, topic_job: str | None = None) -> wire.Batch:
    batch = _fast(payload, topic_job)
    return batch if batch is not None else hand_decode_batch(payload, topic_job=topic_job)


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
        events = [_fast_event(job, node, e) for e in raw]
    except _Reject:
        return None
    return wire.Batch(
        agent=agent, job=job, node=node, sent_at=float(sent_at), seq=seq, events=events, behind=behind
    )


class _Reject(Exception):
    pass


def _fast_event(job: str, node: str, e: Any) -> Event:
    if type(e) is not dict or len(e) != _NKEYS:
        raise _Reject
    try:
        eid, kind, rank, local_rank = e["id"], e["kind"], e["rank"], e["local_rank"]
        file, offset, line_no, ts, ts_source = e["file"], e["offset"], e["line_no"], e["ts"], e["ts_source"]
        rule, severity, role, category = e["rule"], e["severity"], e["role"], e["category"]
        text, context, fields = e["text"], e["context"], e["fields"]
    except KeyError:
        raise _Reject from None
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
        if not _TS_MIN <= ts < _TS_MAX:
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
    return Event(
        eid, kind, job, node, rank, local_rank, file, offset, line_no, ts, ts_source,
        rule, severity, role, category, text, context, fields,
    )  # fmt: skip


# The benchmark -----------------------------------------------------------------------------------

JOB = "job-bench"


def progress_payload() -> tuple[bytes, int]:
    """bench_serve.py's phase-1 batch: one node's 8 ranks x 5 steps of step lines."""
    node = "n000"
    evs = [
        Event(
            id=f"{node}-{r}-p{s}",
            kind="progress",
            job=JOB,
            node=node,
            rank=r,
            local_rank=r,
            file=f"/logs/{node}/rank{r}.log",
            offset=s * 120,
            line_no=s,
            ts=1.8e9 + s * 0.5,
            ts_source="line",
            rule="megatron-iteration",
            severity="info",
            role="progress",
            category="progress",
            text=f"iteration {s} | lm loss: 2.31 | grad norm: 1.02",
            fields={"step": s, "loss": 2.31},
        )
        for s in range(5)
        for r in range(8)
    ]
    return wire.encode_batch(f"{node}-agent", JOB, node, 1, time.time(), evs), len(evs)


def match_payload() -> tuple[bytes, int]:
    """bench_serve.py's failure cascade, one node: each rank's error line with 20 lines of context."""
    node = "n001"
    evs = [
        Event(
            id=f"{node}-{r}-nccl-timeout",
            kind="match",
            job=JOB,
            node=node,
            rank=8 + r,
            local_rank=r,
            file=f"/logs/{node}/rank{8 + r}.log",
            offset=10**6,
            line_no=9999,
            ts=1.8e9 + r * 0.01,
            ts_source="line",
            rule="nccl-timeout",
            severity="error",
            role="symptom",
            category="communication",
            text=f"nccl-timeout on rank {8 + r}",
            context=[f"[rank{8 + r}]:previous line {i} of the traceback" for i in range(20)],
        )
        for r in range(8)
    ]
    return wire.encode_batch(f"{node}-agent", JOB, node, 2, time.time(), evs), len(evs)


DECODERS: dict[str, Callable[[bytes, str | None], wire.Batch]] = {
    "hand": hand_decode_batch,
    "fastwire": fastwire_decode_batch,
    "msgspec": wire.decode_batch,
}


def rate(
    decode: Callable[[bytes, str | None], wire.Batch], payload: bytes, n_events: int, seconds: float
) -> float:
    """Events per CPU second of `decode` on `payload`."""
    n, c0 = 0, time.process_time()
    while time.process_time() - c0 < seconds:
        for _ in range(50):
            decode(payload, JOB)
        n += 50 * n_events
    return n / (time.process_time() - c0)


def reference_rate(seconds: float = 1.0) -> float:
    """The hand validator on the progress batch: bench_serve.py's machine-speed baseline."""
    payload, n = progress_payload()
    return rate(hand_decode_batch, payload, n, seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seconds", type=float, default=0.5, help="CPU seconds per decoder, batch and round")
    ap.add_argument("--json", help="also write the summary here")
    args = ap.parse_args()
    batches = {"progress": progress_payload(), "match": match_payload()}
    for payload, _ in batches.values():  # the three agree on what they decode
        got = {name: [e.to_dict() for e in d(payload, JOB).events] for name, d in DECODERS.items()}
        assert got["hand"] == got["fastwire"] == got["msgspec"]
    best: dict[str, dict[str, float]] = {b: dict.fromkeys(DECODERS, 0.0) for b in batches}
    order = list(DECODERS)
    for i in range(args.rounds):
        for bname, (payload, n) in batches.items():
            for name in order[i % 3 :] + order[: i % 3]:  # interleaved, each first in turn
                best[bname][name] = max(best[bname][name], rate(DECODERS[name], payload, n, args.seconds))
    summary: dict[str, Any] = {"rounds": args.rounds, "seconds": args.seconds}
    for bname, (payload, n) in batches.items():
        r = best[bname]
        summary[bname] = {
            "events": n,
            "bytes": len(payload),
            **{f"{k}_events_per_cpu_s": round(v) for k, v in r.items()},
            "msgspec_vs_fastwire": round(r["msgspec"] / r["fastwire"], 2),
            "msgspec_vs_hand": round(r["msgspec"] / r["hand"], 2),
        }
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
