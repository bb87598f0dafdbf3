"""Stall reports that list ranks (Horovod's stall inspector): the scanner's `stalled-ranks` fold
reads the ranks the others wait for into ``missing_ranks`` and, when there is one, ``culprit_rank``;
the hang analysis names that rank, also when its own log is missing, and a report that no step
line follows is a failure."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from denpex_agent.events import Event
from denpex_agent.matcher import Matcher
from denpex_agent.rules import RuleSet
from denpex_agent.scanner import LineScanner, missing_ranks, stall_fields
from denpexd.analysis.hang import HANG_RULE, hang_suspect, unresolved_stalls
from denpexd.analysis.tracks import Aggregate, NodeProgress, RankTrack, Tracks
from denpexd.engine import Engine
from tests.unit.test_engine import T0, ev, steps
from tests.unit.test_scanner import _source

HEAD = (
    "One or more tensors were submitted to be reduced, gathered or broadcasted by subset of ranks and are "
    "waiting for remainder of ranks for more than 60 seconds. This may indicate that different ranks are trying "
    "to submit different tensors or that only subset of ranks is submitting tensors, which will cause deadlock."
)
# Horovod <= 0.13: one line, the ranks that are ready after each stalled op
READY = f"WARNING: {HEAD} Stalled ops: {{ops}}\n"
# Horovod 0.15-0.16: a `Stalled ops:` heading, one op per line with the ranks missing
MISSING = (
    f"WARNING: {HEAD} \n"
    "Stalled ops:\n"
    "HorovodBroadcast_fully_connected_weights_0 [missing ranks: 0]\n"
    "HorovodBroadcast_fully_connected_1_weights_0 [missing ranks: 0]\n"
)
# Horovod >= 0.16 (stall_inspector.cc) under mpirun --tag-output: one `N: [ops]` line per rank missing
STALLED_RANKS = (
    f"[1,0]<stderr>:[2019-10-09 15:36:43.594972: W horovod/common/stall_inspector.cc:105] {HEAD}\n"
    "[1,0]<stderr>:Stalled ranks:\n"
    "[1,0]<stderr>:6: [horovod_allreduce.0, horovod_allreduce.1, horovod_allreduce.10, horovod_allreduce.100, "
    "horovod_allreduce.101, horovod_allreduce.102 ...]\n"
)


def _ops(*ready: str) -> str:
    return ", ".join(f"allreduce.layer{i}.weight [ready ranks: {r}]" for i, r in enumerate(ready))


def _scan(matcher: Matcher, data: bytes, sizes: list[int] | None = None) -> list[Event]:
    sc = LineScanner(matcher, _source())
    out: list[Event] = []
    if sizes is None:
        out += sc.feed(data)
    else:
        pos, i = 0, 0
        while pos < len(data):
            out += sc.feed(data[pos : pos + sizes[i % len(sizes)]])
            pos += sizes[i % len(sizes)]
            i += 1
    out += sc.finish()
    return [e for e in out if e.kind == "match"]


@pytest.fixture(scope="module")
def matcher(library: RuleSet) -> Matcher:
    return Matcher(library)


# -- the ranks a report says are missing ------------------------------------------------------------


def test_the_one_rank_absent_from_the_ready_lists_is_the_culprit() -> None:
    ready = "21, 25, 26, 27, 28, 29, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 1, 3, 0, 15, 17, 18, 20, 22, 23, 24, 31, 8, 19, 2, 30"
    line = READY.format(ops=_ops(ready, ready)).rstrip("\n")
    assert missing_ranks([line]) == {16}
    assert stall_fields([line]) == {"missing_ranks": "16", "culprit_rank": 16}


def test_ready_lists_that_leave_out_several_ranks_name_no_culprit() -> None:
    # horovod/horovod#334: ranks 0 and 6 of 8 are missing (their order is the coordinator's)
    line = READY.format(ops=_ops("5, 1, 4, 7, 2, 3")).rstrip("\n")
    assert stall_fields([line]) == {"missing_ranks": "0, 6"}
    # horovod/horovod#336: one op waits for 0-2, the other ranks differ per op: no single culprit
    line = READY.format(ops=_ops("3", "2, 0, 1")).rstrip("\n")
    assert stall_fields([line]) == {"missing_ranks": "0, 1, 2, 3"}


def test_a_missing_rank_above_every_rank_listed_is_unknowable() -> None:
    # ranks 0-6 ready, rank 7 (the highest) missing: the report does not give the world size
    assert stall_fields([READY.format(ops=_ops("0, 1, 2, 3, 4, 5, 6"))]) == {}


def test_missing_ranks_listed_per_op_and_per_rank() -> None:
    assert stall_fields(MISSING.splitlines()) == {"missing_ranks": "0", "culprit_rank": 0}
    assert stall_fields(STALLED_RANKS.splitlines()) == {"missing_ranks": "6", "culprit_rank": 6}
    shutdown = [
        "Stalled ranks:",
        "3!: [HorovodAllreduce_a_0]",
        "5!: [HorovodAllreduce_a_0, HorovodAllreduce_b_0]",
    ]
    assert stall_fields(shutdown) == {"missing_ranks": "3, 5"}
    # `N: [` lines are rank entries only under a `Stalled ranks:` heading
    assert stall_fields(["2: [not a rank list]"]) == {}


# -- the scanner's fold -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("log", "culprit", "missing"),
    [
        (READY.format(ops=_ops("3, 0, 1", "1, 3, 0")), 2, "2"),
        (MISSING, 0, "0"),
        (STALLED_RANKS, 6, "6"),
    ],
)
def test_the_report_is_one_event_naming_the_missing_rank(
    matcher: Matcher, log: str, culprit: int, missing: str
) -> None:
    data = ("step 99 | loss 2.0\n" + log + "Epoch 2/90\n").encode()
    (event,) = _scan(matcher, data)
    assert (
        event.rule == "horovod-stall-inspector" and event.category == "hang" and event.severity == "warning"
    )
    assert event.fields["culprit_rank"] == culprit and event.fields["missing_ranks"] == missing
    assert event.text.count("\n") == log.count("\n") - 1  # the listing lines are the report's own
    assert "Epoch 2/90" not in event.text


def test_a_heading_wrapped_by_the_terminal_keeps_its_listing(matcher: Matcher) -> None:
    # as posted in horovod/horovod#1442: the heading wrapped after 200 columns
    log = (
        "[1,0]<stderr>:[2019-10-09 15:36:43.594972: W horovod/common/stall_inspector.cc:105] One or more tensors "
        "were submitted to be reduced, gathered or broadcasted by subset of ranks and are waiting for remaind\n"
        "er of ranks for more than 60 seconds. This may indicate that different ranks are trying to submit "
        "different tensors or that only subset of ranks is submitting tensors, which will cause deadlock.\n"
        + STALLED_RANKS.split("\n", 1)[1]
    )
    (event,) = _scan(matcher, log.encode())
    assert event.fields == {"missing_ranks": "6", "culprit_rank": 6} and event.rank == 0


def test_the_next_report_starts_a_new_event(matcher: Matcher) -> None:
    events = _scan(matcher, (STALLED_RANKS + STALLED_RANKS.replace("6: [", "4: [")).encode())
    assert [e.fields.get("culprit_rank") for e in events] == [6, 4]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=97), min_size=1, max_size=6))
def test_the_report_does_not_depend_on_read_sizes(library: RuleSet, sizes: list[int]) -> None:
    matcher = Matcher(library)
    data = ("step 1 | loss 2.0\n" + STALLED_RANKS + MISSING + "step 2 | loss 2.0\n").encode()
    whole = [(e.offset, e.text, e.fields) for e in _scan(matcher, data)]
    assert [(e.offset, e.text, e.fields) for e in _scan(matcher, data, sizes)] == whole
    assert [f["culprit_rank"] for _, _, f in whole] == [6, 0]


TWO_MISSING = STALLED_RANKS + "[1,0]<stderr>:1: [horovod_allreduce.7]\n" + "step 2 | loss 2.0\n"


@given(st.lists(st.integers(min_value=1, max_value=97), min_size=1, max_size=12))
@settings(max_examples=60, deadline=None)
def test_a_quiet_spell_inside_the_listing_does_not_cut_it(library: RuleSet, sizes: list[int]) -> None:
    """The file going quiet between the listing's lines (the agent's flush) is no end of the
    report: the event is the one a whole read gives, whatever the reads and the pauses."""
    matcher = Matcher(library)
    data = TWO_MISSING.encode()
    whole = [(e.offset, e.fields) for e in _scan(matcher, data) if e.kind == "match"]
    assert whole == [(0, {"missing_ranks": "1, 6"})]
    sc = LineScanner(matcher, _source())
    got: list[Event] = []
    pos, i = 0, 0
    while pos < len(data):
        got += sc.feed(data[pos : pos + sizes[i % len(sizes)]])
        got += sc.flush()  # quiet after every read
        pos += sizes[i % len(sizes)]
        i += 1
    got += sc.finish()
    assert [(e.offset, e.fields) for e in got if e.kind == "match"] == whole


def test_a_report_whose_listing_has_not_arrived_waits_for_it(matcher: Matcher) -> None:
    sc = LineScanner(matcher, _source())
    head, rest = STALLED_RANKS.split("\n", 1)
    assert sc.feed((head + "\n").encode()) == []  # more may follow: the heading waits
    (event,) = [e for e in sc.feed(rest.encode()) + sc.finish() if e.kind == "match"]
    assert event.fields["culprit_rank"] == 6


# -- the hang analysis ------------------------------------------------------------------------------


def _same(node: str, ts: float | None) -> float | None:
    return ts


def _report(library: RuleSet, ts: float | None, culprit: int | None, rank: int | None = 0) -> Aggregate:
    fields = {} if culprit is None else {"culprit_rank": culprit}
    return Aggregate(ev("n0", rank, ts, "horovod-stall-inspector", library, **fields), last_ts=ts)


def test_a_named_rank_without_a_log_of_its_own_is_the_suspect(library: RuleSet) -> None:
    report = _report(library, None, 16)
    suspects, tied = hang_suspect({("n0", 0, report.first.rule or ""): report}, {}, _same)
    assert tied == 1 and [(c.rank, c.rule, c.kind) for c in suspects] == [(16, HANG_RULE, "hang")]
    # ranks we follow that are not named do not outweigh the report
    tracks: Tracks = {("n0", r): RankTrack("n0", r, NodeProgress()) for r in (0, 1)}
    assert [c.rank for c in hang_suspect({("n0", 0, "x"): report}, tracks, _same)[0]] == [16]


def test_a_report_no_step_follows_is_a_failure(library: RuleSet) -> None:
    report = _report(library, T0 + 100, 16)
    aggs = {("n0", 0, "horovod-stall-inspector"): report}
    track = RankTrack("n0", 0, NodeProgress())
    step = ev("n0", 0, T0 + 50, None, library, step=5)
    track.add(5, step.ts, step)
    assert unresolved_stalls(aggs, {("n0", 0): track}) == [report]
    later = ev("n0", 0, T0 + 200, None, library, step=6)
    track.add(6, later.ts, later)  # the job went on after the stall: it was slow, not hung
    assert unresolved_stalls(aggs, {("n0", 0): track}) == []
    # a report naming no rank at all is no failure of its own
    assert unresolved_stalls({("n0", 0, "h"): _report(library, T0 + 100, None)}, {}) == []


def test_a_deadlock_report_no_step_follows_is_a_failure_that_names_nobody(library: RuleSet) -> None:
    """Horovod's report listing several ranks, each missing from collectives the others wait in
    (rank 0 in broadcasts, rank 1 in allreduces: a deadlock), with no step line after it: the job
    hangs, and no rank is the one the others wait for."""
    e = Engine("j", library)
    steps(e, library, "node0", [0, 1], 0.0, n=5)
    e.add(ev("node0", 0, T0 + 100, "horovod-stall-inspector", library, missing_ranks="0, 1"))
    d = e.diagnose()
    assert d["verdict"] == "failed" and d["initiator"] is None
    assert d["root_cause"]["category"] == "hang"
    # the job stepping on afterwards: the ranks caught up, no failure
    e.add(ev("node0", 1, T0 + 200, None, library, step=6))
    assert e.diagnose()["verdict"] == "healthy"


def test_the_engine_names_the_rank_a_stall_report_waits_for(library: RuleSet) -> None:
    e = Engine("j", library)
    steps(e, library, "node0", [0], 0.0, n=5)
    e.add(ev("node0", 0, T0 + 100, "horovod-stall-inspector", library, culprit_rank=16, missing_ranks="16"))
    d = e.diagnose()
    assert d["verdict"] == "failed" and d["initiator"]["rank"] == 16 and d["initiator"]["category"] == "hang"
    # the same report with the job stepping on afterwards: a slow rank, not a failure
    e.add(ev("node0", 0, T0 + 200, None, library, step=6))
    assert e.diagnose()["verdict"] == "healthy"
