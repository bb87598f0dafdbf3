"""Two `denpexd serve` replicas on one external broker with a shared subscription: every batch
reaches exactly one of them."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import aiomqtt
import pytest

from denpex_agent import wire
from denpex_agent.events import Event
from tests.integration.agent_harness import broker_up
from tests.integration.replay import Daemon, forget_session

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not broker_up(), reason="no MQTT broker on 127.0.0.1:1883 (.ci/run starts one)"),
]

BATCHES = 60


async def _events_of(daemon: Daemon, jobs: list[str]) -> int:
    """Events a replica holds for ``jobs`` (0 for a job it never saw)."""
    total = 0
    for job in jobs:
        status, doc = await daemon.get(f"/api/v1/jobs/{job}")
        if status == 200:
            total += int(doc["stats"]["events"])
    return total


@pytest.mark.asyncio
async def test_replicas_share_the_stream(tmp_path: Path) -> None:
    group = f"g{uuid.uuid4().hex[:8]}"
    ids = [f"denpexd-{group}-{i}" for i in range(2)]
    replicas = [
        Daemon(
            tmp_path / f"r{i}", "--shared-group", group, "--client-id", ids[i], broker="mqtt://127.0.0.1:1883"
        )
        for i in range(2)
    ]
    try:
        for d in replicas:
            await d.start()
        async with aiomqtt.Client("127.0.0.1", 1883, identifier=f"pub-{group}") as pub:
            for n in range(BATCHES):
                job = f"shared-{group}-{n % 7}"
                ev = Event(
                    id=f"{group}-{n}", kind="progress", job=job, node="n1", rank=n % 4, local_rank=None,
                    file="rank.log", offset=n, line_no=n + 1, ts=time.time(), ts_source="line",
                    rule="progress-step-line", severity="info", role="progress", category="progress",
                    text=f"step {n}", fields={"step": n},
                )  # fmt: skip
                payload = wire.encode_batch("a1", job, "n1", n, time.time(), [ev])
                await pub.publish(wire.events_topic(job), payload, qos=1)
        # counted per job of this test: other traffic on the shared broker is not ours
        jobs = sorted({f"shared-{group}-{n % 7}" for n in range(BATCHES)})
        deadline = time.monotonic() + 20
        counts = [0, 0]
        while time.monotonic() < deadline:
            counts = [await _events_of(d, jobs) for d in replicas]
            if sum(counts) >= BATCHES:
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(0.5)
        counts = [await _events_of(d, jobs) for d in replicas]
        assert sum(counts) == BATCHES, counts  # each batch once, not once per replica
        assert all(c > 0 for c in counts), counts  # and both replicas take a share
    finally:
        for d in replicas:
            await d.stop()
        for cid in ids:
            await forget_session(cid)


def test_the_emqx_example_names_the_filters_replicas_subscribe_to() -> None:
    from denpexd.ingest import subscriptions

    emqx = (Path(__file__).resolve().parents[2] / "deploy" / "broker" / "emqx.conf").read_text()
    for topic in subscriptions("denpexd"):
        assert topic in emqx
    assert subscriptions(None) == list(wire.SUBSCRIPTIONS)
