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
    post = want.get("post_mortem")
    if post is not None:  # a failure only time shows (a silent stall): what the files alone say
        assert got["verdict"] == post["verdict"] and got["finished"] is post["finished"], got["verdict"]
        return
    assert got["verdict"] == want["verdict"], got["initiator"]
    if want["category"] is not None and want["verdict"] != "healthy":
        assert (got["root_cause"] or {}).get("category") == want["category"], got["root_cause"]
    if want["verdict"] == "healthy":
        assert got["finished"] is True and not got["trends"] and not got["stragglers"]
    if "diverge_step" in want:
        loss = next(t for t in got["trends"] if t["metric"] == "loss")
        assert loss["kind"] == "divergence" and loss["start_step"] >= want["diverge_step"], loss
    if "slow_ratio" in want:
        (slow,) = got["stragglers"]
        assert abs(slow["ratio"] - want["slow_ratio"]) < 0.02 and slow["confidence"] > 0.99, slow
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


def test_the_chain_starts_at_the_initiator_and_the_others_follow(
    diagnoses: dict[str, dict[str, Any]],
) -> None:
    """On every job whose initiator is a line of its own: the chain starts with that line, and the
    other ranks' failures come after it (on the aligned clock, within its uncertainty)."""
    seen = 0
    for case, got in diagnoses.items():
        ini, ch = got["initiator"], got.get("chain")
        if ini is None or ini["kind"] != "event" or ch is None:
            # no line of the rank's own: inferred, or the launcher's report of its exit
            assert ini is None or ini["kind"] != "event" or ini["rule"].startswith("elastic-"), case
            continue
        seen += 1
        assert ch is not None, case
        fw = ch["first_warning"]
        assert (fw["node"], fw["rank"], fw["rule"], fw["time"]) == (
            ini["node"],
            ini["rank"],
            ini["rule"],
            ini["time"],
        ), case
        then = ch.get("then")
        if then is not None and "lag_s" in then:
            slack = 2 * max(c["uncertainty_s"] for c in got["clock"].values())
            assert then["lag_s"] >= -slack, (case, then)
    assert seen >= 5


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
