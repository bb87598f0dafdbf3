"""The batch validator (`wire.decode_batch`, msgspec structs): what it accepts comes out as the
agent's events, and every rejection the protocol names is refused with the bounded reason label
`metrics.invalid_reason` counts it under."""

from __future__ import annotations

import gc
import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from denpex_agent import wire
from denpex_agent.events import KINDS, TS_SOURCES, Event
from denpex_agent.rules import CATEGORIES, PROGRESS_CATEGORY, ROLES, SEVERITIES
from denpexd.metrics import INVALID_REASONS, invalid_reason


def _event(i: int) -> dict[str, Any]:
    return {
        "id": f"e{i}", "kind": "match", "rank": i % 4, "local_rank": None, "file": "/l/rank0.log",
        "offset": 10 * i, "line_no": i + 1, "ts": 1795953600.5 + i, "ts_source": "line",
        "rule": "cuda-oom", "severity": "error", "role": "root-cause", "category": "out-of-memory",
        "text": "torch.OutOfMemoryError: CUDA out of memory.", "context": ["a", "b"], "fields": {"step": i},
    }  # fmt: skip


def _batch(evs: list[dict[str, Any]], **top: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"v": 1, "agent": "a1", "job": "job-1", "node": "n1", "seq": 3, "sent_at": 1.0}
    doc["events"] = evs
    doc.update(top)
    return doc


def _reason(payload: bytes, topic_job: str | None = "job-1") -> str:
    """The label the daemon counts a refused payload under (fails if it is accepted)."""
    with pytest.raises(wire.WireError) as err:
        wire.decode_batch(payload, topic_job)
    reason = invalid_reason(err.value.reason, err.value.code)
    assert reason in INVALID_REASONS
    return reason


def test_a_valid_batch_comes_out_as_events() -> None:
    payload = orjson.dumps(_batch([_event(i) for i in range(50)], behind=7))
    b = wire.decode_batch(payload, "job-1")
    assert (b.agent, b.job, b.node, b.seq, b.sent_at, b.behind) == ("a1", "job-1", "n1", 3, 1.0, 7)
    assert [e.to_dict() for e in b.events] == [{**_event(i), "job": "job-1", "node": "n1"} for i in range(50)]
    assert all(type(e) is Event for e in b.events)


def test_left_out_keys_take_their_defaults() -> None:
    minimal = {"id": "e", "kind": "progress", "offset": 0, "line_no": 1}
    b = wire.decode_batch(
        orjson.dumps({"v": 1, "agent": "a", "job": "j", "node": "n", "sent_at": 5, "events": [minimal]})
    )
    assert (b.seq, b.behind, b.sent_at) == (0, 0, 5.0) and isinstance(b.sent_at, float)
    assert b.events == [Event("e", "progress", "j", "n", None, None, "", 0, 1, None, "none")]
    ts_int = wire.decode_batch(orjson.dumps(_batch([{**_event(0), "ts": 1795953600}])), "job-1").events[0].ts
    assert ts_int == 1795953600.0 and isinstance(ts_int, float)


def test_unknown_batch_keys_are_ignored_unknown_event_keys_refused() -> None:
    assert wire.decode_batch(orjson.dumps(_batch([_event(0)], later="x")), "job-1").events
    assert _reason(orjson.dumps(_batch([{**_event(0), "extra": 1}]))) == "schema"


def test_an_events_job_and_node_are_its_batchs_alone() -> None:
    """`Event` has job and node fields, the wire event has not: inside an event they are refused,
    and every decoded event carries its batch's."""
    for key in ("job", "node"):
        assert _reason(orjson.dumps(_batch([{**_event(0), key: "other"}]))) == "schema", key
    events = wire.decode_batch(orjson.dumps(_batch([_event(0), _event(1)])), "job-1").events
    assert {(e.job, e.node) for e in events} == {("job-1", "n1")}
    # a daemon keeps hundreds of thousands of events: the collector does not walk them
    assert not any(gc.is_tracked(e) for e in events)


def test_the_vocabularies_are_the_rules() -> None:
    for key, allowed in (
        ("kind", KINDS), ("ts_source", TS_SOURCES), ("severity", SEVERITIES), ("role", ROLES),
        ("category", (*CATEGORIES, PROGRESS_CATEGORY)),
    ):  # fmt: skip
        for value in allowed:
            wire.decode_batch(orjson.dumps(_batch([{**_event(0), key: value}])), "job-1")
        assert _reason(orjson.dumps(_batch([{**_event(0), key: "bogus"}]))) == "schema", key
        assert _reason(orjson.dumps(_batch([{**_event(0), key: 3}]))) == "schema", key


TOO_LARGE = b'{"v":1,' + b" " * wire.MAX_BATCH_BYTES + b"}"
# Every refusal of the validator before msgspec, one problem per payload, and its label.
REFUSED: list[tuple[str, Any, str]] = [
    ("not JSON", b"{", "not_json"),
    ("not JSON either", b"\xff", "not_json"),
    ("an array", b"[1]", "not_json"),
    ("a string", b'"x"', "not_json"),
    ("too large", TOO_LARGE, "too_large"),
    ("no version", {"v": None}, "version"),
    ("version 2", {"v": 2}, "version"),
    ("version as text", {"v": "1"}, "version"),
    ("agent missing", {"agent": None}, "bad_id"),
    ("agent with a slash", {"agent": "a/b"}, "bad_id"),
    ("agent a wildcard", {"agent": "+"}, "bad_id"),
    ("job with #", {"job": "j#"}, "bad_id"),
    ("job with ..", {"job": "a..b"}, "bad_id"),
    ("node with a leading dot", {"node": ".n"}, "bad_id"),
    ("node too long", {"node": "n" * 129}, "bad_id"),
    ("node empty", {"node": ""}, "bad_id"),
    ("node a number", {"node": 7}, "bad_id"),
    ("node with a newline", {"node": "n1\n"}, "bad_id"),
    ("another job than the topic's", {"job": "job-2"}, "topic_mismatch"),
    ("seq negative", {"seq": -1}, "schema"),
    ("seq a float", {"seq": 1.5}, "schema"),
    ("seq true", {"seq": True}, "schema"),
    ("sent_at missing", {"sent_at": None}, "schema"),
    ("sent_at text", {"sent_at": "now"}, "schema"),
    ("behind negative", {"behind": -1}, "schema"),
    ("behind absurd", {"behind": 1 << 53}, "schema"),
    ("behind a float", {"behind": 1.0}, "schema"),
    ("events missing", {"events": None}, "schema"),
    ("events an object", {"events": {}}, "schema"),
    (
        "too many events",
        {"events": [{"id": "e", "kind": "heartbeat", "offset": 0, "line_no": 0}] * (wire.MAX_EVENTS + 1)},
        "schema",
    ),
    ("an event not an object", {"events": [1]}, "schema"),
    ("an unknown event key", {"extra": 1}, "schema"),
    ("id missing", {"id": None}, "schema"),
    ("id empty", {"id": ""}, "schema"),
    ("id too long", {"id": "x" * 129}, "schema"),
    ("kind unknown", {"kind": "other"}, "schema"),
    ("kind missing", {"kind": None}, "schema"),
    ("ts text", {"ts": "yesterday"}, "schema"),
    ("ts before 2000", {"ts": 946684799.5}, "range"),
    ("ts at 2100", {"ts": 4102444800}, "range"),
    ("ts absurd", {"ts": 1e300}, "range"),
    ("ts_source unknown", {"ts_source": "guess"}, "schema"),
    ("severity unknown", {"severity": "fatal"}, "schema"),
    ("role unknown", {"role": "cause"}, "schema"),
    ("category unknown", {"category": "weather"}, "schema"),
    ("text too long", {"text": "x" * (wire.MAX_TEXT + 1)}, "schema"),
    ("text a list", {"text": ["x"]}, "schema"),
    ("context not a list", {"context": "x"}, "schema"),
    ("context too long", {"context": ["x"] * (wire.MAX_CONTEXT_LINES + 1)}, "schema"),
    ("a context line too long", {"context": ["x" * (wire.MAX_TEXT + 1)]}, "schema"),
    ("a context line a number", {"context": [1]}, "schema"),
    ("fields a list", {"fields": []}, "schema"),
    ("too many fields", {"fields": {f"f{i}": i for i in range(wire.MAX_FIELDS + 1)}}, "schema"),
    ("a field name too long", {"fields": {"x" * 65: 1}}, "field"),
    ("a field text too long", {"fields": {"text": "x" * (wire.MAX_FIELD_TEXT + 1)}}, "field"),
    ("a field a list", {"fields": {"a": [1, 2]}}, "nesting"),
    ("a field an object", {"fields": {"a": {"x": {"x": 1}}}}, "nesting"),
    ("a field integer too large", {"fields": {"step": 2**60}}, "range"),
    (
        "a field integer beyond 64 bits",
        orjson.dumps(_batch([{**_event(0), "fields": {"step": 0}}])).replace(
            b'"step":0', b'"step":' + str(2**70).encode()
        ),
        "range",
    ),
    ("a field float too large", {"fields": {"loss": -1e301}}, "range"),
    ("a clock offset beyond a day", {"fields": {"clock_offset_s": 86400.5}}, "range"),
    ("a clock offset absurd", {"fields": {"clock_offset_s": 1e300}}, "range"),
    ("a clock uncertainty beyond a day", {"fields": {"clock_uncertainty_s": -86401}}, "range"),
    ("file a number", {"file": 1}, "schema"),
    ("file too long", {"file": "x" * 4097}, "schema"),
    ("rule too long", {"rule": "x" * 65}, "schema"),
    ("rule a number", {"rule": 1}, "schema"),
    ("offset missing", {"offset": None}, "schema"),
    ("line_no missing", {"line_no": None}, "schema"),
    ("offset negative", {"offset": -1}, "schema"),
    ("offset at 2**62", {"offset": 1 << 62}, "schema"),
    ("line_no a float", {"line_no": 1.0}, "schema"),
    ("line_no true", {"line_no": True}, "schema"),
    ("rank below -1", {"rank": -2}, "schema"),
    ("rank at 2**31", {"rank": 1 << 31}, "schema"),
    ("local_rank text", {"local_rank": "0"}, "schema"),
]
_TOP = ("v", "agent", "job", "node", "seq", "sent_at", "behind", "events")


def _payload(change: Any) -> bytes:
    if isinstance(change, bytes):
        return change
    top = {k: v for k, v in change.items() if k in _TOP}
    event = {**_event(1), **{k: v for k, v in change.items() if k not in _TOP}}
    doc = _batch([_event(0), event], **top)
    for key in [k for k, v in doc.items() if v is None]:  # None: the key left out
        del doc[key]
    for key in [k for k, v in event.items() if v is None and k in change]:
        del event[key]
    return orjson.dumps(doc)


@pytest.mark.parametrize(("what", "change", "reason"), REFUSED, ids=[r[0] for r in REFUSED])
def test_every_refusal_keeps_its_reason_label(what: str, change: Any, reason: str) -> None:
    assert _reason(_payload(change)) == reason


def test_the_accepted_edges() -> None:
    """The bounds themselves are inside: what the old validator took, this one takes."""
    for change in (
        {"ts": 946684800}, {"ts": 4102444799.5}, {"rank": -1, "local_rank": (1 << 31) - 1},
        {"offset": (1 << 62) - 1}, {"fields": {"step": 2**53, "loss": -1e300, "clock_offset_s": -86400}},
        {"fields": {"x" * 64: "y" * wire.MAX_FIELD_TEXT, "b": True, "n": None}}, {"ts": None, "rule": None},
        {"behind": (1 << 53) - 1}, {"node": "gpu-node-3.example:x@y=1"},
    ):  # fmt: skip
        wire.decode_batch(_payload(change), "job-1")


WORDS = st.text(max_size=30)
EVENTS = st.builds(
    Event,
    id=st.text(min_size=1, max_size=wire.MAX_ID_LEN),
    kind=st.sampled_from(KINDS),
    job=st.just("job-1"),
    node=st.just("n1"),
    rank=st.none() | st.integers(-1, 2**31 - 1),
    local_rank=st.none() | st.integers(-1, 2**31 - 1),
    file=WORDS,
    offset=st.integers(0, 2**62 - 1),
    line_no=st.integers(0, 2**62 - 1),
    ts=st.none() | st.floats(wire.TS_MIN, wire.TS_MAX, exclude_max=True),
    ts_source=st.sampled_from(TS_SOURCES),
    rule=st.none() | st.text(max_size=64),
    severity=st.none() | st.sampled_from(SEVERITIES),
    role=st.none() | st.sampled_from(ROLES),
    category=st.none() | st.sampled_from((*CATEGORIES, PROGRESS_CATEGORY)),
    text=WORDS,
    context=st.lists(WORDS, max_size=3),
    fields=st.dictionaries(
        st.text(max_size=64),
        st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.floats(-1e300, 1e300) | WORDS,
        max_size=4,
    ),
)


@settings(max_examples=300, deadline=None)
@given(events=st.lists(EVENTS, max_size=5), seq=st.integers(0, 2**40), behind=st.integers(0, 2**53 - 1))
def test_what_an_agent_encodes_decodes_to_the_same_events(events: list[Event], seq: int, behind: int) -> None:
    for ev in events:  # the clock fields' bound is the protocol's too
        for key in ("clock_offset_s", "clock_uncertainty_s"):
            ev.fields.pop(key, None)
    b = wire.decode_batch(wire.encode_batch("a1", "job-1", "n1", seq, 2.5, events, behind), "job-1")
    assert (b.agent, b.seq, b.sent_at, b.behind) == ("a1", seq, 2.5, behind)
    assert b.events == events


def _escape_some(text: str, picks: list[bool]) -> str:
    """JSON string contents with some characters written as \\uXXXX (as any encoder may)."""
    return "".join(
        f"\\u{ord(c):04x}" if pick else c for c, pick in zip(text, picks + [False] * len(text), strict=False)
    )


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(KINDS), min_size=1, max_size=6),
    st.lists(st.booleans(), max_size=5),
    st.text(max_size=40),
    st.booleans(),
)
def test_a_batch_holding_a_match_event_is_always_taken_for_urgent(
    kinds: list[str], picks: list[bool], text: str, ascii_only: bool
) -> None:
    """The daemon's read path validates first the batches that may hold a match event
    (`ingest.may_carry_match`, a byte search before any parsing): never False for a batch that
    holds one, however the sender spelled the kind (escaped letters) or the texts."""
    from denpexd.ingest import may_carry_match

    evs = [dict(_event(i), kind=k, text=text) for i, k in enumerate(kinds)]
    doc = _batch(evs)
    # non-ASCII text as \u escapes, or as UTF-8
    raw = (
        json.dumps(doc, ensure_ascii=True, separators=(",", ":"))
        if ascii_only
        else orjson.dumps(doc).decode()
    )
    raw = raw.replace('"kind":"match"', f'"kind":"{_escape_some("match", picks)}"')
    payload = raw.encode()
    batch = wire.decode_batch(payload, "job-1")
    assert [e.kind for e in batch.events] == kinds
    if "match" in kinds:
        assert may_carry_match(payload)
