"""`LineScanner.quiet_since`: from when a file logged no step line, by its own clock, whatever
the reads; and `analysis.quiet`, the stall it shows when the logs went on after it."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from denpex_agent.events import Event
from denpex_agent.matcher import Matcher
from denpex_agent.rules import RuleSet
from denpex_agent.scanner import QUIET_WINDOW, LineScanner, Source
from denpex_agent.timestamps import parse_timestamp
from denpexd.analysis.quiet import (
    FLOOR_S,
    PAUSE_S,
    LogTimes,
    logged_stall,
    note_log_time,
    note_pause,
    step_interval,
)
from denpexd.engine import Engine
from tests.unit.test_engine import T0, ev

STEP = b" iteration     %d/  115311 | consumed samples: %d | lm loss: 2.113567E+00 |\n"
PULSE = b"[2022-05-01 %02d:%02d:%02d] PULSE: job is running\n"


def _ts(text: bytes) -> float:
    got = parse_timestamp(text.decode(), 2026, None)
    assert got is not None
    return got


@pytest.fixture(scope="module")
def matcher(library: RuleSet) -> Matcher:
    return Matcher(library)


def _scanner(matcher: Matcher) -> LineScanner:
    return LineScanner(matcher, Source(job="j", agent="a", node="n", rank=None, local_rank=None, file="f.log",
                                       identity="i", default_year=2026))  # fmt: skip


def _read(matcher: Matcher, data: bytes, cuts: list[int], looks: bool = False) -> tuple[float | None, list]:
    """``data`` fed in pieces cut at ``cuts``; with ``looks``, `quiet_since` asked after each piece
    (the agent's heartbeats); then the end of input. The final value and the ones seen on the way."""
    sc = _scanner(matcher)
    seen = []
    last = 0
    for cut in [*sorted(cuts), len(data)]:
        sc.feed(data[last:cut])
        last = cut
        if looks:
            seen.append(sc.quiet_since())
    sc.finish()
    return sc.quiet_since(), [s for s in seen if s is not None]


def test_an_untimed_step_is_dated_by_the_next_line_with_a_time(matcher: Matcher) -> None:
    data = STEP % (45000, 1) + b"-----\n" + PULSE % (3, 56, 11) + PULSE % (5, 56, 18)
    assert _read(matcher, data, [])[0] == _ts(PULSE % (3, 56, 11))


def test_a_timed_step_is_dated_by_itself(matcher: Matcher) -> None:
    data = PULSE % (1, 0, 0) + b"2022-05-01 02:00:00,000 INFO step 7/100 | loss 1.5\n" + PULSE % (4, 0, 0)
    assert _read(matcher, data, [])[0] == _ts(b"2022-05-01 02:00:00")


def test_no_step_or_no_time_after_it_is_none(matcher: Matcher) -> None:
    assert _read(matcher, PULSE % (1, 0, 0) + PULSE % (2, 0, 0), [])[0] is None
    assert _read(matcher, PULSE % (1, 0, 0) + STEP % (10, 1), [])[0] is None


def test_steps_pushed_out_of_the_window_leave_the_windows_first_time(matcher: Matcher) -> None:
    pulses = b"".join(PULSE % (h, m, s) for h in range(6, 12) for m in range(60) for s in range(0, 60, 10))
    assert len(pulses) > QUIET_WINDOW
    data = STEP % (1, 1) + pulses
    got = _read(matcher, data, [])[0]
    # later than the step, earlier than the end: a bound that shortens the silence
    assert got is not None and _ts(PULSE % (6, 0, 0)) < got < _ts(PULSE % (11, 59, 50))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_cuts=st.integers(0, 40))
def test_the_value_does_not_depend_on_the_reads(matcher: Matcher, seed: int, n_cuts: int) -> None:
    rnd = random.Random(seed)
    parts = []
    clock = [0, 0, 0]
    n = rnd.randint(1, 600)
    steps_until = rnd.randint(0, n)  # the steps stop there (the file goes on without them)
    for i in range(n):
        if i < steps_until and rnd.random() < 0.3:
            parts.append(STEP % (i, i))
        clock[2] += rnd.randint(1, 50)
        clock[1] += clock[2] // 60
        clock[2] %= 60
        clock[0] += clock[1] // 60
        clock[1] %= 60
        parts.append(
            PULSE % (clock[0] % 24, clock[1], clock[2])
            if rnd.random() < 0.8
            else b"noise " * rnd.randint(0, 600) + b"\n"
        )
    data = b"".join(parts)
    whole, _ = _read(matcher, data, [])
    cuts = [rnd.randint(0, len(data)) for _ in range(n_cuts)]
    final, seen = _read(matcher, data, cuts, looks=True)
    assert final == whole
    # the heartbeats' values never pass the final one (the engine keeps the newest)
    assert all(s <= final for s in seen) if final is not None else True


# -- analysis.quiet ---------------------------------------------------------------------------


def _aligned(node: str, ts: float | None) -> float | None:
    return ts


def test_the_newest_report_of_each_node_is_kept() -> None:
    times: LogTimes = {}
    note_log_time(times, "a", T0 + 10, T0 + 5)
    note_log_time(times, "a", T0 + 8, None)
    note_log_time(times, "a", T0 + 9, "junk")
    note_log_time(times, "a", T0 + 7, T0 + 3)
    assert times == {"a": (T0 + 10, T0 + 5)}


def test_a_silence_longer_than_the_threshold_is_a_stall() -> None:
    times = {"a": (T0 + FLOOR_S + 60, T0), "b": (T0 + 30, None)}
    got = logged_stall(times, _aligned, [], None)
    assert got is not None and got["silent_s"] == FLOOR_S + 60 and got["threshold_s"] == FLOOR_S
    assert logged_stall({"a": (T0 + FLOOR_S - 1, T0)}, _aligned, [], None) is None


def test_the_latest_node_to_step_decides_and_slow_steps_raise_the_threshold() -> None:
    times = {"a": (T0 + 2 * FLOOR_S, T0), "b": (T0 + 2 * FLOOR_S, T0 + 1.5 * FLOOR_S)}
    assert logged_stall(times, _aligned, [], None) is None
    assert (
        logged_stall({"a": (T0 + 2 * FLOOR_S, T0)}, _aligned, [[(1, 0.0), (2, 0.3 * FLOOR_S)]], None) is None
    )


def test_a_finished_job_or_one_without_steps_is_not_stalled() -> None:
    assert logged_stall({"a": (T0 + 10 * FLOOR_S, T0)}, _aligned, [], True) is None
    assert logged_stall({"a": (T0 + 10 * FLOOR_S, None)}, _aligned, [], None) is None


def test_an_announced_pause_after_the_last_step_waits_longer() -> None:
    times = {"a": (T0 + FLOOR_S + 60, T0)}
    pauses: dict[str, float] = {}
    note_pause(pauses, "a", T0 - 30)  # announced before the last step: over
    assert logged_stall(times, _aligned, [], None, pauses) is not None
    note_pause(pauses, "a", T0 + 5)  # an evaluation began after it: it may take PAUSE_S
    note_pause(pauses, "a", T0 - 60)  # an older one changes nothing
    assert pauses == {"a": T0 + 5}
    assert logged_stall(times, _aligned, [], None, pauses) is None
    got = logged_stall({"a": (T0 + PAUSE_S + 1, T0)}, _aligned, [], None, pauses)
    assert got is not None and got["threshold_s"] == PAUSE_S


def test_step_interval_is_the_median_gap_between_logged_steps() -> None:
    assert step_interval([[(1, 0.0), (2, 10.0), (3, 20.0)], [(1, 5.0), (5, 105.0)]]) == 10.0
    assert step_interval([[(1, 0.0)]]) is None


def _beat(rules: RuleSet, node: str, ts: float, quiet: float | None) -> Event:
    e = ev(node, 0, ts, None, rules)
    e.kind = "heartbeat"
    e.fields = {} if quiet is None else {"quiet_since": quiet}
    return e


def test_the_engine_fails_a_job_whose_logs_outlived_its_steps(unit_rules: RuleSet) -> None:
    e = Engine("j", unit_rules)
    for s in range(1, 6):
        e.add(ev("n0", 0, T0 + 10 * s, None, unit_rules, step=s))
    e.add(_beat(unit_rules, "n0", T0 + 60 + FLOOR_S + 1, T0 + 60))
    d = e.diagnose()
    assert d["verdict"] == "failed" and d["root_cause"]["category"] == "hang"
    assert d["initiator"] is None and d["scope"] == "job"
    assert d["logged_stall"]["silent_s"] == pytest.approx(FLOOR_S + 1)
    e2 = Engine("j", unit_rules)
    for s in range(1, 6):
        e2.add(ev("n0", 0, T0 + 10 * s, None, unit_rules, step=s))
    e2.add(_beat(unit_rules, "n0", T0 + 60 + FLOOR_S - 1, T0 + 60))
    assert e2.diagnose()["verdict"] == "healthy" and e2.diagnose()["logged_stall"] is None


def test_a_rank_that_stopped_at_an_earlier_step_is_the_suspect(unit_rules: RuleSet) -> None:
    e = Engine("j", unit_rules)
    for s in range(1, 6):
        for r in range(4):
            if r != 2 or s <= 3:  # rank 2 logged its last step at step 3, the others went on to 5
                e.add(ev("n0", r, T0 + 10 * s, None, unit_rules, step=s))
    e.add(_beat(unit_rules, "n0", T0 + 60 + FLOOR_S + 1, T0 + 60))
    d = e.diagnose()
    assert d["verdict"] == "failed" and d["root_cause"]["category"] == "hang"
    assert d["initiator"] is not None and d["initiator"]["rank"] == 2 and d["scope"] == "rank"
