"""analysis.fingerprints: the NaN fingerprint's stages and loss-scale drops."""

from __future__ import annotations

import pytest

from denpex_agent.events import Event
from denpex_agent.rules import RuleSet
from denpexd.analysis.fingerprints import nan_fingerprint, scale_drops
from denpexd.analysis.tracks import Aggregate, Aggregates, NodeProgress, RankTrack, Tracks
from tests.conftest import UNIT_RULES, rules_from_text
from tests.unit.test_engine import T0, ev

SCALE_RULE = """
[[rule]]
id = "loss-scale-halved"
title = "Loss scale halved"
category = "numerical-instability"
severity = "warning"
role = "symptom"
fingerprint = "nan"
patterns = ['reducing loss scale to']
root_cause = "overflow"
fix = "bf16"
verify = "rerun"
examples = ["Gradient overflow. Skipping step, reducing loss scale to 1024"]
"""


@pytest.fixture(scope="module")
def rules(tmp_path_factory: pytest.TempPathFactory) -> RuleSet:
    return rules_from_text(tmp_path_factory, "nan", UNIT_RULES + SCALE_RULE)


def _aggs(*events: Event) -> Aggregates:
    return {(e.node, e.rank, e.rule or ""): Aggregate(e, 2, e.ts) for e in events}


def _progress(rules: RuleSet, ranks: list[int]) -> Tracks:
    tracks: Tracks = {}
    for r in ranks:
        e = ev("a", r, T0, None, rules, step=1)
        tracks[("a", r)] = t = RankTrack("a", r, NodeProgress())
        t.add(1, e.ts, e)
    return tracks


def _shift(node: str, ts: float | None) -> float | None:
    return None if ts is None else ts - (10.0 if node == "b" else 0.0)


def test_each_rank_at_its_furthest_stage_and_the_first_by_aligned_time(rules: RuleSet) -> None:
    aggs = _aggs(
        ev("a", 0, T0 + 5, "grad-norm-nonfinite", rules),
        ev("a", 0, T0 + 6, "loss-nan", rules),
        ev("b", 1, T0 + 12, "grad-norm-nonfinite", rules),  # 2 s on the reference clock: first
        ev("a", 2, T0 + 1, "cuda-oom", rules),  # not a NaN rule
    )
    nan = nan_fingerprint(aggs, _progress(rules, [0, 1, 2, 3]), _shift, rules)
    assert nan == {
        "stage": "error",
        "first_rank": 1,
        "ranks": [0, 1],
        "per_rank": {"0": "error", "1": "warn", "2": "info", "3": "info"},
    }


def test_a_job_without_numerical_trouble(rules: RuleSet) -> None:
    assert nan_fingerprint({}, {}, _shift, rules)["stage"] == "none"
    nan = nan_fingerprint({}, _progress(rules, [0]), _shift, rules)
    assert nan["stage"] == "info" and nan["first_rank"] is None and nan["ranks"] == []


def test_only_nan_warnings_about_the_scale_are_drops(rules: RuleSet) -> None:
    drop = ev("a", 0, T0, "loss-scale-halved", rules)
    aggs = _aggs(drop, ev("a", 1, T0, "grad-norm-nonfinite", rules), ev("a", 2, T0, "loss-nan", rules))
    assert [a.first for a in scale_drops(aggs, rules)] == [drop]
