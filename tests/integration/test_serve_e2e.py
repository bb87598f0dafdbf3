"""`denpexd serve` end to end: replayed corpus jobs over MQTT, diagnosis via `denpexd query`.

Real parts: `denpexd serve` subprocesses on free ports, the embedded broker or the real Mosquitto
on 127.0.0.1:1883, SQLite files in tmp_path, an HTTP receiver standing in for Alertmanager.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from denpex_agent.rules import RuleSet
from denpexd.diagnosecmd import diagnose_paths
from tests.integration.replay import JOBS, AlertReceiver, Daemon, load_case, query_json, replay

pytestmark = [pytest.mark.integration]

CASES = ("nan_fp16", "exception_skew", "alloc_fail", "sigkill_skew")


def _summary(doc: dict[str, Any]) -> tuple[Any, ...]:
    ini = doc["initiator"] or {}
    return (
        doc["verdict"],
        ini.get("node"),
        ini.get("rank"),
        (doc["root_cause"] or {}).get("category"),
        tuple(doc["collateral_ranks"]),
    )


async def _run_cases(tmp_path: Path, library: RuleSet, *, external: bool) -> None:
    tag = uuid.uuid4().hex[:8]
    async with AlertReceiver().serve() as receiver:
        extra = ["--alertmanager", f"http://127.0.0.1:{receiver.port}"]
        client_id = f"denpexd-test-{tag}"
        if external:
            extra += ["--client-id", client_id]
        daemon = Daemon(tmp_path / "data", *extra, broker="mqtt://127.0.0.1:1883" if external else None)
        await daemon.start()
        try:
            jobs = {case: f"{case}-{tag}" for case in CASES}
            loaded = {case: load_case(case, jobs[case], library) for case in CASES}
            await asyncio.gather(
                *(replay(loaded[c], jobs[c], port=daemon.mqtt_port, v5=external, speed=20.0) for c in CASES)
            )
            for case in CASES:
                job = jobs[case]
                await daemon.wait_events(job, len(loaded[case]))
                want = diagnose_paths([str(JOBS / case)], job=job, rules=library)
                got = await query_json(daemon.url, job)
                assert _summary(got) == _summary(want), case
                expected = json.loads((JOBS / case / "expected.json").read_text())
                assert (got["initiator"]["node"], got["initiator"]["rank"]) == (
                    expected["initiator"]["node"],
                    expected["initiator"]["rank"],
                )
            status, metrics = await daemon.get("/metrics")
            assert status == 200
            nan_job = jobs["nan_fp16"]
            assert f'denpex_nan_fingerprint_stage{{job="{nan_job}",stage="error"}} 1.0' in metrics
            for stage in ("info", "error"):
                line = rf'denpex_nan_fingerprint_events_total{{job="{nan_job}",stage="{stage}"}} [1-9]'
                assert re.search(line, metrics), stage
            assert re.search(rf'denpex_job_failed{{category="numerical-instability",initiator_node="node2",'
                             rf'initiator_rank="3",job="{nan_job}"}} 1.0', metrics)  # fmt: skip
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not all(receiver.firing(j) for j in jobs.values()):  # noqa: ASYNC110 - waits on another process
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)  # anything more would arrive now
            for case, job in jobs.items():
                firing = receiver.firing(job)
                assert len(firing) == 1, (case, firing)
                labels = firing[0]["labels"]
                assert labels["role"] == "initiator"
                assert f"denpexd query --job {job}" == firing[0]["annotations"]["query"]
            assert await daemon.stop() == 0
        finally:
            if daemon.proc is not None and daemon.proc.returncode is None:
                daemon.kill()
                await daemon.wait()
            if external:
                from tests.integration.replay import forget_session

                await forget_session(client_id)


@pytest.mark.asyncio
async def test_live_matches_diagnose_embedded_broker(tmp_path: Path, library: RuleSet) -> None:
    await _run_cases(tmp_path, library, external=False)


@pytest.mark.asyncio
async def test_live_matches_diagnose_mosquitto(tmp_path: Path, library: RuleSet) -> None:
    await _run_cases(tmp_path, library, external=True)
