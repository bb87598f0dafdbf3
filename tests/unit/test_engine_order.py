"""The engine's state does not depend on the order events arrive in: on every case of the fixture
corpus, the diagnosis after any shuffle of the events (the live daemon gets the nodes' streams
interleaved, ingest hoists match events ahead of queued progress, a restart replays the store)
equals the diagnosis after reading the files one after another."""

from __future__ import annotations

import random

import pytest

from denpex_agent.events import Event
from denpex_agent.matcher import Matcher
from denpex_agent.reader import ReadReport, discover, read_files
from denpex_agent.rules import RuleSet
from denpexd.engine import Engine
from tests.conftest import JOBS

CASES = sorted(p.name for p in JOBS.iterdir() if (p / "expected.json").is_file())


def _events(case: str, rules: RuleSet) -> list[Event]:
    report = ReadReport()
    return list(read_files(discover([str(JOBS / case)], None, report), Matcher(rules), "job", report))


def _diagnose(events: list[Event], rules: RuleSet) -> dict[str, object]:
    engine = Engine("job", rules)
    for ev in events:
        engine.add(ev)
    return engine.diagnose()


@pytest.mark.parametrize("case", CASES)
def test_any_arrival_order_gives_the_file_order_diagnosis(case: str, library: RuleSet) -> None:
    events = _events(case, library)
    reference = _diagnose(events, library)
    for seed in range(4):
        shuffled = list(events)
        random.Random(seed).shuffle(shuffled)
        assert _diagnose(shuffled, library) == reference, f"seed {seed}"
    assert _diagnose(events[::-1], library) == reference


def test_a_duplicate_of_the_first_event_at_the_same_time_does_not_move_the_initiator(
    library: RuleSet,
) -> None:
    """Two copies of one line (a worker's own file and its launcher's echo) tie on time: one rule
    picks the same one whichever arrives first."""
    events = _events("exception", library)
    first = next(
        e
        for e in events
        if e.kind == "match" and e.role == "root-cause" and not e.text.startswith("[default")
    )
    echo = Event(**{**first.to_dict(), "id": "echo", "file": "zz-launcher.log", "offset": 0})
    a = _diagnose([*events, echo], library)
    b = _diagnose([echo, *events], library)
    assert a == b
    assert a["evidence"]["file"] == first.file  # type: ignore[index]
