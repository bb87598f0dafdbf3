"""The embedded MQTT broker (amqtt, in-process) used when no `--broker` is configured.

amqtt speaks MQTT 3.1.1: clients of the embedded broker (the daemon's own ingest included)
connect with protocol 3.1.1; an external broker is used with MQTT v5.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import secrets
import socket
from collections.abc import Callable
from types import TracebackType
from typing import Any, Self

from amqtt.broker import Broker

from denpex_agent.errors import divert_loop_errors
from denpexd import brokeraccess
from denpexd.config import split_listen
from denpexd.errors import BrokerError
from denpexd.podidentity import PodTokens

log = logging.getLogger(__name__)


def _port_free(host: str, port: int) -> str | None:
    """None when host:port can be bound, else the reason (checked first: amqtt logs a traceback)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "address already in use"
            return exc.strerror or str(exc)
    return None


def _raised_in_amqtt(exc: BaseException) -> bool:
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    return last is not None and f"{os.sep}amqtt{os.sep}" in last


# what amqtt logs (at ERROR, with a traceback) when a message it sends to a client fails
SKIPPED_DELIVERY = "Task failed and will be skipped"


class _SkippedDeliveries(logging.Filter):
    """amqtt sends each message to each subscriber in a task of its own and logs a task that
    failed with its traceback at ERROR. The failure is the subscriber's connection closing as the
    message went out (a client killed mid-delivery; with uvloop the write to the closed transport
    raises): that message does not reach that client, and nothing else is affected. Said as one
    plain warning and counted instead; any other amqtt record passes unchanged."""

    def __init__(self, on_failure: Callable[[], None] | None) -> None:
        super().__init__()
        self._on_failure = on_failure

    def filter(self, record: logging.LogRecord) -> bool:
        if not (isinstance(record.msg, str) and record.msg.startswith(SKIPPED_DELIVERY)):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        gone = isinstance(exc, OSError) or (isinstance(exc, RuntimeError) and "closed" in str(exc))
        if not gone:
            return True  # not a connection that went away: amqtt's own words, as they are
        if self._on_failure is not None:
            self._on_failure()
        log.warning(
            "embedded broker: a message to a client whose connection had just closed was not "
            "delivered (agents send again what the daemon has not receipted) error=%s: %s",
            type(exc).__name__,
            exc,
        )
        return False


class EmbeddedBroker:
    """`async with EmbeddedBroker("127.0.0.1:1883"):` runs a broker until the block exits."""

    def __init__(
        self,
        listen: str,
        on_client_failure: Callable[[], None] | None = None,
        on_delivery_failure: Callable[[], None] | None = None,
        secret: str | None = None,
        shared_password: str | None = None,
        intake: brokeraccess.Intake | None = None,
        tokens: PodTokens | None = None,
    ) -> None:
        self.listen = listen
        self.host, self.port = split_listen(listen)
        self._broker: Any = None
        self._on_client_failure = on_client_failure
        self._skipped = _SkippedDeliveries(on_delivery_failure)
        self.secret = secret
        self.shared_password = shared_password
        self.intake = intake
        self.tokens = tokens
        # the daemon's own ingest connects as `denpexd` with this (brokeraccess)
        self.daemon_password = secrets.token_hex(24)

    async def __aenter__(self) -> Self:
        reason = _port_free(self.host, self.port)
        if reason is not None:
            raise BrokerError(
                self.listen,
                f"cannot listen ({reason}); choose another address with --mqtt-listen HOST:PORT, "
                "or use the broker already running there with --broker mqtt://HOST:PORT",
            )
        for name in ("amqtt", "transitions"):
            logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger(name).level))
        logging.getLogger("amqtt.broker").addFilter(self._skipped)
        access = {
            "secret": self.secret,
            "daemon_password": self.daemon_password,
            "shared_password": self.shared_password,
            "intake": self.intake,
            "tokens": self.tokens,
        }
        config = {
            "listeners": {"default": {"type": "tcp", "bind": f"{self.host}:{self.port}"}},
            "plugins": {
                f"{brokeraccess.__name__}.Authenticate": access,
                f"{brokeraccess.__name__}.Authorize": access,
            },
        }
        broker = Broker(config)
        self._watch_client_failures()
        try:
            await broker.start()
        except Exception as exc:  # amqtt raises its own BrokerError wrapping OSError
            raise BrokerError(self.listen, f"embedded broker failed to start: {exc}") from exc
        self._broker = broker
        access_modes = [
            name
            for name, on in (
                ("per-agent credentials", self.secret),
                ("pod service-account tokens", self.tokens),
                ("one password for all agents", self.shared_password),
            )
            if on
        ]
        log.info(
            "embedded MQTT broker listening address=%s protocol=3.1.1 access=%s",
            self.listen,
            ", ".join(access_modes) or "local development (anyone on loopback)",
        )
        return self

    def _watch_client_failures(self) -> None:
        """amqtt handles each client connection in a task of its own; when one fails inside
        amqtt (0.12 iterates its subscriptions while sending retained messages to a connecting
        client, and another client's subscribe in between ends that with RuntimeError), asyncio
        reports it as an unhandled error. Only that client's connection is lost and it connects
        again; say so plainly and count it (denpex_broker_client_failures_total)."""

        def client_failure(context: dict[str, Any]) -> bool:
            exc = context.get("exception")
            if exc is None or not _raised_in_amqtt(exc):
                return False
            if self._on_client_failure is not None:
                self._on_client_failure()
            log.warning(
                "embedded broker: a client's connection failed inside the broker; the client "
                "connects again error=%s: %s",
                type(exc).__name__,
                exc,
            )
            return True

        divert_loop_errors(asyncio.get_running_loop(), client_failure)

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._broker is not None:
            try:
                await self._broker.shutdown()
            except Exception as exc:  # shutting down anyway; say so and carry on
                log.warning("embedded broker shutdown failed error=%s", exc)
            self._broker = None
        logging.getLogger("amqtt.broker").removeFilter(self._skipped)
