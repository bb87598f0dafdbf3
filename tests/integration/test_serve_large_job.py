"""A 4,096-rank failure through a Mosquitto configured like deploy/broker (packets up to 1 MiB):
the retained diagnosis fits, says what it shortened, and the daemon stays connected.

Real parts: a private Mosquitto with the production `max_packet_size`, `denpexd serve` as a
subprocess against it, an aiomqtt publisher and subscriber.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from pathlib import Path

import aiomqtt
import orjson
import pytest

from denpex_agent import wire
from denpex_agent.events import Event
from tests.integration.agent_harness import PrivateBroker
from tests.integration.replay import Daemon

pytestmark = [pytest.mark.integration]

NODES, PER_NODE, FAILING = 512, 8, 1234
DEPLOY_CONF = Path(__file__).resolve().parents[2] / "deploy" / "broker" / "mosquitto.conf"


def _event(node: str, rank: int, kind: str, rule: str, role: str, category: str, ts: float) -> Event:
    return Event(
        id=f"{node}-{rank}-{rule}", kind=kind, job="", node=node, rank=rank, local_rank=rank % PER_NODE,
        file=f"/logs/{node}/rank{rank}.log", offset=100, line_no=10, ts=ts, ts_source="line",
        rule=rule, severity="info" if kind == "progress" else "error", role=role, category=category,
        text=f"{rule} on rank {rank}", context=[f"line {i} before the failure on rank {rank}" for i in range(20)]
        if kind == "match" else [], fields={"step": 7} if kind == "progress" else {},
    )  # fmt: skip


@pytest.mark.asyncio
async def test_diagnosis_of_a_4096_rank_failure_fits_the_production_broker(tmp_path: Path) -> None:
    limit = re.search(r"^max_packet_size (\d+)$", DEPLOY_CONF.read_text(), re.M)
    assert limit is not None
    (tmp_path / "mosq").mkdir()
    broker = PrivateBroker(tmp_path / "mosq")
    broker.conf.write_text(broker.conf.read_text() + f"max_packet_size {limit.group(1)}\n")
    broker.start()
    job, client_id = f"big-{uuid.uuid4().hex[:6]}", f"denpexd-big-{uuid.uuid4().hex[:6]}"
    daemon = Daemon(tmp_path / "data", "--client-id", client_id, broker=f"mqtt://127.0.0.1:{broker.port}")
    await daemon.start()
    try:
        async with (
            aiomqtt.Client("127.0.0.1", broker.port) as pub,
            aiomqtt.Client("127.0.0.1", broker.port) as sub,
        ):
            await sub.subscribe(wire.diagnosis_topic(job), qos=1)
            topic = wire.events_topic(job)
            for n in range(NODES):
                node = f"n{n:03d}"
                ranks = range(n * PER_NODE, (n + 1) * PER_NODE)
                evs = [
                    _event(node, r, "progress", "megatron-iteration", "progress", "progress", 1.8e9)
                    for r in ranks
                ]
                await pub.publish(topic, wire.encode_batch(node, job, node, 1, 1.0, evs), qos=1)
            root = f"n{FAILING // PER_NODE:03d}"
            oom = _event(root, FAILING, "match", "cuda-oom", "root-cause", "out-of-memory", 1.8e9 + 10)
            await pub.publish(topic, wire.encode_batch(root, job, root, 2, 1.0, [oom]), qos=1)
            for n in range(NODES):
                node = f"n{n:03d}"
                evs = [_event(node, r, "match", "nccl-remote-error", "collateral", "communication", 1.8e9 + 11)
                       for r in range(n * PER_NODE, (n + 1) * PER_NODE) if r != FAILING]  # fmt: skip
                await pub.publish(topic, wire.encode_batch(node, job, node, 3, 1.0, evs), qos=1)

            await daemon.wait_events(job, NODES * PER_NODE * 2, timeout_s=60)
            doc = None
            async with asyncio.timeout(30):
                async for msg in sub.messages:
                    assert isinstance(msg.payload, bytes)
                    assert len(msg.payload) <= int(limit.group(1))
                    doc = orjson.loads(msg.payload)
                    if "truncated" not in doc:  # an early diagnosis, before most collateral arrived
                        continue
                    if doc["truncated"]["counts"].get("collateral") == NODES * PER_NODE - 1:
                        break
            assert doc is not None
            assert doc["verdict"] == "failed" and doc["initiator"]["rank"] == FAILING
            assert doc["truncated"]["whole"] == f"/api/v1/jobs/{job}"
            assert 0 < len(doc["collateral"]) < NODES * PER_NODE - 1

            # still connected: a later batch of another job is ingested
            other = f"after-{uuid.uuid4().hex[:6]}"
            ev = _event("n000", 0, "progress", "megatron-iteration", "progress", "progress", 1.8e9)
            await pub.publish(
                wire.events_topic(other), wire.encode_batch("n000", other, "n000", 1, 1.0, [ev]), qos=1
            )
            await daemon.wait_events(other, 1)

        status, whole = await daemon.get(f"/api/v1/jobs/{job}")
        assert status == 200 and len(whole["collateral"]) == NODES * PER_NODE - 1
        assert "truncated" not in whole
        assert "connection lost" not in daemon.log.read_text()
        assert await daemon.stop() == 0
    finally:
        if daemon.proc is not None and daemon.proc.returncode is None:
            daemon.kill()
            await daemon.wait()
        broker.stop()
