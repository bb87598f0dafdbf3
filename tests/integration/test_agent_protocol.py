"""The agent's MQTT version: v5 with Mosquitto, 3.1.1 with `denpexd serve`'s embedded broker, and
no time lost finding out. Measured from the agent's start (a real subprocess) to its "connected to
broker" log line; before the probe the fallback waited out the 3 s connect timeout at every start."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.agent_harness import agent_cmd, broker_up, start_agent, stop, unique_job
from tests.integration.replay import Daemon

pytestmark = [pytest.mark.integration]

CONNECTED_WITHIN_S = 1.5  # interpreter start and rule loading included (~0.5 s)


def _text(log: Path) -> str:
    return log.read_text(errors="replace") if log.exists() else ""


async def _time_to(log: Path, pattern: str, t0: float, within: float = 15.0) -> tuple[float, str]:
    """Seconds from ``t0`` until a line matching ``pattern`` is in ``log``, and that line."""
    rx = re.compile(pattern)
    deadline = t0 + within
    while time.monotonic() < deadline:
        for line in (await asyncio.to_thread(_text, log)).splitlines():
            if rx.search(line):
                return time.monotonic() - t0, line
        await asyncio.sleep(0.01)
    raise AssertionError(f"no {pattern!r} within {within} s:\n{_text(log)[-3000:]}")


def _logs(tmp_path: Path) -> list[str]:
    (tmp_path / "logs").mkdir(exist_ok=True)
    (tmp_path / "logs" / "rank0.log").write_text("2026-11-29 12:00:00,000 INFO [rank0] step 1 | loss 2.0\n")
    return [str(tmp_path / "logs" / "*.log")]


@pytest.mark.asyncio
async def test_embedded_broker_connects_at_once_with_3_1_1(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path / "data")
    await daemon.start()
    try:
        for attempt in range(2):  # a first start and a restart: neither waits
            log = tmp_path / f"agent-{attempt}.log"
            cmd = agent_cmd(
                unique_job("proto"), "n1", _logs(tmp_path), tmp_path / "state", port=daemon.mqtt_port
            )
            t0 = time.monotonic()
            proc = start_agent(cmd, log)
            try:
                elapsed, line = await _time_to(log, r"connected to broker", t0)
            finally:
                stop(proc)
            print(f"embedded broker: connected {elapsed:.2f} s after start: {line}")
            assert "protocol=V311" in line
            assert elapsed < CONNECTED_WITHIN_S, _text(log)
            assert "timed out" not in _text(log)
    finally:
        await daemon.stop()


@pytest.mark.asyncio
async def test_mosquitto_keeps_v5(tmp_path: Path) -> None:
    if not broker_up():
        pytest.skip("Mosquitto on 127.0.0.1:1883 is needed")
    log = tmp_path / "agent.log"
    t0 = time.monotonic()
    proc = start_agent(agent_cmd(unique_job("proto"), "n1", _logs(tmp_path), tmp_path / "state"), log)
    try:
        elapsed, line = await _time_to(log, r"connected to broker", t0)
    finally:
        stop(proc)
    print(f"mosquitto: connected {elapsed:.2f} s after start: {line}")
    assert "protocol=V5" in line and elapsed < CONNECTED_WITHIN_S
    assert "connect failed" not in _text(log)


@contextlib.contextmanager
def _closing_server() -> Iterator[int]:
    """Reads each connection's first packet, then closes it without a word (as some brokers
    treat a CONNECT of a version they do not speak)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.1)
    stop_event = threading.Event()

    def serve() -> None:
        while not stop_event.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(2)
                with contextlib.suppress(OSError):
                    conn.recv(4096)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield int(srv.getsockname()[1])
    finally:
        stop_event.set()
        thread.join()
        srv.close()


@pytest.mark.asyncio
async def test_a_closed_connection_is_a_failed_attempt_at_once(tmp_path: Path) -> None:
    """v5 then 3.1.1 are both tried within a moment, not one connect timeout (3 s) each."""
    with _closing_server() as port:
        log = tmp_path / "agent.log"
        cmd = agent_cmd(unique_job("proto"), "n1", _logs(tmp_path), tmp_path / "state", port=port)
        t0 = time.monotonic()
        proc = start_agent(cmd, log)
        try:
            first, _ = await _time_to(log, r"connect failed.*tried=V5 ", t0)
            second, line = await _time_to(log, r"connect failed.*tried=V311 ", t0)
        finally:
            stop(proc)
    assert "closed before CONNACK" in line
    assert second < CONNECTED_WITHIN_S, (first, second, _text(log))
