"""Notices: lines the library knows look alarming and are not failures (role "notice").

They are listed in the diagnosis (`notices`), and take no part in anything else: not the verdict,
not a story's first related warning, not collateral, not what makes a rank "loud" in a hang.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from denpex_agent.errors import RuleError
from denpex_agent.rules import RuleSet, load_rules
from denpexd.analysis.hang import hang_suspect
from denpexd.analysis.tracks import Aggregate, Aggregates
from denpexd.diagnosecmd import diagnose_paths
from denpexd.engine import Engine
from denpexd.htmlreport import render_html
from denpexd.markdown import render_markdown
from denpexd.report import render_text
from tests.unit.test_analysis_hang import _same, _timeouts, _tracks
from tests.unit.test_engine import T0, ev, steps

NOTICES = [r for r in load_rules() if r.role == "notice"]


def test_a_notice_leaves_a_healthy_job_healthy_and_is_listed(unit_rules: RuleSet) -> None:
    eng = Engine("j", unit_rules)
    steps(eng, unit_rules, "a", [0, 1], skew=0.0)
    for rank in (0, 1):
        eng.add(ev("a", rank, T0 + 2, "scale-warmup", unit_rules))
    d = eng.diagnose()
    assert d["verdict"] == "healthy" and d["initiator"] is None
    assert d["candidates"] == [] and d["collateral"] == []
    [n] = d["notices"]
    assert (n["rule"], n["count"], n["ranks"]) == ("scale-warmup", 2, 2)
    assert n["why"].startswith("the scaler starts high") and n["title"] == "Loss scale settling at start-up"
    assert "KNOWN HARMLESS" in render_text(d) and "the scaler starts high" in render_text(d)
    assert "### Known harmless" in render_markdown(d) and "scale-warmup" in render_markdown(d)
    assert '<section id="notices">' in render_html(d)


def test_a_notice_line_is_escaped_in_every_report(unit_rules: RuleSet) -> None:
    eng = Engine("j", unit_rules)
    hostile = ev("a", 0, T0, "scale-warmup", unit_rules).but(
        text="scaler warm-up overflow <script>x</script> | `"
    )
    eng.add(hostile)
    d = eng.diagnose()
    assert "<script>" not in render_html(d) and "&lt;script&gt;" in render_html(d)
    # in Markdown the line is a code span in a table cell: its pipe escaped, so the row keeps its 4 cells
    [row] = [line for line in render_markdown(d).splitlines() if line.startswith("| `scale-warmup`")]
    assert "`` scaler warm-up overflow <script>x</script> \\| ` ``" in row
    assert len(row.replace("\\|", "").split("|")) == 6


def test_a_notice_is_never_the_first_related_warning(unit_rules: RuleSet) -> None:
    # rank 1's notice is of the failure's category and comes first; rank 0 warned, then failed
    eng = Engine("j", unit_rules)
    steps(eng, unit_rules, "a", [0, 1], skew=0.0, n=5)
    eng.add(ev("a", 1, T0 + 6, "scale-warmup", unit_rules))
    eng.add(ev("a", 0, T0 + 8, "grad-norm-nonfinite", unit_rules))
    for rank in (0, 1):
        eng.add(ev("a", rank, T0 + 9, "loss-nan", unit_rules))
    d = eng.diagnose()
    assert d["verdict"] == "failed" and d["initiator"]["rank"] == 0
    assert all(c["rule"] != "scale-warmup" for c in d["candidates"])
    assert all(c["rule"] != "scale-warmup" for c in d["collateral"])
    assert [n["rule"] for n in d["notices"]] == ["scale-warmup"]
    # a failed job's report names its notices and leaves the why to the healthy job's
    text = render_text(d)
    assert "KNOWN HARMLESS" in text and "scale-warmup" in text and "the scaler starts high" not in text


def test_a_rank_that_logged_only_a_notice_is_still_silent_in_a_hang(unit_rules: RuleSet) -> None:
    tracks = _tracks(unit_rules, {r: 5 for r in range(4)})  # same last step everywhere
    aggs: Aggregates = _timeouts(unit_rules, [1, 2, 3])
    note = ev("a", 0, T0 + 1, "scale-warmup", unit_rules)
    aggs[("a", 0, "scale-warmup")] = Aggregate(note)
    suspects, tied = hang_suspect(aggs, tracks, _same)
    assert tied == 1 and [c.rank for c in suspects] == [0]


def test_a_notice_rule_is_info_severity(tmp_path: Path) -> None:
    (tmp_path / "n.toml").write_text(
        'schema = 1\n[[rule]]\nid = "loud-notice"\ntitle = "t"\ncategory = "hang"\nseverity = "warning"\n'
        'role = "notice"\npatterns = [\'x\']\nroot_cause = "r"\nfix = "f"\nverify = "v"\n'
        'examples = ["x"]\n'
    )
    with pytest.raises(RuleError, match="info-severity"):
        load_rules(tmp_path)


def test_the_library_has_notices() -> None:
    assert len(NOTICES) >= 5


@pytest.mark.parametrize("rule", NOTICES, ids=lambda r: r.id)
def test_every_notice_of_the_library_alone_leaves_a_job_healthy(tmp_path: Path, rule) -> None:  # type: ignore[no-untyped-def]
    # each real example line, as logged by two ranks of a job that then trained on
    log = tmp_path / "logs" / "node0"
    log.mkdir(parents=True)
    lines = [ex.text for ex in rule.examples]
    for rank in (0, 1):
        body = "".join(
            line + "\n" if line.startswith("[rank") else f"[rank{rank}]:{line}\n" for line in lines
        )
        body += "".join(f"[rank{rank}]:step {s} | loss 2.0\n" for s in range(1, 6))
        (log / f"rank{rank}.log").write_text(body)
    d = diagnose_paths([str(tmp_path / "logs")])
    assert d["verdict"] == "healthy", (rule.id, d["root_cause"], d["candidates"][:1])
    assert d["initiator"] is None and d["collateral"] == []
    assert rule.id in {n["rule"] for n in d["notices"]}
