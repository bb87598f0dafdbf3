"""MQTT ingest: the daemon's only subscribing aiomqtt module (aiomqtt>=2.5,<3).

Subscribes to `wire.SUBSCRIPTIONS`, validates every payload with `wire`, hands valid batches to
a `BatchSink` (the job table) and answers clock requests. QoS 1 messages are acknowledged only
after their events are in the store (paho's manual acknowledgement), so a `kill -9` between
receipt and commit loses nothing: the broker redelivers to the persistent session.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from collections.abc import Callable
from types import TracebackType
from typing import Protocol, Self
from urllib.parse import unquote, urlsplit

import aiomqtt
import orjson
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from denpex_agent import wire
from denpexd import fastwire
from denpexd.config import ServeConfig, split_listen
from denpexd.errors import BrokerError
from denpexd.metrics import Metrics, invalid_reason

log = logging.getLogger(__name__)

Ack = Callable[[], None]
RECEIVE_MAXIMUM = 1000
RECONNECT_MAX_S = 10.0
PUBLISH_DRAIN_S = 5.0  # waiting for the broker's PUBACKs of our own messages on disconnect
# Acks are small packets sent one by one: without TCP_NODELAY, Nagle's algorithm meets the
# broker's delayed ACK and each QoS 1 window stalls for tens of milliseconds.
_SOCKET_OPTIONS = ((socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),)


class BatchSink(Protocol):
    async def submit(self, batch: wire.Batch, ack: Ack) -> None: ...

    def agent_status(self, job: str, agent: str, node: str, state: str) -> None: ...


class Bus(Protocol):
    async def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None: ...


class Ingest:
    """`async with Ingest(cfg, sink, metrics) as ingest: await ingest.run()`; also a `Bus`."""

    def __init__(
        self,
        cfg: ServeConfig,
        sink: BatchSink,
        metrics: Metrics,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.sink = sink
        self.metrics = metrics
        self._clock = clock
        self._client: aiomqtt.Client | None = None
        self._generation = 0
        self._connected = asyncio.Event()
        self._publishing: set[asyncio.Future[None]] = set()
        self.external = cfg.broker is not None
        self.address = cfg.broker or f"mqtt://{cfg.mqtt_listen}"

    @property
    def ready(self) -> bool:
        return self._connected.is_set()

    def _new_client(self) -> aiomqtt.Client:
        if self.cfg.broker is None:
            host, port = split_listen(self.cfg.mqtt_listen)
            client = aiomqtt.Client(
                host,
                port,
                identifier=self.cfg.client_id,
                protocol=aiomqtt.ProtocolVersion.V311,
                clean_session=True,
                socket_options=_SOCKET_OPTIONS,
            )
        else:
            u = urlsplit(self.cfg.broker)
            props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
            props.SessionExpiryInterval = self.cfg.session_expiry_s
            props.ReceiveMaximum = RECEIVE_MAXIMUM
            client = aiomqtt.Client(
                u.hostname or "127.0.0.1",
                u.port or (8883 if u.scheme == "mqtts" else 1883),
                username=unquote(u.username) if u.username else None,
                password=unquote(u.password) if u.password else None,
                identifier=self.cfg.client_id,
                protocol=aiomqtt.ProtocolVersion.V5,
                clean_start=False,
                properties=props,
                tls_context=ssl.create_default_context() if u.scheme == "mqtts" else None,
                socket_options=_SOCKET_OPTIONS,
            )
        # Acknowledge QoS 1 deliveries only once the store holds them (see the module docstring).
        client._client.manual_ack_set(True)
        return client

    async def __aenter__(self) -> Self:
        try:
            await self._connect()
        except aiomqtt.MqttError as exc:
            raise BrokerError(self.address, f"cannot connect: {exc}") from exc
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._disconnect()

    async def _connect(self) -> None:
        client = self._new_client()
        await client.__aenter__()
        try:
            for topic in subscriptions(self.cfg.shared_group):
                await client.subscribe(topic, qos=1)
        except aiomqtt.MqttError:
            await client.__aexit__(None, None, None)
            raise
        self._client = client
        self._generation += 1
        self._connected.set()
        log.info("connected to MQTT broker address=%s client_id=%s", _safe(self.address), self.cfg.client_id)

    async def _disconnect(self) -> None:
        if self._publishing:
            await asyncio.wait(set(self._publishing), timeout=PUBLISH_DRAIN_S)
        client, self._client = self._client, None
        self._connected.clear()
        if client is not None:
            try:
                await client.__aexit__(None, None, None)
            except aiomqtt.MqttError as exc:
                log.debug("disconnect failed error=%s", exc)

    async def run(self) -> None:
        """Consume until cancelled; reconnect with backoff when the broker goes away."""
        delay = 0.2
        while True:
            client = self._client
            if client is None:
                try:
                    await self._connect()
                    delay = 0.2
                except aiomqtt.MqttError as exc:
                    log.warning("broker unreachable; retrying address=%s error=%s", _safe(self.address), exc)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, RECONNECT_MAX_S)
                continue
            try:
                async for message in client.messages:
                    await self._handle(client, message)
            except aiomqtt.MqttError as exc:
                log.warning(
                    "broker connection lost; reconnecting address=%s error=%s", _safe(self.address), exc
                )
                self._client = None
                self._connected.clear()

    def _acker(self, client: aiomqtt.Client, message: aiomqtt.Message) -> Ack:
        generation, mid, qos = self._generation, message.mid, message.qos

        def ack() -> None:
            if qos > 0 and generation == self._generation and self._client is client:
                client._client.ack(mid, qos)

        return ack

    async def _handle(self, client: aiomqtt.Client, message: aiomqtt.Message) -> None:
        ack = self._acker(client, message)
        topic = message.topic.value
        payload = message.payload if isinstance(message.payload, bytes) else b""
        try:
            kind, job, agent = wire.parse_topic(topic)
            if kind == "events":
                batch = fastwire.decode_batch(payload, topic_job=job)  # same outcome as wire's
            elif kind == "clock":
                await self._clock_reply(payload, agent or "")
                ack()
                return
            else:
                a, node, state = wire.decode_status(payload)
                self.sink.agent_status(job, a, node, state)
                ack()
                return
        except wire.WireError as exc:
            reason = invalid_reason(exc.reason)
            self.metrics.batches_invalid.labels(reason).inc()
            log.warning(
                "invalid message dropped reason=%s topic=%r sender=%s bytes=%d error=%s",
                reason, topic[:160], _sender(payload), len(payload), exc.reason[:200],
            )  # fmt: skip
            ack()
            return
        self.metrics.batches.inc()
        await self.sink.submit(batch, ack)

    async def _clock_reply(self, payload: bytes, topic_agent: str) -> None:
        t1 = self._clock()
        agent, t0 = wire.decode_clock_request(payload)
        if agent != topic_agent:
            raise wire.WireError(f"invalid agent id {agent!r}: does not match the topic")
        self.metrics.clock_requests.inc()
        await self.publish(
            wire.clock_reply_topic(agent), wire.encode_clock_reply(t0, t1, self._clock()), qos=0
        )

    async def publish(self, topic: str, payload: bytes, *, retain: bool = False, qos: int = 1) -> None:
        """Queue a message for the broker without waiting for its PUBACK.

        The PUBACK arrives on the same connection behind every delivery the broker already sent
        us; waiting for it would hold a diagnosis or an alert back until that backlog is
        consumed. Messages leave in the order of the calls; the confirmation is awaited in the
        background (and on disconnect, within `PUBLISH_DRAIN_S`).
        """
        client = self._client
        if client is None:
            log.warning("publish skipped: not connected topic=%s", topic)
            return
        task = asyncio.ensure_future(self._publish(client, topic, payload, retain, qos))
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)
        await asyncio.sleep(0)  # let the task hand the message to the client now, in call order

    async def _publish(
        self, client: aiomqtt.Client, topic: str, payload: bytes, retain: bool, qos: int
    ) -> None:
        try:
            await client.publish(topic, payload, qos=qos, retain=retain)
        except aiomqtt.MqttError as exc:
            log.warning("publish failed topic=%s error=%s", topic, exc)


def _sender(payload: bytes) -> str:
    """Best-effort agent/node of an invalid payload, for the log line only."""
    if len(payload) > wire.MAX_BATCH_BYTES:
        return "?"
    try:
        doc = orjson.loads(payload)
    except ValueError:
        return "?"
    if not isinstance(doc, dict):
        return "?"
    return f"agent={str(doc.get('agent'))[:64]!r} node={str(doc.get('node'))[:64]!r}"


def _safe(url: str) -> str:
    u = urlsplit(url)
    return url.replace(f":{u.password}@", ":***@") if u.password else url


def subscriptions(shared_group: str | None) -> list[str]:
    """The filters to subscribe to; with a group, as a shared subscription (several replicas:
    each message reaches one of them; EMQX's hash_topic strategy keeps a job on one replica)."""
    if not shared_group:
        return list(wire.SUBSCRIPTIONS)
    return [f"$share/{shared_group}/{t}" for t in wire.SUBSCRIPTIONS]
