"""analysis.stragglers: ranks whose data loading is much slower than the others'."""

from __future__ import annotations

from denpexd.analysis.stragglers import stragglers
from denpexd.analysis.tracks import NodeProgress, RankTrack, StepSamples, Tracks


def _tracks(times: dict[tuple[str, int], list[float]]) -> Tracks:
    tracks: Tracks = {}
    for (node, rank), values in times.items():
        t = tracks[(node, rank)] = RankTrack(node, rank, NodeProgress())
        t.data_times = StepSamples()
        for step, v in enumerate(values):
            t.data_times.add(step, v)
    return tracks


def test_a_rank_far_slower_than_the_others_is_a_straggler() -> None:
    tracks = _tracks(
        {("a", 0): [0.01] * 5, ("a", 1): [0.012] * 5, ("b", 2): [0.2, 0.3, 0.25], ("b", 3): [0.011] * 4}
    )
    assert stragglers(tracks) == [{"node": "b", "rank": 2, "data_time_s": 0.25, "typical_s": 0.011}]


def test_slow_but_not_by_enough_is_no_straggler() -> None:
    ratio_only = _tracks({("a", 0): [0.001] * 3, ("a", 1): [0.001] * 3, ("a", 2): [0.01] * 3})  # 10x, +9 ms
    assert stragglers(ratio_only) == []
    gap_only = _tracks({("a", 0): [1.0] * 3, ("a", 1): [1.0] * 3, ("a", 2): [2.0] * 3})  # +1 s, 2x
    assert stragglers(gap_only) == []


def test_too_few_samples_or_ranks_to_compare() -> None:
    assert stragglers(_tracks({("a", 0): [0.01] * 3, ("a", 1): [5.0, 5.0]})) == []
    assert stragglers(_tracks({("a", 0): [5.0] * 10})) == []
