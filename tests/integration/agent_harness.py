"""Helpers for agent tests: a real subscriber on a real broker, the agent as a real subprocess,
a private Mosquitto that a test may restart."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiomqtt

from denpex_agent import wire

BROKER_HOST = "127.0.0.1"
BROKER_PORT = 1883


def unique_job(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def broker_up(port: int = BROKER_PORT) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((BROKER_HOST, port)) == 0


@dataclass
class Received:
    batches: list[wire.Batch] = field(default_factory=list)
    statuses: list[tuple[str, str, str]] = field(default_factory=list)
    clock_requests: int = 0
    invalid: int = 0

    def events(self, kind: str | None = None) -> list[Any]:
        return [e for b in self.batches for e in b.events if kind is None or e.kind == kind]


@contextlib.asynccontextmanager
async def collector(job: str, port: int = BROKER_PORT, session: str | None = None) -> AsyncIterator[Received]:
    """Subscribe to everything under the job; with ``session`` a persistent session survives
    broker restarts (and the subscriber reconnects by itself)."""
    got = Received()
    ready = asyncio.Event()

    async def run() -> None:
        while True:
            try:
                async with aiomqtt.Client(
                    BROKER_HOST,
                    port,
                    identifier=session or f"collector-{uuid.uuid4().hex[:8]}",
                    clean_session=not session,
                    protocol=aiomqtt.ProtocolVersion.V311,
                ) as client:
                    await client.subscribe(f"denpex/v1/jobs/{job}/#", qos=1)
                    ready.set()
                    async for msg in client.messages:
                        payload = msg.payload if isinstance(msg.payload, bytes) else b""
                        try:
                            kind = wire.parse_topic(str(msg.topic)).kind
                        except wire.WireError:
                            continue  # e.g. a correlator's retained diagnosis under the job
                        try:
                            if kind == "events":
                                got.batches.append(wire.decode_batch(payload, job))
                            elif kind == "status":
                                got.statuses.append(wire.decode_status(payload))
                            else:
                                got.clock_requests += 1
                        except wire.WireError:
                            got.invalid += 1
            except aiomqtt.MqttError:
                if session is None and not ready.is_set():
                    raise
                await asyncio.sleep(0.2)

    task = asyncio.create_task(run(), name="collector")
    await asyncio.wait_for(ready.wait(), 10)
    try:
        yield got
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, aiomqtt.MqttError):
            await task


async def eventually(predicate: Any, within: float = 15.0, step: float = 0.05) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(step)
    raise AssertionError(f"condition not met within {within} s")


def agent_cmd(
    job: str, node: str, logs: list[str], state: Path, *extra: str, port: int = BROKER_PORT
) -> list[str]:
    cmd = [
        sys.executable,
        "-c",
        "from denpex_agent.cli import main; raise SystemExit(main())",
        "--job",
        job,
        "--node",
        node,
        "--broker",
        f"mqtt://{BROKER_HOST}:{port}",
        "--state-dir",
        str(state),
        "--heartbeat-interval",
        "1",
    ]
    for pattern in logs:
        cmd += ["--logs", pattern]
    return cmd + list(extra)


def start_agent(cmd: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DENPEX_")}
    with log_path.open("ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    return proc.wait(timeout=timeout)


class PrivateBroker:
    """A Mosquitto of the test's own, with persistence, that the test may restart."""

    def __init__(self, workdir: Path) -> None:
        exe = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        self.exe = exe
        self.port = free_port()
        self.dir = workdir
        self.conf = workdir / "mosquitto.conf"
        self.conf.write_text(
            # as root, mosquitto would switch to its own user and could not write the test's folder
            f"{'user root' + chr(10) if os.geteuid() == 0 else ''}"
            f"listener {self.port} 127.0.0.1\nallow_anonymous true\npersistence true\n"
            f"persistence_location {workdir}/\nautosave_interval 1\nmax_queued_messages 0\n"
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.exe, "-c", str(self.conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 10
        while not broker_up(self.port):
            if time.monotonic() > deadline:
                raise RuntimeError("private mosquitto did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None
