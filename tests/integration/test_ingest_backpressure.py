"""Back-pressure at the socket: while its backlog is full, ingest stops reading from the broker.

A sink that holds the first batch it is given (a job worker or a store that cannot keep up)
stops validation; the backlog then fills to `ingest_backlog` and stays there however many
messages the broker has for the daemon: they wait at the broker (Mosquitto) or are refused by
the embedded broker and counted, instead of piling up in the daemon's memory. Once the sink
takes batches again, reading resumes: with Mosquitto every batch arrives, each once.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from prometheus_client import CollectorRegistry

from denpex_agent import wire
from denpex_agent.events import Event
from denpexd.broker import EmbeddedBroker
from denpexd.brokeraccess import Intake
from denpexd.config import ServeConfig
from denpexd.ingest import Ack, Ingest
from denpexd.metrics import Metrics
from tests.integration.agent_harness import BROKER_PORT, broker_up
from tests.integration.replay import free_port

pytestmark = pytest.mark.integration

BACKLOG = 16
SENT = 300  # beyond the backlog, within Mosquitto's in-flight window and queue


class HeldSink:
    """Takes batches of one job; holds every submit until `release` is set."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.release = asyncio.Event()
        self.seqs: list[int] = []
        self.entered = asyncio.Event()

    async def submit(self, batch: wire.Batch, ack: Ack, payload: bytes | None = None) -> None:
        self.entered.set()
        await self.release.wait()
        if batch.job == self.job:
            self.seqs.append(batch.seq)
        ack()

    async def hoist(self, batch: wire.Batch) -> None:
        return None

    def agent_status(self, job: str, agent: str, node: str, state: str, lost: bool = False) -> None:
        return None


def _batch(job: str, seq: int) -> bytes:
    ev = Event(
        id=f"p{seq}", kind="progress", job=job, node="n1", rank=0, local_rank=0, file="rank0.log",
        offset=seq * 40, line_no=seq, ts=time.time(), ts_source="line", rule="megatron-iteration",
        severity="info", role="progress", category="progress", text=f"iteration {seq}",
        fields={"step": seq},
    )  # fmt: skip
    return wire.encode_batch("a1", job, "n1", seq, time.time(), [ev])


def _publish_one(port: int, job: str, seq: int) -> None:
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"one-{job}", protocol=paho.MQTTv311)
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        client.publish(wire.events_topic(job), _batch(job, seq), qos=1).wait_for_publish(timeout=10)
    finally:
        client.disconnect()
        client.loop_stop()


def _publish_all(port: int, job: str, v5: bool) -> None:
    """Publish SENT batches at QoS 1 and wait for the broker's acknowledgements."""
    client = paho.Client(
        CallbackAPIVersion.VERSION2,
        client_id=f"flood-{job}",
        protocol=paho.MQTTv5 if v5 else paho.MQTTv311,
    )
    client.max_inflight_messages_set(50)
    client.max_queued_messages_set(0)
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        infos = [
            client.publish(wire.events_topic(job), _batch(job, seq), qos=1) for seq in range(1, SENT + 1)
        ]
        for info in infos:
            info.wait_for_publish(timeout=30)
    finally:
        client.disconnect()
        client.loop_stop()


def _gauge(metrics: Metrics) -> float:
    value = metrics.registry.get_sample_value("denpex_ingest_backlog_messages")
    return value or 0.0


def _counter(metrics: Metrics, name: str) -> float:
    sample = {
        "read_pauses": "denpex_ingest_read_pauses_total",
        "shed": "denpex_ingest_messages_shed_total",
    }[name]
    return metrics.registry.get_sample_value(sample) or 0.0


async def _wait_for(predicate: Callable[[], bool], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.05)
    return predicate()


@pytest.mark.asyncio
@pytest.mark.skipif(not broker_up(), reason="no MQTT broker on 127.0.0.1:1883 (.ci/run starts one)")
async def test_mosquitto_waits_at_the_broker_while_the_backlog_is_full(tmp_path: Path) -> None:
    job = f"bp-{uuid.uuid4().hex[:8]}"
    cfg = ServeConfig(
        broker=f"mqtt://127.0.0.1:{BROKER_PORT}", client_id=f"denpexd-bp-{job}", ingest_backlog=BACKLOG,
        data_dir=str(tmp_path), session_expiry_s=60,
    )  # fmt: skip
    metrics = Metrics(CollectorRegistry())
    sink = HeldSink(job)
    async with Ingest(cfg, sink, metrics) as ingest:
        runner = asyncio.create_task(ingest.run())
        try:
            await asyncio.to_thread(_publish_all, BROKER_PORT, job, True)
            await asyncio.wait_for(sink.entered.wait(), 10)
            largest = 0.0
            deadline = time.monotonic() + 3.0  # Mosquitto holds all SENT: the daemon may read
            while time.monotonic() < deadline:
                largest = max(largest, _gauge(metrics))
                await asyncio.sleep(0.05)
            # reading stopped at the bound (a few packets of one read may pass it)
            assert _counter(metrics, "read_pauses") >= 1
            assert BACKLOG // 2 <= largest <= BACKLOG + 4, largest
            sink.release.set()
            assert await _wait_for(lambda: len(set(sink.seqs)) == SENT, 30), (len(set(sink.seqs)), SENT)
            assert sorted(sink.seqs) == list(range(1, SENT + 1))  # each once, none lost
        finally:
            sink.release.set()
            await ingest.drain()
            await runner


@pytest.mark.asyncio
async def test_the_embedded_broker_refuses_batches_while_the_backlog_is_full(tmp_path: Path) -> None:
    job = f"bp-{uuid.uuid4().hex[:8]}"
    listen = f"127.0.0.1:{free_port()}"
    cfg = ServeConfig(mqtt_listen=listen, ingest_backlog=BACKLOG, data_dir=str(tmp_path))
    metrics = Metrics(CollectorRegistry())
    intake = Intake(on_refused=metrics.messages_shed.inc)
    sink = HeldSink(job)
    async with (
        EmbeddedBroker(listen, intake=intake) as broker,
        Ingest(cfg, sink, metrics, embedded_password=broker.daemon_password, intake=intake) as ingest,
    ):
        runner = asyncio.create_task(ingest.run())
        try:
            await asyncio.to_thread(_publish_all, broker.port, job, False)
            await asyncio.wait_for(sink.entered.wait(), 10)
            await asyncio.sleep(1.0)
            largest = _gauge(metrics)
            shed = _counter(metrics, "shed")
            assert _counter(metrics, "read_pauses") >= 1
            assert largest <= BACKLOG + 4, largest
            assert shed > 0  # refused at the broker, counted (an agent sends them again)
            sink.release.set()
            # reading resumes and the broker takes batches again: a new one arrives at once
            assert await _wait_for(lambda: intake.open, 10)
            await asyncio.to_thread(_publish_one, broker.port, job, SENT + 1)
            assert await _wait_for(lambda: SENT + 1 in sink.seqs, 10)
            got = sorted(sink.seqs)
            assert len(got) == len(set(got))  # none twice
            # What was refused is not delivered (its agent sends it again, unconfirmed:
            # test_fault_kill9 shows that nothing is lost with real agents).
            assert len(got) <= SENT + 1 - shed
        finally:
            sink.release.set()
            await ingest.drain()
            await runner
