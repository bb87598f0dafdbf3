"""The Markdown and HTML renderers on hand-built diagnosis documents: shapes the recorded jobs do
not have (a live stall, a job-wide failure, no times at all, hundreds of ranks)."""

from __future__ import annotations

from typing import Any

from denpexd.docview import evidence_lines, prose, rank_ranges
from denpexd.htmlreport import picture, render_html
from denpexd.markdown import code, fence, render_markdown, span


def _doc(ranks: int = 4, **over: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "job": "j",
        "verdict": "failed",
        "initiator": {
            "node": "n0", "rank": 1, "rule": "cuda-oom", "category": "out-of-memory",
            "time": "2026-01-01T00:00:10.000Z", "file": "n1/rank1.log", "line": 3, "text": "OOM",
            "confidence": 1.0, "local_time": None, "kind": "event",
        },
        "scope": "rank",
        "root_cause": {"rule": "cuda-oom", "title": "OOM", "category": "out-of-memory", "root_cause": "a",
                       "fix": "use `x|y`", "verify": "b"},
        "candidates": [],
        "collateral": [
            {"node": f"n{r // 2}", "rank": r, "rule": "peer-gone", "category": "communication",
             "role": "collateral", "first_time": f"2026-01-01T00:00:{11 + r % 40:02d}.000Z", "count": 1}
            for r in range(ranks) if r != 1
        ],
        "collateral_ranks": [r for r in range(ranks) if r != 1],
        "suppressed": ranks - 1,
        "clock": {},
        "fingerprints": {"nan": {"stage": "info", "first_rank": None, "ranks": [], "per_rank": {}}},
        "chain": None,
        "evidence": {"file": "n1/rank1.log", "line": 3, "text": "OOM", "before": ["a", "b"]},
        "stragglers": [],
        "trends": [],
        "ranks": [
            {"node": f"n{r // 2}", "rank": r, "last_step": 5, "last_step_time": "2026-01-01T00:00:09.000Z",
             "events": 1}
            for r in range(ranks)
        ],
    }  # fmt: skip
    doc.update(over)
    return doc


def test_rank_ranges_and_prose() -> None:
    assert rank_ranges([5, 0, 1, 2, 7, 8]) == "0-2, 5, 7-8"
    assert rank_ranges(list(range(0, 100, 2)), limit=2) == "0, 2, … (+48 more)"
    assert prose("run `a` then ``` and `b`") == [
        (False, "run "),
        (True, "a"),
        (False, " then ``` and "),
        (True, "b"),
    ]


def test_spans_and_fences_outlast_the_backticks_inside() -> None:
    assert code("a|b`c") == "``a\\|b`c``"
    assert span("a|b") == "`a|b`"
    assert code("`x`") == "`` `x` ``"
    block = fence(["````", "x"])
    assert block[0] == "`````text" and block[-1] == "`````"


def test_evidence_keeps_the_initiators_lines_and_the_latest_before_them() -> None:
    ev = {"text": "x\ny", "before": [str(i) for i in range(200)]}
    before, own = evidence_lines(ev)
    assert own == ["x", "y"] and len(before) == 98 and before[-1] == "199"


def test_many_ranks_collapse_to_the_interesting_ones_and_count_the_rest() -> None:
    doc = _doc(300)
    pic = picture(doc)
    ranks = [lane.rank for lane in pic.lanes if lane.rank is not None]
    assert ranks[0] == 1 and pic.lanes[0].initiator
    assert len(ranks) + sum(pic.hidden_by_node.values()) == 300
    assert len(ranks) < 64
    page = render_html(doc)
    assert page.count('class="more"') >= 1 and 'data-ranks-total="300"' in page


def test_a_live_stall_a_job_wide_failure_and_no_times_render() -> None:
    stall = {
        "since": "2026-01-01T00:01:00.000Z", "silent_s": 60.0, "threshold_s": 30.0, "interval_s": 0.5,
        "pause": None, "ranks": 4, "last_step": 9, "behind": [], "behind_total": 0,
        "last_steps": [{"node": "n0", "rank": 0, "step": 9, "file": "f", "line_no": 1, "text": "step 9 | x",
                        "local_time": None}],
    }  # fmt: skip
    stalled = _doc(initiator=None, scope="job", stall=stall, collateral=[], chain=None)
    untimed = _doc()
    untimed["initiator"]["time"] = None
    for c in untimed["collateral"]:
        c["first_time"] = None
    for r in untimed["ranks"]:
        r["last_step_time"] = None
    healthy = _doc(
        verdict="healthy", initiator=None, root_cause=None, collateral=[], evidence=None, finished=False
    )
    for doc in (stalled, untimed, healthy):
        page = render_html(doc)
        assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
        markdown = render_markdown(doc)
        assert markdown.startswith("## Denpex: job `j`")
    assert "Stalled:" in render_markdown(stalled) and "Stall: each rank" in render_markdown(stalled)
    assert "no time" in render_html(untimed)
    assert "Not finished" in render_markdown(healthy)
