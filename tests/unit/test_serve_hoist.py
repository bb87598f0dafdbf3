"""Match events fed ahead of queued progress (`Engine.add(place=False)` + `Engine.place`) end in
the same diagnosis as arrival order, on every case of the fixture corpus."""

from __future__ import annotations

import random

import pytest

from denpex_agent.events import Event
from denpex_agent.matcher import Matcher
from denpex_agent.reader import ReadReport, discover, read_files
from denpex_agent.rules import RuleSet
from denpexd.engine import Engine
from tests.conftest import JOBS

CASES = sorted(p.name for p in JOBS.iterdir() if p.is_dir())


def _events(case: str, rules: RuleSet) -> list[Event]:
    report = ReadReport()
    return list(read_files(discover([str(JOBS / case)], None, report), Matcher(rules), "job", report))


def _arrival(events: list[Event], seed: int) -> list[Event]:
    """Interleave the nodes' streams at random, as agents publishing concurrently would."""
    streams: dict[str, list[Event]] = {}
    for ev in events:
        streams.setdefault(ev.node, []).append(ev)
    rng = random.Random(seed)
    out: list[Event] = []
    heads = {n: 0 for n in streams}
    while heads:
        node = rng.choice(sorted(heads))
        out.append(streams[node][heads[node]])
        heads[node] += 1
        if heads[node] == len(streams[node]):
            del heads[node]
    return out


@pytest.mark.parametrize("case", CASES)
def test_hoisted_matches_end_in_the_arrival_order_diagnosis(case: str, library: RuleSet) -> None:
    for seed in range(3):
        events = _arrival(_events(case, library), seed)
        reference = Engine("job", library)
        for ev in events:
            reference.add(ev)
        hoisted = Engine("job", library)
        rng = random.Random(seed)
        # ingest hoists match events in their arrival order, each some time before its batch is
        # processed in place; everything else keeps arrival order
        matches = [ev for ev in events if ev.kind == "match"]
        fed, early = 0, set()
        for ev in events:
            while fed < len(matches) and ((ev.kind == "match" and id(ev) not in early) or rng.random() < 0.3):
                hoisted.add(matches[fed], place=False)
                early.add(id(matches[fed]))
                fed += 1
            if ev.kind == "match":
                hoisted.place(ev)
            else:
                hoisted.add(ev)
        assert fed == len(matches)
        assert list(hoisted.tracks) == list(reference.tracks)
        assert hoisted.local_ranks == reference.local_ranks
        assert hoisted.diagnose() == reference.diagnose()
