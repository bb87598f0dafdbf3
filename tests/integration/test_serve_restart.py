"""kill -9 mid-job with an external broker and a persistent session: nothing lost, nothing re-fired."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest

from denpex_agent.rules import RuleSet
from denpexd.diagnosecmd import diagnose_paths
from tests.integration.replay import (
    JOBS,
    AlertReceiver,
    Daemon,
    forget_session,
    load_case,
    query_json,
    replay,
)

pytestmark = [pytest.mark.integration]


@pytest.mark.asyncio
async def test_kill9_restart_loses_nothing_and_does_not_refire(tmp_path: Path, library: RuleSet) -> None:
    tag = uuid.uuid4().hex[:8]
    job, client_id = f"restart-{tag}", f"denpexd-restart-{tag}"
    events = load_case("nan_fp16", job, library)
    first_error = next(i for i, e in enumerate(events) if e.severity == "error")
    cut = min(len(events) - 20, first_error + 10)
    async with AlertReceiver().serve() as receiver:
        extra = ("--alertmanager", f"http://127.0.0.1:{receiver.port}", "--client-id", client_id)
        first = Daemon(tmp_path / "data", *extra, broker="mqtt://127.0.0.1:1883")
        second = Daemon(tmp_path / "data", *extra, broker="mqtt://127.0.0.1:1883")
        try:
            await first.start()
            await replay(events[:cut], job, speed=40.0)
            await first.wait_events(job, cut)
            deadline = time.monotonic() + 10
            while not receiver.firing(job) and time.monotonic() < deadline:  # noqa: ASYNC110 - waits on another process
                await asyncio.sleep(0.1)
            assert len(receiver.firing(job)) == 1
            first.kill()
            assert await first.wait() == -9
            # published while the daemon is down, with an overlap that must be dropped as duplicates
            await replay(events[cut - 15 :], job, speed=40.0, seq0=10_000)
            await second.start()
            doc = await second.wait_events(job, len(events))
            assert doc["stats"]["events"] == len(events)  # every event once: none lost, no duplicates
            got = await query_json(second.url, job)
            want = diagnose_paths([str(JOBS / "nan_fp16")], job=job, rules=library)
            for key in ("verdict", "collateral_ranks"):
                assert got[key] == want[key]
            assert (got["initiator"]["node"], got["initiator"]["rank"]) == ("node2", 3)
            assert got["root_cause"]["category"] == want["root_cause"]["category"]
            await asyncio.sleep(1.0)
            assert len(receiver.firing(job)) == 1, receiver.firing(job)
            status, metrics = await second.get("/metrics")
            assert status == 200 and "denpex_ingest_events_duplicate_total" in metrics
            assert await second.stop() == 0
        finally:
            for d in (first, second):
                if d.proc is not None and d.proc.returncode is None:
                    d.kill()
                    await d.wait()
            await forget_session(client_id)
