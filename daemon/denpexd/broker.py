"""The embedded MQTT broker (amqtt, in-process) used when no `--broker` is configured.

amqtt speaks MQTT 3.1.1: clients of the embedded broker (the daemon's own ingest included)
connect with protocol 3.1.1; an external broker is used with MQTT v5.
"""

from __future__ import annotations

import errno
import logging
import socket
from types import TracebackType
from typing import Any, Self

from amqtt.broker import Broker

from denpexd.config import split_listen
from denpexd.errors import BrokerError

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


class EmbeddedBroker:
    """`async with EmbeddedBroker("127.0.0.1:1883"):` runs a broker until the block exits."""

    def __init__(self, listen: str) -> None:
        self.listen = listen
        self.host, self.port = split_listen(listen)
        self._broker: Any = None

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
        config = {
            "listeners": {"default": {"type": "tcp", "bind": f"{self.host}:{self.port}"}},
            "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
        }
        broker = Broker(config)
        try:
            await broker.start()
        except Exception as exc:  # amqtt raises its own BrokerError wrapping OSError
            raise BrokerError(self.listen, f"embedded broker failed to start: {exc}") from exc
        self._broker = broker
        log.info("embedded MQTT broker listening address=%s protocol=3.1.1", self.listen)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._broker is not None:
            try:
                await self._broker.shutdown()
            except Exception as exc:  # shutting down anyway; say so and carry on
                log.warning("embedded broker shutdown failed error=%s", exc)
            self._broker = None
