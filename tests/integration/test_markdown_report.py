"""`--format markdown` renders as GitHub would: every recorded job's Markdown, put through cmark-gfm
(GitHub's own CommonMark/GFM implementation, via cmarkgfm), keeps its tables whole, names the
expected initiator, folds the evidence into <details> and closes its one code block; hostile log
text (pipes, backtick runs, a fence, HTML) changes none of that."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import cmarkgfm
import pytest
from cmarkgfm.cmark import Options

from denpex_agent.rules import RuleSet
from denpexd.diagnosecmd import diagnose_paths
from denpexd.docview import evidence_lines
from denpexd.htmlreport import render_html
from denpexd.markdown import render_markdown
from tests.integration.htmltree import Element, parse, table_rows

pytestmark = [pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
JOBS = REPO / "tests" / "fixtures" / "jobs"
CASES = sorted(p.parent.name for p in JOBS.glob("*/expected.json"))
UNESCAPED_PIPE = re.compile(r"(?<!\\)\|")


def gfm(markdown: str) -> str:
    # GitHub keeps <details>/<summary> after sanitising, so raw HTML is let through here
    return cmarkgfm.github_flavored_markdown_to_html(markdown, options=Options.CMARK_OPT_UNSAFE)


@pytest.fixture(scope="module")
def diagnoses(library: RuleSet) -> dict[str, dict[str, Any]]:
    return {case: diagnose_paths([str(JOBS / case)], rules=library) for case in CASES}


def _fences_emitted(doc: dict[str, Any]) -> int:
    before, own = evidence_lines(doc.get("evidence"))
    return 1 if before or own else 0


def _source_tables_are_regular(markdown: str) -> None:
    """In the Markdown itself, every row of a table has as many unescaped pipes as its header."""
    block: list[str] = []
    for line in [*markdown.splitlines(), ""]:
        if line.startswith("|"):
            block.append(line)
            continue
        if block:
            assert len({len(UNESCAPED_PIPE.findall(row)) for row in block}) == 1, block
            block = []


def _check_structure(markdown: str, doc: dict[str, Any]) -> Element:
    html = gfm(markdown)
    tree = parse(html)
    tables = list(tree.iter("table"))
    assert tables, html[:500]
    for t in tables:
        rows = table_rows(t)
        assert len({len(r) for r in rows}) == 1, rows
    _source_tables_are_regular(markdown)
    codes = [pre for pre in tree.iter("pre") if pre.find("code") is not None]
    assert len(codes) == len(list(tree.iter("pre"))) == _fences_emitted(doc), html[-2000:]
    details = list(tree.iter("details"))
    if _fences_emitted(doc):
        assert len(details) == 1
        pre = details[0].find("pre")
        assert pre is not None, "the evidence's code block is not inside <details>"
        summary = details[0].find("summary")
        assert summary is not None and "Evidence" in summary.text()
        before, own = evidence_lines(doc.get("evidence"))
        shown = pre.text().rstrip("\n").split("\n")
        assert shown == [f"  {x}" for x in before] + [f"> {x}" for x in own]
    else:
        assert not details
    return tree


def _summary(tree: Element) -> dict[str, str]:
    table = next(tree.iter("table"))
    header, row = table_rows(table)
    return dict(zip(header, row, strict=True))


@pytest.mark.parametrize("case", CASES)
def test_every_recorded_job_renders_as_gfm(case: str, diagnoses: dict[str, dict[str, Any]]) -> None:
    doc = diagnoses[case]
    want = json.loads((JOBS / case / "expected.json").read_text())
    markdown = render_markdown(doc)
    tree = _check_structure(markdown, doc)
    summary = _summary(tree)
    assert summary["job"] == case and summary["verdict"] == doc["verdict"]
    ini = want.get("initiator")
    if ini is not None and want.get("post_mortem") is None:
        assert (summary["initiator node"], summary["rank"]) == (ini["node"], str(ini["rank"])), summary
    elif doc["initiator"] is None:
        assert summary["initiator node"] == "none"
    if doc.get("collateral"):
        coll = next(t for t in tree.iter("table") if table_rows(t)[0] == ["rule", "count", "where"])
        counts = {r[0]: int(r[1]) for r in table_rows(coll)[1:]}
        assert sum(counts.values()) == doc["suppressed"]
    if doc.get("clock"):
        clocks = next(t for t in tree.iter("table") if table_rows(t)[0][:2] == ["node", "offset"])
        assert [r[0] for r in table_rows(clocks)[1:]] == list(doc["clock"])


HOSTILE = [
    "plain | pipe and `a code span` and ``two`` and a trailing backslash \\",
    "```",
    "````python",
    "   ```",
    "~~~",
    "</details>",
    "<script>alert(1)</script> & &amp; *not emphasis* _nor this_ [a](link) #1 @someone",
    "| a | b |",
    "\\| escaped pipe already \\\\| and a double backslash",
]


def _hostile(doc: dict[str, Any]) -> dict[str, Any]:
    d = copy.deepcopy(doc)
    d["job"] = "job|with`ticks"
    d["initiator"]["text"] = "\n".join(HOSTILE)
    d["initiator"]["rule"] = "rule|`x`"
    d["root_cause"]["title"] = "a title | with `ticks` and <b>html</b>"
    d["root_cause"]["fix"] = "run `grep -E 'a|b' x` then ``` and | and `unclosed"
    d["evidence"]["before"] = [*HOSTILE, "`" * 7 + " seven backticks", *d["evidence"]["before"]]
    d["evidence"]["text"] = "\n".join(HOSTILE)
    d["collateral"][0]["rule"] = "coll|rule``x"
    d["chain"]["first_warning"]["text"] = HOSTILE[0]
    return d


def test_hostile_log_text_breaks_no_table_and_no_fence(diagnoses: dict[str, dict[str, Any]]) -> None:
    doc = _hostile(diagnoses["nan_fp16_skew"])
    markdown = render_markdown(doc)
    tree = _check_structure(markdown, doc)
    summary = _summary(tree)
    assert summary["job"] == "job|with`ticks" and summary["rule"] == "rule|`x`"
    assert summary["root cause"] == "a title | with `ticks` and <b>html</b>"
    assert not list(tree.iter("script")) and not list(tree.iter("b"))
    first = next(p for p in tree.iter("p") if p.text().startswith("First failure"))
    assert first.text().endswith("\\| escaped pipe already \\\\| and a double backslash")
    coll = next(t for t in tree.iter("table") if table_rows(t)[0] == ["rule", "count", "where"])
    assert "coll|rule``x" in [r[0] for r in table_rows(coll)]
    chain = next(t for t in tree.iter("table") if table_rows(t)[0][1:2] == ["time (aligned)"])
    assert table_rows(chain)[1][-1] == " ".join(HOSTILE[0].split())
    after = [p.text() for p in tree.iter("p")]
    assert after[-1].startswith("Read "), after[-3:]


def test_the_cli_prints_markdown(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "denpexd",
            "diagnose",
            str(REPO / "examples" / "job-4711"),
            "--format",
            "markdown",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.startswith("## Denpex: job `job-4711`: FAILED")
    assert _summary(parse(gfm(out)))["rank"] == "3"


def test_the_divergence_from_a_control_run(library: RuleSet) -> None:
    doc = diagnose_paths([str(JOBS / "exception_skew")], rules=library, control=[str(JOBS / "healthy")])
    tree = _check_structure(render_markdown(doc), doc)
    div = next(t for t in tree.iter("table") if table_rows(t)[0][-1] == "first new line")
    rows = table_rows(div)[1:]
    first = doc["divergence"]["first"]
    assert len(rows) == len(doc["divergence"]["per_rank"])
    assert rows[0][:3] == [first["time"], first["node"], str(first["rank"])]
    assert 'id="divergence"' in render_html(doc)
