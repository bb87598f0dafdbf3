"""Every recorded real job (tests/fixtures/jobs, made by tests/fixtures/make_jobs.py with real
torch/gloo/torchrun runs) must be diagnosed as its expected.json says — skewed copies included."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from denpex_agent.matcher import Matcher
from denpex_agent.reader import ReadReport, discover, read_files
from denpex_agent.rules import SEVERITIES, RuleSet
from denpexd.diagnosecmd import diagnose_paths

JOBS = Path(__file__).resolve().parents[1] / "fixtures" / "jobs"
CASES = sorted(p.parent.name for p in JOBS.glob("*/expected.json"))


def _expected(case: str) -> dict[str, Any]:
    return json.loads((JOBS / case / "expected.json").read_text())


@pytest.fixture(scope="module")
def diagnoses(library: RuleSet) -> dict[str, dict[str, Any]]:
    return {case: diagnose_paths([str(JOBS / case)], rules=library) for case in CASES}


def test_corpus_is_there() -> None:
    assert len(CASES) >= 12
    assert any(c.endswith("_skew") for c in CASES)


@pytest.mark.parametrize("case", CASES)
def test_case(case: str, diagnoses: dict[str, dict[str, Any]]) -> None:
    want = _expected(case)
    got = diagnoses[case]
    assert got["verdict"] == want["verdict"], got["initiator"]
    if want["initiator"] is None:
        assert got["initiator"] is None or want["verdict"] != "failed"
    else:
        ini = got["initiator"]
        assert ini is not None
        assert (ini["node"], ini["rank"]) == (want["initiator"]["node"], want["initiator"]["rank"]), ini
        assert got["root_cause"]["category"] == want["category"], got["root_cause"]
    assert got["collateral_ranks"] == sorted(want["collateral_ranks"])
    if want.get("straggler"):
        assert [(s["node"], s["rank"]) for s in got["stragglers"]] == [
            (want["straggler"]["node"], want["straggler"]["rank"])
        ]
    for node, shift in want.get("skew_s", {}).items():
        base = _expected(case.removesuffix("_skew"))
        if base["skew_s"] == {} and node in got["clock"] and got["clock"][node]["method"] == "progress":
            ref = next(n for n, c in got["clock"].items() if c["method"] == "reference")
            rel = shift - want["skew_s"].get(ref, 0.0)
            assert abs(got["clock"][node]["offset_s"] - rel) < 0.05, got["clock"]


def naive_earliest_error(job: Path, rules: RuleSet) -> tuple[str, int | None] | None:
    """What grep-and-sort does: the earliest timestamped error line across all files wins."""
    report = ReadReport()
    best: tuple[float, str, int | None] | None = None
    matcher = Matcher(rules)
    for e in read_files(discover([job], None, report), matcher, "naive", report):
        if (
            e.kind != "match"
            or e.ts is None
            or SEVERITIES.index(e.severity or "info") < SEVERITIES.index("error")
        ):
            continue
        if best is None or e.ts < best[0]:
            best = (e.ts, e.node, e.rank)
    return None if best is None else (best[1], best[2])


def test_naive_earliest_error_is_fooled_by_skew_where_denpex_is_not(
    library: RuleSet, diagnoses: dict[str, dict[str, Any]]
) -> None:
    fooled = []
    for case in CASES:
        want = _expected(case)
        if not want["skew_s"] or want["initiator"] is None:
            continue
        truth = (want["initiator"]["node"], want["initiator"]["rank"])
        got = diagnoses[case]["initiator"]
        naive = naive_earliest_error(JOBS / case, library)
        if naive != truth and (got["node"], got["rank"]) == truth:
            fooled.append((case, naive))
    assert fooled, "no skewed case separates Denpex from the naive method"
