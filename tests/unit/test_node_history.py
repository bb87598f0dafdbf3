"""Node history: counting across jobs (`nodehistory`) and the store's window of recent failures,
including jobs diagnosed before the store kept the initiator's rule in a column."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import orjson

from denpexd import nodehistory
from denpexd import store as store_mod
from denpexd.nodehistory import Failure
from denpexd.store import Store

HW = [
    Failure("j5", "node7", "cuda-error-device-fault", "hardware"),
    Failure("j4", "node2", "nccl-internal-error", "communication"),
    Failure("j3", "node7", "cuda-error-device-fault", "hardware"),
    Failure("j2", "node7", "nccl-socket", "communication"),
    Failure("j1", "node1", "cuda-oom", "out-of-memory"),
    Failure("j0", "node2", "xid-79-fallen-off-bus", "hardware"),
]


def test_ranking_counts_hardware_and_communication_failures_only() -> None:
    doc = nodehistory.ranking(HW, jobs=9)
    assert (doc["jobs"], doc["failures"]) == (9, 5)
    assert [(r["node"], r["initiated"], r["of"]) for r in doc["nodes"]] == [("node7", 3, 5), ("node2", 2, 5)]
    assert doc["nodes"][0]["rules"] == {"cuda-error-device-fault": 2, "nccl-socket": 1}
    assert doc["nodes"][0]["recent_jobs"] == ["j5", "j3", "j2"]
    assert nodehistory.summary(doc["nodes"][0]) == (
        "node7 initiated 3 of the last 5 hardware/communication failures "
        "(cuda-error-device-fault x2, nccl-socket x1)"
    )


def test_the_note_needs_two_failures_and_a_current_one_of_the_kind() -> None:
    mixed = nodehistory.history("node7", "hardware", HW, jobs=9)
    assert mixed is not None and mixed["categories"] == ["communication", "hardware"]
    assert mixed["note"].endswith(
        "suspect the node itself rather than the job: drain it and run its hardware and link checks"
    )
    assert "note" not in (nodehistory.history("node7", "out-of-memory", HW, jobs=9) or {})
    one = nodehistory.history("node7", "hardware", HW[:1], jobs=1)
    assert one is not None and one["initiated"] == 1 and "note" not in one
    assert nodehistory.history("node1", "hardware", HW, jobs=9) is None  # its failure is not counted
    assert nodehistory.history("node9", "hardware", HW, jobs=9) is None


def _diagnosis(
    job: str, node: str | None, rule: str, category: str, verdict: str = "failed"
) -> dict[str, Any]:
    ini = {"node": node, "rank": 0, "rule": rule, "category": category} if node else None
    return {
        "job": job,
        "verdict": verdict,
        "initiator": ini,
        "root_cause": {"rule": rule, "category": category},
    }


def test_store_window_newest_first_other_than_the_current_job(tmp_path: Path) -> None:
    async def run() -> None:
        async with Store(tmp_path / "s.db") as st:
            for i, (node, rule, cat, verdict) in enumerate([
                ("n1", "ecc-uncorrectable", "hardware", "failed"),
                (None, "bad-config", "configuration", "failed"),  # no single rank: no node
                ("n2", "nccl-internal-error", "communication", "failed"),
                ("n1", "", "", "healthy"),
                ("n1", "ecc-uncorrectable", "hardware", "failed"),
            ]):  # fmt: skip
                job = f"j{i}"
                await st.write_events([], {job: (float(i), float(i))})
                await st.save_diagnosis(job, _diagnosis(job, node, rule, cat, verdict))
            failures, jobs = await st.failures(200)
            assert jobs == 5
            assert [f.job for f in failures] == ["j4", "j2", "j0"]
            failures, jobs = await st.failures(3, other_than="j4")
            assert (jobs, [f.job for f in failures]) == (3, ["j2"])

    asyncio.run(run())


def test_jobs_diagnosed_before_the_rule_column_read_it_from_their_diagnosis(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    db = sqlite3.connect(path, isolation_level=None)
    for i, migration in enumerate(store_mod._MIGRATIONS[:4]):
        db.executescript(f"BEGIN; {migration}; PRAGMA user_version={i + 1}; COMMIT;")
    doc = _diagnosis("old", "n3", "xid-79-fallen-off-bus", "hardware")
    db.execute(
        "INSERT INTO jobs (job, first_seen, last_seen, verdict, initiator_node, initiator_rank, category)"
        " VALUES ('old', 1, 1, 'failed', 'n3', 0, 'hardware')"
    )
    db.execute("INSERT INTO diagnoses (job, updated, doc) VALUES ('old', 1, ?)", (orjson.dumps(doc),))
    db.close()

    async def run() -> None:
        async with Store(path) as st:
            failures, _ = await st.failures(10)
            assert failures == [Failure("old", "n3", "xid-79-fallen-off-bus", "hardware")]

    asyncio.run(run())
