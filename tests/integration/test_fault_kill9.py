"""kill -9 and floods while agents stream: nothing an agent read is lost, in either broker mode.

* The daemon with its embedded broker is killed and restarted again and again. The broker dies
  with it, after having acknowledged batches the daemon had not stored yet; the agents learn it
  from the missing receipts and send those batches again.
* Mosquitto, with the persistence settings of deploy/broker/mosquitto.conf, is killed and
  restarted again and again under the daemon and the agents. It forgets what it acknowledged
  since its last save (and, if never saved, the daemon's session); again the receipts bring
  every batch in.
* No kill, but a publisher floods the daemon with another job's batches: ingest stops reading
  from the broker whenever its backlog is full; Mosquitto holds (or drops beyond its queue
  limit) what waits, the embedded broker refuses agents' batches meanwhile, and the receipts
  bring every batch in.

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
import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from denpex_agent import wire
from denpex_agent.events import Event
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


def _stored_rows(data_dir: Path, job: str) -> list[str]:
    """The marker of every stored failure event of ``job`` (one per row)."""
    db = sqlite3.connect(data_dir / "denpex.sqlite")
    try:
        rows = db.execute("SELECT doc FROM events WHERE job = ? AND kind = 'match'", (job,)).fetchall()
    finally:
        db.close()
    out = []
    for (doc,) in rows:
        m = MARKER.search(orjson.loads(doc).get("text", ""))
        if m:
            out.append(m.group(1))
    return out


def _stored(data_dir: Path, job: str) -> set[str]:
    return set(_stored_rows(data_dir, job))


async def _stream_with_kills(
    tmp_path: Path,
    daemon: Daemon,
    port: int,
    kill: object,
    extra: list[str],
    stop_flood: threading.Event | None = None,
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
            if kill is not None:
                await kill()  # type: ignore[operator]
                kills += 1
        await asyncio.sleep(KILL_EVERY_S)
        writer.stop.set()
        thread.join()
        if stop_flood is not None:
            stop_flood.set()  # what the agents have not had confirmed comes in now
        # every marker written reaches the store (the agents re-send what was never confirmed)
        deadline = time.monotonic() + (60 if stop_flood is None else 150)  # a flood is worked off first
        while time.monotonic() < deadline:
            await asyncio.sleep(1.0)
            if writer.written <= await asyncio.to_thread(_stored, daemon.data_dir, job):
                break
    finally:
        writer.stop.set()
        codes = [stop(proc) for proc in procs]
    for node, code in enumerate(codes):  # the agents lived through it all and stopped cleanly
        assert code == 0, (tmp_path / f"agent-{node}.log").read_text(errors="replace")[-3000:]
    rows = await asyncio.to_thread(_stored_rows, daemon.data_dir, job)
    stored = set(rows)
    resent = 0
    for node in range(NODES):
        text = (tmp_path / f"agent-{node}.log").read_text(errors="replace")
        resent += len(re.findall(r"sending batches again batches=(\d+)", text))
    lost = writer.written - stored
    duplicated = len(rows) - len(stored)  # a re-sent event is dropped by its id: never stored twice
    summary = (
        f"written {len(writer.written)}, stored {len(stored & writer.written)}, lost {len(lost)}, "
        f"duplicated {duplicated}, re-sends logged {resent}, kills {kills}"
    )
    print(summary)
    assert not lost, f"{summary}; e.g. {sorted(lost)[:5]}"
    assert duplicated == 0, summary
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


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


FLOOD_BATCHES = 1_500  # 300,000 events: Mosquitto queues all of them for the daemon's session


def _flood(port: int, job: str, stop: threading.Event, v5: bool) -> int:
    """Another job's batches (200 failure events each) at QoS 1, as fast as the broker takes
    them, until ``stop`` or FLOOD_BATCHES; the number the broker acknowledged."""
    client = paho.Client(
        CallbackAPIVersion.VERSION2, client_id=f"flood-{job}", protocol=paho.MQTTv5 if v5 else paho.MQTTv311
    )
    client.max_inflight_messages_set(100)
    client.connect("127.0.0.1", port)
    client.loop_start()
    seq = acked = 0
    infos = []
    try:
        while not stop.is_set() and seq < FLOOD_BATCHES:
            seq += 1
            now = time.time()
            events = [
                Event(
                    id=f"f{seq}-{i}",
                    kind="match",
                    job=job,
                    node="n9",
                    rank=i % 64,
                    local_rank=i % 8,
                    file="rank.log",
                    offset=seq * 200 + i,
                    line_no=seq * 200 + i,
                    ts=now,
                    ts_source="line",
                    rule="nccl-remote-error",
                    category="communication",
                    severity="error",
                    role="collateral",
                    text=f"NCCL error: remote process exited or there was a network error {seq}-{i}",
                )
                for i in range(200)
            ]
            info = client.publish(
                wire.events_topic(job), wire.encode_batch("n9", job, "n9", seq, now, events), qos=1
            )
            infos.append(info)
            if len(infos) >= 100:
                first = infos.pop(0)
                first.wait_for_publish(timeout=10)
                acked += first.is_published()
    finally:
        client.disconnect()
        client.loop_stop()
    return acked + sum(1 for i in infos if i.is_published())


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["embedded", "mosquitto"])
async def test_agents_lose_nothing_while_another_job_floods_the_daemon(tmp_path: Path, mode: str) -> None:
    """A publisher floods the daemon with another job's batches at full speed while the agents
    stream (`ingest_backlog = 8`: the daemon stops reading from the broker often). Mosquitto
    holds what waits (and drops beyond its queue limit); the embedded broker refuses batches
    while ingest is full (counted). The agents send again what was not confirmed: nothing is lost."""
    config = tmp_path / "denpexd.toml"
    config.write_text("ingest_backlog = 8\n")
    broker = _private_broker(tmp_path, shipped_persistence=False) if mode == "mosquitto" else None
    if broker is None:
        daemon = Daemon(tmp_path / "data", "--config", str(config))
        port = daemon.mqtt_port
    else:
        daemon = Daemon(
            tmp_path / "data", "--config", str(config), "--client-id", f"denpexd-bp-{uuid.uuid4().hex[:8]}",
            broker=f"mqtt://127.0.0.1:{broker.port}",
        )  # fmt: skip
        port = broker.port
    await daemon.start()
    stop_flood = threading.Event()
    flood = asyncio.create_task(
        asyncio.to_thread(_flood, port, f"flood-{uuid.uuid4().hex[:8]}", stop_flood, broker is not None)
    )

    try:
        extra = ["--mqtt-version", "3.1.1"] if broker is None else []
        await _stream_with_kills(tmp_path, daemon, port, None, extra, stop_flood=stop_flood)
        _, metrics = await daemon.get("/metrics")
        pauses = _metric(metrics, "denpex_ingest_read_pauses_total")
        refused = _metric(metrics, "denpex_ingest_messages_shed_total")
        print(
            f"{mode}: reading paused {pauses:.0f} times, batches refused by the embedded broker {refused:.0f}"
        )
        assert pauses > 0
        if broker is None:
            assert refused > 0  # and yet nothing was lost: the agents sent those again
    finally:
        stop_flood.set()
        flooded = await flood
        print(f"{mode}: flood batches acknowledged by the broker {flooded}")
        await daemon.stop()
        if broker is not None:
            broker.stop()
