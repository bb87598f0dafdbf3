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
