"""analysis.story: the candidates, their order and their confidence."""

from __future__ import annotations

import dataclasses

import msgspec

from denpex_agent.events import Event
from denpex_agent.rules import RuleSet
from denpexd.analysis.ranks import tasks_are_ranks
from denpexd.analysis.story import (
    KILLED_RULE,
    LONE_CONFIDENCE,
    WEAK_CONFIDENCE,
    WITNESS_RULE,
    Candidate,
    candidates,
    rank_candidates,
    witnessed_rank,
    witnesses,
)
from denpexd.analysis.tracks import Aggregate, Aggregates, NodeProgress, RankTrack
from denpexd.clock import ClockEstimate
from tests.unit.test_engine import T0, ev


def _aggs(*events: Event) -> Aggregates:
    return {(e.node, e.rank, e.rule or ""): Aggregate(e, last_ts=e.ts) for e in events}


def _same(node: str, ts: float | None) -> float | None:
    return ts


def _pool(aggs: Aggregates, lookback_s: float = 300.0) -> list[Candidate]:
    failing = [a for a in aggs.values() if a.first.severity == "error"]
    start = min((a.first.ts for a in failing if a.first.ts is not None), default=None)
    return candidates(aggs, {}, failing, start, _same, lookback_s=lookback_s, nodes=["a", "b"])


def _clock(node: str, uncertainty_s: float) -> ClockEstimate:
    return ClockEstimate(offset_s=0.0, uncertainty_s=uncertainty_s, method="progress", samples=10)


def test_causes_and_symptoms_of_the_failures_story_are_the_candidates(unit_rules: RuleSet) -> None:
    aggs = _aggs(
        ev("a", 0, T0 + 1, "grad-norm-nonfinite", unit_rules),  # a symptom of another story
        ev("a", 1, T0 + 2, "cuda-oom", unit_rules),
        ev("b", 2, T0 + 3, "gloo-closed", unit_rules),  # collateral
    )
    assert [(c.rank, c.rule, c.kind) for c in _pool(aggs)] == [(1, "cuda-oom", "event")]


def test_warnings_long_before_the_failure_are_not_candidates(unit_rules: RuleSet) -> None:
    for warned, kept in ((T0 - 200, [0, 1]), (T0 - 400, [1])):
        aggs = _aggs(
            ev("a", 0, warned, "grad-norm-nonfinite", unit_rules), ev("b", 1, T0, "loss-nan", unit_rules)
        )
        assert [c.rank for c in _pool(aggs)] == kept
    alone = _aggs(ev("a", 0, T0, "grad-norm-nonfinite", unit_rules))
    assert candidates(alone, {}, [], None, _same, lookback_s=300.0, nodes=["a"]) == []  # nothing failed


def test_a_worker_killed_by_sigkill_is_the_candidate_when_nothing_names_a_cause(unit_rules: RuleSet) -> None:
    report = ev("a", None, T0, "elastic-child-failed", unit_rules, culprit_rank=5, signal=9)
    pool = _pool(_aggs(report, ev("b", 1, T0, "gloo-closed", unit_rules)))
    assert [(c.node, c.rank, c.rule, c.kind) for c in pool] == [("a", 5, KILLED_RULE, "killed")]


def test_the_earliest_rank_leads_and_confidence_follows_the_clock_uncertainty(unit_rules: RuleSet) -> None:
    pool = _pool(
        _aggs(ev("a", 0, T0 + 1.0, "cuda-oom", unit_rules), ev("b", 1, T0 + 1.01, "cuda-oom", unit_rules))
    )
    sure = rank_candidates(pool, {"a": _clock("a", 0.0001), "b": _clock("b", 0.0001)})
    unsure = rank_candidates(pool, {"a": _clock("a", 5.0), "b": _clock("b", 5.0)})
    assert [c.rank for c, _ in sure] == [0, 1] and sure[0][1] > 0.99
    assert 0.5 < unsure[0][1] < 0.51
    assert abs(sum(conf for _, conf in unsure) - 1.0) < 1e-9


def test_one_candidate_per_rank_and_a_named_rank_before_an_unknown_one(unit_rules: RuleSet) -> None:
    early, late = ev("a", 0, T0 + 1, "cuda-oom", unit_rules), ev("a", 0, T0 + 2, "killed-line", unit_rules)
    unknown = msgspec.structs.replace(ev("a", None, T0 + 1, "cuda-oom", unit_rules), id="z")
    pool = _pool(_aggs(late, early, unknown))
    ranked = rank_candidates(pool, {})
    assert [(c.rank, c.rule) for c, _ in ranked] == [(0, "cuda-oom"), (None, "cuda-oom")]


def test_tied_hang_suspects_share_the_confidence() -> None:
    pool = [Candidate("a", r, "hang", "hang", T0, T0, None, "hang") for r in range(3)]
    ranked = rank_candidates(pool, {}, tied=10)
    assert [conf for _, conf in ranked] == [0.1, 0.1, 0.1]


def test_the_launcher_is_the_witness_only_of_a_workers_exit(unit_rules: RuleSet) -> None:
    summary = ev("a", None, T0 + 5, "elastic-child-failed", unit_rules, culprit_rank=6, exitcode=1)
    barrier = ev("b", 0, T0 + 4, "gloo-closed", unit_rules, culprit_rank=3)  # names a rank, no exit
    failing = list(_aggs(summary, barrier).values())
    got = witnesses(failing, {}, _same, ["a", "b"])
    assert [(c.node, c.rank, c.rule, c.kind, c.category) for c in got] == [
        ("a", 6, WITNESS_RULE, "witness", "user-code-exception")
    ]
    assert witnesses(list(_aggs(barrier).values()), {}, _same, ["b"]) == []


def test_a_launchers_signal_notice_is_a_witness_too(unit_rules: RuleSet) -> None:
    # mpirun's "noticed that process rank 3 ... exited on signal 11": a signal, no exit code
    notice = ev("a", None, T0 + 5, "elastic-child-failed", unit_rules, culprit_rank=3, signal=11)
    got = witnesses(list(_aggs(notice).values()), {}, _same, ["a"])
    assert [(c.rank, c.kind) for c in got] == [(3, "witness")]


def test_a_rank_alone_in_the_logs_is_not_confidently_first() -> None:
    one = Candidate("a", 0, "cuda-oom", "out-of-memory", T0, T0, None, "event")
    assert rank_candidates([one], {}, lone=True) == [(one, LONE_CONFIDENCE)]
    assert rank_candidates([one], {}, lone=False) == [(one, 1.0)]
    two = [one, dataclasses.replace(one, rank=1, ts=T0 + 5, aligned=T0 + 5)]
    # another rank in the pool is someone to have been first before: the cap is for a lone rank
    assert rank_candidates(two, {}, lone=True)[0][1] > 0.99


def test_a_rank_named_by_a_vocabulary_fallback_alone_is_trusted_less(unit_rules: RuleSet) -> None:
    first = Candidate("a", 2, "vocab-x", "numerical-instability", T0, T0, None, "event")
    late = Candidate("a", 0, "loss-nan", "numerical-instability", T0 + 5, T0 + 5, None, "event")
    clocks = {"a": _clock("a", 0.001)}
    sure = rank_candidates([first, late], clocks)
    weak = rank_candidates([first, late], clocks, weak=lambda rid: rid.startswith("vocab-"))
    assert sure[0][0].rank == weak[0][0].rank == 2
    assert sure[0][1] > 0.99 and weak[0][1] == WEAK_CONFIDENCE


def test_a_ranks_specific_story_beats_its_generic_traceback(unit_rules: RuleSet) -> None:
    """An exception no rule classifies tells no story: another story's symptom on the rank is a
    candidate, and represents the rank even when it came after the traceback."""
    aggs = _aggs(
        ev("a", 1, T0 + 1, "python-traceback", unit_rules),
        ev("a", 1, T0 + 2, "grad-norm-nonfinite", unit_rules),  # a symptom (numerical story)
    )
    failing = [a for a in aggs.values() if a.first.severity == "error"]

    def generic(rule: str) -> bool:
        return rule == "python-traceback"

    pool = candidates(aggs, {}, failing, T0 + 1, _same, lookback_s=300.0, nodes=["a"], generic=generic)
    assert sorted(c.rule for c in pool) == ["grad-norm-nonfinite", "python-traceback"]
    ranked = rank_candidates(pool, {}, generic=generic)
    assert [(c.rank, c.rule) for c, _ in ranked] == [(1, "grad-norm-nonfinite")]
    # without the distinction the traceback's category makes the symptom another story
    assert [c.rule for c in candidates(aggs, {}, failing, T0 + 1, _same, lookback_s=300.0, nodes=["a"])] == [
        "python-traceback"
    ]


def test_the_launchers_own_traceback_is_no_candidate(unit_rules: RuleSet) -> None:
    """torchrun/accelerate raise their own error after the workers failed (through their entry
    point's frames): that traceback is the launcher's, not a worker's story."""
    launcher = msgspec.structs.replace(
        ev("a", None, T0 + 9, "python-traceback", unit_rules),
        text='Traceback (most recent call last):\n  File "/opt/conda/bin/accelerate", line 8, in <module>\n'
        "    sys.exit(main())",
    )
    worker = msgspec.structs.replace(
        ev("a", 2, T0 + 10, "python-traceback", unit_rules),
        text='Traceback (most recent call last):\n  File "train.py", line 3, in <module>\nKeyError: 7',
    )
    aggs = _aggs(launcher, worker)
    failing = list(aggs.values())

    def generic(rule: str) -> bool:
        return rule == "python-traceback"

    pool = candidates(aggs, {}, failing, T0 + 9, _same, lookback_s=300.0, nodes=["a"], generic=generic)
    assert [(c.rank, c.rule) for c in pool] == [(2, "python-traceback")]


def test_a_traceback_cut_off_in_nobodys_stream_is_no_candidate(unit_rules: RuleSet) -> None:
    """A traceback without its exception line (posted or logged cut off) in a stream that names
    no rank tells neither what failed nor where: it still fails the job, but names nobody; one
    with its exception, or with a rank, stays a candidate."""

    def generic(rule: str) -> bool:
        return rule == "python-traceback"

    cut = ev("a", None, T0, "python-traceback", unit_rules)
    whole = ev("a", None, T0, "python-traceback", unit_rules, exception="RuntimeError: boom")
    ranked = ev("a", 2, T0, "python-traceback", unit_rules)
    for event, named in ((cut, []), (whole, [None]), (ranked, [2])):
        aggs = _aggs(event)
        pool = candidates(
            aggs, {}, list(aggs.values()), T0, _same, lookback_s=300.0, nodes=["a"], generic=generic
        )
        assert [c.rank for c in pool] == named


def test_a_cut_off_traceback_beside_its_ranks_own_failure_is_no_candidate(unit_rules: RuleSet) -> None:
    """A rank's traceback whose exception line was lost, on a rank that reported its failure in
    words a rule knows (a timeout): which exception it was is unknown, so it does not make the
    failure a story of user code; the same traceback with its exception line does, and so does
    a cut-off traceback of another rank."""

    def generic(rule: str) -> bool:
        return rule == "python-traceback"

    timeout = ev("a", 2, T0, "gloo-closed", unit_rules)
    cut = ev("a", 2, T0 + 1, "python-traceback", unit_rules)
    whole = ev("a", 2, T0 + 1, "python-traceback", unit_rules, exception="KeyError: 7")
    other = ev("a", 3, T0 + 1, "python-traceback", unit_rules)
    for event, rules in ((cut, []), (whole, ["python-traceback"]), (other, ["python-traceback"])):
        aggs = _aggs(timeout, event)
        failing = [a for a in aggs.values() if a.first.severity == "error"]
        assert len(failing) == 2
        pool = candidates(aggs, {}, failing, T0, _same, lookback_s=300.0, nodes=["a"], generic=generic)
        assert [c.rule for c in pool] == rules


def test_srun_names_a_rank_by_its_task_only_where_srun_started_the_ranks(unit_rules: RuleSet) -> None:
    # `srun: error: host: task 3: Out Of Memory`: the task is SLURM_PROCID, the rank when srun
    # started the training processes; under a per-node launcher it is a node's launcher
    oom = ev("a", None, T0, "cuda-oom", unit_rules, task=3)
    aggs = _aggs(oom)
    failing = list(aggs.values())
    for srun_tasks, rank in ((True, 3), (False, None)):
        pool = candidates(
            aggs, {}, failing, T0, _same, lookback_s=300.0, nodes=["a"], srun_tasks=lambda v=srun_tasks: v
        )
        assert [c.rank for c in pool] == [rank]
    assert tasks_are_ranks(aggs, {})
    launcher = _aggs(oom, ev("a", None, T0 + 1, "elastic-child-failed", unit_rules, exitcode=1))
    assert not tasks_are_ranks(launcher, {})
    # a local rank echoed by a launcher (torchrun's `[default1]:`): the node runs one
    track = RankTrack("a", 5, NodeProgress())
    track.vote_local(1)
    assert not tasks_are_ranks(aggs, {("a", 5): track})


def test_an_unranked_first_failure_takes_the_one_rank_its_story_names_on_the_node(
    unit_rules: RuleSet,
) -> None:
    # slurmstepd's OOM-kill report names nobody; srun's `task 0: Out Of Memory` beside it does
    lead = Candidate("a", None, "cuda-oom", "out-of-memory", T0, T0, None, "event")
    named = dataclasses.replace(lead, rank=0, ts=None, aligned=None)
    assert witnessed_rank(lead, [], {}, _same, ["a"], [lead, named]) == 0
    other_story = dataclasses.replace(named, category="communication")
    other_node = dataclasses.replace(named, node="b")
    two = [lead, named, dataclasses.replace(named, rank=1)]
    for pool in ([lead, other_story], [lead, other_node], two, [lead]):
        assert witnessed_rank(lead, [], {}, _same, ["a", "b"], pool) is None


def test_each_per_node_launcher_prefix_names_rules_of_the_library(library: RuleSet) -> None:
    # `tasks_are_ranks` knows a per-node launcher by its rules' ids: a rename must not go unseen
    from denpexd.analysis.ranks import PER_NODE_LAUNCHER_RULE

    prefixes = PER_NODE_LAUNCHER_RULE.pattern.removeprefix("^(?:").removesuffix(")-").split("|")
    for prefix in prefixes:
        assert any(r.id.startswith(prefix + "-") for r in library), prefix
