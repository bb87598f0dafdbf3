"""`denpexd query --job X --control Y` against a real `denpexd serve`, and the events pages it reads."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from denpex_agent.rules import RuleSet
from denpexd.diagnosecmd import diagnose_paths
from tests.integration.replay import JOBS, Daemon, load_case, replay

pytestmark = [pytest.mark.integration]
TOKEN = "t0ken-for-tests"


async def _query(url: str, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "denpexd", "query", "--server", url, "--api-token", TOKEN, *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def _pages(daemon: Daemon, job: str, limit: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    after = ""
    while True:
        status, page = await daemon.get(f"/api/v1/jobs/{job}/events?limit={limit}&after={after}", token=TOKEN)
        assert status == 200, page
        assert len(page["events"]) <= limit
        out += page["events"]
        if page["next"] is None:
            return out
        after = page["next"]


@pytest.mark.asyncio
async def test_query_control_over_the_stored_events(tmp_path: Path, library: RuleSet) -> None:
    daemon = Daemon(tmp_path / "data", "--api-token", TOKEN)
    await daemon.start()
    try:
        tag = uuid.uuid4().hex[:8]
        healthy, failed = f"ctl-healthy-{tag}", f"ctl-alloc-{tag}"
        loaded = {
            healthy: load_case("healthy", healthy, library),
            failed: load_case("alloc_fail", failed, library),
        }
        await asyncio.gather(
            *(replay(evs, job, port=daemon.mqtt_port, v5=False, speed=50.0) for job, evs in loaded.items())
        )
        for job, evs in loaded.items():
            deadline = asyncio.get_running_loop().time() + 20
            while True:
                status, doc = await daemon.get(f"/api/v1/jobs/{job}", token=TOKEN)
                if status == 200 and doc["stats"]["events"] >= len(evs):
                    break
                assert asyncio.get_running_loop().time() < deadline, doc
                await asyncio.sleep(0.2)

        # the events, a page at a time: every event once, in the same order as one large page
        whole = await _pages(daemon, failed, 10_000)
        assert len(whole) == len(loaded[failed])
        assert await _pages(daemon, failed, 7) == whole
        assert [e["id"] for e in await _pages(daemon, failed, 1)] == [e["id"] for e in whole]
        for bad in ("x", "1", "1:2:3", "-1:0", "9" * 30 + ":0"):
            status, doc = await daemon.get(f"/api/v1/jobs/{failed}/events?after={bad}", token=TOKEN)
            assert status == 400 and "cursor" in doc["error"], bad
        assert (await daemon.get(f"/api/v1/jobs/{failed}/events?after=1:0"))[0] == 401
        for bad in ("..%2Fetc", "a%23b", "x" * 200):
            assert (await daemon.get(f"/api/v1/jobs/{bad}/events?after=1:0", token=TOKEN))[0] == 400, bad

        rc, out, err = await _query(daemon.url, "--job", failed, "--control", healthy, "--json")
        assert rc == 0, err
        div = json.loads(out)["divergence"]
        assert (div["first"]["node"], div["first"]["rank"]) == ("host-b", 2)
        assert "DefaultCPUAllocator: can't allocate memory" in div["first"]["text"]
        # the healthy job's end-of-training line (a marker event) came with its context lines, so
        # the failed job's context lines are compared too (no warning that they were left out)
        assert not any("no context lines" in w for w in div["warnings"])
        # the same first lines as reading the files, where the store holds them
        files = diagnose_paths([str(JOBS / "alloc_fail")], control=[str(JOBS / "healthy")])["divergence"]
        key = [(e["node"], e["rank"], e["line"], e["time"]) for e in div["per_rank"]]
        assert key == [(e["node"], e["rank"], e["line"], e["time"]) for e in files["per_rank"]]

        rc, out, err = await _query(daemon.url, "--job", failed, "--control", failed, "--json")
        assert rc == 0, err
        assert json.loads(out)["divergence"]["first"] is None
        rc, out, err = await _query(daemon.url, "--job", failed, "--control", healthy)
        assert rc == 0, err
        assert "FIRST DIVERGENCE FROM THE HEALTHY RUN" in out and "first      node host-b rank 2" in out

        rc, _out, err = await _query(daemon.url, "--job", failed, "--control", f"nope-{tag}")
        assert rc == 1 and f"--control nope-{tag}" in err and "not found" in err
        rc, _out, err = await _query(daemon.url, "--job", failed, "--control", "../etc")
        assert rc == 2 and "invalid --control job id" in err
        rc, _out, err = await _query(daemon.url, "--jobs", "--control", healthy)
        assert rc == 2 and "--control goes with --job" in err
        assert await daemon.stop() == 0
    finally:
        if daemon.proc is not None and daemon.proc.returncode is None:
            daemon.kill()
            await daemon.wait()
