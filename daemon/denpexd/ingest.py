"""MQTT ingest: the daemon's only subscribing aiomqtt module (aiomqtt>=2.5,<3).

Subscribes to `wire.SUBSCRIPTIONS`, validates every payload with `wire`, hands valid batches to
a `BatchSink` (the job table) and answers clock requests. QoS 1 messages are acknowledged only
after their events are in the store (paho's manual acknowledgement), so a `kill -9` between
receipt and commit loses nothing: the broker redelivers to the persistent session.

Received messages wait in a bounded backlog for validation. A batch that may carry match events
is validated first and its match events are fed to the job's engine at once (`hoist`), so a
failure is diagnosed without waiting behind a burst of progress; the batch is still submitted,
stored and acknowledged at its own place in the backlog.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import select
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import Any, Protocol, Self
from urllib.parse import unquote, urlsplit

import aiomqtt
import orjson
from paho.mqtt.enums import MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from denpex_agent import wire
from denpex_agent.redact import redact_url
from denpexd import fastwire
from denpexd.brokeraccess import DAEMON_USER
from denpexd.config import ServeConfig, split_listen
from denpexd.errors import BrokerError
from denpexd.metrics import Metrics, invalid_reason

log = logging.getLogger(__name__)

Ack = Callable[[], None]
RECEIVE_MAXIMUM = 256  # QoS 1 deliveries in flight from the broker (v5): their payloads wait in memory
QOS0_QUEUE_MAX = 10_000  # QoS 0 messages the client may hold before ingest takes them
RECONNECT_MAX_S = 10.0
PUBLISH_DRAIN_S = 5.0  # waiting for the broker's PUBACKs of our own messages on disconnect
# Acks are small packets sent one by one: without TCP_NODELAY, Nagle's algorithm meets the
# broker's delayed ACK and each QoS 1 window stalls for tens of milliseconds.
_SOCKET_OPTIONS = ((socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),)


URGENT_SCAN_JOBS = 8
READ_AHEAD_PACKETS = 64  # at most, per validated message
YIELD_EVERY = 8  # validated messages between turns given to the other tasks
BACKLOG_MAX = 2 * RECEIVE_MAXIMUM  # received, not yet validated messages (bounds memory) ...
BACKLOG_BYTES = 64 << 20  # ... and their payloads' bytes
# A batch that may carry a match event is validated (and its matches hoisted) first. A JSON
# string "match" is spelled with these bytes unless escaped with \u: no match event is missed,
# and a false positive costs nothing (hoisting a batch without match events does nothing).
_MATCH, _ESCAPE = b'"match"', b"\\u"


class BatchSink(Protocol):
    async def submit(self, batch: wire.Batch, ack: Ack, payload: bytes | None = None) -> None: ...

    async def hoist(self, batch: wire.Batch) -> None: ...

    def agent_status(self, job: str, agent: str, node: str, state: str, lost: bool = False) -> None: ...


class Bus(Protocol):
    async def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None: ...


_RAW, _HOISTED, _DONE = 0, 1, 2


class _Entry:
    """A received message waiting for validation (`batch` set once validated ahead of turn)."""

    __slots__ = ("ack", "batch", "message", "size", "state")

    def __init__(self, message: aiomqtt.Message, ack: Ack) -> None:
        self.message, self.ack = message, ack
        self.batch: wire.Batch | None = None
        self.state = _RAW
        payload = message.payload
        self.size = len(payload) if isinstance(payload, (bytes, bytearray)) else 0


class Ingest:
    """`async with Ingest(cfg, sink, metrics) as ingest: await ingest.run()`; also a `Bus`."""

    def __init__(
        self,
        cfg: ServeConfig,
        sink: BatchSink,
        metrics: Metrics,
        *,
        clock: Callable[[], float] = time.time,
        embedded_password: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.sink = sink
        self._embedded_password = embedded_password  # the daemon's own login on the embedded broker
        self.metrics = metrics
        self._clock = clock
        self._client: aiomqtt.Client | None = None
        self._generation = 0
        self._connected = asyncio.Event()
        self._publishing: set[asyncio.Future[None]] = set()
        self._backlog: deque[_Entry] = deque()
        self._backlog_bytes = 0
        self._urgent: dict[str, deque[_Entry]] = {}  # job -> its batches carrying match events
        self._pending = asyncio.Event()
        self._draining = False
        self._consumer: asyncio.Task[None] | None = None
        self._validator: asyncio.Task[None] | None = None
        self._room = asyncio.Event()
        self._room.set()
        self.external = cfg.broker is not None
        self.address = redact_url(cfg.broker) if cfg.broker else f"mqtt://{cfg.mqtt_listen}"  # as shown

    @property
    def ready(self) -> bool:
        return self._connected.is_set()

    def _new_client(self) -> aiomqtt.Client:
        if self.cfg.broker is None:
            host, port = split_listen(self.cfg.mqtt_listen)
            client = aiomqtt.Client(
                host,
                port,
                username=DAEMON_USER if self._embedded_password else None,
                password=self._embedded_password,
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
        # QoS 1 deliveries are bounded by the broker's in-flight window (RECEIVE_MAXIMUM); QoS 0
        # ones are not, so while ingest is behind they are shed (and counted) instead of queued
        # without bound in the client.
        deliver: Any = client._client.on_message
        queue = client._queue
        shed = self.metrics.messages_shed

        def on_message(paho: Any, userdata: Any, message: Any) -> None:
            if message.qos == 0 and queue.qsize() >= QOS0_QUEUE_MAX:
                shed.inc()
                return
            deliver(paho, userdata, message)

        client._client.on_message = on_message
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
        log.info("connected to MQTT broker address=%s client_id=%s", self.address, self.cfg.client_id)

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
        """Consume until cancelled; reconnect with backoff when the broker goes away.

        Received messages wait in a backlog (bounded by `BACKLOG_MAX`, beyond the broker's
        window) for `_validate`; a batch carrying match events is validated and handed to the
        sink's `hoist` ahead of that backlog, then submitted at its own place in it.
        """
        consume = self._consumer = asyncio.create_task(self._consume(), name="ingest-consume")
        validate = self._validator = asyncio.create_task(self._validate(), name="ingest-validate")
        tasks = {consume, validate}
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if not (task is consume and self._draining and task.cancelled()):
                    task.result()  # neither returns unless draining: re-raise what stopped it
            await validate  # draining: returns once the backlog is handed over
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def drain(self) -> None:
        """Stop reading from the broker, then validate and hand over what was received (the
        sink acknowledges it once stored); `run()` returns when that is done."""
        self._draining = True
        if self._consumer is not None:
            self._consumer.cancel()
        self._pending.set()
        if self._validator is not None:
            await asyncio.wait({self._validator})

    async def _validate(self) -> None:
        backlog, urgent = self._backlog, self._urgent
        turns = 0
        while True:
            if urgent:
                entry = self._next_urgent()
                if entry.state == _RAW:
                    batch = self._decode(entry)
                    if batch is not None:
                        entry.batch, entry.state = batch, _HOISTED
                        await self.sink.hoist(batch)
            elif backlog:
                entry = backlog.popleft()
                self._backlog_bytes -= entry.size
                if self._has_room():
                    self._room.set()
                if entry.state == _RAW:
                    batch = self._decode(entry)
                    if batch is not None:
                        await self.sink.submit(batch, entry.ack, _payload(entry))
                elif entry.state == _HOISTED:
                    assert entry.batch is not None
                    await self.sink.submit(entry.batch, entry.ack, _payload(entry))
                entry.state = _DONE
            elif self._draining:
                return
            else:
                self._pending.clear()
                await self._pending.wait()
                continue
            if self._has_room() and not self._draining:
                self._read_ahead()
                if self._client is not None:
                    self._take_queued(self._client)  # what was read may be urgent: look at it now
            turns += 1
            if turns % YIELD_EVERY == 0:
                await asyncio.sleep(0)  # the worker, the diagnoser and the HTTP API get a turn

    def _take_queued(self, client: aiomqtt.Client) -> None:
        """Move what aiomqtt's queue holds (whatever paho has read already) into the backlog."""
        queue = client._queue
        while queue.qsize() and self._has_room():
            self._take(client, queue.get_nowait())

    def _has_room(self) -> bool:
        """Whether the backlog may take more (bounded in messages and in bytes)."""
        return len(self._backlog) < BACKLOG_MAX and self._backlog_bytes < BACKLOG_BYTES

    def _read_ahead(self) -> None:
        """Read the deliveries already in the socket now. The event loop's reader callback has
        paho read one packet per wake-up, so a batch behind a backlog would otherwise stay in the
        socket until everything before it was validated."""
        client = self._client
        if client is None:
            return
        paho = client._client
        sock = paho.socket()
        if sock is None:
            return
        pending = getattr(sock, "pending", None)  # TLS: bytes already decrypted
        for _ in range(READ_AHEAD_PACKETS):
            if not (pending is not None and pending()) and not select.select((sock,), (), (), 0)[0]:
                return
            if paho.loop_read() != MQTTErrorCode.MQTT_ERR_SUCCESS:
                return

    async def _consume(self) -> None:
        delay = 0.2
        while True:
            client = self._client
            if client is None:
                try:
                    await self._connect()
                    delay = 0.2
                except aiomqtt.MqttError as exc:
                    log.warning("broker unreachable; retrying address=%s error=%s", self.address, exc)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, RECONNECT_MAX_S)
                continue
            try:
                async for message in client.messages:
                    self._take(client, message)
                    # the iterator costs a task and an `asyncio.wait` per message: take the rest
                    # directly, so a batch behind them is seen (and possibly hoisted) now
                    self._take_queued(client)
                    if not self._has_room():
                        self._room.clear()
                        await self._room.wait()
            except aiomqtt.MqttError as exc:
                log.warning("broker connection lost; reconnecting address=%s error=%s", self.address, exc)
                self._client = None
                self._connected.clear()

    def _take(self, client: aiomqtt.Client, message: aiomqtt.Message) -> None:
        entry = _Entry(message, self._acker(client, message))
        self._backlog.append(entry)
        self._backlog_bytes += entry.size
        payload = message.payload
        if isinstance(payload, bytes) and (_MATCH in payload or _ESCAPE in payload):
            job = _topic_job(message.topic.value)
            if job is not None:
                self._urgent.setdefault(job, deque()).append(entry)
        self._pending.set()

    def _next_urgent(self) -> _Entry:
        """The oldest urgent batch of the first job (among the first few) whose diagnosis has not
        failed yet, else of the first job: a new failure does not wait behind the cascade of
        one already diagnosed. Each job's own urgent batches keep their order."""
        urgent = self._urgent
        settled = getattr(self.sink, "settled", None)
        pick = next(iter(urgent))
        if settled is not None:
            for job in itertools.islice(urgent, URGENT_SCAN_JOBS):
                if not settled(job):
                    pick = job
                    break
        queue = urgent[pick]
        entry = queue.popleft()
        if not queue:
            del urgent[pick]
        return entry

    def _acker(self, client: aiomqtt.Client, message: aiomqtt.Message) -> Ack:
        generation, mid, qos = self._generation, message.mid, message.qos

        def ack() -> None:
            if qos > 0 and generation == self._generation and self._client is client:
                client._client.ack(mid, qos)

        return ack

    def _decode(self, entry: _Entry) -> wire.Batch | None:
        """A valid event batch, or None once anything else was handled (status, clock request,
        invalid message: counted, logged, acknowledged)."""
        message, ack = entry.message, entry.ack
        entry.state = _DONE
        topic = message.topic.value
        payload = message.payload if isinstance(message.payload, bytes) else b""
        try:
            where = wire.parse_topic(topic)
            job = where.job
            if where.kind == "events":
                try:
                    batch = fastwire.decode_batch(payload, topic_job=job)  # same outcome as wire's
                    wire.check_sender(where, batch.agent, batch.node)
                except wire.WireError as exc:
                    self._refused_receipt(where, payload, exc.reason)
                    raise
                # The agent checkpoints this batch's lines once told that it is stored. On the
                # first revision's topic (job style) the payload names the agent.
                entry.ack = self._with_receipt(
                    entry.ack, wire.receipt_topic(batch.agent, batch.node),
                    wire.encode_receipt(job, batch.seq, batch.sent_at),
                )  # fmt: skip
            elif where.kind == "clock":
                t1 = self._clock()
                a, t0 = wire.decode_clock_request(payload)
                if a != (where.agent or ""):
                    raise wire.WireError(f"invalid agent id {a!r}: does not match the topic")
                self.metrics.clock_requests.inc()
                self._publish_nowait(
                    wire.clock_reply_topic(a, where.node),
                    wire.encode_clock_reply(t0, t1, self._clock(), receipts=True),
                    False,
                    0,
                )
                ack()
                return None
            else:
                if not payload:  # a retained status deleted (see below): nothing to say
                    ack()
                    return None
                a, node, state, lost = wire.decode_status_full(payload)
                wire.check_sender(where, a, node)
                self.sink.agent_status(job, a, node, state, lost)
                if not self.external:
                    # The embedded broker (amqtt) sends every retained message that matches any
                    # client's subscription to each client that connects (and can fail doing so
                    # while others subscribe): once read here, an agent's retained status is
                    # deleted (an empty retained message); the daemon keeps the state itself.
                    self._publish_nowait(topic, b"", True, 0)
                ack()
                return None
        except wire.WireError as exc:
            reason = invalid_reason(exc.reason, exc.code)
            self.metrics.batches_invalid.labels(reason).inc()
            log.warning(
                "invalid message dropped reason=%s topic=%r sender=%s bytes=%d error=%s",
                reason, topic[:160], _sender(payload), len(payload), exc.reason[:200],
            )  # fmt: skip
            ack()
            return None
        self.metrics.batches.inc()
        return batch

    def _with_receipt(self, ack: Ack, topic: str, receipt: bytes) -> Ack:
        """``ack`` that also tells the agent its batch is stored (QoS 0: a lost receipt costs one
        re-send, whose events are dropped as duplicates, and a new receipt)."""

        def ack_and_tell() -> None:
            ack()
            self.metrics.receipts.inc()
            self._publish_nowait(topic, receipt, False, 0)

        return ack_and_tell

    def _refused_receipt(self, where: wire.Topic, payload: bytes, reason: str) -> None:
        """An agent's batch refused for good: tell it (if its seq and sent_at can be read), so it
        does not send it again."""
        if len(payload) > wire.MAX_BATCH_BYTES:
            return
        try:
            doc = orjson.loads(payload)
        except ValueError:
            return
        if not isinstance(doc, dict):
            return
        seq, sent_at = doc.get("seq"), doc.get("sent_at")
        agent, node = (
            (where.agent, where.node) if where.node is not None else (doc.get("agent"), doc.get("node"))
        )
        if not (wire.valid_id(agent) and wire.valid_id(node)):
            return
        assert isinstance(agent, str) and isinstance(node, str)
        if isinstance(seq, int) and not isinstance(seq, bool) and isinstance(sent_at, (int, float)):
            receipt = wire.encode_receipt(where.job, seq, float(sent_at), refused=reason)
            self._publish_nowait(wire.receipt_topic(agent, node), receipt, False, 0)

    async def publish(self, topic: str, payload: bytes, *, retain: bool = False, qos: int = 1) -> None:
        """Queue a message for the broker without waiting for its PUBACK.

        The PUBACK arrives on the same connection behind every delivery the broker already sent
        us; waiting for it would hold a diagnosis or an alert back until that backlog is
        consumed. Messages leave in the order of the calls; the confirmation is awaited in the
        background (and on disconnect, within `PUBLISH_DRAIN_S`).
        """
        if self._publish_nowait(topic, payload, retain, qos):
            await asyncio.sleep(0)  # let the task hand the message to the client now, in call order

    def _publish_nowait(self, topic: str, payload: bytes, retain: bool, qos: int) -> bool:
        client = self._client
        if client is None:
            log.warning("publish skipped: not connected topic=%s", topic)
            return False
        task = asyncio.ensure_future(self._publish(client, topic, payload, retain, qos))
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)
        return True

    async def _publish(
        self, client: aiomqtt.Client, topic: str, payload: bytes, retain: bool, qos: int
    ) -> None:
        try:
            await client.publish(topic, payload, qos=qos, retain=retain)
        except aiomqtt.MqttError as exc:
            log.warning("publish failed topic=%s error=%s", topic, exc)


def _topic_job(topic: str) -> str | None:
    try:
        where = wire.parse_topic(topic)
    except wire.WireError:
        return None
    return where.job if where.kind == "events" else None


def _payload(entry: _Entry) -> bytes | None:
    payload = entry.message.payload
    return payload if isinstance(payload, bytes) else None


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


def subscriptions(shared_group: str | None) -> list[str]:
    """The filters to subscribe to; with a group, as a shared subscription (several replicas:
    each message reaches one of them; EMQX's hash_topic strategy keeps a job on one replica)."""
    if not shared_group:
        return list(wire.SUBSCRIPTIONS)
    return [f"$share/{shared_group}/{t}" for t in wire.SUBSCRIPTIONS]
