"""analysis.hang: the rank whose progress stopped first."""

from __future__ import annotations

from denpex_agent.rules import RuleSet
from denpexd.analysis.hang import HANG_RULE, hang_suspect, stopped_rank
from denpexd.analysis.story import ABSENT_CONFIDENCE, ABSENT_RULE, Candidate, rank_candidates
from denpexd.analysis.tracks import Aggregate, Aggregates, NodeProgress, RankTrack, Tracks
from tests.unit.test_engine import T0, ev


def _tracks(unit_rules: RuleSet, last_steps: dict[int, int]) -> Tracks:
    tracks: Tracks = {}
    for rank, last in last_steps.items():
        t = tracks[("a", rank)] = RankTrack("a", rank, NodeProgress())
        for s in range(1, last + 1):
            e = ev("a", rank, T0 + s, None, unit_rules, step=s)
            t.add(s, e.ts, e)
    return tracks


def _same(node: str, ts: float | None) -> float | None:
    return ts


def _timeouts(unit_rules: RuleSet, ranks: list[int], **fields: int) -> Aggregates:
    evs = [ev("a", r, T0 + 50, "gloo-closed", unit_rules, **fields) for r in ranks]
    return {(e.node, e.rank, "gloo-closed"): Aggregate(e) for e in evs}


def test_the_silent_rank_that_stopped_first_is_the_suspect(unit_rules: RuleSet) -> None:
    tracks = _tracks(unit_rules, {0: 10, 1: 7, 2: 10, 3: 4})
    suspects, tied = hang_suspect(_timeouts(unit_rules, [0, 2, 3]), tracks, _same)
    assert tied == 1 and [(c.rank, c.rule, c.kind) for c in suspects] == [(1, HANG_RULE, "hang")]
    assert suspects[0].event is tracks[("a", 1)].last_progress and suspects[0].aligned == T0 + 7


def test_a_rank_named_as_the_culprit_comes_before_a_silent_one(unit_rules: RuleSet) -> None:
    tracks = _tracks(unit_rules, {0: 10, 1: 7, 2: 10})  # rank 1 is silent; rank 2 times out too
    suspects, _ = hang_suspect(_timeouts(unit_rules, [0, 2], culprit_rank=2), tracks, _same)
    assert [c.rank for c in suspects] == [2]


def test_ranks_stopped_at_the_same_step_are_tied(unit_rules: RuleSet) -> None:
    tracks = _tracks(unit_rules, {r: 5 for r in range(100)})
    tracks.update(_tracks(unit_rules, {100: 6}))  # one rank got a step further than the rest
    suspects, tied = hang_suspect({}, tracks, _same)
    assert tied == 100 and len(suspects) == 64 and [c.rank for c in suspects[:3]] == [0, 1, 2]
    assert hang_suspect({}, {}, _same) == ([], 0)


def test_ranks_that_only_wait_alike_give_no_suspect(unit_rules: RuleSet) -> None:
    # every rank at the same step and every rank reporting the timeout: nothing points at one
    tracks = _tracks(unit_rules, {r: 5 for r in range(8)})
    assert hang_suspect(_timeouts(unit_rules, list(range(8))), tracks, _same) == ([], 0)
    # one rank's timeout and nothing else (the only rank whose log was kept)
    assert hang_suspect(_timeouts(unit_rules, [3]), _tracks(unit_rules, {3: 5}), _same) == ([], 0)
    # all silent, all at the same step
    assert hang_suspect({}, tracks, _same) == ([], 0)


def test_the_rank_absent_from_the_timeouts_is_the_suspect(unit_rules: RuleSet) -> None:
    tracks = _tracks(unit_rules, {r: 5 for r in range(4)})  # same last step everywhere
    suspects, tied = hang_suspect(_timeouts(unit_rules, [1, 2, 3]), tracks, _same)
    assert tied == 1 and [c.rank for c in suspects] == [0]


def test_a_rank_never_heard_from_is_a_weak_suspect(unit_rules: RuleSet) -> None:
    """Ranks 1-3 time out alike and rank 0 never appears: rank 0 is the suspect, under its own
    conclusion and at most half sure (a post or a collector may simply have lost its lines)."""
    tracks = _tracks(unit_rules, {r: 5 for r in (1, 2, 3)})
    suspects, tied = hang_suspect(_timeouts(unit_rules, [1, 2, 3]), tracks, _same)
    assert tied == 1 and [(c.rank, c.rule, c.kind) for c in suspects] == [(0, ABSENT_RULE, "hang")]
    ((lead, confidence),) = rank_candidates(suspects, {}, tied)
    assert lead.rank == 0 and confidence == ABSENT_CONFIDENCE == 0.5
    # a rank seen stopping earlier stays fully trusted
    seen, tied = hang_suspect(
        _timeouts(unit_rules, [0, 2, 3]), _tracks(unit_rules, {0: 10, 1: 7, 2: 10, 3: 10}), _same
    )
    assert [(c.rule, conf) for c, conf in rank_candidates(seen, {}, tied)] == [(HANG_RULE, 1.0)]


def _node_fault(node: str) -> Candidate:
    """A first failure that names no rank: a node's `nvidia-smi` saying that a GPU is lost."""
    return Candidate(node, None, "nvml-gpu-lost", "hardware", None, None, None, "event")


def test_a_node_fault_takes_the_rank_of_its_node_that_stopped(unit_rules: RuleSet) -> None:
    tracks = _tracks(unit_rules, {r: 5 for r in range(4)})
    timeouts = _timeouts(unit_rules, [1, 2, 3])  # rank 0 never reached the collective
    assert stopped_rank(_node_fault("a"), timeouts, tracks, _same) == 0
    tracks = _tracks(unit_rules, {0: 10, 1: 7, 2: 10, 3: 10})  # rank 1 stopped steps earlier
    assert stopped_rank(_node_fault("a"), _timeouts(unit_rules, [0, 2, 3]), tracks, _same) == 1


def test_a_node_fault_names_no_rank_without_one_suspect_on_its_node(unit_rules: RuleSet) -> None:
    tracks = _tracks(unit_rules, {r: 5 for r in range(4)})
    # the suspect is on another node than the fault's
    assert stopped_rank(_node_fault("b"), _timeouts(unit_rules, [1, 2, 3]), tracks, _same) is None
    # every rank only waited, alike: nothing points at one
    assert stopped_rank(_node_fault("a"), _timeouts(unit_rules, [0, 1, 2, 3]), tracks, _same) is None
    # two ranks stopped at the same earlier step: tied
    tracks = _tracks(unit_rules, {0: 10, 1: 7, 2: 7, 3: 10})
    assert stopped_rank(_node_fault("a"), {}, tracks, _same) is None
