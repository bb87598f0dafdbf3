"""Node history across jobs through a real `denpexd serve`: `query --nodes`, `GET /api/v1/nodes`
and the `node_history` of a live diagnosis.

Failed jobs are made from the recorded healthy run: one rank's log stops after step 10 with a
real line of a hardware or communication failure, taken from the rule library's sourced examples
(lines quoted from public bug reports), and are replayed under their own job ids.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from denpex_agent.rules import RuleSet
from tests.integration.replay import JOBS, Daemon, load_case, replay

pytestmark = [pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
RANK_OF = {"node1": 0, "node2": 1, "node3": 2}  # the healthy run: one rank per node


def failed_copy(root: Path, name: str, node: str, rule: str, library: RuleSet) -> Path:
    """The healthy run, with ``node``'s rank stopping after step 10 on a real line of ``rule``."""
    dest = root / name
    shutil.copytree(JOBS / "healthy", dest)
    line = next(e.text for e in library.get(rule).examples if e.source)  # type: ignore[union-attr]
    log = dest / node / f"rank{RANK_OF[node]}.log"
    kept = log.read_bytes().splitlines(keepends=True)[:12]  # two set-up lines, steps 1-10
    log.write_bytes(b"".join(kept) + line.encode() + b"\n")
    return dest


def denpexd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "denpexd", *args], capture_output=True, text=True, cwd=REPO, timeout=120,
        check=False,
    )  # fmt: skip


async def feed(daemon: Daemon, cases: dict[str, tuple[Path, str]], library: RuleSet, token: str) -> None:
    """Replay each (root, case) under its job id and wait until serve has all of its events."""
    loaded = {job: load_case(case, job, library, root=root) for job, (root, case) in cases.items()}
    await asyncio.gather(
        *(replay(evs, job, port=daemon.mqtt_port, v5=False, speed=50.0) for job, evs in loaded.items())
    )
    for job, evs in loaded.items():
        doc = await daemon.wait_events(job, len(evs), token=token)
        assert doc["verdict"] == "failed", doc


@pytest.mark.asyncio
async def test_nodes_that_keep_starting_failures(tmp_path: Path, library: RuleSet) -> None:
    tag = uuid.uuid4().hex[:8]
    token = f"token-{tag}"
    made = tmp_path / "made"
    for name, node, rule in (
        ("hw-a", "node3", "cuda-error-device-fault"),
        ("hw-b", "node3", "ecc-uncorrectable"),
        ("comm", "node1", "nccl-internal-error"),
        ("hw-c", "node3", "cuda-error-device-fault"),
    ):
        failed_copy(made, name, node, rule, library)
    job = {name: f"{name}-{tag}" for name in ("hw-a", "hw-b", "comm", "hw-c", "nan", "exception")}
    daemon = Daemon(tmp_path / "data", "--api-token", token)
    await daemon.start()
    server = ["--server", daemon.url, "--api-token", token]
    try:
        await feed(
            daemon,
            {
                job["hw-a"]: (made, "hw-a"),
                job["hw-b"]: (made, "hw-b"),
                job["comm"]: (made, "comm"),
                job["nan"]: (JOBS, "nan_fp16"),
            },
            library,
            token,
        )
        p = await asyncio.to_thread(denpexd, "query", "--nodes", *server)
        assert p.returncode == 0, p.stderr
        assert p.stdout.splitlines() == [
            "3 hardware/communication failure(s) with an initiating node in the last 4 job(s)",
            "node3  initiated 2 of the last 3 hardware/communication failures  "
            "(cuda-error-device-fault x1, ecc-uncorrectable x1)",
            "node1  initiated 1 of the last 3 hardware/communication failures  (nccl-internal-error x1)",
        ]
        p = await asyncio.to_thread(denpexd, "query", "--nodes", "--json", *server)
        ranked = json.loads(p.stdout)
        assert (ranked["limit"], ranked["jobs"], ranked["failures"]) == (200, 4, 3)
        assert ranked["categories"] == ["communication", "hardware"]
        top = ranked["nodes"][0]
        assert (top["node"], top["initiated"], top["of"], top["categories"]) == ("node3", 2, 3, ["hardware"])
        assert set(top["recent_jobs"]) == {job["hw-a"], job["hw-b"]}

        # a third hardware failure on node3: its diagnosis says the node is suspect
        await feed(daemon, {job["hw-c"]: (made, "hw-c")}, library, token)
        status, doc = await daemon.get(f"/api/v1/jobs/{job['hw-c']}", token)
        assert status == 200
        record = doc["node_history"]
        assert {k: record[k] for k in ("node", "initiated", "of", "jobs", "categories", "rules")} == {
            "node": "node3",
            "initiated": 2,
            "of": 3,
            "jobs": 4,
            "categories": ["hardware"],
            "rules": {"cuda-error-device-fault": 1, "ecc-uncorrectable": 1},
        }
        assert record["note"].startswith(
            "node3 initiated 2 of the last 3 hardware/communication failures "
            "(cuda-error-device-fault x1, ecc-uncorrectable x1): suspect its hardware"
        )
        p = await asyncio.to_thread(denpexd, "query", "--job", job["hw-c"], *server)
        assert p.returncode == 0, p.stderr
        assert "NODE HISTORY  node3 initiated 2 of the last 3 hardware/communication failures" in p.stdout

        # node3 again, failing in user code: its record is there, without a verdict on the node
        await feed(daemon, {job["exception"]: (JOBS, "exception")}, library, token)
        status, doc = await daemon.get(f"/api/v1/jobs/{job['exception']}", token)
        assert doc["initiator"]["node"] == "node3"
        assert (doc["node_history"]["initiated"], doc["node_history"]["of"]) == (3, 4)
        assert "note" not in doc["node_history"]
        # node2 never started one: no field
        status, doc = await daemon.get(f"/api/v1/jobs/{job['nan']}", token)
        assert doc["initiator"]["node"] == "node2" and "node_history" not in doc

        p = await asyncio.to_thread(denpexd, "query", "--nodes", "--last", "2", "--json", *server)
        assert json.loads(p.stdout)["jobs"] == 2
        await _hostile_queries(daemon, token, server)
        assert await daemon.stop() == 0
    finally:
        if daemon.proc is not None and daemon.proc.returncode is None:
            daemon.kill()
            await daemon.wait()


async def _hostile_queries(daemon: Daemon, token: str, server: list[str]) -> None:
    bad: dict[str, str] = {
        "?limit=abc": "limit must be an integer, got 'abc'",
        "?limit=0": "limit must be between 1 and 10000",
        "?limit=10001": "limit must be between 1 and 10000",
        "?limit=-5": "limit must be between 1 and 10000",
        "?limit=1e3": "limit must be an integer",
        "?node=node3": "unknown parameter 'node' (known: limit)",
        "?limit=5&limit=6&x=%00": "unknown parameter 'x'",
    }
    for query, message in bad.items():
        status, body = await daemon.get(f"/api/v1/nodes{query}", token)
        assert status == 400 and message in body["error"], (query, status, body)
    status, body = await daemon.get("/api/v1/nodes")
    assert status == 401
    for args, message in (
        (["--nodes", "--last", "0"], "--last must be between 1 and 10000"),
        (["--nodes", "--jobs"], "choose one of --job ID, --jobs, --nodes"),
        (["--nodes", "--last", "x"], "invalid int value"),
    ):
        p: Any = await asyncio.to_thread(denpexd, "query", *args, *server)
        assert p.returncode == 2 and message in p.stderr, (args, p.stderr)
