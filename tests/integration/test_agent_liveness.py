"""The agent stays alive whatever its scanner is doing: on adversarial file content (a rule whose
pattern backtracks for ages on some lines, a traceback header at the end of a file, bare CRs,
NUL bytes, a 5 MB line) it keeps heartbeating, says that a scan is unusually slow (log and
metric), and answers SIGTERM within its bound."""

from __future__ import annotations

import asyncio
import itertools
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from denpex_agent.rules import default_rules_dir
from tests.integration.agent_harness import (
    agent_cmd,
    broker_up,
    collector,
    eventually,
    free_port,
    start_agent,
    unique_job,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not broker_up(), reason="no MQTT broker on 127.0.0.1:1883 (.ci/run starts one)"),
]

# Never matches (a lookahead for 'q' right before a 'b'), but hyperscan can only approximate the
# lookahead (prefilter mode), so every line of a's ending in b reaches the exact engine, which
# backtracks through every way of splitting the a's: far beyond any bound without one.
PATHOLOGICAL = """
schema = 1
category = "configuration"

[[rule]]
id = "badly-written-rule"
title = "A user's rule that backtracks"
severity = "error"
role = "root-cause"
patterns = ['(a|aa)+(?=q)b']
root_cause = "x"
fix = "x"
verify = "x"
examples = ["aab"]
"""


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return str(resp.read().decode())


async def _sigterm(proc: subprocess.Popen[bytes], within: float) -> tuple[int, float]:
    """SIGTERM; (exit code, seconds it took)."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc = await asyncio.to_thread(proc.wait, within)
    return rc, time.monotonic() - t0


def _reap(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _adversarial(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as fh:
        fh.write(b"2026-11-29 10:00:00,000 INFO [rank0] step 1 | loss 1.0\n")
        fh.write(b"a" * 40 + b"b\n" * 1)
        for _ in range(120):
            fh.write(b"a" * 40 + b"b\n")
        fh.write(b"line\rwith\rbare\rCRs\r" * 1000 + b"\n")
        fh.write(b"\x00\xff\xfe garbage \x00" * 100 + b"\n")
        fh.write(b"x" * (5 << 20) + b"\n")
        fh.write(b"Traceback (most recent call last):\n")


@pytest.mark.asyncio
async def test_heartbeats_go_on_and_sigterm_is_answered_while_a_scan_is_stuck(tmp_path: Path) -> None:
    rules = tmp_path / "rules"
    shutil.copytree(default_rules_dir(), rules)
    (rules / "zz-user.toml").write_text(PATHOLOGICAL)
    log = tmp_path / "logs" / "node1" / "rank0.log"
    _adversarial(log)
    job = unique_job("live")
    metrics_port = free_port()
    cmd = agent_cmd(
        job, "node1", [str(tmp_path / "logs" / "**" / "*.log")], tmp_path / "state",
        "--rules", str(rules), "--heartbeat-interval", "0.5", "--slow-scan-warning", "1",
        "--shutdown-timeout", "4", "--metrics-listen", f"127.0.0.1:{metrics_port}",
    )  # fmt: skip
    agent_log = tmp_path / "agent.log"
    async with collector(job) as got:
        proc = start_agent(cmd, agent_log)
        try:
            await eventually(lambda: any(e.kind == "heartbeat" for e in got.events()), within=20)
            # the scan of the pathological lines takes far longer than the watch below
            start, beats = time.monotonic(), []
            while time.monotonic() - start < 6.0:
                beats.append(len(got.events("heartbeat")))
                await asyncio.sleep(1.0)
            assert all(b > a for a, b in itertools.pairwise(beats)), beats  # every second, more
            body = await asyncio.to_thread(_get, f"http://127.0.0.1:{metrics_port}/metrics")
            assert "denpex_agent_slow_scans_total 1.0" in body
            assert 'denpex_agent_warnings_total{reason="pattern-timeout"}' in body
            slow = [e for e in got.events("heartbeat") if "scan_busy_s" in e.fields]
            assert slow, "heartbeats say that the reader is busy"
            # the stuck scan is the reader's first: until it ends, the heartbeats say the files'
            # unread bytes (the daemon's alert gate waits for an agent catching up on a backlog)
            first_read = next(
                (i for i, b in enumerate(got.batches) if any(e.kind != "heartbeat" for e in b.events)),
                len(got.batches),
            )
            early = got.batches[:first_read]
            assert early and all(b.behind >= log.stat().st_size // 2 for b in early), [
                b.behind for b in early
            ]
            rc, took = await _sigterm(proc, 10)
        finally:
            _reap(proc)
    text = agent_log.read_text(errors="replace")
    assert rc == 0, text[-3000:]
    assert took < 4 + 2.0, f"SIGTERM answered after {took:.1f} s"
    assert "a scan is taking unusually long" in text
    assert "badly-written-rule" in text and "timed out" in text


def test_diagnose_finishes_on_the_same_file_and_names_the_timeouts(tmp_path: Path) -> None:
    rules = tmp_path / "rules"
    shutil.copytree(default_rules_dir(), rules)
    (rules / "zz-user.toml").write_text(PATHOLOGICAL)
    _adversarial(tmp_path / "job" / "node1" / "rank0.log")
    out = subprocess.run(
        ["denpexd", "diagnose", str(tmp_path / "job"), "--rules", str(rules), "--format", "json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "rule badly-written-rule: a pattern timed out on" in out.stdout


@pytest.mark.asyncio
async def test_a_stop_that_cannot_finish_still_ends_within_its_bound(tmp_path: Path) -> None:
    """A checkpoint write that never completes (here a FIFO nobody reads where the checkpoint's
    temporary file goes, as a hung network mount would behave) holds up the stop; the agent still
    exits, with rc 1, within `shutdown_timeout` plus its margin, and says why with every
    thread's stack."""
    import os

    from denpex_agent.checkpoint import FILENAME
    from denpex_agent.cli import STOP_MARGIN_S

    state = tmp_path / "state"
    state.mkdir()
    os.mkfifo(state / Path(FILENAME).with_suffix(".tmp"))
    log = tmp_path / "logs" / "rank0.log"
    log.parent.mkdir()
    log.write_text("2026-11-29 10:00:00,000 INFO [rank0] step 1 | loss 1.0\n")
    job = unique_job("stall")
    cmd = agent_cmd(
        job, "node1", [str(tmp_path / "logs" / "*.log")], state,
        "--shutdown-timeout", "1", "--checkpoint-interval", "0.2",
    )  # fmt: skip
    agent_log = tmp_path / "agent.log"
    async with collector(job) as got:
        proc = start_agent(cmd, agent_log)
        try:
            await eventually(lambda: any(e.kind == "heartbeat" for e in got.events()), within=20)
            await asyncio.sleep(1.0)  # a periodic checkpoint write is stuck by now
            rc, took = await _sigterm(proc, 20)
        finally:
            _reap(proc)
    text = agent_log.read_text(errors="replace")
    assert rc == 1, text[-3000:]
    assert took < 1 + STOP_MARGIN_S + 1.5, f"stopped after {took:.1f} s"
    assert "stop overran its bound" in text
    assert "checkpoint.py" in text, "the stacks name where the stop was held up"
