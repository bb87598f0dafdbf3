"""analysis.tracks: the order of events, first-event aggregates, bounded step samples, rank tracks."""

from __future__ import annotations

import random

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from denpex_agent.rules import RuleSet
from denpexd.analysis.tracks import (
    MAX_SAMPLES,
    Aggregate,
    NodeProgress,
    RankTrack,
    StepSamples,
    event_order,
)
from denpexd.clock import node_curve
from tests.unit.test_engine import T0, ev


def test_events_without_a_time_sort_last_and_ties_fall_to_file_offset_and_id(unit_rules: RuleSet) -> None:
    timed = ev("a", 0, T0 + 5, "cuda-oom", unit_rules)
    untimed = ev("a", 0, None, "cuda-oom", unit_rules)
    same_time = msgspec.structs.replace(timed, offset=timed.offset + 1)
    assert sorted([untimed, same_time, timed], key=event_order) == [timed, same_time, untimed]


def test_an_aggregate_keeps_the_first_event_whatever_the_order(unit_rules: RuleSet) -> None:
    evs = [ev("a", 0, T0 + t, "gloo-closed", unit_rules) for t in (3.0, 1.0, 2.0)]
    for order in (evs, evs[::-1]):
        agg = Aggregate(first=order[0], last_ts=order[0].ts)
        for e in order[1:]:
            agg.add(e)
        assert agg.first is evs[1] and agg.count == 3 and agg.last_ts == T0 + 3.0
    merged = Aggregate(evs[0], 2, T0 + 3.0).merged(Aggregate(evs[1], 5, T0 + 1.0))
    assert merged.first is evs[1] and merged.count == 7 and merged.last_ts == T0 + 3.0


def test_step_samples_keep_the_same_bounded_steps_in_any_order() -> None:
    steps = list(range(3 * MAX_SAMPLES))
    kept = []
    for seed in (1, 2):
        random.Random(seed).shuffle(steps)
        samples = StepSamples()
        for s in steps:
            samples.add(s, float(s))
        assert len(samples.by_step) <= MAX_SAMPLES
        kept.append(sorted(samples.by_step))
    assert kept[0] == kept[1] == list(range(0, 3 * MAX_SAMPLES, 4))


def test_a_rank_track_follows_the_furthest_step_and_only_samples_feed_the_curve(unit_rules: RuleSet) -> None:
    node = NodeProgress()
    track = RankTrack("a", 0, node)
    for s, dt in ((2, 0.1), (5, 0.3), (3, 0.2)):
        e = ev("a", 0, T0 + s, None, unit_rules, step=s, data_time=dt)
        track.add(s, e.ts, e)
    tip = ev("a", 0, T0 + 9, None, unit_rules, step=9, tip=True)
    track.add(9, tip.ts, tip)
    assert track.last_step == 9 and track.last_progress is tip
    assert [s for s, _ in node.curve()] == [2, 3, 5]  # the tip is not a sample
    assert track.data_times is not None and sorted(track.data_times.values()) == [0.1, 0.2, 0.3]
    assert track.votes()[0] == {"a/rank0.log": 3}


def test_merging_a_track_takes_the_further_progress(unit_rules: RuleSet) -> None:
    behind, ahead = RankTrack("a", 0, NodeProgress()), RankTrack("a", None, NodeProgress())
    e1, e2 = ev("a", 0, T0 + 1, None, unit_rules, step=1), ev("a", None, T0 + 4, None, unit_rules, step=4)
    behind.add(1, e1.ts, e1)
    ahead.add(4, e2.ts, e2)
    dup = behind.copy()
    dup.merge(ahead)
    assert (dup.last_step, dup.last_progress) == (4, e2)
    assert behind.last_step == 1  # the copy is merged, not the original


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.integers(0, 3 * MAX_SAMPLES), st.floats(0, 1e6)),  # a sample
            st.just(None),  # a look at the curve (a diagnosis) in between
        ),
        max_size=300,
    ),
    st.integers(0, 2**32),
)
def test_a_node_curve_kept_between_looks_equals_one_computed_afresh(ops: list, seed: int) -> None:
    """The curve is cached and only the steps sampled since the last look are computed again:
    whatever the order of samples and looks (thinning included), every look gives what
    `clock.node_curve` gives from all samples kept, and an earlier look's list is not changed."""
    node = NodeProgress()
    rng = random.Random(seed)
    # then enough distinct steps to thin the node's samples, with looks in between
    for step in rng.sample(range(4 * MAX_SAMPLES), rng.randrange(2 * MAX_SAMPLES)):
        ops.append((step, rng.random()))
        if rng.random() < 0.01:
            ops.append(None)
    looked: list[tuple[list[tuple[int, float]], list[tuple[int, float]]]] = []
    for op in ops:
        if op is None:
            got = node.curve()
            looked.append((got, list(got)))
            assert got == node_curve(node.samples())
        else:
            node.add(*op)
    assert node.curve() == node_curve(node.samples())
    assert all(got == copy for got, copy in looked)
