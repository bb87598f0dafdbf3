"""One MQTT connection driven by asyncio through paho-mqtt's public external-loop API.

paho-mqtt documents how to run it inside someone else's event loop: the socket callbacks
(`on_socket_open`, `on_socket_close`, `on_socket_register_write`, `on_socket_unregister_write`)
say when to watch its socket, and `loop_read`, `loop_write` and `loop_misc` do the work. This
module does exactly that on the running asyncio loop. Both programs use it: the agent's
publisher (`publisher.py`) and the daemon's ingest (`denpexd/ingest.py`). It adds what they need
and aiomqtt cannot express without reaching into its internals (private attributes of a
dependency break silently on its next release; `tests/unit/test_no_private_access.py` keeps
the product off them):

* deliveries go to a callback as they are read, with nothing queued in between;
* QoS 1 deliveries are acknowledged by the caller once stored (`manual_ack_set`, `ack`);
* reading can be paused: while the daemon's queues are full it stops reading its socket, the
  kernel's buffers fill and TCP flow control holds the broker back, which then applies its
  own limits (an external broker queues for the persistent session; the embedded broker is
  told to refuse publishes, see `broker.py`) instead of the daemon's memory growing;
* a packet queued on the loop's own thread is written on the loop's next turn (packets queued
  in the same turn go out in one write), and a writer is registered only when the socket
  would block: no self-pipe wake-up and no epoll change per publish;
* a connection the broker closes before its CONNACK fails the attempt at once, and a refused
  CONNECT carries the broker's reason code (`MqttError.rc`).

Everything runs on the event loop's thread except paho's blocking `connect()`, which runs in
an executor; the socket callbacks it makes from there are moved to the loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode, MQTTProtocolVersion
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

log = logging.getLogger(__name__)

READ_PACKETS = 64  # per wake-up of the reader (then other tasks get a turn)
MISC_INTERVAL_S = 1.0  # keepalive bookkeeping (paho's loop_misc)
CONNECT_TIMEOUT_S = 10.0


class MqttError(Exception):
    """The connection could not be made, was refused, or was lost; ``rc`` is the CONNACK's
    reason code when the broker refused the connection (v5 codes: paho reports a 3.1.1
    broker's codes as their v5 equivalents)."""

    def __init__(self, message: str, rc: int | None = None) -> None:
        super().__init__(message)
        self.rc = rc


@dataclass(frozen=True, slots=True)
class Will:
    """The last will the broker publishes when the connection is lost without a DISCONNECT."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = False


Deliver = Callable[[paho.MQTTMessage], None]


class Connection:
    """``conn = Connection(...); await conn.connect(); await conn.subscribe([...]);``
    deliveries reach ``deliver``; ``await conn.wait_closed()`` returns the reason once the
    connection is lost."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        client_id: str,
        deliver: Deliver,
        v5: bool,
        clean: bool,
        username: str | None = None,
        password: str | None = None,
        properties: Properties | None = None,
        tls_context: ssl.SSLContext | None = None,
        keepalive: int = 60,
        socket_options: tuple[tuple[int, int, int], ...] = (),
        will: Will | None = None,
        manual_ack: bool = True,
    ) -> None:
        self._host, self._port, self._keepalive = host, port, keepalive
        self._clean = clean
        self._v5 = v5
        self._properties = properties
        self._socket_options = socket_options
        self._deliver = deliver
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        client = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id,
            protocol=MQTTProtocolVersion.MQTTv5 if v5 else MQTTProtocolVersion.MQTTv311,
            clean_session=None if v5 else clean,
        )
        if username is not None:
            client.username_pw_set(username, password)
        if tls_context is not None:
            client.tls_set_context(tls_context)
        if will is not None:
            client.will_set(will.topic, will.payload, qos=will.qos, retain=will.retain)
        client.manual_ack_set(manual_ack)  # else paho acknowledges after ``deliver`` returns
        client.on_socket_open = self._on_socket_open
        client.on_socket_close = self._on_socket_close
        client.on_socket_register_write = self._on_register_write
        client.on_socket_unregister_write = self._on_unregister_write
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_subscribe = self._on_subscribe
        client.on_publish = self._on_publish
        client.on_message = self._on_message
        self._client = client
        self._sock: Any = None
        self._reading = False  # the socket is watched for reading
        self._paused = False
        self._misc: asyncio.Task[None] | None = None
        self._writing = False  # inside loop_write (a register_write then means: would block)
        self._write_soon = False  # a write is scheduled for the loop's next turn
        self._connack: asyncio.Future[None] = self._loop.create_future()
        # a connect() that timed out no longer waits for it: its failure is nobody's to report
        self._connack.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._closed: asyncio.Future[str] = self._loop.create_future()  # the reason, once lost
        self._subacks: dict[int, asyncio.Future[list[ReasonCode]]] = {}
        self._pubacks: dict[int, asyncio.Future[None]] = {}

    # -- life cycle --------------------------------------------------------------------------

    async def connect(self, timeout: float = CONNECT_TIMEOUT_S) -> None:  # noqa: ASYNC109
        """Connect and wait for the broker's CONNACK; `MqttError` when that fails."""
        clean_start: Any = self._clean if self._v5 else paho.MQTT_CLEAN_START_FIRST_ONLY
        self._client.connect_timeout = timeout  # the TCP (and TLS) connect, in the executor
        try:
            await self._loop.run_in_executor(
                None,
                lambda: self._client.connect(
                    self._host, self._port, self._keepalive,
                    clean_start=clean_start, properties=self._properties,
                ),
            )  # fmt: skip
            await asyncio.wait_for(asyncio.shield(self._connack), timeout)
        except (OSError, ValueError) as exc:
            self._teardown()
            raise MqttError(f"cannot connect to {self._host}:{self._port}: {exc}") from exc
        except TimeoutError as exc:
            self._teardown()
            raise MqttError(f"no answer from {self._host}:{self._port} within {timeout:.0f} s") from exc
        except MqttError:
            self._teardown()
            raise
        self._misc = self._loop.create_task(self._misc_loop(), name="mqtt-misc")

    async def subscribe(self, filters: list[str], qos: int = 1) -> None:
        """Subscribe and wait for the SUBACK; `MqttError` if the broker refuses any filter."""
        if self._v5:
            rc, mid = self._client.subscribe([(f, SubscribeOptions(qos=qos)) for f in filters])
        else:
            rc, mid = self._client.subscribe([(f, qos) for f in filters])
        if rc != MQTTErrorCode.MQTT_ERR_SUCCESS or mid is None:
            raise MqttError(f"subscribe failed: {paho.error_string(rc)}")
        done = self._subacks[mid] = self._loop.create_future()
        codes = await self._until(done)
        refused = [f for f, code in zip(filters, codes, strict=False) if code.is_failure]
        if refused:
            raise MqttError(f"the broker refused the subscription to {', '.join(refused)}")

    def publish(
        self, topic: str, payload: bytes, *, qos: int = 0, retain: bool = False
    ) -> asyncio.Future[None]:
        """Queue a message; the future completes once it is written (QoS 0) or acknowledged (QoS 1)."""
        done: asyncio.Future[None] = self._loop.create_future()
        if self._closed.done():
            done.set_exception(MqttError(f"not connected: {self._closed.result()}"))
            return done
        info = self._client.publish(topic, payload, qos=qos, retain=retain)
        if info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS and info.rc != MQTTErrorCode.MQTT_ERR_QUEUE_SIZE:
            done.set_exception(MqttError(f"publish failed: {paho.error_string(info.rc)}"))
        elif info.is_published():
            done.set_result(None)
        else:
            self._pubacks[info.mid] = done
        return done

    def ack(self, mid: int, qos: int) -> None:
        """Acknowledge a delivery (QoS 1: the PUBACK the broker waits for)."""
        if qos > 0 and not self._closed.done():
            self._client.ack(mid, qos)

    async def disconnect(self, timeout: float = 5.0) -> None:  # noqa: ASYNC109
        """Send DISCONNECT (after what is queued) and wait, within ``timeout``, for the close."""
        if not self._closed.done():
            self.resume_reading()
            self._client.disconnect()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._closed), timeout)
        self._teardown()

    def abort(self) -> None:
        """Drop the connection at once, without DISCONNECT (the broker publishes the will)."""
        self._teardown()

    async def wait_closed(self) -> str:
        """The reason, once the connection is lost (cancelling the wait leaves it alone)."""
        return await asyncio.shield(self._closed)

    @property
    def is_closed(self) -> bool:
        return self._closed.done()

    # -- reading -----------------------------------------------------------------------------

    def pause_reading(self) -> None:
        """Stop reading the socket (TCP flow control then holds the broker back)."""
        self._paused = True
        self._unwatch_read()

    def resume_reading(self) -> None:
        if not self._paused:
            return
        self._paused = False
        if self._sock is not None and not self._closed.done():
            self._watch_read()
            self._loop.call_soon(self.read_now)  # bytes TLS already decrypted wake no selector

    @property
    def paused(self) -> bool:
        return self._paused

    def read_now(self, packets: int = READ_PACKETS) -> None:
        """Read up to ``packets`` packets that are already in the socket, without waiting."""
        sock = self._sock
        if sock is None or self._paused:
            return
        pending = getattr(sock, "pending", None)  # TLS: bytes already decrypted
        for _ in range(packets):
            if self._paused or self._sock is not sock:
                return
            if not (pending is not None and pending()) and not select.select((sock,), (), (), 0)[0]:
                return
            if self._client.loop_read() != MQTTErrorCode.MQTT_ERR_SUCCESS:
                return

    def _on_readable(self) -> None:
        sock = self._sock
        if sock is None:
            return
        if self._client.loop_read() != MQTTErrorCode.MQTT_ERR_SUCCESS:
            return
        self.read_now(READ_PACKETS - 1)

    def _watch_read(self) -> None:
        if not self._reading and self._sock is not None:
            self._loop.add_reader(self._sock, self._on_readable)
            self._reading = True

    def _unwatch_read(self) -> None:
        if self._reading and self._sock is not None:
            self._loop.remove_reader(self._sock)
        self._reading = False

    async def _misc_loop(self) -> None:
        while self._client.loop_misc() == MQTTErrorCode.MQTT_ERR_SUCCESS:  # noqa: ASYNC110  (a timer)
            await asyncio.sleep(MISC_INTERVAL_S)

    async def _until(self, fut: asyncio.Future[Any]) -> Any:
        """``fut``'s result, or `MqttError` if the connection is lost first."""
        await asyncio.wait({fut, self._closed}, return_when=asyncio.FIRST_COMPLETED)
        if fut.done():
            return fut.result()
        raise MqttError(f"connection lost: {self._closed.result()}")

    def _teardown(self) -> None:
        if self._misc is not None:
            self._misc.cancel()
        self._unwatch_read()
        if self._sock is not None:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_writer(self._sock)
        self._sock = None
        sock = self._client.socket()  # still open when the connection was not closed by paho
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
        self._lost("closed")
        waiting: list[asyncio.Future[Any]] = [*self._pubacks.values(), *self._subacks.values()]
        for fut in waiting:
            if not fut.done():
                fut.set_exception(MqttError("connection closed"))
        self._pubacks.clear()
        self._subacks.clear()

    def _lost(self, reason: str, rc: int | None = None) -> None:
        if not self._closed.done():
            self._closed.set_result(reason)
        if not self._connack.done():
            self._connack.set_exception(MqttError(reason, rc))

    # -- paho's callbacks (on the loop thread, except socket ones during connect) -------------

    def _on_loop(self, fn: Callable[[], None]) -> None:
        if threading.get_ident() == self._loop_thread:
            fn()
        else:
            self._loop.call_soon_threadsafe(fn)

    def _on_socket_open(self, client: paho.Client, userdata: Any, sock: Any) -> None:
        for option in self._socket_options:
            with contextlib.suppress(OSError):
                sock.setsockopt(*option)

        def watch() -> None:
            if self._closed.done():  # given up while paho connected (a connect timed out)
                with contextlib.suppress(OSError):
                    sock.close()
                return
            self._sock = sock
            if not self._paused:
                self._watch_read()

        self._on_loop(watch)

    def _on_socket_close(self, client: paho.Client, userdata: Any, sock: Any) -> None:
        def unwatch() -> None:
            if self._sock is sock:
                self._unwatch_read()
                with contextlib.suppress(ValueError, OSError):
                    self._loop.remove_writer(sock)
                self._sock = None

        self._on_loop(unwatch)

    def _on_register_write(self, client: paho.Client, userdata: Any, sock: Any) -> None:
        if threading.get_ident() != self._loop_thread:  # the connect, in the executor
            self._loop.call_soon_threadsafe(self._watch_write, sock)
        elif self._writing:  # from loop_write itself: the socket would block
            self._watch_write(sock)
        elif not self._write_soon:  # a packet queued on the loop: write it on the next turn
            self._write_soon = True
            self._loop.call_soon(self._write, sock)

    def _watch_write(self, sock: Any) -> None:
        with contextlib.suppress(ValueError, OSError):  # closed meanwhile
            if sock.fileno() >= 0:
                self._loop.add_writer(sock, self._write, sock)

    def _write(self, sock: Any) -> None:
        self._write_soon = False
        if sock.fileno() < 0:
            return
        self._writing = True
        try:  # paho registers a writer again (above) if the socket would block, else unregisters it
            self._client.loop_write()
        finally:
            self._writing = False

    def _on_unregister_write(self, client: paho.Client, userdata: Any, sock: Any) -> None:
        def unwatch() -> None:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_writer(sock)

        self._on_loop(unwatch)

    def _on_connect(
        self, client: paho.Client, userdata: Any, flags: Any, reason: ReasonCode, props: Any
    ) -> None:
        if reason.is_failure:
            self._lost(f"the broker refused the connection: {reason}", reason.value)
        elif not self._connack.done():
            self._connack.set_result(None)

    def _on_disconnect(
        self, client: paho.Client, userdata: Any, flags: Any, reason: ReasonCode, props: Any
    ) -> None:
        # paho reports a close in any state: before the CONNACK it fails the attempt at once
        # (a broker that drops a CONNECT it does not accept), not after the connect timeout
        self._lost("connection closed before CONNACK" if not self._connack.done() else str(reason))

    def _on_subscribe(
        self, client: paho.Client, userdata: Any, mid: int, codes: list[ReasonCode], props: Any
    ) -> None:
        fut = self._subacks.pop(mid, None)
        if fut is not None and not fut.done():
            fut.set_result(codes)

    def _on_publish(
        self, client: paho.Client, userdata: Any, mid: int, reason: ReasonCode, props: Any
    ) -> None:
        fut = self._pubacks.pop(mid, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _on_message(self, client: paho.Client, userdata: Any, message: paho.MQTTMessage) -> None:
        try:
            self._deliver(message)
        except Exception:  # a delivery the caller cannot take must not break the connection
            log.exception("delivery callback failed topic=%r", message.topic[:160])


TCP_NODELAY = ((socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),)
