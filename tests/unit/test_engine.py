"""The pure engine, fed hand-built events (the only place fakes are used)."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec

from denpex_agent.events import Event
from denpex_agent.rules import RuleSet, load_rules
from denpexd.engine import Engine

T0 = 1_795_953_600.0
_ids = itertools.count()


def ev(
    node: str, rank: int | None, ts: float | None, rule: str | None, rules: RuleSet, **fields: Any
) -> Event:
    kind = "progress" if rule is None else "match"
    r = rules.get(rule) if rule else None
    return Event(
        id=str(next(_ids)),
        kind=kind,
        job="j",
        node=node,
        rank=rank,
        local_rank=None,
        file=f"{node}/rank{rank}.log",
        offset=0,
        line_no=1,
        ts=ts,
        ts_source="line" if ts is not None else "none",
        rule=rule or "step",
        severity=r.severity if r else "info",
        role=r.role if r else "progress",
        category=r.category if r else "progress",
        text=rule or "step",
        context=["before"],
        fields=fields,
    )


def steps(
    engine: Engine, rules: RuleSet, node: str, ranks: list[int], skew: float, n: int = 30, **extra: Any
) -> None:
    for s in range(1, n + 1):
        for r in ranks:
            engine.add(ev(node, r, T0 + 0.1 * s + skew, None, rules, step=s, **extra))


def test_nan_initiator_survives_clock_skew_that_fools_earliest_error(unit_rules: RuleSet) -> None:
    e = Engine("j", unit_rules)
    steps(e, unit_rules, "node1", [0, 1], skew=-4.0)
    steps(e, unit_rules, "node2", [2, 3], skew=+4.0)
    # true time: rank 3 warns at step 30 + 0.05 s, NaN reaches everyone 0.04 s later
    e.add(ev("node2", 3, T0 + 3.05 + 4.0, "grad-norm-nonfinite", unit_rules))
    for r, node, skew in ((0, "node1", -4.0), (1, "node1", -4.0), (2, "node2", 4.0), (3, "node2", 4.0)):
        e.add(ev(node, r, T0 + 3.09 + skew, "loss-nan", unit_rules))
    d = e.diagnose()
    assert d["verdict"] == "failed"
    assert (d["initiator"]["node"], d["initiator"]["rank"]) == ("node2", 3)
    assert d["initiator"]["rule"] == "grad-norm-nonfinite"
    assert d["initiator"]["confidence"] > 0.9
    assert d["collateral_ranks"] == [0, 1, 2]
    assert abs(d["clock"]["node2"]["offset_s"] - 8.0) < 0.01
    nan = d["fingerprints"]["nan"]
    assert nan["stage"] == "error" and nan["first_rank"] == 3 and nan["ranks"] == [0, 1, 2, 3]
    assert d["evidence"]["before"] == ["before"]
    assert d["root_cause"]["fix"] == "bf16"


def test_hang_suspect_is_the_silent_rank(unit_rules: RuleSet) -> None:
    e = Engine("j", unit_rules)
    steps(e, unit_rules, "node1", [0, 1], 0.0, n=20)
    steps(e, unit_rules, "node2", [2, 3], 0.0, n=20)
    for r, node in ((0, "node1"), (1, "node1"), (3, "node2")):
        e.add(ev(node, r, T0 + 12.0, "gloo-closed", unit_rules))
    d = e.diagnose()
    assert d["initiator"]["rank"] == 2 and d["initiator"]["category"] == "hang"
    assert d["initiator"]["kind"] == "hang"
    assert d["collateral_ranks"] == [0, 1, 3]


def test_sigkill_seen_only_by_the_launcher_names_the_killed_rank(unit_rules: RuleSet) -> None:
    e = Engine("j", unit_rules)
    steps(e, unit_rules, "node1", [0, 1], 0.0, n=10)
    steps(e, unit_rules, "node2", [2, 3], 0.0, n=10)
    for r, node in ((0, "node1"), (1, "node1"), (2, "node2")):
        e.add(ev(node, r, T0 + 1.2, "gloo-closed", unit_rules))
    e.add(
        ev("node2", None, T0 + 1.5, "elastic-child-failed", unit_rules, culprit_rank=3, exitcode=-9, signal=9)
    )
    d = e.diagnose()
    assert (d["initiator"]["node"], d["initiator"]["rank"]) == ("node2", 3)
    assert d["initiator"]["category"] == "process-killed"


def test_rivals_closer_than_the_clock_uncertainty_share_confidence(unit_rules: RuleSet) -> None:
    e = Engine("j", unit_rules)
    e.add(ev("a", 0, T0 + 1.000, "cuda-oom", unit_rules))
    e.add(ev("b", 1, T0 + 1.001, "cuda-oom", unit_rules))  # no progress: clocks unaligned (±10 s)
    d = e.diagnose()
    assert len(d["candidates"]) == 2
    assert 0.4 < d["candidates"][0]["confidence"] < 0.6
    assert d["clock"]["b"]["method"] == "none"


def test_healthy_and_degraded_verdicts(unit_rules: RuleSet) -> None:
    e = Engine("j", unit_rules)
    steps(e, unit_rules, "node1", [0, 1], 0.0, data_time=0.005)
    d = e.diagnose()
    assert d["verdict"] == "healthy" and d["initiator"] is None and d["collateral"] == []
    assert d["fingerprints"]["nan"]["stage"] == "info"
    steps(e, unit_rules, "node2", [2], 0.0, data_time=0.25)
    d = e.diagnose()
    assert d["verdict"] == "degraded"
    assert [(s["node"], s["rank"]) for s in d["stragglers"]] == [("node2", 2)]


def test_a_loss_scale_below_one_fails_the_job_not_a_rank() -> None:
    rules = load_rules()
    e = Engine("j", rules)
    scale = 2.0**16
    for s in range(1, 41):  # settles, trains, then halves on every step (every step overflows)
        for r in (0, 1):
            e.add(ev("a", r, T0 + s, None, rules, step=s))
        if s < 4 or s > 20:
            scale /= 2
            rule = "deepspeed-loss-scale-overflow" if scale >= 1 else "loss-scale-reported-below-one"
            e.add(ev("a", 0, T0 + s + 0.5, rule, rules, scale=scale))
        if s == 30:  # scale 8
            assert e.diagnose()["verdict"] == "degraded"  # still above 1: falling, not collapsed
    d = e.diagnose()
    assert scale < 1 and d["verdict"] == "failed" and d["scope"] == "job"
    assert d["initiator"] is None and d["root_cause"]["rule"] == "loss-scale-collapse"


def test_two_nodes_announcing_the_same_global_ranks_fail_the_launch() -> None:
    rules = load_rules()
    e = Engine("j", rules)
    for node in ("a", "b"):  # each node believes it is the first: ranks 0-1 of 4, twice
        for r in (0, 1):
            e.add(ev(node, r, T0 + r, "marker-rank-identity", rules, announced_rank=r, world_size=4))
    e.add(ev("a", 0, T0 + 600, "nccl-watchdog-timeout", rules))  # what such a job runs into
    d = e.diagnose()
    assert d["verdict"] == "failed" and d["scope"] == "job" and d["initiator"] is None
    assert d["root_cause"]["rule"] == "duplicate-global-rank"
    assert d["root_cause"]["category"] == "configuration"
    assert [x["rank"] for x in d["duplicate_ranks"]] == [0, 1]
    assert [c["rule"] for c in d["collateral"]] == ["nccl-watchdog-timeout"]


def test_symptoms_of_another_story_are_not_candidates(unit_rules: RuleSet) -> None:
    e = Engine("j", unit_rules)
    e.add(ev("a", 0, T0 + 1.0, "grad-norm-nonfinite", unit_rules))  # numerical warning first...
    e.add(ev("a", 5, T0 + 2.0, "cuda-oom", unit_rules))  # ...but the failure is an OOM
    d = e.diagnose()
    assert d["initiator"]["rank"] == 5 and d["root_cause"]["category"] == "out-of-memory"


def test_state_is_bounded_by_ranks_and_rules_not_by_events(unit_rules: RuleSet) -> None:
    e = Engine("j", unit_rules)
    for i in range(20000):
        e.add(ev("a", i % 4, T0 + i, "gloo-closed", unit_rules))
        e.add(ev("a", i % 4, T0 + i, None, unit_rules, step=i))
    assert len(e.aggs) == 4
    assert all(len(t.samples) <= 1024 for t in e.tracks.values())
    d = e.diagnose()
    assert sum(c["count"] for c in d["collateral"]) + 0 >= 15000


def test_a_flood_of_distinct_collateral_is_bounded_and_cannot_push_a_cause_out(
    unit_rules: RuleSet, monkeypatch: Any
) -> None:
    """Past the job's bounds new collateral aggregates are counted, not kept; a cause that comes
    after the flood is still kept and named; the diagnosis lists the best candidates only."""
    import denpexd.engine as engine_module

    monkeypatch.setattr(engine_module, "MAX_OTHER_AGGREGATES", 50)
    monkeypatch.setattr(engine_module, "MAX_TRACKS", 60)
    e = Engine("j", unit_rules)
    for r in range(200):
        flood = ev("node1", r, T0 + 10 + r * 1e-3, "gloo-closed", unit_rules)
        flood.context = ["x" * 200] * 10
        e.add(flood)
    e.add(ev("node2", 999, T0 + 9.0, "cuda-oom", unit_rules))
    d = e.diagnose()
    assert len(e.aggs) == 51  # 50 collateral + the cause
    assert all(not a.first.context for k, a in e.aggs.items() if k[2] == "gloo-closed")  # no context kept
    assert d["initiator"]["rank"] == 999 and d["initiator"]["rule"] == "cuda-oom"
    assert d["overflow"]["events_not_kept"] == 150 and d["overflow"]["by_rule"] == {"gloo-closed": 150}
    assert len(e.tracks) == 60 and d["overflow"]["events_of_ranks_not_followed"] == 141


def test_ties_among_thousands_of_silent_ranks_list_the_first_candidates_only(unit_rules: RuleSet) -> None:
    e = Engine("j", unit_rules)
    for r in range(300):
        e.add(ev("node1", r, T0 + 1.0, None, unit_rules, step=5))
    e.add(ev("node1", 0, T0 + 20, "gloo-closed", unit_rules))
    d = e.diagnose()
    assert d["initiator"]["kind"] == "hang"
    assert len(d["candidates"]) == 64 and d["candidates_total"] == 299
    assert abs(d["candidates"][0]["confidence"] - round(1 / 299, 3)) < 1e-9


# -- no single rank: every rank failed the same way ------------------------------------------


def _library() -> RuleSet:
    from denpex_agent.rules import load_rules

    return load_rules()


def test_the_same_error_on_every_rank_at_once_names_no_rank() -> None:
    lib = _library()
    e = Engine("j", lib)
    steps(e, lib, "node1", [0, 1, 2, 3], skew=0.0)
    for r in range(4):  # one bad argument, every rank within 0.3 s
        e.add(ev("node1", r, T0 + 3.2 + 0.1 * r, "file-not-found", lib))
    d = e.diagnose()
    assert d["verdict"] == "failed" and d["scope"] == "job" and d["initiator"] is None
    assert d["root_cause"]["rule"] == "file-not-found"
    assert d["collateral"] == []  # the failure itself is no one's collateral


def test_one_rank_ahead_of_the_others_by_more_than_the_clocks_is_the_initiator() -> None:
    lib = _library()
    e = Engine("j", lib)
    steps(e, lib, "node1", [0, 1, 2, 3], skew=0.0)
    e.add(ev("node1", 2, T0 + 3.2, "file-not-found", lib))
    for r in (0, 1, 3):  # the others 5 s later
        e.add(ev("node1", r, T0 + 8.2, "file-not-found", lib))
    d = e.diagnose()
    assert d["scope"] == "rank" and d["initiator"]["rank"] == 2


def test_an_error_on_a_few_ranks_only_is_not_job_wide() -> None:
    lib = _library()
    e = Engine("j", lib)
    steps(e, lib, "node1", list(range(8)), skew=0.0)
    for r in (4, 5):  # two of eight, at once; the others fail differently later
        e.add(ev("node1", r, T0 + 3.2, "file-not-found", lib))
    for r in (0, 1, 2, 3, 6, 7):
        e.add(ev("node1", r, T0 + 3.9, "cuda-oom", lib))
    d = e.diagnose()
    assert d["scope"] == "rank" and d["initiator"]["rank"] in (4, 5)


def test_a_rule_about_the_launch_names_no_rank_even_when_one_rank_says_it() -> None:
    """`scope = "job"` (two ranks on one GPU): the launch is wrong, not the rank that noticed;
    it counts when it comes with the rank's generic NCCL error of the same moment."""
    lib = _library()
    assert lib.get("nccl-duplicate-gpu").scope == "job"
    e = Engine("j", lib)
    e.add(ev("node1", 3, None, "nccl-invalid-usage", lib))
    e.add(ev("node1", 3, None, "nccl-duplicate-gpu", lib))
    d = e.diagnose()
    assert d["scope"] == "job" and d["initiator"] is None
    assert d["root_cause"]["rule"] == "nccl-duplicate-gpu"


def test_without_times_no_rank_gets_the_confidence_alone() -> None:
    lib = _library()
    e = Engine("j", lib)
    for r in (0, 1):  # two ranks, two different errors, no timestamps: nothing orders them
        e.add(ev("node1", r, None, "cuda-oom" if r else "file-not-found", lib))
    d = e.diagnose()
    assert d["scope"] == "rank"
    assert [c["confidence"] for c in d["candidates"]] == [0.5, 0.5]


def test_a_launcher_local_rank_is_the_global_rank_of_a_single_node_job() -> None:
    """torchrun's `failed (exitcode: -9) local_rank: 4` and nothing else: on the only node of the
    job, local rank 4 is rank 4; with a second node in the job it is not known which rank it is."""
    lib = _library()
    e = Engine("j", lib)
    e.add(ev("node1", None, None, "elastic-worker-sigkill", lib, exitcode=-9, local_rank=4, pid=24905))
    d = e.diagnose()
    assert d["initiator"]["rank"] == 4 and d["initiator"]["category"] == "process-killed"
    e.add(ev("node2", None, None, "elastic-worker-sigterm", lib, local_rank=1))
    assert e.diagnose()["initiator"]["rank"] is None


def test_a_launchers_echo_of_a_workers_line_is_the_workers_event_once(unit_rules: RuleSet) -> None:
    """torchrun --tee copies each worker line into the launcher's log as '[defaultN]:...': with the
    worker's own file, the event counts once and the evidence is the worker's own line; alone,
    the echo stands for it."""

    def echo_of(e: Event) -> Event:
        return msgspec.structs.replace(
            e, id=e.id + "-echo", file="b/torchrun.log", local_rank=1, text="[default1]:" + e.text
        )

    own = [ev("b", 2, T0 + 10 + i, "gloo-closed", unit_rules) for i in range(3)]
    cause = ev("b", 3, T0 + 9, "cuda-oom", unit_rules)
    e = Engine("j", unit_rules)
    for x in [*own, cause]:
        e.add(x)
        e.add(echo_of(x))
    d = e.diagnose()
    assert d["initiator"]["rank"] == 3 and d["initiator"]["file"] == "b/rank3.log"
    assert [(c["rank"], c["rule"], c["count"]) for c in d["collateral"]] == [(2, "gloo-closed", 3)]
    # only the launcher's log: the echoes are the events
    e2 = Engine("j", unit_rules)
    for x in [*own, cause]:
        e2.add(echo_of(x))
    d2 = e2.diagnose()
    assert d2["initiator"]["rank"] == 3 and d2["initiator"]["file"] == "b/torchrun.log"
    assert [(c["rank"], c["count"]) for c in d2["collateral"]] == [(2, 3)]


def test_an_overflow_that_leaves_the_scale_at_one_fails_the_job(library: RuleSet) -> None:
    """DeepSpeed's `Attempted loss scale: 1, reducing to 1`: the scaler is at its floor and the step
    overflowed anyway (every step is skipped); an overflow that leaves a higher scale, or a
    logged scale of 1, is no failure."""

    def verdict(rule: str, scale: float) -> str:
        eng = Engine("j", library)
        eng.add(ev("a", 0, T0, rule, library, scale=scale))
        return str(eng.diagnose()["verdict"])

    assert verdict("deepspeed-loss-scale-overflow", 1.0) == "failed"
    assert verdict("deepspeed-loss-scale-overflow", 2.0) != "failed"
    assert verdict("loss-scale-reported-below-one", 1.0) != "failed"
