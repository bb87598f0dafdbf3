"""A failure every rank shares (`"scope": "job"`): the report says so, an alert fires without a
rank, and collateral alone still never alerts."""

from __future__ import annotations

from typing import Any

from denpex_agent.rules import load_rules
from denpexd.alerts import alerts_on, build_alert
from denpexd.engine import Engine
from denpexd.markdown import render_markdown
from denpexd.report import render_text
from tests.unit.test_engine import T0, ev, steps


def _job_wide() -> dict[str, Any]:
    lib = load_rules()
    e = Engine("j", lib)
    steps(e, lib, "node1", [0, 1, 2, 3], skew=0.0)
    for r in range(4):
        e.add(ev("node1", r, T0 + 3.2 + 0.05 * r, "file-not-found", lib))
    return e.diagnose()


def test_the_report_says_no_single_rank() -> None:
    text = render_text(_job_wide())
    assert "NO SINGLE RANK  every rank failed the same way (file-not-found, ranks 0-3)" in text
    assert "FIRST FAILURE" not in text
    assert "ROOT CAUSE" in text


def test_the_alert_names_no_rank() -> None:
    doc = _job_wide()
    assert alerts_on(doc)
    alert = build_alert("j", doc, T0, "http://denpexd")
    labels = alert["labels"]
    assert labels["rank"] == "" and labels["node"] == "" and labels["rule"] == "file-not-found"
    assert labels["category"] == "configuration" and labels["role"] == "initiator"
    assert "on the whole job (no single rank)" in alert["annotations"]["summary"]
    assert not alerts_on({**doc, "scope": "rank"})  # no initiator, not job-wide: collateral only


def test_a_set_up_failure_one_rank_logged_is_not_called_every_rank() -> None:
    """A rule about the job's set-up (`scope = "job"`) seen in one rank's lines only: the report
    says the rank noticed it, not that every rank failed alike."""
    lib = load_rules()
    e = Engine("j", lib)
    steps(e, lib, "node1", [0, 1, 2, 3], skew=0.0)
    e.add(ev("node1", 2, T0 + 3.2, "nccl-bootstrap-message-truncated", lib))
    doc = e.diagnose()
    assert doc["scope"] == "job" and doc["initiator"] is None
    text = render_text(doc)
    assert "every rank failed the same way" not in text
    assert (
        "NO SINGLE RANK  a failure of the job's set-up (nccl-bootstrap-message-truncated, logged by rank 2)"
        in text
    )
    md = render_markdown(doc)
    assert "logged by rank 2" in md and "every rank failed the same way" not in md
