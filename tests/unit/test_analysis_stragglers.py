"""analysis.stragglers: ranks whose own share of a step is persistently slower than their peers'."""

from __future__ import annotations

import random

import pytest

from denpexd.analysis.stragglers import ALPHA, binomial_tail, stragglers
from denpexd.analysis.tracks import NodeProgress, RankTrack, Tracks


def _tracks(times: dict[tuple[str, int], list[float]], name: str = "data_time") -> Tracks:
    tracks: Tracks = {}
    for (node, rank), values in times.items():
        t = tracks[(node, rank)] = RankTrack(node, rank, NodeProgress())
        for step, v in enumerate(values):
            t.series_of(name).add(step, v)
    return tracks


def test_a_rank_far_slower_than_the_others_is_a_straggler() -> None:
    tracks = _tracks(
        {("a", 0): [0.01] * 5, ("a", 1): [0.012] * 5, ("b", 2): [0.2, 0.3, 0.25], ("b", 3): [0.011] * 4}
    )
    assert stragglers(tracks) == [
        {
            "node": "b",
            "rank": 2,
            "metric": "data_time",
            "data_time_s": 0.25,
            "typical_s": 0.011,
            "rule": "straggler-slow-rank",
        }
    ]


def test_slow_but_not_by_enough_is_no_straggler() -> None:
    ratio_only = _tracks({("a", 0): [0.001] * 3, ("a", 1): [0.001] * 3, ("a", 2): [0.01] * 3})  # 10x, +9 ms
    assert stragglers(ratio_only) == []
    gap_only = _tracks({("a", 0): [1.0] * 3, ("a", 1): [1.0] * 3, ("a", 2): [2.0] * 3})  # +1 s, 2x
    assert stragglers(gap_only) == []


def test_too_few_samples_or_ranks_to_compare() -> None:
    assert stragglers(_tracks({("a", 0): [0.01] * 3, ("a", 1): [5.0, 5.0]})) == []
    assert stragglers(_tracks({("a", 0): [5.0] * 10})) == []


def _noisy(rng: random.Random, n: int, base: float, factor: float, since: int = 0) -> list[float]:
    return [base * (factor if i >= since else 1.0) * rng.gauss(1.0, 0.03) for i in range(n)]


@pytest.mark.parametrize("seed", range(5))
def test_a_rank_five_percent_slower_in_its_own_step_time_is_found_with_its_confidence(seed: int) -> None:
    rng = random.Random(seed)
    times = {("n1", r): _noisy(rng, 120, 0.08, 1.0) for r in range(8)}
    times[("n2", 5)] = _noisy(rng, 120, 0.08, 1.07, since=40)
    got = stragglers(_tracks(times, "step_time"))
    assert [(s["node"], s["rank"], s["metric"]) for s in got] == [("n2", 5, "step_time")]
    (s,) = got
    assert 1.05 <= s["ratio"] <= 1.08 and s["confidence"] > 1 - ALPHA / 9
    assert 30 <= s["since_step"] <= 50  # slow from step 40 on


@pytest.mark.parametrize("seed", range(20))
def test_peers_alike_within_noise_give_no_straggler(seed: int) -> None:
    rng = random.Random(100 + seed)
    times = {("n1", r): _noisy(rng, 200, 0.08, 1.0) for r in range(64)}
    assert stragglers(_tracks(times, "step_time")) == []


def test_a_persistent_excess_below_five_percent_is_not_reported() -> None:
    rng = random.Random(7)
    times = {("n1", r): _noisy(rng, 200, 0.08, 1.0) for r in range(8)}
    times[("n1", 3)] = _noisy(rng, 200, 0.08, 1.03)  # significant, but only 3 %
    assert stragglers(_tracks(times, "step_time")) == []


def test_binomial_tail() -> None:
    assert binomial_tail(10, 0) == 1.0
    assert binomial_tail(10, 10) == pytest.approx(2**-10)
    assert binomial_tail(4, 3) == pytest.approx(5 / 16)
    assert binomial_tail(2000, 1000) == pytest.approx(0.5, abs=0.02)  # normal approximation
