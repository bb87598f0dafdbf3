"""`verify.verify` on hand-built diagnoses: the cases the recorded corpus does not hold."""

from __future__ import annotations

from typing import Any

import pytest

from denpexd.verify import NothingToVerify, verify


def doc(
    job: str, verdict: str = "failed", steps: tuple[int | None, ...] = (5, 5), **extra: Any
) -> dict[str, Any]:
    base: dict[str, Any] = {
        "job": job,
        "verdict": verdict,
        "initiator": None,
        "root_cause": None,
        "candidates": [],
        "collateral": [],
        "matches": [],
        "ranks": [{"node": "n1", "rank": i, "last_step": s} for i, s in enumerate(steps)],
    }
    base.update(extra)
    return base


def initiator(rule: str, category: str, kind: str = "event") -> dict[str, Any]:
    return {"node": "n1", "rank": 1, "rule": rule, "category": category, "file": "r1.log", "line": 7,
            "text": "Traceback\nboom", "kind": kind}  # fmt: skip


def test_an_old_job_wide_failure_is_its_root_cause() -> None:
    old = doc("old", scope="job", root_cause={"rule": "bad-config", "category": "configuration"})
    result = verify(doc("new", "healthy", steps=(9,)), old)
    assert result["signature"] == {"rule": "bad-config", "category": "configuration", "scope": "job"}
    assert result["verified"] is True


def test_a_hang_suspect_still_named_is_the_signature_still_there() -> None:
    hang = initiator("hang-rank-stopped-progress", "hang", kind="hang")
    old = doc("old", initiator=hang)
    new = doc("new", steps=(9,), initiator=hang, candidates=[hang])
    result = verify(new, old)
    first = result["reasons"][0]
    assert first["ok"] is False
    assert first["text"].startswith("hang-rank-stopped-progress is still there: named as a candidate")


def test_without_matches_the_candidates_and_collateral_are_searched() -> None:
    old = doc("old", initiator=initiator("cuda-oom", "out-of-memory"))
    coll = [
        {"node": "n2", "rank": 2, "rule": "cuda-oom", "first_time": "2026-01-01T00:00:00.000Z", "count": 3}
    ]
    new = doc("new", steps=(9,), collateral=coll)
    del new["matches"]
    result = verify(new, old)
    assert result["verified"] is False
    assert result["reasons"][0]["where"] == {
        "node": "n2",
        "rank": 2,
        "time": coll[0]["first_time"],
        "count": 3,
    }
    assert any("has no `matches`" in n for n in result["notes"])


def test_a_rule_counted_only_in_the_overflow_is_still_there() -> None:
    old = doc("old", initiator=initiator("cuda-oom", "out-of-memory"))
    new = doc("new", "healthy", steps=(9,), overflow={"by_rule": {"cuda-oom": 4}})
    assert verify(new, old)["reasons"][0]["ok"] is False


def test_other_rules_of_the_category_are_reported_not_held_against_new() -> None:
    old = doc("old", initiator=initiator("nccl-socket", "communication"))
    seen = {
        "rule": "gloo-connection-closed",
        "category": "communication",
        "count": 2,
        "ranks": 2,
        "first": {},
    }
    new = doc("new", steps=(9,), initiator=initiator("cuda-oom", "out-of-memory"), matches=[seen])
    result = verify(new, old)
    assert result["verified"] is True
    assert (
        "other communication lines in NEW, not its failure: gloo-connection-closed x2"
        in result["reasons"][1]["text"]
    )


def test_new_without_step_lines_did_not_progress() -> None:
    old = doc("old", initiator=initiator("cuda-oom", "out-of-memory"))
    result = verify(doc("new", "healthy", steps=(None,)), old)
    assert result["reasons"][2] == {
        "check": "progress",
        "ok": False,
        "text": "NEW did not progress past step 5: it logged no step line",
    }


@pytest.mark.parametrize("verdict", ["healthy", "unknown"])
def test_an_old_run_that_did_not_fail_has_nothing_to_verify(verdict: str) -> None:
    with pytest.raises(NothingToVerify, match=f"verdict {verdict}"):
        verify(doc("new"), doc("old", verdict))
