"""The daemon's fast batch decoder must decide exactly as `wire.decode_batch` does."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from denpex_agent import wire
from denpexd import fastwire

VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=True),
    st.text(max_size=20), st.lists(st.text(max_size=5), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)  # fmt: skip


def _event(i: int) -> dict[str, Any]:
    return {
        "id": f"e{i}", "kind": "match", "rank": i % 4, "local_rank": None, "file": "/l/rank0.log",
        "offset": 10 * i, "line_no": i + 1, "ts": 1795953600.5 + i, "ts_source": "line",
        "rule": "cuda-oom", "severity": "error", "role": "root-cause", "category": "out-of-memory",
        "text": "torch.OutOfMemoryError: CUDA out of memory.", "context": ["a", "b"], "fields": {"step": i},
    }  # fmt: skip


def _batch(events: list[dict[str, Any]], **top: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"v": 1, "agent": "a1", "job": "job-1", "node": "n1", "seq": 3, "sent_at": 1.0}
    doc.update(top)
    doc["events"] = events
    return doc


def _outcome(decode: Any, payload: bytes) -> Any:
    try:
        b = decode(payload, "job-1")
    except wire.WireError as exc:
        return ("error", exc.reason)
    return ("ok", b.agent, b.job, b.node, b.seq, b.sent_at, [e.to_dict() for e in b.events])


@settings(max_examples=400, deadline=None)
@given(
    n=st.integers(0, 4),
    which=st.integers(0, 3),
    key=st.sampled_from([*wire._EVENT_KEYS, "extra", "v", "agent", "job", "node", "seq", "sent_at"]),
    value=VALUES,
    drop=st.booleans(),
)
def test_same_outcome_as_the_reference_validator(
    n: int, which: int, key: str, value: Any, drop: bool
) -> None:
    events = [_event(i) for i in range(n)]
    top: dict[str, Any] = {}
    if key in ("v", "agent", "job", "node", "seq", "sent_at"):
        top[key] = value
    elif events:
        target = events[which % len(events)]
        if drop and key in target:
            del target[key]
        else:
            target[key] = value
    doc = _batch(events, **top)
    try:
        payload = orjson.dumps(doc)
    except (TypeError, orjson.JSONEncodeError):
        return
    assert _outcome(fastwire.decode_batch, payload) == _outcome(wire.decode_batch, payload)


def test_well_formed_batches_are_equal() -> None:
    payload = orjson.dumps(_batch([_event(i) for i in range(50)]))
    assert _outcome(fastwire.decode_batch, payload) == _outcome(wire.decode_batch, payload)


FIELD_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**60), 2**60), st.floats(allow_nan=True, allow_infinity=False),
    st.floats(min_value=-1e6, max_value=1e6), st.text(max_size=1100), st.lists(st.integers(-9, 9), max_size=2),
    st.dictionaries(st.text(max_size=3), st.dictionaries(st.text(max_size=3), st.integers(-9, 9), max_size=2), max_size=2),
)  # fmt: skip
FIELD_KEYS = st.one_of(
    st.sampled_from(["step", "clock_offset_s", "clock_uncertainty_s", "loss"]), st.text(max_size=70)
)


@settings(max_examples=400, deadline=None)
@given(
    fields=st.dictionaries(FIELD_KEYS, FIELD_VALUES, max_size=4),
    ts=st.one_of(st.none(), st.floats(allow_nan=False, allow_infinity=False), st.integers(-(2**40), 2**40)),
    offset=st.integers(-5, 2**63 - 1),
    behind=st.one_of(st.integers(-5, 2**60), st.floats(allow_nan=False, allow_infinity=False)),
)
def test_bounds_at_the_edge_are_decided_alike(
    fields: dict[str, Any], ts: Any, offset: int, behind: Any
) -> None:
    """Timestamps outside 2000-2100, nested or oversized fields, absurd clock offsets and
    counters: the fast path refuses nothing the reference takes, and takes nothing it refuses."""
    event = {**_event(1), "fields": fields, "ts": ts, "offset": offset}
    payload = orjson.dumps(_batch([event], behind=behind))
    assert _outcome(fastwire.decode_batch, payload) == _outcome(wire.decode_batch, payload)


def test_absurd_numbers_are_refused_and_labelled() -> None:
    cases = {
        "range": [{"ts": 1e300}, {"ts": -1e12}, {"ts": 253402300810.0}, {"fields": {"clock_offset_s": 1e308}},
                  {"fields": {"step": 2**60}}],
        "nesting": [{"fields": {"a": {"x": {"x": 1}}}}, {"fields": {"a": [1, 2]}}],
        "field": [{"fields": {"text": "x" * 2000}}],
    }  # fmt: skip
    for code, changes in cases.items():
        for change in changes:
            payload = orjson.dumps(_batch([{**_event(1), **change}]))
            try:
                wire.decode_batch(payload, "job-1")
            except wire.WireError as exc:
                assert exc.code == code, change
            else:
                raise AssertionError(f"accepted: {change}")
