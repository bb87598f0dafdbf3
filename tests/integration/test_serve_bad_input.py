"""Hostile and excessive input over MQTT: every bad payload is counted, the daemon keeps serving."""

from __future__ import annotations

import asyncio
import os
import re
import time
import uuid
from pathlib import Path

import aiomqtt
import orjson
import pytest

from denpex_agent import wire
from denpex_agent.events import Event
from tests.integration.replay import MOSQUITTO, Daemon, forget_session

pytestmark = [pytest.mark.integration]

JOBS_FLOOD = int(os.environ.get("DENPEX_TEST_FLOOD_JOBS", "20000"))
MAX_OPEN = 200


def _metric(text: str, name: str) -> float:
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M):
        total += float(m.group(1))
    return total


def _event(i: int) -> Event:
    return Event(id=f"e{i}", kind="progress", job="x", node="n1", rank=0, local_rank=0, file="r0.log",
                 offset=i, line_no=i, ts=1.0e9 + i, ts_source="line", fields={"step": i})  # fmt: skip


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@pytest.mark.asyncio
async def test_bad_payloads_and_job_flood(tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    client_id = f"denpexd-bad-{tag}"
    daemon = Daemon(
        tmp_path / "data", "--client-id", client_id, "--max-open-jobs", str(MAX_OPEN),
        broker="mqtt://127.0.0.1:1883",
    )  # fmt: skip
    await daemon.start()
    try:
        good = f"good-{tag}"
        async with aiomqtt.Client(*MOSQUITTO, protocol=aiomqtt.ProtocolVersion.V5) as c:
            topic = wire.events_topic(good)
            await c.publish(topic, b"{not json", qos=1)
            await c.publish(topic, orjson.dumps({"v": 99, "agent": "a", "job": good, "node": "n"}), qos=1)
            await c.publish(topic, b"x" * (10 * 1024 * 1024), qos=1)
            await c.publish("denpex/v1/jobs/../events", wire.encode_batch("a", "..", "n", 1, 1.0, []), qos=1)
            bad_job = orjson.dumps({"v": 1, "agent": "a", "job": "a#b", "node": "n", "seq": 1, "sent_at": 1.0,
                                    "events": []})  # fmt: skip
            await c.publish(topic, bad_job, qos=1)
            await c.publish(topic, wire.encode_batch("a", good, "n1", 1, time.time(), [_event(1)]), qos=1)
        await daemon.wait_events(good, 1)
        status, metrics = await daemon.get("/metrics")
        for reason in ("not_json", "version", "too_large", "bad_id"):
            assert _metric(metrics, f'denpex_ingest_batches_invalid_total{{reason="{reason}"}}') >= 1, reason

        # many distinct jobs (100,000 with DENPEX_TEST_FLOOD_JOBS=100000), one small batch each: memory stays bounded, the oldest are evicted
        async with aiomqtt.Client(*MOSQUITTO, protocol=aiomqtt.ProtocolVersion.V5) as c:
            for i in range(JOBS_FLOOD):
                job = f"flood-{tag}-{i}"
                await c.publish(
                    wire.events_topic(job), wire.encode_batch("a", job, "n1", 1, 1.0, [_event(i)])
                )
        deadline = time.monotonic() + 90
        evicted = shed = 0.0
        while time.monotonic() < deadline:
            status, metrics = await daemon.get("/metrics")
            evicted = _metric(metrics, "denpex_jobs_evicted_total")
            shed = _metric(metrics, "denpex_ingest_messages_shed_total")  # QoS 0 while behind
            if evicted + shed >= JOBS_FLOOD - MAX_OPEN:
                break
            await asyncio.sleep(0.5)
        # every flood message is either a job (open, or evicted and counted) or counted as shed
        assert evicted + shed >= JOBS_FLOOD - MAX_OPEN
        assert evicted >= min(JOBS_FLOOD, 10_000) - MAX_OPEN
        assert _metric(metrics, "denpex_jobs_open") <= MAX_OPEN
        assert daemon.proc is not None
        rss = _rss_mb(daemon.proc.pid)
        print(
            f"flood of {JOBS_FLOOD} jobs: evicted {evicted:.0f}, shed {shed:.0f}, open <= {MAX_OPEN}, RSS {rss:.0f} MB"
        )
        assert rss < 400
        assert (await daemon.get("/-/healthy"))[0] == 200
        if shed == 0:
            status, doc = await daemon.get(f"/api/v1/jobs/flood-{tag}-{JOBS_FLOOD - 1}")
            assert status == 200 and doc["stats"]["events"] == 1
        assert await daemon.stop() == 0
    finally:
        if daemon.proc is not None and daemon.proc.returncode is None:
            daemon.kill()
            await daemon.wait()
        await forget_session(client_id)
