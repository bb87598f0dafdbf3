"""A real job stalls silently and `denpexd serve` says so within seconds.

A real 2-node x 2-rank gloo job (tests/fixtures/fault_train.py under torchrun, layout a, python
logging) runs with a 600 s collective timeout; rank 2 blocks forever in its data loading at
step 12 and the other ranks wait inside the all-reduce. No process prints an error. One real
`denpex-agent` per node follows the rank files and a real `denpexd serve` (embedded broker,
`stall_floor_s = 3`) correlates. The incident (Alertmanager v2 POST to a local receiver) must
arrive within the threshold plus a bounded delay after the last step line was written, say
category hang, and nothing in the logs may look like an error. The time from the last step line
to the alert is printed.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from denpex_agent.timestamps import parse_timestamp
from tests.fixtures.make_jobs import CASES, TRAIN, free_port, freeze_and_kill
from tests.integration.agent_harness import agent_cmd, start_agent, stop
from tests.integration.replay import JOBS, AlertReceiver, Daemon
from tests.integration.test_live_e2e import _schedule as schedule
from tests.integration.test_live_e2e import _write as write_schedule

pytestmark = [pytest.mark.integration]

FLOOR_S = 3.0
SLACK_S = 4.0  # agent poll + batch + diagnosis + delivery, on a busy 2-core machine
ERRORISH = re.compile(r"Traceback|Error|ERROR|exitcode|Signals\.|\bE\d{4} ")


def _torchruns(logs: Path) -> list[subprocess.Popen[bytes]]:
    c = CASES["stall"]
    port = free_port()
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1", TZ="UTC")
    procs = []
    for ni, node in enumerate(c["nodes"]):
        ndir = logs / node
        ndir.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(c['nodes'])}", f"--node-rank={ni}",
            f"--nproc-per-node={c['nproc']}", "--master-addr=127.0.0.1", f"--master-port={port}",
            f"--rdzv-id=live-stall-{port}", "--max-restarts=0", str(TRAIN), "--fault", c["fault"],
            "--fault-rank", str(c["rank"]), "--fault-step", str(c["step"]), "--steps", str(c["steps"]),
            "--fmt", c["fmt"], "--node-name", node, "--seed", "1234", "--rank-log-dir", str(ndir), *c["args"],
        ]  # fmt: skip
        with (ndir / "torchrun.log").open("wb") as out:
            procs.append(
                subprocess.Popen(
                    cmd,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
    return procs


def _last_step_time(logs: Path) -> tuple[float | None, int]:
    """The newest step line's own timestamp over every rank file, and how many step lines."""
    newest, n = None, 0
    for f in logs.rglob("rank*.log"):
        for line in f.read_text(errors="replace").splitlines():
            if " step " in line:
                n += 1
                ts = parse_timestamp(line, time.gmtime().tm_year)
                if ts is not None and (newest is None or ts > newest):
                    newest = ts
    return newest, n


@pytest.mark.asyncio
async def test_a_silent_stall_alerts_within_seconds(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="torch is installed by .ci/run (pip install torch==2.13.0)")
    job = f"live-stall-{uuid.uuid4().hex[:6]}"
    logs = tmp_path / "logs"
    (tmp_path / "serve.toml").write_text(f"stall_floor_s = {FLOOR_S}\nstall_factor = 10.0\n")
    async with AlertReceiver().serve() as receiver:
        daemon = Daemon(
            tmp_path / "data", "--config", str(tmp_path / "serve.toml"),
            "--alertmanager", f"http://127.0.0.1:{receiver.port}",
        )  # fmt: skip
        await daemon.start()
        agents, job_procs = [], []
        try:
            for node in CASES["stall"]["nodes"]:
                (logs / node).mkdir(parents=True, exist_ok=True)
            for node in CASES["stall"]["nodes"]:
                cmd = agent_cmd(job, node, [str(logs / node / "*.log")], tmp_path / f"state-{node}",
                                "--progress-interval", "0.25", port=daemon.mqtt_port)  # fmt: skip
                agents.append(start_agent(cmd, tmp_path / f"agent-{node}.log"))
            job_procs = _torchruns(logs)
            deadline = time.monotonic() + 120
            alert = None
            while time.monotonic() < deadline and alert is None:
                await asyncio.sleep(0.1)
                firing = receiver.firing(job)
                if firing:
                    alert, got_at = firing[0], time.time()
                assert all(p.poll() is None for p in job_procs), "the job ended by itself"
            assert alert is not None, f"no alert; daemon log: {daemon.log.read_text()[-3000:]}"
            last, n = _last_step_time(logs)
            assert last is not None and n >= 4 * 11, n
            latency = got_at - last
            print(f"\nlast step line -> alert: {latency:.2f} s (threshold {FLOOR_S:.0f} s, {n} step lines)")
            assert FLOOR_S - 0.5 <= latency <= FLOOR_S + SLACK_S, latency
            assert alert["labels"]["category"] == "hang"
            assert alert["labels"]["rule"] == "job-progress-stalled"
            status, doc = await daemon.get(f"/api/v1/jobs/{job}")
            assert status == 200 and doc["verdict"] == "failed" and doc["stall"]["last_step"] == 11
            assert doc["initiator"] is None and doc["scope"] == "job"  # every rank stopped at step 11
            texts = "".join(f.read_text(errors="replace") for f in logs.rglob("*.log"))
            assert not ERRORISH.search(texts), ERRORISH.search(texts)
        finally:
            if job_procs:
                freeze_and_kill(job_procs)
                for p in job_procs:
                    p.wait(timeout=15)
            for p in agents:
                stop(p)
            await daemon.stop()


async def _replay_alerts(case: str, tmp: Path, config: str, linger_s: float) -> tuple[list[dict], dict]:
    """Replay a recorded job at its true pace through real agents into a `serve` configured with
    ``config``; wait ``linger_s`` after the last line; return the job's alerts and diagnosis."""
    src = JOBS / case
    job = f"live-{case.replace('_', '-')}-{uuid.uuid4().hex[:6]}"
    logs = tmp / "logs"
    tmp.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - the test's own folder, before anything runs
    (tmp / "serve.toml").write_text(config)
    async with AlertReceiver().serve() as receiver:
        daemon = Daemon(
            tmp / "data",
            "--config",
            str(tmp / "serve.toml"),
            "--alertmanager",
            f"http://127.0.0.1:{receiver.port}",
        )
        await daemon.start()
        agents = []
        try:
            for node in sorted(p.name for p in src.iterdir() if p.is_dir()):
                (logs / node).mkdir(parents=True, exist_ok=True)
                cmd = agent_cmd(job, node, [str(logs / node / "**" / "*.log")], tmp / f"state-{node}",
                                "--progress-interval", "0.25", port=daemon.mqtt_port)  # fmt: skip
                agents.append(start_agent(cmd, tmp / f"agent-{node}.log"))
            await write_schedule(schedule(src), logs, pace=1.0)
            await asyncio.sleep(linger_s)
            _, doc = await daemon.get(f"/api/v1/jobs/{job}")
            return [a for a in receiver.alerts if a["labels"]["job"] == job], doc
        finally:
            for p in agents:
                stop(p)
            await daemon.stop()


@pytest.mark.asyncio
async def test_an_announced_evaluation_pause_is_no_stall_and_a_finished_job_neither(tmp_path: Path) -> None:
    """eval_pause: a real run with an 8 s evaluation and a 5 s checkpoint pause, both announced,
    and the end of training logged. With a 3 s floor and the pause allowance, no alert, also well
    after the job ended; with the pause allowance at 1 s the same replay alerts (the check can fail)."""
    (quiet, doc), (loud, _) = await asyncio.gather(
        _replay_alerts(
            "eval_pause",
            tmp_path / "allowed",
            f"stall_floor_s = {FLOOR_S}\nstall_pause_s = 30.0\n",
            FLOOR_S + 3,
        ),
        _replay_alerts(
            "eval_pause", tmp_path / "short", f"stall_floor_s = {FLOOR_S}\nstall_pause_s = 1.0\n", 0.5
        ),
    )
    assert quiet == [] and doc["verdict"] == "healthy" and doc["stall"] is None, (quiet, doc["verdict"])
    assert loud and loud[0]["labels"]["rule"] == "job-progress-stalled", loud
