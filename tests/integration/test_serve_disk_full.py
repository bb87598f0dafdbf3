"""The disk under the store fills up (a real tmpfs of a few MB): `denpexd serve` says so, naming
the data dir, stops acknowledging (the external broker keeps the messages), stays alive and
answers; when space returns it writes everything it was sent: nothing lost."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiomqtt
import orjson
import pytest

from tests.integration.agent_harness import broker_up
from tests.integration.replay import Daemon, forget_session

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not broker_up(), reason="no MQTT broker on 127.0.0.1:1883 (.ci/run starts one)"),
]

EVENTS = 400


@contextlib.contextmanager
def _tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    if done.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs (the test needs root): {done.stderr.decode()[:200]}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(disk: Path) -> Path:
    """Take every free byte of ``disk`` with one file."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        block = b"\0" * 4096
        while True:
            try:
                os.write(fd, block)
            except OSError:
                break
    finally:
        os.close(fd)
    return filler


def _event(i: int) -> dict[str, Any]:
    return {
        "id": f"e{i}", "kind": "match", "rank": i % 8, "local_rank": None, "file": "/l/rank.log", "offset": i,
        "line_no": i + 1, "ts": time.time(), "ts_source": "line", "rule": "gloo-connection-closed",
        "severity": "error", "role": "collateral", "category": "communication",
        "text": f"Connection closed by peer [127.0.0.1]:{i} " + "x" * 2000, "context": [], "fields": {},
    }  # fmt: skip


def _gauge(metrics: str, name: str) -> float:
    m = re.search(rf"^{name} ([0-9.e+]+)$", metrics, re.M)
    return float(m.group(1)) if m else -1.0


@pytest.mark.asyncio
async def test_a_full_disk_is_said_waited_out_and_nothing_is_lost(tmp_path: Path) -> None:
    client_id = f"denpexd-full-{uuid.uuid4().hex[:6]}"
    job = f"full-{uuid.uuid4().hex[:6]}"
    with _tmpfs(tmp_path / "disk", "3m") as disk:
        daemon = Daemon(disk / "data", "--client-id", client_id, broker="mqtt://127.0.0.1:1883")
        daemon.log = tmp_path / "denpexd.log"  # outside the full disk
        await daemon.start()
        try:
            filler = _fill(disk)
            async with aiomqtt.Client("127.0.0.1", 1883, identifier=f"pub-{job}") as pub:
                for i in range(0, EVENTS, 20):
                    events = [_event(j) for j in range(i, i + 20)]
                    doc = {
                        "v": 1,
                        "agent": "a1",
                        "job": job,
                        "node": "n1",
                        "seq": i,
                        "sent_at": time.time(),
                        "events": events,
                    }
                    await pub.publish(f"denpex/v1/jobs/{job}/events", orjson.dumps(doc), qos=1)
            deadline = time.monotonic() + 20
            metrics = ""
            while time.monotonic() < deadline:
                _, metrics = await daemon.get("/metrics")
                if _gauge(metrics, "denpex_store_full") == 1.0:
                    break
                await asyncio.sleep(0.2)
            assert _gauge(metrics, "denpex_store_full") == 1.0, "the full disk is not reported"
            text = daemon.log.read_text()
            assert "the disk is full" in text and str(disk / "data") in text
            status, _ = await daemon.get("/-/healthy")
            assert status == 200 and daemon.proc is not None and daemon.proc.returncode is None
            os.unlink(filler)  # room again
            stored = 0
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                status, doc = await daemon.get(f"/api/v1/jobs/{job}/events?limit=10000")
                stored = len(doc["events"]) if status == 200 else 0
                if stored == EVENTS:
                    break
                await asyncio.sleep(0.3)
            assert stored == EVENTS, f"{stored} of {EVENTS} events stored after the disk had room again"
            _, metrics = await daemon.get("/metrics")
            assert _gauge(metrics, "denpex_store_full") == 0.0
            print(
                f"disk full: written {EVENTS}, stored {stored}, lost {EVENTS - stored}; the daemon "
                f"said so naming {disk / 'data'}, stayed up and resumed when the disk had room"
            )
        finally:
            assert await daemon.stop() == 0
            await forget_session(client_id)
