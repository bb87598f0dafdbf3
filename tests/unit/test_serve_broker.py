"""The embedded broker's own failures while it sets up a client connection are counted and said
plainly (the client reconnects); every other unhandled error still reaches asyncio's handler."""

from __future__ import annotations

import asyncio
import socket

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
