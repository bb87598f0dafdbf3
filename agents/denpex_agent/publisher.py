"""The agent's only MQTT module: one supervised connection, QoS 1 publishing.

`Publisher` keeps a connection up (MQTT v5, falling back to 3.1.1 at once when the broker does
not speak v5, see `Publisher._speaks_v5`), reconnects with exponential backoff and jitter,
registers a last will (``offline``, retained) so the correlator learns when the agent dies,
announces ``online`` on every connect, and delivers clock replies to a callback. `publish()`
returns only after the broker's PUBACK, retrying across reconnects: that is the guarantee
checkpoints are built on (with receipts, `agent.py` waits for the daemon's word as well).

The connection is `mqttconn.Connection`, paho-mqtt's public external-loop API on the asyncio
loop, the same one the daemon's ingest uses; nothing here touches a dependency's private
attributes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import ssl
import time
from collections.abc import Awaitable, Callable
from types import TracebackType

import paho.mqtt.client as paho

from denpex_agent import wire
from denpex_agent.config import AgentConfig
from denpex_agent.errors import DenpexAgentError
from denpex_agent.mqttconn import TCP_NODELAY, Connection, MqttError, Will

log = logging.getLogger(__name__)

BACKOFF_MIN_S = 0.2
BACKOFF_MAX_S = 10.0
PUBLISH_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 1.0  # for a clean disconnect at close; then the connection is dropped
CONNECT_TIMEOUT_S = 3.0  # until the first connection: a silent broker is tried with 3.1.1 soon
UNSUPPORTED_PROTOCOL_VERSION = 0x84  # a v5 CONNACK reason; paho reports a 3.1.1 broker's code 1 as it
KEEPALIVE_S = 15


class PublishError(DenpexAgentError):
    def __init__(self, topic: str, reason: str) -> None:
        self.topic = topic
        self.reason = reason
        super().__init__(f"publish to {topic} failed: {reason}")


class Publisher:
    """``async with Publisher(cfg, on_clock_reply) as pub: await pub.publish(topic, payload)``."""

    def __init__(
        self,
        cfg: AgentConfig,
        on_clock_reply: Callable[[bytes, float], None] | None = None,
        on_receipt: Callable[[bytes], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.url = cfg.broker_url
        self.on_clock_reply = on_clock_reply
        self.on_receipt = on_receipt
        self.topics = wire.agent_topics(cfg.job, cfg.agent, cfg.node, cfg.topic_style)
        self._conn: Connection | None = None
        self._connected = asyncio.Event()
        self._stopping = False
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._v5 = cfg.mqtt_version != "3.1.1"
        self._settled = False  # a connection succeeded once with self._v5
        self.connects = 0
        self.failures = 0
        self.foreign_messages = 0  # delivered on topics the agent did not subscribe to (ignored)

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def _protocol_name(self) -> str:
        return "V5" if self._v5 else "V311"

    @property
    def _auto_unsettled(self) -> bool:
        """The MQTT version is still to be found: ``auto`` and no connection succeeded yet."""
        return self.cfg.mqtt_version == "auto" and not self._settled

    @property
    def _username(self) -> str | None:
        """The broker user name: as configured, else (with a password) the agent's principal,
        which is what the brokers' ACLs pin its topics to."""
        cfg, url = self.cfg, self.url
        if cfg.username or url.username:
            return cfg.username or url.username
        secret = cfg.password or url.password or cfg.password_file
        return wire.principal(cfg.agent, cfg.node) if secret else None

    def _password(self) -> str | None:
        """The broker password: as configured, or read from `password_file` now (it may have
        been renewed since the last connection)."""
        cfg = self.cfg
        if cfg.password_file is None:
            return cfg.password or self.url.password
        try:
            with open(cfg.password_file, encoding="utf-8") as fh:
                return fh.read().strip() or None
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("cannot read the password file path=%s error=%s", cfg.password_file, exc)
            return None

    async def __aenter__(self) -> Publisher:
        self._task = asyncio.create_task(self._supervise(), name="mqtt-connection")
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self, announce: bool = True) -> None:
        """Say ``offline`` (when connected and ``announce``) and disconnect."""
        self._stopping = True
        conn = self._conn
        if announce and conn is not None and self.connected:
            status = wire.encode_status(self.cfg.agent, self.cfg.node, "offline", time.time())
            with contextlib.suppress(MqttError):
                await _within(
                    conn.publish(self.topics["status"], status, qos=1, retain=True), CLOSE_TIMEOUT_S
                )
        self._stop.set()
        if self._task is not None:
            try:  # the connection task disconnects ...
                await asyncio.wait_for(asyncio.shield(self._task), CLOSE_TIMEOUT_S)
            except TimeoutError:  # ... or is stopped where it is (a broker that does not answer)
                self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def _connection(self, v5: bool, *, will: bool = True) -> Connection:
        cfg, url = self.cfg, self.url
        tls_context = None
        if url.tls:
            tls_context = ssl.create_default_context(cafile=cfg.ca_file)
            if cfg.cert_file and cfg.key_file:
                tls_context.load_cert_chain(cfg.cert_file, cfg.key_file)
        last_will = Will(
            self.topics["status"], wire.encode_status(cfg.agent, cfg.node, "offline", 0.0), qos=1, retain=True
        )
        return Connection(
            url.host,
            url.port,
            client_id=f"denpex-agent-{cfg.agent}",
            deliver=self._deliver,
            v5=v5,
            clean=True,
            username=self._username,
            password=self._password(),
            tls_context=tls_context,
            keepalive=KEEPALIVE_S,
            # a batch must not wait for the broker's delayed ACK of the one before (Nagle)
            socket_options=TCP_NODELAY,
            will=last_will if will else None,
            manual_ack=False,  # clock replies and receipts: paho acknowledges once delivered
        )

    async def _speaks_v5(self) -> bool:
        """Does the broker speak MQTT v5? False when it refuses the version; `MqttError` when it
        cannot be reached, does not answer in time, or closes the connection.

        A 3.1.1-only broker is meant to refuse a v5 CONNECT at once (CONNACK code 1), but the
        agent's CONNECT carries a last will, and v5 puts a properties field before it: the
        embedded broker (amqtt) reads that field as the start of the will topic's length, then
        waits for bytes that never come, and the attempt only ended with the connect timeout
        (3 s at every start). The probe is a v5 CONNECT without a will, which such a broker can
        read far enough to refuse; a v5 broker answers it like the real one (accepted, or refused
        for a reason of its own, which the real attempt reports), and the probe disconnects.
        (With a user name the probe is misread too: against a 3.1.1 broker that needs
        credentials the fallback still waits for `CONNECT_TIMEOUT_S`.)"""
        probe = self._connection(True, will=False)
        try:
            await probe.connect(CONNECT_TIMEOUT_S)
        except MqttError as exc:
            if exc.rc is None:  # not refused: unreachable, silent or closed
                raise
            # refused for a reason of its own (credentials): v5 it is, and the real attempt says why
            return exc.rc != UNSUPPORTED_PROTOCOL_VERSION
        except BaseException:  # cancelled (close) while connecting
            probe.abort()
            raise
        await probe.disconnect(CLOSE_TIMEOUT_S)
        return True

    async def _supervise(self) -> None:
        delay = BACKOFF_MIN_S
        while not self._stopping:
            conn: Connection | None = None
            try:
                if self._v5 and self._auto_unsettled and not await self._speaks_v5():
                    log.info("the broker speaks MQTT 3.1.1, not 5 broker=%s", self.url.redacted())
                    self._v5 = False
                    continue
                conn = self._connection(self._v5)
                await conn.connect(PUBLISH_TIMEOUT_S if self._settled else CONNECT_TIMEOUT_S)
                self._conn = conn
                self._settled = True
                self.connects += 1
                delay = BACKOFF_MIN_S
                await self._subscribe(conn)
                online = wire.encode_status(self.cfg.agent, self.cfg.node, "online", time.time())
                await _within(
                    conn.publish(self.topics["status"], online, qos=1, retain=True), PUBLISH_TIMEOUT_S
                )
                self._connected.set()
                log.info(
                    "connected to broker broker=%s protocol=%s", self.url.redacted(), self._protocol_name
                )
                # Until close(), then a clean DISCONNECT; or until the connection is lost.
                lost = asyncio.create_task(conn.wait_closed(), name="mqtt-lost")
                stop = asyncio.create_task(self._stop.wait(), name="mqtt-stop")
                try:
                    await asyncio.wait({lost, stop}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for task in (lost, stop):
                        task.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await task
                if not conn.is_closed:  # stopping
                    self._connected.clear()
                    await conn.disconnect(CLOSE_TIMEOUT_S)
                    break
                raise MqttError(f"connection lost: {await conn.wait_closed()}")
            except MqttError as exc:
                if self._stopping:
                    log.debug("disconnected on close error=%s", exc)
                    break
                self.failures += 1
                if self._auto_unsettled:
                    # A broker that did not answer the v5 probe in time, or closed the connection,
                    # may still be a 3.1.1 one: until one connection succeeded, alternate the two
                    # versions.
                    tried = self._protocol_name
                    self._v5 = not self._v5
                    log.warning(
                        "connect failed; trying another MQTT version broker=%s tried=%s next=%s error=%s",
                        self.url.redacted(),
                        tried,
                        self._protocol_name,
                        exc,
                    )
                    if not self._v5:
                        continue
                elif exc.rc in _REFUSED_LOGIN:
                    delay = BACKOFF_MAX_S
                    log.error(
                        "the broker refused this agent's credentials; retrying broker=%s user=%s "
                        "error=%s delay_s=%.2f (set DENPEX_PASSWORD, and DENPEX_USERNAME if it is not "
                        "the agent's principal %s; with denpexd's embedded broker `denpexd credential "
                        "--agent ID [--node NODE]` prints both)",
                        self.url.redacted(),
                        self._username or "-",
                        exc,
                        delay,
                        wire.principal(self.cfg.agent, self.cfg.node),
                    )
                else:
                    log.warning(
                        "broker connection lost; reconnecting broker=%s error=%s delay_s=%.2f",
                        self.url.redacted(),
                        exc,
                        delay,
                    )
            finally:
                self._connected.clear()
                self._conn = None
                if conn is not None and not conn.is_closed:
                    conn.abort()  # an attempt that failed half-way, or a cancelled close
            if self._stopping:
                break
            await asyncio.sleep(delay * random.uniform(0.5, 1.5))
            delay = min(delay * 2, BACKOFF_MAX_S)

    async def _subscribe(self, conn: Connection) -> None:
        """The clock reply and receipt topics; a broker that refuses them is logged, not retried
        (the agent then works without clock samples or receipts, as it would without a daemon)."""
        for topic in (self.topics["clock_reply"], self.topics["receipt"]):
            try:
                await _within(conn.subscribe([topic], qos=1), PUBLISH_TIMEOUT_S)
            except MqttError as exc:
                if conn.is_closed:
                    raise
                log.warning("subscription refused topic=%s error=%s", topic, exc)

    def _deliver(self, message: paho.MQTTMessage) -> None:
        # only our clock replies and receipts: a broker may deliver retained messages of other
        # topics too (the embedded amqtt broker does), they are not ours to parse
        topic, payload = message.topic, bytes(message.payload)
        if topic == self.topics["clock_reply"]:
            if self.on_clock_reply is not None:
                self.on_clock_reply(payload, time.time())
        elif topic == self.topics["receipt"]:
            if self.on_receipt is not None:
                self.on_receipt(payload)
        else:
            self.foreign_messages += 1

    async def wait_connected(self, seconds: float | None = None) -> bool:
        try:
            await asyncio.wait_for(self._connected.wait(), seconds)
        except TimeoutError:
            return False
        return True

    async def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        """Deliver at least once: returns after PUBACK, retrying across reconnects."""
        while True:
            if self._stopping and not self._connected.is_set():
                raise PublishError(topic, "publisher is closed")
            await self._connected.wait()
            conn = self._conn
            if conn is None:
                await asyncio.sleep(0)
                continue
            try:
                await _within(conn.publish(topic, payload, qos=1, retain=retain), PUBLISH_TIMEOUT_S)
                return
            except MqttError as exc:
                # the supervisor notices a dead connection and reconnects; until then, retry
                log.warning("publish failed; retrying topic=%s error=%s", topic, exc)
                await asyncio.sleep(0.1)

    async def publish_nowait_ack(self, topic: str, payload: bytes) -> None:
        """Best effort, for clock requests: one try when connected, nothing otherwise."""
        conn = self._conn
        if conn is None or not self.connected:
            return
        with contextlib.suppress(MqttError):
            await _within(conn.publish(topic, payload, qos=0), 2.0)


async def _within(done: Awaitable[object], seconds: float) -> None:
    """Wait for ``done``; `MqttError` when it takes longer than ``seconds``. (`asyncio.timeout`
    rather than `wait_for`: the task wakes straight from ``done``, one loop turn and a waiter
    future less per publish.)"""
    try:
        async with asyncio.timeout(seconds):
            await done
    except TimeoutError as exc:
        raise MqttError(f"no answer within {seconds:.0f} s") from exc


# CONNACK codes of a refused login: 3.1.1 "bad user name or password" and "not authorized", v5
# "bad user name or password" and "not authorized"
_REFUSED_LOGIN = frozenset({4, 5, 134, 135})
