"""The whole live path with real processes on loopback: a writer replays a recorded multi-rank
failure into rank files at its original pace, one `denpex-agent` per node follows them, and
`denpexd serve` correlates. `denpexd query --json` must name what `denpexd diagnose` names on the
same logs; `/metrics` must show the NaN fingerprint; exactly one alert per incident."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from denpex_agent.rules import RuleSet
from denpex_agent.timestamps import parse_timestamp
from denpexd.diagnosecmd import diagnose_paths
from tests.integration.agent_harness import agent_cmd, broker_up, start_agent, stop
from tests.integration.replay import JOBS, AlertReceiver, Daemon, forget_session, query_json

pytestmark = [pytest.mark.integration]


def _schedule(case: Path) -> list[tuple[float, Path, str]]:
    """(true time, relative path, line) for every line of every log file of a recorded job."""
    expected = json.loads((case / "expected.json").read_text())
    skew = expected.get("skew_s", {})
    out: list[tuple[float, Path, str]] = []
    for f in sorted(case.rglob("*.log")):
        rel = f.relative_to(case)
        node = rel.parts[0]
        last = None
        for line in f.read_text(errors="replace").splitlines(keepends=True):
            ts = parse_timestamp(line, 2026)
            if ts is not None:
                last = ts - skew.get(node, 0.0)
            out.append((last if last is not None else 0.0, rel, line))
    t0 = min(t for t, _, _ in out if t > 0)
    return sorted(((max(t - t0, 0.0), rel, line) for t, rel, line in out), key=lambda x: x[0])


async def _write(schedule: list[tuple[float, Path, str]], dest: Path, pace: float) -> None:
    """Append each line at its original moment (``pace`` < 1 speeds the replay up)."""
    start = time.monotonic()
    handles: dict[Path, Any] = {}
    try:
        for t, rel, line in schedule:
            delay = start + t * pace - time.monotonic()
            if delay > 0:
                for fh in handles.values():
                    fh.flush()
                await asyncio.sleep(delay)
            fh = handles.get(rel)
            if fh is None:
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                fh = handles[rel] = (dest / rel).open("a")
            fh.write(line)
    finally:
        for fh in handles.values():
            fh.close()


def _summary(doc: dict[str, Any]) -> tuple[Any, ...]:
    if not doc:
        return ()
    ini = doc["initiator"] or {}
    rc = doc["root_cause"] or {}
    return (
        doc["verdict"],
        ini.get("node"),
        ini.get("rank"),
        rc.get("category"),
        tuple(doc["collateral_ranks"]),
    )


async def _run_case(case: str, tmp: Path, library: RuleSet, broker: str | None, pace: float = 1.0) -> None:
    src = JOBS / case
    want = diagnose_paths([str(src)], rules=library)
    job = f"live-{case.replace('_', '-')}-{uuid.uuid4().hex[:6]}"
    logs = tmp / "logs"
    nodes = sorted(p.name for p in src.iterdir() if p.is_dir())
    async with AlertReceiver().serve() as receiver:
        client_id = f"denpexd-{uuid.uuid4().hex[:8]}"
        extra = ["--alertmanager", f"http://127.0.0.1:{receiver.port}", "--client-id", client_id]
        daemon = Daemon(tmp / "data", *extra, broker=broker)
        await daemon.start()
        agents: list[subprocess.Popen[bytes]] = []
        try:
            for node in nodes:
                (logs / node).mkdir(parents=True, exist_ok=True)
                cmd = agent_cmd(
                    job, node, [str(logs / node / "**" / "*.log")], tmp / f"state-{node}",
                    "--progress-interval", "0.1", port=daemon.mqtt_port,
                )  # fmt: skip
                agents.append(start_agent(cmd, tmp / f"agent-{node}.log"))
            await _write(_schedule(src), logs, pace=pace)
            deadline = time.monotonic() + 40
            got: dict[str, Any] = {}
            stable_since = None
            while time.monotonic() < deadline:
                status, doc = await daemon.get(f"/api/v1/jobs/{job}")
                if status == 200:
                    if got and _summary(doc) == _summary(got) and got["initiator"] is not None:
                        stable_since = stable_since or time.monotonic()
                        if time.monotonic() - stable_since > 3.0:
                            break
                    else:
                        stable_since = None
                    got = doc
                await asyncio.sleep(0.3)
            live = await query_json(daemon.url, job)
            assert _summary(live) == _summary(want), (live["initiator"], want["initiator"])
            _, metrics = await daemon.get("/metrics")
            if want["fingerprints"]["nan"]["stage"] == "error":
                assert f'denpex_nan_fingerprint_stage{{job="{job}",stage="error"}} 1.0' in metrics
            await asyncio.sleep(1.0)
            firing = receiver.firing(job)  # the latest state of each labelset
            assert len(firing) == 1, receiver.alerts
            alert = firing[0]
            assert alert["labels"]["role"] == "initiator"
            assert alert["labels"]["rank"] == str(want["initiator"]["rank"])
        finally:
            for p in agents:
                stop(p)
            await daemon.stop()
            if broker is not None:
                await forget_session(client_id)
    for node in nodes:
        log = (tmp / f"agent-{node}.log").read_text()
        assert "connected to broker" in log and "agent stopped" in log


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("case", "pace"), [("nan_fp16_skew", 1.0), ("exception_skew", 1.0), ("hang_skew", 0.3)]
)
async def test_live_agents_and_embedded_broker_agree_with_diagnose(
    case: str, pace: float, tmp_path: Path, library: RuleSet
) -> None:
    await _run_case(case, tmp_path, library, broker=None, pace=pace)


@pytest.mark.asyncio
@pytest.mark.skipif(not broker_up(), reason="no MQTT broker on 127.0.0.1:1883 (.ci/run starts one)")
async def test_live_agents_through_mosquitto_agree_with_diagnose(tmp_path: Path, library: RuleSet) -> None:
    await _run_case("sigkill_skew", tmp_path, library, broker="mqtt://127.0.0.1:1883")
