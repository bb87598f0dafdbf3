"""analysis.collateral: the consequences, leaving out the initiator and the shared failure."""

from __future__ import annotations

from denpex_agent.events import Event
from denpex_agent.rules import RuleSet
from denpexd.analysis.collateral import collateral
from denpexd.analysis.story import Candidate
from denpexd.analysis.tracks import Aggregate, Aggregates
from tests.unit.test_engine import T0, ev


def _aggs(*events: Event, count: int = 1) -> Aggregates:
    return {(e.node, e.rank, e.rule or ""): Aggregate(e, count, e.ts) for e in events}


def _shift(node: str, ts: float | None) -> float | None:
    return None if ts is None else ts - (10.0 if node == "b" else 0.0)


def test_warnings_and_worse_of_other_ranks_in_order_of_aligned_time(unit_rules: RuleSet) -> None:
    oom = ev("a", 0, T0 + 1, "cuda-oom", unit_rules)
    aggs = _aggs(
        oom,
        ev("a", 0, T0 + 2, "gloo-closed", unit_rules),  # the initiator's own: left out
        ev("a", 1, T0 + 3, "gloo-closed", unit_rules),
        ev("b", 2, T0 + 12.5, "gloo-closed", unit_rules),  # 2.5 s on the reference clock
        ev("a", 3, None, "grad-norm-nonfinite", unit_rules),
        ev("a", 4, T0 + 1, None, unit_rules, step=3),  # info: never collateral
        count=4,
    )
    initiator = Candidate("a", 0, "cuda-oom", "out-of-memory", oom.ts, oom.ts, oom, "event")
    rows = collateral(aggs, initiator, _shift)
    assert [(r["node"], r["rank"], r["rule"]) for r in rows] == [
        ("b", 2, "gloo-closed"),
        ("a", 1, "gloo-closed"),
        ("a", 3, "grad-norm-nonfinite"),  # no time: last
    ]
    assert rows[0]["first_time"] is not None and rows[2]["first_time"] is None
    assert all(r["count"] == 4 for r in rows) and rows[0]["role"] == "collateral"


def test_the_failure_every_rank_shares_is_not_its_own_collateral(unit_rules: RuleSet) -> None:
    aggs = _aggs(
        *(ev("a", r, T0, "cuda-oom", unit_rules) for r in range(3)),
        ev("a", 1, T0 + 1, "gloo-closed", unit_rules),
    )
    rows = collateral(aggs, None, _shift, shared_rule="cuda-oom")
    assert [(r["rank"], r["rule"]) for r in rows] == [(1, "gloo-closed")]
    assert len(collateral(aggs, None, _shift)) == 4
