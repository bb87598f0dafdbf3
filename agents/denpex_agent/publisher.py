"""The agent's only MQTT module: one supervised aiomqtt connection, QoS 1 publishing.

`Publisher` keeps a connection up (MQTT v5, falling back to 3.1.1 at once when the broker does
not speak v5, see `Publisher._speaks_v5`), reconnects with exponential backoff and jitter,
registers a last will (``offline``, retained) so the correlator learns when the agent dies,
announces ``online`` on every connect, and delivers clock replies to a callback. `publish()`
returns only after the broker's PUBACK, retrying across reconnects: that is the guarantee
checkpoints are built on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import ssl
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

import aiomqtt
import paho.mqtt.client as paho
from aiomqtt.types import PahoSocket
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from denpex_agent import wire
from denpex_agent.config import AgentConfig
from denpex_agent.errors import DenpexAgentError, divert_loop_errors

log = logging.getLogger(__name__)

BACKOFF_MIN_S = 0.2
BACKOFF_MAX_S = 10.0
PUBLISH_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 1.0  # for a clean disconnect at close; then the connection is dropped
CONNECT_TIMEOUT_S = 3.0  # until the first connection: a silent broker is tried with 3.1.1 soon
UNSUPPORTED_PROTOCOL_VERSION = 0x84  # a v5 CONNACK reason; paho reports a 3.1.1 broker's code 1 as it


class PublishError(DenpexAgentError):
    def __init__(self, topic: str, reason: str) -> None:
        self.topic = topic
        self.reason = reason
        super().__init__(f"publish to {topic} failed: {reason}")


class _LoopClient(aiomqtt.Client):
    """aiomqtt's client, with one shortcut for a publish made on the event loop's own thread.

    For every outgoing packet aiomqtt schedules ``add_writer`` through ``call_soon_threadsafe``
    (paho may ask from the thread that connects), then waits for the socket to report writable:
    a self-pipe write, two extra wake-ups and two epoll changes per batch. On the loop thread
    the packet is written on the loop's next turn instead, and a writer is registered only when
    the socket would block. At a batch every 150 ms this is a good part of an agent's cost."""

    def _on_socket_register_write(self, client: paho.Client, userdata: Any, sock: PahoSocket) -> None:
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:  # a worker thread (the connect)
            on_loop = False
        if not on_loop:
            super()._on_socket_register_write(client, userdata, sock)
            return

        def write() -> None:
            try:
                client.loop_write()
            except Exception as exc:  # a broken pipe: the connection is gone, as in aiomqtt
                if not self._disconnected.done():
                    self._disconnected.set_exception(exc)
                return
            if client.want_write():  # the socket would block: wait until it is writable
                with contextlib.suppress(ValueError, OSError):  # closed meanwhile: aiomqtt sees it
                    self._loop.add_writer(sock.fileno(), write)

        self._loop.call_soon(write)

    def _on_disconnect(
        self,
        client: paho.Client,
        userdata: Any,
        flags: paho.DisconnectFlags,
        reason_code: ReasonCode,
        properties: Properties | None = None,
    ) -> None:
        # aiomqtt ignores a disconnection before CONNACK, so a broker that closes the connection
        # on a CONNECT it does not accept costs the whole connect timeout: fail the attempt now.
        if not self._connected.done() and self._lock.locked():
            self._connected.set_exception(aiomqtt.MqttError("connection closed before CONNACK"))
            return
        super()._on_disconnect(client, userdata, flags, reason_code, properties)


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
        self._client: aiomqtt.Client | None = None
        self._connected = asyncio.Event()
        self._stopping = False
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._protocol = self._initial_protocol()
        self._settled = False  # a connection succeeded once with self._protocol
        self.connects = 0
        self.failures = 0
        self.foreign_messages = 0  # delivered on topics the agent did not subscribe to (ignored)

    def _initial_protocol(self) -> aiomqtt.ProtocolVersion:
        return (
            aiomqtt.ProtocolVersion.V311 if self.cfg.mqtt_version == "3.1.1" else aiomqtt.ProtocolVersion.V5
        )

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

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
        def stray(context: dict[str, Any]) -> bool:
            # A connection attempt that timed out can still be ended by the broker afterwards:
            # aiomqtt then stores that disconnection in a future of the abandoned client, which
            # nobody awaits any more. The loss was handled (and logged) when the attempt failed.
            exc = context.get("exception")
            if isinstance(exc, aiomqtt.MqttError) and "never retrieved" in str(context.get("message")):
                log.debug("an abandoned connection attempt ended error=%s", exc)
                return True
            return False

        divert_loop_errors(asyncio.get_running_loop(), stray)
        self._task = asyncio.create_task(self._supervise(), name="mqtt-connection")
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self, announce: bool = True) -> None:
        """Say ``offline`` (when connected and ``announce``) and disconnect."""
        self._stopping = True
        client = self._client
        if announce and client is not None and self.connected:
            with contextlib.suppress(aiomqtt.MqttError, TimeoutError):
                await client.publish(
                    self.topics["status"],
                    wire.encode_status(self.cfg.agent, self.cfg.node, "offline", time.time()),
                    qos=1,
                    retain=True,
                    timeout=CLOSE_TIMEOUT_S,
                )
        self._stop.set()
        if self._task is not None:
            try:  # the connection task leaves its client's block and disconnects ...
                await asyncio.wait_for(asyncio.shield(self._task), CLOSE_TIMEOUT_S)
            except TimeoutError:  # ... or is stopped where it is (a broker that does not answer)
                self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def _client_for(self, protocol: aiomqtt.ProtocolVersion, *, will: bool = True) -> aiomqtt.Client:
        cfg, url = self.cfg, self.url
        tls_context = None
        if url.tls:
            tls_context = ssl.create_default_context(cafile=cfg.ca_file)
            if cfg.cert_file and cfg.key_file:
                tls_context.load_cert_chain(cfg.cert_file, cfg.key_file)
        last_will = aiomqtt.Will(
            topic=self.topics["status"],
            payload=wire.encode_status(cfg.agent, cfg.node, "offline", 0.0),
            qos=1,
            retain=True,
        )
        return _LoopClient(
            url.host,
            url.port,
            username=self._username,
            password=self._password(),
            identifier=f"denpex-agent-{cfg.agent}",
            protocol=protocol,
            will=last_will if will else None,
            tls_context=tls_context,
            keepalive=15,
            timeout=PUBLISH_TIMEOUT_S if self._settled else CONNECT_TIMEOUT_S,
        )

    async def _speaks_v5(self) -> bool:
        """Does the broker speak MQTT v5? False when it refuses the version; `aiomqtt.MqttError`
        when it cannot be reached, does not answer in time, or closes the connection.

        A 3.1.1-only broker is meant to refuse a v5 CONNECT at once (CONNACK code 1), but the
        agent's CONNECT carries a last will, and v5 puts a properties field before it: the
        embedded broker (amqtt) reads that field as the start of the will topic's length, then
        waits for bytes that never come, and the attempt only ended with the connect timeout
        (3 s at every start). The probe is a v5 CONNECT without a will, which such a broker can
        read far enough to refuse; a v5 broker answers it like the real one (accepted, or refused
        for a reason of its own, which the real attempt reports), and the probe disconnects.
        (With a user name the probe is misread too: against a 3.1.1 broker that needs
        credentials the fallback still waits for `CONNECT_TIMEOUT_S`.)"""
        try:
            async with self._client_for(aiomqtt.ProtocolVersion.V5, will=False):
                return True
        except aiomqtt.MqttCodeError as exc:
            # refused for a reason of its own (credentials): v5 it is, and the real attempt says why
            return exc.rc != UNSUPPORTED_PROTOCOL_VERSION

    async def _supervise(self) -> None:
        delay = BACKOFF_MIN_S
        while not self._stopping:
            client = self._client_for(self._protocol)
            try:
                probe = self._protocol == aiomqtt.ProtocolVersion.V5 and self._auto_unsettled
                if probe and not await self._speaks_v5():
                    log.info("the broker speaks MQTT 3.1.1, not 5 broker=%s", self.url.redacted())
                    self._protocol = aiomqtt.ProtocolVersion.V311
                    continue
                async with client:
                    self._client = client
                    self._settled = True
                    self.connects += 1
                    delay = BACKOFF_MIN_S
                    await client.subscribe(self.topics["clock_reply"], qos=1)
                    await client.subscribe(self.topics["receipt"], qos=1)
                    await client.publish(
                        self.topics["status"],
                        wire.encode_status(self.cfg.agent, self.cfg.node, "online", time.time()),
                        qos=1,
                        retain=True,
                    )
                    self._connected.set()
                    log.info(
                        "connected to broker broker=%s protocol=%s", self.url.redacted(), self._protocol.name
                    )
                    # Until close(): then the block is left normally, so that the client's own
                    # exit disconnects and collects how the disconnection went (a broker that
                    # drops the connection on DISCONNECT is reported there, not lost).
                    reader = asyncio.create_task(self._messages(client), name="mqtt-messages")
                    stop = asyncio.create_task(self._stop.wait(), name="mqtt-stop")
                    await asyncio.wait({reader, stop}, return_when=asyncio.FIRST_COMPLETED)
                    for task in (reader, stop):
                        task.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await task
            except aiomqtt.MqttError as exc:
                if self._stopping:
                    log.debug("disconnected on close error=%s", exc)
                    break
                self.failures += 1
                if self._auto_unsettled:
                    # A broker that did not answer the v5 probe in time, or closed the connection,
                    # may still be a 3.1.1 one: until one connection succeeded, alternate the two
                    # versions.
                    nxt = (
                        aiomqtt.ProtocolVersion.V311
                        if self._protocol == aiomqtt.ProtocolVersion.V5
                        else aiomqtt.ProtocolVersion.V5
                    )
                    log.warning(
                        "connect failed; trying another MQTT version broker=%s tried=%s next=%s error=%s",
                        self.url.redacted(),
                        self._protocol.name,
                        nxt.name,
                        exc,
                    )
                    self._protocol = nxt
                    if nxt == aiomqtt.ProtocolVersion.V311:
                        continue
                elif _refused_credentials(exc):
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
                self._client = None
            if self._stopping:
                break
            await asyncio.sleep(delay * random.uniform(0.5, 1.5))
            delay = min(delay * 2, BACKOFF_MAX_S)

    async def _messages(self, client: aiomqtt.Client) -> None:
        reply_topic, receipts = self.topics["clock_reply"], self.topics["receipt"]
        async for message in client.messages:
            # only our clock replies and receipts: a broker may deliver retained messages of other
            # topics too (the embedded amqtt broker does), they are not ours to parse
            payload = message.payload
            if not isinstance(payload, bytes):
                continue
            if message.topic.matches(reply_topic):
                if self.on_clock_reply is not None:
                    self.on_clock_reply(payload, time.time())
            elif message.topic.matches(receipts):
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
            client = self._client
            if client is None:
                continue
            try:
                await client.publish(topic, payload, qos=1, retain=retain, timeout=PUBLISH_TIMEOUT_S)
                return
            except (aiomqtt.MqttError, TimeoutError) as exc:
                # the supervisor notices a dead connection and reconnects; until then, retry
                log.warning("publish failed; retrying topic=%s error=%s", topic, exc)
                await asyncio.sleep(0.1)

    async def publish_nowait_ack(self, topic: str, payload: bytes) -> None:
        """Best effort, for clock requests: one try when connected, nothing otherwise."""
        client = self._client
        if client is None or not self.connected:
            return
        with contextlib.suppress(aiomqtt.MqttError, TimeoutError):
            await client.publish(topic, payload, qos=0, timeout=2.0)


# CONNACK codes of a refused login: 3.1.1 "bad user name or password" and "not authorized", v5
# "bad user name or password" and "not authorized"
_REFUSED_LOGIN = frozenset({4, 5, 134, 135})


def _refused_credentials(exc: aiomqtt.MqttError) -> bool:
    rc = getattr(exc, "rc", None)
    value = getattr(rc, "value", rc)
    return isinstance(value, int) and value in _REFUSED_LOGIN
