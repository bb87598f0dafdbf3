"""Torture: 8 rank files written fast, rotated (rename and copytruncate) while the agent is
killed with SIGKILL at random moments and the broker restarts. At the end every numbered
matched line has arrived at least once, and every duplicate carries the same event id."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import threading
import time
from pathlib import Path

import pytest

from tests.integration.agent_harness import (
    PrivateBroker,
    agent_cmd,
    collector,
    eventually,
    start_agent,
    stop,
    unique_job,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        shutil.which("mosquitto") is None and not os.path.exists("/usr/sbin/mosquitto"),
        reason="mosquitto not installed",
    ),
]

RANKS = 8
DURATION_S = 20.0
LINES_PER_S_PER_FILE = 400
MATCH_EVERY = 10


class Writer:
    """Appends to rank<r>.log; rotation actions hold the lock so no write races them."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.lock = threading.Lock()
        self.written: dict[int, list[str]] = {r: [] for r in range(RANKS)}
        self.stop = threading.Event()
        self.lines = 0

    def run(self) -> None:
        n = 0
        period = 0.02
        per_tick = max(1, int(LINES_PER_S_PER_FILE * period))
        while not self.stop.is_set():
            with self.lock:
                for r in range(RANKS):
                    chunk = []
                    for _ in range(per_tick):
                        n += 1
                        if n % MATCH_EVERY == 0:
                            marker = f"{r}-{n}"
                            self.written[r].append(marker)
                            chunk.append(
                                f"[rank{r}]: RuntimeError: CUDA error: an illegal memory access was encountered marker={marker}\n"
                            )
                        else:
                            chunk.append(
                                f"2026-11-29 12:00:00,{n % 1000:03d} INFO [rank{r}] step {n} | loss 2.0 | grad_norm 1.0\n"
                            )
                    with (self.logs / f"rank{r}.log").open("a") as fh:
                        fh.write("".join(chunk))
                    self.lines += len(chunk)
            time.sleep(period)


@pytest.mark.asyncio
async def test_torture_rotation_kill9_broker_restart(tmp_path: Path) -> None:
    rng = random.Random(20261129)
    (tmp_path / "broker").mkdir()
    broker = PrivateBroker(tmp_path / "broker")
    broker.start()
    logs = tmp_path / "logs"
    logs.mkdir()
    job = unique_job("torture")
    cmd = agent_cmd(
        job, "n1", [str(logs / "rank*.log*")], tmp_path / "state",
        "--context-lines", "3", "--checkpoint-interval", "0.3", port=broker.port,
    )  # fmt: skip
    writer = Writer(logs)
    counts = {"kills": 0, "renames": 0, "copytruncates": 0, "broker_restarts": 0}
    agent = start_agent(cmd, tmp_path / "agent.log")
    thread = threading.Thread(target=writer.run, name="writer", daemon=True)
    try:
        async with collector(job, broker.port, session=f"torture-{job}") as got:

            def received() -> set[str]:
                return {e.text.rsplit("marker=", 1)[1] for e in got.events("match") if "marker=" in e.text}

            thread.start()
            t_end = time.monotonic() + DURATION_S
            gen = 0
            while time.monotonic() < t_end:
                await asyncio.sleep(rng.uniform(0.5, 1.5))
                action = rng.choice(["kill", "kill", "rename", "rename", "copytruncate", "broker"])
                r = rng.randrange(RANKS)
                if action == "kill":
                    agent.kill()
                    agent.wait()
                    counts["kills"] += 1
                    await asyncio.sleep(rng.uniform(0.1, 1.0))
                    agent = start_agent(cmd, tmp_path / "agent.log")
                elif action == "rename":
                    gen += 1
                    with writer.lock:
                        os.rename(logs / f"rank{r}.log", logs / f"rank{r}.log.{gen}")
                    counts["renames"] += 1
                elif action == "copytruncate":
                    # copytruncate loses whatever the reader had not read when the file is cut
                    # (for every tool): rotate only once the agent has caught up with this file.
                    with writer.lock:
                        want = set(writer.written[r])
                        try:
                            await eventually(lambda want=want: want <= received(), within=10)  # type: ignore[misc]
                        except AssertionError:
                            continue
                        shutil.copyfile(logs / f"rank{r}.log", tmp_path / f"copy-{r}-{gen}.bak")
                        with (logs / f"rank{r}.log").open("r+") as fh:
                            fh.truncate(0)
                    counts["copytruncates"] += 1
                else:
                    broker.stop()
                    await asyncio.sleep(rng.uniform(0.2, 1.0))
                    broker.start()
                    counts["broker_restarts"] += 1
            writer.stop.set()
            thread.join()
            expected = {m for ms in writer.written.values() for m in ms}
            await eventually(lambda: expected <= received(), within=90)
            ids: dict[str, set[str]] = {}
            arrivals = 0
            for e in got.events("match"):
                if "marker=" in e.text:
                    ids.setdefault(e.text.rsplit("marker=", 1)[1], set()).add(e.id)
                    arrivals += 1
    finally:
        writer.stop.set()
        stop(agent)
        broker.stop()
    unexplained = {m: v for m, v in ids.items() if len(v) > 1}
    summary = (
        f"lines written {writer.lines}, numbered matched lines {len(expected)}, arrived {len(ids)}, "
        f"arrivals {arrivals} (re-sent duplicates {arrivals - len(ids)}), unexplained duplicates {len(unexplained)}, "
        f"actions {counts}"
    )
    print(summary)
    (tmp_path / "summary.txt").write_text(summary + "\n")
    assert expected <= set(ids), summary
    assert not unexplained, summary
    assert counts["kills"] >= 3 and counts["renames"] >= 2, summary
