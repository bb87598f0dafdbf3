"""analysis.ranks: global ranks for events that name none."""

from __future__ import annotations

import msgspec

from denpex_agent.rules import RuleSet
from denpexd.analysis.ranks import global_rank, resolve_rank, resolved
from denpexd.analysis.tracks import Aggregate, NodeProgress, RankTrack, Tracks
from tests.unit.test_engine import T0, ev


def _track(node: str, rank: int, files: dict[str, int], locals_: dict[int, int]) -> RankTrack:
    t = RankTrack(node, rank, NodeProgress())
    for file, n in files.items():
        t.vote_file(file, n)
    for local, n in locals_.items():
        t.vote_local(local, n)
    return t


def test_a_local_rank_named_alongside_global_ranks_gives_the_global_rank() -> None:
    tracks: Tracks = {("a", 8): _track("a", 8, {}, {0: 5}), ("a", 9): _track("a", 9, {}, {1: 5})}
    assert resolve_rank("a", "any.log", 1, tracks) == 9
    assert resolve_rank("b", "any.log", 1, tracks) is None  # another node's votes do not count


def test_a_file_is_a_rank_only_when_nearly_all_its_ranked_events_name_it() -> None:
    tracks: Tracks = {
        ("a", 0): _track("a", 0, {"mixed.log": 8, "own.log": 19}, {}),
        ("a", 1): _track("a", 1, {"mixed.log": 2, "own.log": 1}, {}),
    }
    assert resolve_rank("a", "own.log", None, tracks) == 0  # 19 of 20
    assert resolve_rank("a", "mixed.log", None, tracks) is None  # 8 of 10


def test_a_candidates_local_rank_by_position_and_on_a_single_node() -> None:
    tracks: Tracks = {("a", 4): _track("a", 4, {}, {}), ("a", 6): _track("a", 6, {}, {})}
    assert global_rank("a", 1, tracks, ["a", "b"]) == 6
    assert global_rank("a", 2, tracks, ["a", "b"]) is None
    assert global_rank("b", 2, tracks, ["b"]) == 2  # one node: local ranks are global ranks
    assert global_rank("b", 2, tracks, ["a", "b"]) is None


def test_resolving_merges_unranked_aggregates_without_changing_the_inputs(unit_rules: RuleSet) -> None:
    ranked_ev = ev("a", 3, T0 + 2, "cuda-oom", unit_rules)
    loose_ev = msgspec.structs.replace(ev("a", None, T0 + 1, "cuda-oom", unit_rules), file="a/rank3.log")
    aggs = {("a", 3, "cuda-oom"): Aggregate(ranked_ev, 1, ranked_ev.ts)}
    unranked = {("a", "a/rank3.log", None, "cuda-oom"): Aggregate(loose_ev, 2, loose_ev.ts)}
    tracks: Tracks = {("a", 3): _track("a", 3, {"a/rank3.log": 10}, {})}
    out_aggs, out_tracks = resolved(aggs, unranked, tracks, {})
    merged = out_aggs[("a", 3, "cuda-oom")]
    assert merged.first is loose_ev and merged.count == 3
    assert aggs[("a", 3, "cuda-oom")].count == 1 and out_tracks is tracks
