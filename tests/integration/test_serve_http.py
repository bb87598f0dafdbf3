"""HTTP API and CLI edges: bearer token, bad and unknown job ids, no daemon, port taken, validate."""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from pathlib import Path

import pytest

from denpex_agent.rules import RuleSet
from tests.integration.replay import Daemon, free_port, load_case, replay

pytestmark = [pytest.mark.integration]


async def _cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "denpexd", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.asyncio
async def test_api_token_ids_events_and_query(tmp_path: Path, library: RuleSet) -> None:
    daemon = Daemon(tmp_path / "data", "--api-token", "s3cret")
    await daemon.start()
    try:
        job = f"http-{uuid.uuid4().hex[:8]}"
        events = load_case("alloc_fail", job, library)
        await replay(events, job, port=daemon.mqtt_port, v5=False, speed=50.0)
        assert (await daemon.get("/api/v1/jobs"))[0] == 401
        assert (await daemon.get(f"/api/v1/jobs/{job}", token="wrong"))[0] == 401
        assert (await daemon.get("/metrics"))[0] == 401
        assert (await daemon.get("/-/healthy"))[0] == 200
        assert (await daemon.get("/-/ready"))[0] == 200
        tok = "s3cret"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            status, doc = await daemon.get(f"/api/v1/jobs/{job}", token=tok)
            if status == 200 and doc["stats"]["events"] == len(events):
                break
            await asyncio.sleep(0.2)
        assert doc["initiator"]["node"] == "host-b" and doc["initiator"]["rank"] == 2
        for bad in ("..%2Fetc", "a%23b", "x" * 200, "a+b"):
            assert (await daemon.get(f"/api/v1/jobs/{bad}", token=tok))[0] == 400, bad
        assert (await daemon.get("/api/v1/jobs/no-such-job", token=tok))[0] == 404
        assert (await daemon.get("/api/v1/jobs/no-such-job/events", token=tok))[0] == 404
        status, evs = await daemon.get(f"/api/v1/jobs/{job}/events?rank=2&limit=5", token=tok)
        assert status == 200 and 0 < len(evs["events"]) <= 5 and {e["rank"] for e in evs["events"]} == {2}
        status, jobs = await daemon.get("/api/v1/jobs", token=tok)
        assert status == 200 and any(j["job"] == job and j["open"] for j in jobs["jobs"])

        rc, out, err = await _cli("query", "--job", job, "--server", daemon.url)
        assert rc == 1 and "401" in err
        env = {"DENPEX_API_TOKEN": tok, "DENPEX_SERVER": daemon.url, "PATH": "/usr/bin:/bin"}
        env["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")
        rc, out, err = await _cli("query", "--job", job, env=env)
        assert rc == 0, err
        assert f"job {job}: FAILED" in out and "host-b" in out
        rc, out, err = await _cli("query", "--job", job, "--format", "markdown", env=env)
        assert rc == 0, err
        assert out.startswith(f"## Denpex: job `{job}`: FAILED") and "| `host-b` | **2** |" in out
        rc, out, err = await _cli("query", "--job", job, "--json", "--format", "markdown", env=env)
        assert rc == 2 and "--format" in err
        rc, out, err = await _cli("query", "--jobs", env=env)
        assert rc == 0 and job in out and "node host-b rank 2" in out
        assert await daemon.stop() == 0
    finally:
        if daemon.proc is not None and daemon.proc.returncode is None:
            daemon.kill()
            await daemon.wait()


@pytest.mark.asyncio
async def test_query_without_daemon_says_so() -> None:
    rc, _out, err = await _cli("query", "--job", "j1", "--server", f"http://127.0.0.1:{free_port()}")
    assert rc == 1
    assert "is `denpexd serve` running?" in err and "Traceback" not in err


@pytest.mark.asyncio
async def test_serve_port_taken_names_the_fix(tmp_path: Path) -> None:
    rc, _out, err = await _cli(
        "serve", "--mqtt-listen", "127.0.0.1:1883", "--http-listen", f"127.0.0.1:{free_port()}",
        "--data-dir", str(tmp_path / "d"),
    )  # fmt: skip
    assert rc == 1
    assert "--mqtt-listen" in err and "--broker" in err


@pytest.mark.asyncio
async def test_validate(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text('http_listen = "127.0.0.1:9999"\nmax_open_jobs = 5\n')
    bad = tmp_path / "bad.toml"
    bad.write_text('htp_listen = "127.0.0.1:9999"\n')
    rc, out, err = await _cli("validate", "--config", str(good))
    assert rc == 0 and "configuration ok" in out
    rc, out, err = await _cli("validate", "--config", str(bad))
    assert rc == 2 and "htp_listen" in err
