"""The embedded broker's own failures while it sets up a client connection, and its deliveries to
a client whose connection closed under them, are counted and said plainly (the client
reconnects); every other unhandled error and amqtt record still reaches its handler unchanged."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any

import pytest

from denpexd.broker import EmbeddedBroker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _raised_in(filename: str) -> BaseException:
    try:
        exec(compile("raise RuntimeError('dictionary changed size during iteration')", filename, "exec"))
    except RuntimeError as exc:
        return exc
    raise AssertionError("not raised")


@pytest.mark.asyncio
async def test_a_client_setup_failure_inside_the_broker_is_counted(caplog: pytest.LogCaptureFixture) -> None:
    failures: list[int] = []
    async with EmbeddedBroker(f"127.0.0.1:{_free_port()}", on_client_failure=lambda: failures.append(1)):
        loop = asyncio.get_running_loop()
        handler = loop.get_exception_handler()
        assert handler is not None
        handler(loop, {"message": "Unhandled exception in client_connected_cb",
                       "exception": _raised_in("/x/site-packages/amqtt/broker.py")})  # fmt: skip
        assert failures == [1]
        assert "embedded broker: a client's connection failed inside the broker" in caplog.text
        caplog.clear()
        handler(loop, {"message": "something else", "exception": _raised_in("/x/denpexd/jobs.py")})
        assert failures == [1]
        assert "something else" in caplog.text  # asyncio's own report, unchanged


async def _write_to_a_closed_connection() -> BaseException:
    """What a write to a client's connection that has closed raises (under uvloop: RuntimeError
    'unable to perform operation on <TCPTransport closed=True ...>; the handler is closed')."""
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.close()
    await writer.wait_closed()
    server.close()
    try:
        for _ in range(3):
            writer.write(b"\x30\x00")
            await writer.drain()
            await asyncio.sleep(0.01)
    except (RuntimeError, OSError) as exc:
        return exc
    raise AssertionError("the write to a closed connection did not fail")


def _uvloop_run(coro: Any) -> Any:
    uvloop = pytest.importorskip("uvloop")
    return uvloop.run(coro)


@pytest.mark.asyncio
@pytest.mark.parametrize("run", [asyncio.run, _uvloop_run], ids=["asyncio", "uvloop"])
async def test_a_delivery_to_a_client_gone_mid_send_is_one_counted_warning(
    caplog: pytest.LogCaptureFixture, run: Callable[[Any], BaseException]
) -> None:
    """amqtt logs a failed delivery task at ERROR with its traceback; when the failure is the
    subscriber's connection closing under it (a killed agent), the daemon says so in one warning
    and counts it. amqtt's other records keep their level, and the filter goes with the broker.
    The failure is the one each event loop really raises (in a thread of its own)."""
    exc = await asyncio.to_thread(run, _write_to_a_closed_connection())
    amqtt_log = logging.getLogger("amqtt.broker")
    failed: list[int] = []
    async with EmbeddedBroker(f"127.0.0.1:{_free_port()}", on_delivery_failure=lambda: failed.append(1)):
        caplog.clear()
        try:
            raise exc
        except type(exc):
            amqtt_log.exception("Task failed and will be skipped: <Task finished name='Task-1'>")
        assert failed == [1]
        records = [(r.name, r.levelname) for r in caplog.records]
        assert ("amqtt.broker", "ERROR") not in records, caplog.text
        assert ("denpexd.broker", "WARNING") in records
        assert "client whose connection had just closed was not delivered" in caplog.text
        caplog.clear()
        try:
            raise ValueError("a bug of amqtt's own")
        except ValueError:
            amqtt_log.exception("Task failed and will be skipped: <Task finished name='Task-2'>")
        assert failed == [1]
        assert [(r.name, r.levelname) for r in caplog.records] == [("amqtt.broker", "ERROR")]
    caplog.clear()
    try:
        raise exc
    except type(exc):
        amqtt_log.exception("Task failed and will be skipped: <Task finished name='Task-3'>")
    assert failed == [1] and ("amqtt.broker", "ERROR") in [(r.name, r.levelname) for r in caplog.records]
