"""kill -9 while agents stream: nothing an agent read is lost, in either broker mode.

* The daemon with its embedded broker is killed and restarted again and again. The broker dies
  with it, after having acknowledged batches the daemon had not stored yet; the agents learn it
  from the missing receipts and send those batches again.
* Mosquitto, with the persistence settings of deploy/broker/mosquitto.conf, is killed and
  restarted again and again under the daemon and the agents. It forgets what it acknowledged
  since its last save (and, if never saved, the daemon's session); again the receipts bring
  every batch in.

Real `denpexd serve`, real `denpex-agent` processes, a real Mosquitto, real files. The figures
(written, stored, lost, sent again, kills) are printed; the store is read directly at the end.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import sqlite3
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.integration.agent_harness import PrivateBroker, agent_cmd, start_agent, stop
from tests.integration.replay import Daemon

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        shutil.which("mosquitto") is None and not os.path.exists("/usr/sbin/mosquitto"),
        reason="mosquitto not installed (.ci/run installs it)",
    ),
]

SHIPPED_CONF = Path(__file__).resolve().parents[2] / "deploy" / "broker" / "mosquitto.conf"
NODES = 2
RANKS_PER_NODE = 2
KILLS = 4
KILL_EVERY_S = 3.0
MARKER = re.compile(r"marker=(\S+)")


class Writer:
    """Appends numbered failure lines (each one an event) and progress lines to every rank file."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.written: set[str] = set()
        self.stop = threading.Event()

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            for node in range(NODES):
                for local in range(RANKS_PER_NODE):
                    rank = node * RANKS_PER_NODE + local
                    lines = []
                    for _ in range(4):
                        n += 1
                        if n % 4 == 0:
                            marker = f"{rank}-{n}"
                            self.written.add(marker)
                            lines.append(
                                f"[rank{rank}]: RuntimeError: CUDA error: an illegal memory access was "
                                f"encountered marker={marker}\n"
                            )
                        else:
                            lines.append(f"2026-11-29 12:00:00,000 INFO [rank{rank}] step {n} | loss 2.0\n")
                    with (self.root / f"n{node}" / f"rank{rank}.log").open("a") as fh:
                        fh.write("".join(lines))
            time.sleep(0.02)


def _stored(data_dir: Path, job: str) -> set[str]:
    db = sqlite3.connect(data_dir / "denpex.sqlite")
    try:
        rows = db.execute("SELECT doc FROM events WHERE job = ? AND kind = 'match'", (job,)).fetchall()
    finally:
        db.close()
    out = set()
    for (doc,) in rows:
        m = MARKER.search(orjson.loads(doc).get("text", ""))
        if m:
            out.add(m.group(1))
    return out


async def _stream_with_kills(
    tmp_path: Path, daemon: Daemon, port: int, kill: object, extra: list[str]
) -> str:
    job = f"kill9-{uuid.uuid4().hex[:8]}"
    logs = tmp_path / "logs"
    for node in range(NODES):
        (logs / f"n{node}").mkdir(parents=True)
    writer = Writer(logs)
    procs = []
    for node in range(NODES):
        cmd = agent_cmd(
            job, f"n{node}", [str(logs / f"n{node}" / "*.log")], tmp_path / f"state-{node}",
            "--receipt-timeout", "2", "--checkpoint-interval", "0.3", *extra, port=port,
        )  # fmt: skip
        procs.append(start_agent(cmd, tmp_path / f"agent-{node}.log"))
    thread = threading.Thread(target=writer.run, daemon=True)
    kills = 0
    try:
        thread.start()
        for _ in range(KILLS):
            await asyncio.sleep(KILL_EVERY_S)
            await kill()  # type: ignore[operator]
            kills += 1
        await asyncio.sleep(KILL_EVERY_S)
        writer.stop.set()
        thread.join()
        # every marker written reaches the store (the agents re-send what was never confirmed)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            await asyncio.sleep(1.0)
            if writer.written <= await asyncio.to_thread(_stored, daemon.data_dir, job):
                break
    finally:
        writer.stop.set()
        codes = [stop(proc) for proc in procs]
    for node, code in enumerate(codes):  # the agents lived through it all and stopped cleanly
        assert code == 0, (tmp_path / f"agent-{node}.log").read_text(errors="replace")[-3000:]
    stored = await asyncio.to_thread(_stored, daemon.data_dir, job)
    resent = 0
    for node in range(NODES):
        text = (tmp_path / f"agent-{node}.log").read_text(errors="replace")
        resent += len(re.findall(r"sending batches again batches=(\d+)", text))
    lost = writer.written - stored
    summary = (
        f"written {len(writer.written)}, stored {len(stored & writer.written)}, lost {len(lost)}, "
        f"re-sends logged {resent}, kills {kills}"
    )
    print(summary)
    assert not lost, f"{summary}; e.g. {sorted(lost)[:5]}"
    return summary


def _killer(daemon: Daemon) -> Any:
    async def kill_daemon() -> None:
        daemon.kill()
        await daemon.wait()
        await asyncio.sleep(0.3)
        await daemon.start()

    return kill_daemon


def _private_broker(tmp_path: Path, shipped_persistence: bool) -> PrivateBroker:
    (tmp_path / "broker").mkdir()
    broker = PrivateBroker(tmp_path / "broker")
    if shipped_persistence:
        shipped = [
            line
            for line in SHIPPED_CONF.read_text().splitlines()
            if line.startswith(("persistence ", "autosave_interval", "autosave_on_changes"))
        ]
        assert shipped, "deploy/broker/mosquitto.conf has no persistence lines"
        conf = [
            line
            for line in broker.conf.read_text().splitlines()
            if not line.startswith(("persistence ", "autosave"))
        ]
        broker.conf.write_text("\n".join(conf + shipped) + "\n")
    broker.start()
    return broker


def _external_daemon(tmp_path: Path, broker: PrivateBroker) -> Daemon:
    client_id = f"denpexd-kill9-{uuid.uuid4().hex[:8]}"
    return Daemon(tmp_path / "data", "--client-id", client_id, broker=f"mqtt://127.0.0.1:{broker.port}")


@pytest.mark.asyncio
async def test_daemon_kill9_with_the_embedded_broker_loses_nothing(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path / "data")
    await daemon.start()
    try:
        await _stream_with_kills(
            tmp_path, daemon, daemon.mqtt_port, _killer(daemon), ["--mqtt-version", "3.1.1"]
        )
    finally:
        await daemon.stop()


@pytest.mark.asyncio
async def test_mosquitto_kill9_with_the_shipped_persistence_loses_nothing(tmp_path: Path) -> None:
    broker = _private_broker(tmp_path, shipped_persistence=True)
    daemon = _external_daemon(tmp_path, broker)
    await daemon.start()

    async def kill_broker() -> None:
        assert broker.proc is not None
        broker.proc.send_signal(signal.SIGKILL)
        broker.proc.wait()
        await asyncio.sleep(0.3)
        broker.start()

    try:
        await _stream_with_kills(tmp_path, daemon, broker.port, kill_broker, [])
    finally:
        await daemon.stop()
        broker.stop()


@pytest.mark.asyncio
async def test_daemon_kill9_with_mosquitto_loses_nothing(tmp_path: Path) -> None:
    """The daemon's persistent session on the site broker keeps what arrives while it is down;
    what it had received but not stored is delivered again (it acknowledges after storing). The
    agents use job-style topics here (one events topic per job, as behind daemon replicas), whose
    batches get receipts too."""
    broker = _private_broker(tmp_path, shipped_persistence=False)
    daemon = _external_daemon(tmp_path, broker)
    await daemon.start()
    try:
        await _stream_with_kills(tmp_path, daemon, broker.port, _killer(daemon), ["--topic-style", "job"])
    finally:
        await daemon.stop()
        broker.stop()
