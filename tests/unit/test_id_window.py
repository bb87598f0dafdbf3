"""The window of recent event ids a job keeps to drop re-sends: the agents' hex ids are kept as
the numbers they spell (exact: two ids never share a key), any other id as it is."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from denpex_agent.events import event_id
from denpexd.jobs import IdWindow, id_key


def test_agent_ids_are_kept_as_numbers_and_others_as_they_are() -> None:
    eid = event_id("agent", "dev:ino:64:abcd", 1234)
    assert isinstance(id_key(eid), int) and id_key(eid) == int(eid, 16)
    assert id_key("not-hex-but-twenty-four!") == "not-hex-but-twenty-four!"
    assert id_key("abc") == "abc"
    assert id_key(eid.upper()) == eid.upper() and id_key("0x" + eid[2:]) == "0x" + eid[2:]


@settings(max_examples=60, deadline=None)
@given(
    ids=st.lists(
        st.one_of(
            st.integers(0, 50).map(lambda n: event_id("a", "i", n)),
            st.text(min_size=1, max_size=30),
            st.integers(0, 50).map(lambda n: f"{n:024x}"),
            st.integers(0, 50).map(lambda n: f"{n:024X}"),  # the same numbers, other strings
            st.integers(0, 50).map(lambda n: f"0x{n:022x}"),
        ),
        max_size=200,
    ),
    limit=st.integers(1, 40),
)
def test_the_window_answers_as_a_window_of_the_ids_themselves(ids: list[str], limit: int) -> None:
    window = IdWindow()
    model: list[str] = []  # the last `limit` distinct ids taken, as strings
    for eid in ids:
        assert (eid in window) == (eid in model)
        if eid not in model:
            window.add(eid, limit)
            model.append(eid)
            del model[:-limit]
    assert len(window) == len(model)
    for eid in list(model):
        window.discard(eid)
        assert eid not in window
    assert len(window) == 0
