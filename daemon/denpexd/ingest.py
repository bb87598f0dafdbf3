"""MQTT ingest: the daemon's subscribing connection (`mqttconn`, paho-mqtt's external loop).

Subscribes to `wire.SUBSCRIPTIONS`, validates every payload with `wire`, hands valid batches to
a `BatchSink` (the job table) and answers clock requests. QoS 1 messages are acknowledged only
after their events are in the store (paho's manual acknowledgement), so a `kill -9` between
receipt and commit loses nothing: the broker redelivers to the persistent session.

Received messages wait in a bounded backlog for validation. When it is full (`ingest_backlog`
messages or `BACKLOG_BYTES`), ingest stops reading its socket until there is room again: the
broker's own flow control applies, and the daemon's memory does not grow with the publish rate. A batch that may carry match events
is validated first and its match events are fed to the job's engine at once (`hoist`), so a
failure is diagnosed without waiting behind a burst of progress; the batch is still submitted,
stored and acknowledged at its own place in the backlog.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import ssl
import time
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import Protocol, Self
from urllib.parse import unquote, urlsplit

import orjson
import paho.mqtt.client as paho
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from denpex_agent import wire
from denpex_agent.mqttconn import TCP_NODELAY, Connection, MqttError
from denpex_agent.redact import redact_url
from denpexd.brokeraccess import DAEMON_USER, Intake
from denpexd.config import ServeConfig, split_listen
from denpexd.errors import BrokerError
from denpexd.metrics import Metrics, invalid_reason
from denpexd.turns import Turns

log = logging.getLogger(__name__)

Ack = Callable[[], None]
RECEIVE_MAXIMUM = 256  # QoS 1 deliveries in flight from the broker (v5): their payloads wait in memory
RECONNECT_MAX_S = 10.0
# On disconnect, waiting for the broker's PUBACKs of our own messages, then for the close; both
# after the drain, within the stop's margin (serve.STOP_MARGIN_S).
PUBLISH_DRAIN_S = 2.0
DISCONNECT_S = 1.0


URGENT_SCAN_JOBS = 8
READ_AHEAD_PACKETS = 64  # at most, per validated message
BACKLOG_BYTES = 64 << 20  # received, not yet validated payloads' bytes (and `ingest_backlog` messages)
# A batch that may carry a match event is validated (and its matches hoisted) first. A JSON
# string "match" is spelled with these bytes unless escaped: no match event is missed, and a
# false positive costs nothing (hoisting a batch without match events does nothing). Any
# backslash counts as a possible escape: one byte is found by memchr, ~40x faster than the
# two bytes of \u (every batch is searched as it is read).
_MATCH, _ESCAPE = b'"match"', b"\\"


def may_carry_match(payload: bytes) -> bool:
    """Whether a batch may hold a match event (never False for one that does)."""
    return _MATCH in payload or _ESCAPE in payload


class BatchSink(Protocol):
    async def submit(self, batch: wire.Batch, ack: Ack, payload: bytes | None = None) -> None: ...

    async def hoist(self, batch: wire.Batch) -> None: ...

    def agent_status(self, job: str, agent: str, node: str, state: str, lost: bool = False) -> None: ...


class Bus(Protocol):
    async def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None: ...


_RAW, _HOISTED, _DONE = 0, 1, 2


class _Entry:
    """A received message waiting for validation (`batch` set once validated ahead of turn)."""

    __slots__ = ("ack", "batch", "payload", "size", "state", "topic")

    def __init__(self, topic: str, payload: bytes, ack: Ack) -> None:
        self.topic, self.payload, self.ack = topic, payload, ack
        self.batch: wire.Batch | None = None
        self.state = _RAW
        self.size = len(payload)


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
        intake: Intake | None = None,
    ) -> None:
        self.cfg = cfg
        self.sink = sink
        self._embedded_password = embedded_password  # the daemon's own login on the embedded broker
        self.metrics = metrics
        self._intake = intake  # the embedded broker's: closed while reading is paused
        self._clock = clock
        self._conn: Connection | None = None
        self._generation = 0
        self._connected = asyncio.Event()
        self._publishing: set[asyncio.Future[None]] = set()
        self._backlog: deque[_Entry] = deque()
        self._backlog_bytes = 0
        self._backlog_max = cfg.ingest_backlog
        metrics.backlog.set_function(lambda: len(self._backlog))
        self._urgent: dict[str, deque[_Entry]] = {}  # job -> its batches carrying match events
        self._pending = asyncio.Event()
        self._draining = False
        self._consumer: asyncio.Task[None] | None = None
        self._validator: asyncio.Task[None] | None = None
        self.external = cfg.broker is not None
        self.address = redact_url(cfg.broker) if cfg.broker else f"mqtt://{cfg.mqtt_listen}"  # as shown

    @property
    def ready(self) -> bool:
        return self._connected.is_set()

    def _new_connection(self) -> Connection:
        if self.cfg.broker is None:
            host, port = split_listen(self.cfg.mqtt_listen)
            return Connection(
                host,
                port,
                client_id=self.cfg.client_id,
                deliver=self._take,
                v5=False,
                clean=True,
                username=DAEMON_USER if self._embedded_password else None,
                password=self._embedded_password,
                socket_options=TCP_NODELAY,
            )
        u = urlsplit(self.cfg.broker)
        props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        props.SessionExpiryInterval = self.cfg.session_expiry_s
        props.ReceiveMaximum = RECEIVE_MAXIMUM
        # Acks are small packets sent one by one: without TCP_NODELAY, Nagle's algorithm meets
        # the broker's delayed ACK and each QoS 1 window stalls for tens of milliseconds.
        return Connection(
            u.hostname or "127.0.0.1",
            u.port or (8883 if u.scheme == "mqtts" else 1883),
            client_id=self.cfg.client_id,
            deliver=self._take,
            v5=True,
            clean=False,
            username=unquote(u.username) if u.username else None,
            password=unquote(u.password) if u.password else None,
            properties=props,
            tls_context=ssl.create_default_context() if u.scheme == "mqtts" else None,
            socket_options=TCP_NODELAY,
        )

    async def __aenter__(self) -> Self:
        try:
            await self._connect()
        except MqttError as exc:
            raise BrokerError(self.address, f"cannot connect: {exc}") from exc
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._disconnect()

    async def _connect(self) -> None:
        conn = self._new_connection()
        self._generation += 1
        self._conn = conn  # deliveries may arrive as soon as the subscription is made
        try:
            await conn.connect()
            await conn.subscribe(subscriptions(self.cfg.shared_group), qos=1)
        except MqttError:
            self._conn = None
            await conn.disconnect(timeout=1.0)
            raise
        self._connected.set()
        log.info("connected to MQTT broker address=%s client_id=%s", self.address, self.cfg.client_id)

    async def _disconnect(self) -> None:
        if self._publishing:
            await asyncio.wait(set(self._publishing), timeout=PUBLISH_DRAIN_S)
        conn, self._conn = self._conn, None
        self._connected.clear()
        if conn is not None:
            await conn.disconnect(timeout=DISCONNECT_S)

    async def run(self) -> None:
        """Consume until cancelled; reconnect with backoff when the broker goes away.

        Received messages wait in a backlog (bounded by `ingest_backlog` and `BACKLOG_BYTES`;
        reading stops while it is full) for `_validate`; a batch carrying match events is validated and handed to the
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
        """Stop taking deliveries, then validate and hand over what was received (the sink
        acknowledges it once stored); `run()` returns when that is done. Deliveries read after
        this are left unacknowledged: the broker sends them again to the next session."""
        self._draining = True
        if self._consumer is not None:
            self._consumer.cancel()
        if self._intake is not None:
            self._intake.open = False  # nothing more is taken: the embedded broker refuses batches
        if self._conn is not None:
            self._conn.resume_reading()  # deliveries are ignored now, but our PUBACKs must be read
        self._pending.set()
        if self._validator is not None:
            await asyncio.wait({self._validator})

    async def _validate(self) -> None:
        backlog, urgent = self._backlog, self._urgent
        turns = Turns()
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
                if entry.state == _RAW:
                    batch = self._decode(entry)
                    if batch is not None:
                        await self.sink.submit(batch, entry.ack, entry.payload)
                elif entry.state == _HOISTED:
                    assert entry.batch is not None
                    await self.sink.submit(entry.batch, entry.ack, entry.payload)
                entry.state = _DONE
            elif self._draining:
                return
            else:
                self._pending.clear()
                await self._pending.wait()
                continue
            conn = self._conn
            if conn is not None and not self._draining:
                if conn.paused and self._room_to_resume():
                    conn.resume_reading()
                    if self._intake is not None:
                        self._intake.open = True
                # Read the deliveries already in the socket now: the loop's reader callback
                # reads only when the loop gets a turn, so a batch carrying a failure would
                # otherwise wait in the socket until everything read before it was validated.
                conn.read_now(READ_AHEAD_PACKETS)
            await turns.share()  # the worker, the diagnoser and the HTTP API get a turn

    def _has_room(self) -> bool:
        """Whether the backlog may take more (bounded in messages and in bytes)."""
        return len(self._backlog) < self._backlog_max and self._backlog_bytes < BACKLOG_BYTES

    def _room_to_resume(self) -> bool:
        """Whether reading, once paused, may resume: the backlog is half empty."""
        return len(self._backlog) <= self._backlog_max // 2 and self._backlog_bytes <= BACKLOG_BYTES // 2

    async def _consume(self) -> None:
        """Keep the connection: wait for its loss, then reconnect with backoff."""
        delay = 0.2
        while True:
            conn = self._conn
            if conn is None:
                try:
                    await self._connect()
                    delay = 0.2
                except MqttError as exc:
                    log.warning("broker unreachable; retrying address=%s error=%s", self.address, exc)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, RECONNECT_MAX_S)
                continue
            reason = await conn.wait_closed()
            log.warning("broker connection lost; reconnecting address=%s error=%s", self.address, reason)
            if self._conn is conn:
                self._conn = None
            self._connected.clear()

    def _take(self, message: paho.MQTTMessage) -> None:
        """A delivery, as read from the socket (`Connection`'s callback)."""
        conn = self._conn
        if self._draining or conn is None:
            return  # not acknowledged: the broker sends it again to the next session
        try:
            topic = message.topic
        except UnicodeDecodeError:
            self.metrics.batches_invalid.labels("topic").inc()
            log.warning("invalid message dropped reason=topic error=topic is not UTF-8")
            conn.ack(message.mid, message.qos)
            return
        payload = message.payload if isinstance(message.payload, bytes) else bytes(message.payload)
        entry = _Entry(topic, payload, self._acker(conn, message))
        self._backlog.append(entry)
        self._backlog_bytes += entry.size
        if may_carry_match(payload):
            job = _topic_job(topic)
            if job is not None:
                self._urgent.setdefault(job, deque()).append(entry)
        if not self._has_room() and not conn.paused:
            conn.pause_reading()  # until the validator has made room
            if self._intake is not None:
                self._intake.open = False  # and the embedded broker refuses agents' batches
            self.metrics.read_pauses.inc()
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

    def _acker(self, conn: Connection, message: paho.MQTTMessage) -> Ack:
        generation, mid, qos = self._generation, message.mid, message.qos

        def ack() -> None:
            if qos > 0 and generation == self._generation and self._conn is conn:
                conn.ack(mid, qos)

        return ack

    def _decode(self, entry: _Entry) -> wire.Batch | None:
        """A valid event batch, or None once anything else was handled (status, clock request,
        invalid message: counted, logged, acknowledged)."""
        topic, payload, ack = entry.topic, entry.payload, entry.ack
        entry.state = _DONE
        try:
            where = wire.parse_topic(topic)
            job = where.job
            if where.kind == "events":
                try:
                    batch = wire.decode_batch(payload, topic_job=job)
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
        self._publish_nowait(topic, payload, retain, qos)

    def _publish_nowait(self, topic: str, payload: bytes, retain: bool, qos: int) -> bool:
        conn = self._conn
        if conn is None:
            log.warning("publish skipped: not connected topic=%s", topic)
            return False
        done = conn.publish(topic, payload, qos=qos, retain=retain)
        self._publishing.add(done)
        done.add_done_callback(self._published)
        return True

    def _published(self, done: asyncio.Future[None]) -> None:
        self._publishing.discard(done)
        exc = None if done.cancelled() else done.exception()
        if exc is not None:
            log.warning("publish failed error=%s", exc)


def _topic_job(topic: str) -> str | None:
    try:
        where = wire.parse_topic(topic)
    except wire.WireError:
        return None
    return where.job if where.kind == "events" else None


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
