"""Live tips (`LineScanner.due_progress`): the newest step line of what was processed, unless it
was already sent, whatever the reads; and a tip looks only at the bytes processed since the last
one, so a file that logs no step line is not searched through its whole tail four times a second."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from denpex_agent.matcher import Hit, Matcher
from denpex_agent.rules import RuleSet
from denpex_agent.scanner import TAIL_BYTES, LineScanner, Source

STEP = "2026-11-29 12:00:%02d,000 INFO [rank0] step %d | loss 1.25 | lr 1.0e-04\n"
PLAIN = "2026-11-29 12:00:%02d,000 INFO [rank0] data shard %d opened, nothing to report here\n"
STEP_AT = re.compile(rb"step (\d+) \|")


class CountingMatcher(Matcher):
    """The real matcher, counting the bytes `last_progress` is asked to search."""

    searched = 0

    def last_progress(self, buf: bytes, start: int, stop: int) -> Hit | None:
        self.searched += stop - start
        return super().last_progress(buf, start, stop)


@pytest.fixture(scope="module")
def counting(library: RuleSet) -> CountingMatcher:
    return CountingMatcher(library)


def _scanner(matcher: Matcher, clock: list[float]) -> LineScanner:
    src = Source(
        job="j", agent="a", node="n", rank=0, local_rank=0, file="rank0.log", identity="i", default_year=2026
    )
    return LineScanner(matcher, src, progress_interval=0.25, clock=lambda: clock[0], dense=0, stride=1 << 40)


def _log(kinds: list[bool]) -> bytes:
    return "".join((STEP if step else PLAIN) % (i % 60, i) for i, step in enumerate(kinds)).encode()


def _newest_step(data: bytes, upto: int) -> int | None:
    """Offset of the last step line wholly in ``data[:upto]`` (by a plain regex, not the rules)."""
    found = None
    for m in STEP_AT.finditer(data, 0, upto):
        start = data.rfind(b"\n", 0, m.start()) + 1
        if data.find(b"\n", m.end()) < upto:
            found = start
    return found


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kinds=st.lists(st.booleans(), min_size=1, max_size=80),
    cuts=st.lists(st.integers(min_value=1, max_value=8000), max_size=12),
)
def test_each_tip_is_the_newest_step_line_not_sent_yet(
    counting: CountingMatcher, kinds: list[bool], cuts: list[int]
) -> None:
    data = _log(kinds)
    clock = [1000.0]
    sc = _scanner(counting, clock)
    sent: int | None = None
    last = 0
    for cut in sorted({c for c in cuts if c < len(data)} | {len(data)}):
        clock[0] += 1.0
        progress = [e for e in sc.feed(data[last:cut]) if e.kind == "progress"]
        last = cut
        samples = [e.offset for e in progress if not e.fields.get("tip")]
        tips = [e.offset for e in progress if e.fields.get("tip")]
        assert progress[: len(samples)] == [
            e for e in progress if not e.fields.get("tip")
        ]  # the tip comes last
        if samples:
            sent = samples[-1]
        newest = _newest_step(data, sc.offset)
        assert tips == ([] if newest is None or newest == sent else [newest])
        if tips:
            sent = tips[-1]


def test_a_file_without_step_lines_is_searched_once(counting: CountingMatcher) -> None:
    clock = [1000.0]
    sc = _scanner(counting, clock)
    sc.feed(_log([True]))  # one step line first (a sample): the file has a step to report
    chunk = _log([False] * 400)
    assert len(chunk) * 4 > TAIL_BYTES
    before = counting.searched
    fed = 0
    events: list[Any] = []
    for _ in range(40):
        clock[0] += 1.0
        events += sc.feed(chunk)
        fed += len(chunk)
    assert not [e for e in events if e.kind == "progress"]  # its one step line was sent before
    # each byte searched about once (the widening windows may look at a few bytes twice),
    # not the whole tail at every tip
    assert counting.searched - before <= 2 * fed
