"""`denpexd serve` on uvloop and on the standard asyncio loop: the same diagnosis and alert.

The daemon's MQTT connection drives paho's external-loop API with the loop's `add_reader` and
`add_writer`; uvloop implements them itself, so the ingest path (embedded broker and Mosquitto),
the HTTP API and the alert sinks are run on both loops. uvloop is in the dev extra, so CI runs
the uvloop cases; they are skipped only where it is not installed.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
import uuid
from pathlib import Path

import pytest

from denpex_agent.rules import RuleSet
from denpexd.diagnosecmd import diagnose_paths
from tests.integration.replay import JOBS, AlertReceiver, Daemon, load_case, query_json, replay

pytestmark = [pytest.mark.integration]

CASE = "exception_skew"
UVLOOP = pytest.param(
    "uvloop",
    marks=pytest.mark.skipif(importlib.util.find_spec("uvloop") is None, reason="uvloop not installed"),
)


@pytest.mark.asyncio
@pytest.mark.parametrize("loop", [UVLOOP, "asyncio"])
@pytest.mark.parametrize("external", [False, True], ids=["embedded", "mosquitto"])
async def test_serve_runs_on_the_chosen_loop(
    tmp_path: Path, library: RuleSet, loop: str, external: bool
) -> None:
    tag = uuid.uuid4().hex[:8]
    job = f"loop-{loop}-{tag}"
    async with AlertReceiver().serve() as receiver:
        extra = ["--event-loop", loop, "--alertmanager", f"http://127.0.0.1:{receiver.port}"]
        if external:
            extra += ["--client-id", f"denpexd-test-{tag}"]
        daemon = Daemon(tmp_path / "data", *extra, broker="mqtt://127.0.0.1:1883" if external else None)
        await daemon.start()
        try:
            assert f"event loop loop={loop}" in daemon.log.read_text()
            events = load_case(CASE, job, library)
            await replay(events, job, port=daemon.mqtt_port, v5=external, speed=20.0)
            await daemon.wait_events(job, len(events))
            want = diagnose_paths([str(JOBS / CASE)], job=job, rules=library)
            got = await query_json(daemon.url, job)
            assert (got["verdict"], got["initiator"]["node"], got["initiator"]["rank"]) == (
                want["verdict"],
                want["initiator"]["node"],
                want["initiator"]["rank"],
            )
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not receiver.firing(job):  # noqa: ASYNC110 - waits on another process
                await asyncio.sleep(0.1)
            assert receiver.firing(job)
        finally:
            await daemon.stop()
