"""analysis.evidence: candidates as JSON, explanations, evidence lines and the rank table."""

from __future__ import annotations

from denpex_agent.rules import RuleSet
from denpexd.analysis.evidence import candidate_dict, evidence, format_iso, rank_table, root_cause
from denpexd.analysis.story import Candidate
from denpexd.analysis.tracks import NodeProgress, RankTrack, Tracks
from tests.unit.test_engine import T0, ev


def test_a_candidate_with_its_times_and_confidence(unit_rules: RuleSet) -> None:
    oom = ev("b", 3, T0 + 12, "cuda-oom", unit_rules)
    d = candidate_dict(
        (Candidate("b", 3, "cuda-oom", "out-of-memory", oom.ts, T0 + 2, oom, "event"), 0.87654)
    )
    assert d["confidence"] == 0.877 and d["kind"] == "event" and d["text"] == "cuda-oom"
    assert d["time"] == format_iso(T0 + 2) and d["local_time"] == format_iso(T0 + 12)
    assert (d["file"], d["line"]) == ("b/rank3.log", 1)


def test_a_hang_candidate_says_the_rank_stopped(unit_rules: RuleSet) -> None:
    step = ev("a", 7, None, None, unit_rules, step=4)
    d = candidate_dict((Candidate("a", 7, "hang", "hang", None, None, step, "hang"), 1.0))
    assert d["text"] == "rank 7 stopped making progress (last step line: step)"
    assert d["time"] is None and d["local_time"] is None


def test_what_a_rule_says_and_a_rule_the_library_does_not_know(unit_rules: RuleSet) -> None:
    known = root_cause(unit_rules, "cuda-oom", "ignored")
    assert (known["title"], known["category"], known["fix"]) == (
        "CUDA out of memory",
        "out-of-memory",
        "smaller batch",
    )
    assert root_cause(unit_rules, "no-such-rule", "hang") == {
        "rule": "no-such-rule",
        "title": "no-such-rule",
        "category": "hang",
        "root_cause": "",
        "fix": "",
        "verify": "",
    }


def test_evidence_is_the_line_and_its_context(unit_rules: RuleSet) -> None:
    oom = ev("a", 0, T0, "cuda-oom", unit_rules)
    c = Candidate("a", 0, "cuda-oom", "out-of-memory", T0, T0, oom, "event")
    assert evidence(c) == {"file": "a/rank0.log", "line": 1, "before": ["before"], "text": "cuda-oom"}
    assert evidence(Candidate("a", 0, "x", "x", None, None, None, "killed")) is None


def test_the_rank_table_by_rank_with_unknown_ranks_last(unit_rules: RuleSet) -> None:
    tracks: Tracks = {}
    for node, rank in (("b", 2), ("a", None), ("a", 0)):
        t = tracks[(node, rank)] = RankTrack(node, rank, NodeProgress())
        e = ev(node, rank, T0 + 10, None, unit_rules, step=5)
        t.add(5, e.ts, e)
    rows = rank_table(tracks, lambda node, ts: None if ts is None else ts - 10, {("b", 2): 3})
    assert [(r["node"], r["rank"], r["events"]) for r in rows] == [("a", 0, 0), ("b", 2, 3), ("a", None, 0)]
    assert rows[0]["last_step"] == 5 and rows[0]["last_step_time"] == format_iso(T0)


def test_a_hang_suspect_without_a_line_says_the_others_point_at_it() -> None:
    d = candidate_dict((Candidate("a", 0, "hang", "hang", None, None, None, "hang"), 1.0))
    assert d["text"].startswith("rank 0 left no line in these logs") and d["file"] is None
