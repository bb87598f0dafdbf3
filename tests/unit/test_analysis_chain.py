"""analysis.chain: the first related warning, the rank's first error, and how the rest followed."""

from __future__ import annotations

from denpex_agent.rules import RuleSet
from denpexd.analysis.chain import chain
from denpexd.analysis.story import Candidate
from denpexd.analysis.tracks import Aggregate, Aggregates, NodeProgress
from tests.unit.test_engine import T0, ev


def _same(node: str, ts: float | None) -> float | None:
    return ts


def _progress(*nodes: str) -> dict[str, NodeProgress]:
    out = {}
    for n in nodes:
        p = out[n] = NodeProgress()
        for step in range(1, 21):
            p.add(step, T0 + step)  # one step a second
    return out


def test_the_chain_says_how_far_ahead_the_first_warning_was(unit_rules: RuleSet) -> None:
    warn = ev("b", 5, T0 + 10.5, "grad-norm-nonfinite", unit_rules)  # a warning-level symptom
    own = ev("b", 5, T0 + 12.5, "loss-nan", unit_rules)
    others = [ev("a", r, T0 + 12.6 + r / 100, "loss-nan", unit_rules) for r in (0, 1)]
    aggs: Aggregates = {
        (e.node, e.rank, e.rule or ""): Aggregate(e, last_ts=e.ts) for e in [warn, own, *others]
    }
    first = Candidate("b", 5, warn.rule or "", "numerical-instability", warn.ts, warn.ts, warn, "event")
    c = chain(first, aggs, _same, _progress("a", "b"))
    assert c is not None
    assert c["first_warning"]["rank"] == 5 and c["first_warning"]["step"] == 10
    assert c["first_error"]["rule"] == "loss-nan" and c["first_error"]["step"] == 12
    then = c["then"]
    assert then["ranks"] == 2 and then["first"]["rank"] == 0 and then["rules"] == ["loss-nan"]
    assert then["lag_steps"] == 2 and abs(then["lag_s"] - 2.1) < 1e-6
    assert "rank 5" in c["summary"] and "2 other rank(s)" in c["summary"]


def test_no_chain_without_an_event_of_the_initiators_own(unit_rules: RuleSet) -> None:
    hang = Candidate("a", 1, "hang-rank-stopped-progress", "hang", T0, T0, None, "hang")
    assert chain(hang, {}, _same, {}) is None
