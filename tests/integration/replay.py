"""Test helpers for the live path: a replay publisher and a `denpexd serve` subprocess.

`load_case` reads a recorded job with the agent's own reader and matcher; `replay` publishes its
events as real wire batches (`wire.encode_batch`) with aiomqtt, one agent id per node, at the
job's original pace divided by `speed` (per-node clock skew from expected.json removed, as if the
lines were being written now).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import aiomqtt
from aiohttp import web

from denpex_agent import wire
from denpex_agent.events import Event
from denpex_agent.matcher import Matcher
from denpex_agent.reader import ReadReport, discover, read_files
from denpex_agent.rules import RuleSet

JOBS = Path(__file__).resolve().parents[1] / "fixtures" / "jobs"
MOSQUITTO = ("127.0.0.1", 1883)
BATCH_WINDOW_S = 0.05
MAX_BATCH_BYTES = 200_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def load_case(case: str, job: str, rules: RuleSet, root: Path = JOBS) -> list[Event]:
    """The case's events in true-time order (ts minus the node's recorded skew; file order on ties)."""
    report = ReadReport()
    files = discover([str(root / case)], None, report)
    events = list(read_files(files, Matcher(rules), job, report))
    skew = json.loads((root / case / "expected.json").read_text()).get("skew_s", {})
    last: dict[str, float] = {}
    keyed = []
    for i, ev in enumerate(events):
        t = ev.ts - skew.get(ev.node, 0.0) if ev.ts is not None else last.get(ev.file, 0.0)
        last[ev.file] = t
        keyed.append((t, i, ev))
    keyed.sort(key=lambda k: (k[0], k[1]))
    return [ev for _, _, ev in keyed]


def true_time(ev: Event, skew: dict[str, float]) -> float | None:
    return ev.ts - skew.get(ev.node, 0.0) if ev.ts is not None else None


async def replay(
    events: Sequence[Event],
    job: str,
    *,
    host: str = MOSQUITTO[0],
    port: int = MOSQUITTO[1],
    speed: float = 20.0,
    v5: bool = True,
    seq0: int = 0,
) -> int:
    """Publish `events` as batches (QoS 1) from one client per node; returns the batches sent."""
    nodes = sorted({e.node for e in events})
    proto = aiomqtt.ProtocolVersion.V5 if v5 else aiomqtt.ProtocolVersion.V311
    sent = 0
    async with contextlib.AsyncExitStack() as stack:
        clients = {
            n: await stack.enter_async_context(
                aiomqtt.Client(host, port, identifier=f"replay-{job}-{n}"[:64], protocol=proto)
            )
            for n in nodes
        }
        buf: dict[str, list[Event]] = {n: [] for n in nodes}
        seq = seq0

        async def flush() -> None:
            nonlocal seq, sent
            for node, evs in buf.items():
                while evs:
                    chunk, size = [], 0
                    while evs and size < MAX_BATCH_BYTES:
                        e = evs.pop(0)
                        chunk.append(e)
                        size += len(e.text) + sum(len(c) for c in e.context) + 300
                    seq += 1
                    payload = wire.encode_batch(f"{node}-agent", job, node, seq, time.time(), chunk)
                    await clients[node].publish(wire.events_topic(job), payload, qos=1)
                    sent += 1

        start_wall = time.monotonic()
        t0 = next((e.ts for e in events if e.ts is not None), 0.0)
        last_flush = start_wall
        for ev in events:
            if ev.ts is not None:
                due = start_wall + max(0.0, (ev.ts - t0) / speed)
                delay = due - time.monotonic()
                if delay > 0:
                    await flush()
                    await asyncio.sleep(delay)
                    last_flush = time.monotonic()
            buf[ev.node].append(ev)
            if time.monotonic() - last_flush >= BATCH_WINDOW_S:
                await flush()
                last_flush = time.monotonic()
        await flush()
    return sent


@dataclass
class AlertReceiver:
    """An HTTP server on 127.0.0.1 that accepts Alertmanager v2 `POST /api/v2/alerts`."""

    alerts: list[dict[str, Any]] = field(default_factory=list)
    port: int = 0

    def firing(self, job: str) -> list[dict[str, Any]]:
        """Alerts of ``job`` firing now: the latest message per labelset, without endsAt."""
        latest: dict[str, dict[str, Any]] = {}
        for a in self.alerts:
            if a["labels"]["job"] == job:
                latest[json.dumps(a["labels"], sort_keys=True)] = a
        return [a for a in latest.values() if "endsAt" not in a]

    @contextlib.asynccontextmanager
    async def serve(self) -> AsyncIterator[AlertReceiver]:
        async def post(request: web.Request) -> web.Response:
            self.alerts.extend(await request.json())
            return web.json_response({})

        async def ready(request: web.Request) -> web.Response:
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_post("/api/v2/alerts", post)
        app.router.add_get("/-/ready", ready)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        self.port = free_port()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        try:
            yield self
        finally:
            await runner.cleanup()


class Daemon:
    """`denpexd serve` as a real subprocess on free ports."""

    def __init__(self, data_dir: Path, *extra: str, broker: str | None = None) -> None:
        self.data_dir = data_dir
        self.http_port = free_port()
        self.mqtt_port = free_port() if broker is None else MOSQUITTO[1]
        self.extra = extra
        self.broker = broker
        self.proc: asyncio.subprocess.Process | None = None
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.log = data_dir / "denpexd.log"

    async def start(self, timeout_s: float = 20.0) -> None:
        args = ["--http-listen", f"127.0.0.1:{self.http_port}", "--data-dir", str(self.data_dir)]
        if self.broker is None:
            args += ["--mqtt-listen", f"127.0.0.1:{self.mqtt_port}"]
        else:
            args += ["--broker", self.broker]
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("DENPEX_")}
        with open(self.log, "ab") as log:  # noqa: ASYNC230 - a local log file, opened once
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "denpexd", "serve", *args, *self.extra,
                stdout=log, stderr=log, env=env,
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if self.proc.returncode is not None:
                    raise RuntimeError(
                        f"denpexd exited {self.proc.returncode}: {self.log.read_text()[-2000:]}"
                    )
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(f"{self.url}/-/ready") as resp:
                        if resp.status == 200:
                            return
                await asyncio.sleep(0.1)
        raise RuntimeError(f"denpexd not ready: {self.log.read_text()[-2000:]}")

    async def get(self, path: str, token: str | None = None) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with aiohttp.ClientSession() as session, session.get(self.url + path, headers=headers) as resp:
            body = await resp.read()
            ctype = resp.headers.get("Content-Type", "")
            return resp.status, (json.loads(body) if "json" in ctype else body.decode())

    async def wait_events(
        self, job: str, count: int, timeout_s: float = 20.0, token: str | None = None
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        doc: Any = None
        while time.monotonic() < deadline:
            status, doc = await self.get(f"/api/v1/jobs/{job}", token)
            if status == 200 and doc["stats"]["events"] >= count:
                return dict(doc)
            await asyncio.sleep(0.2)
        raise AssertionError(f"job {job} did not reach {count} events: {doc}")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)

    async def stop(self, timeout_s: float = 15.0) -> int:
        if self.proc is None or self.proc.returncode is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(timeout_s):
                return await self.proc.wait()
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
            raise

    async def wait(self) -> int:
        assert self.proc is not None
        return await self.proc.wait()


async def query_json(url: str, job: str) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "denpexd", "query", "--job", job, "--json", "--server", url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    return dict(json.loads(out))


async def forget_session(client_id: str) -> None:
    """Delete a persistent session on Mosquitto (clean start, expiry 0)."""
    async with aiomqtt.Client(
        *MOSQUITTO, identifier=client_id, protocol=aiomqtt.ProtocolVersion.V5, clean_start=True
    ):
        pass
