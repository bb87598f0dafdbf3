"""The embedded broker keeps no agent status retained once the daemon has read it: a client that
connects later gets none of them (the embedded broker would otherwise send it every retained
message that matches any client's subscription)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from pathlib import Path

import aiomqtt
import pytest

from denpex_agent import wire
from tests.integration.replay import Daemon

pytestmark = [pytest.mark.integration]


@pytest.mark.asyncio
async def test_a_status_read_by_the_daemon_is_not_kept_retained(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path / "data")
    await daemon.start()
    job, agent = f"ret-{uuid.uuid4().hex[:6]}", "n1-agent"
    proto = aiomqtt.ProtocolVersion.V311
    try:
        async with aiomqtt.Client("127.0.0.1", daemon.mqtt_port, identifier="an-agent", protocol=proto) as c:
            await c.publish(
                wire.status_topic(job, agent),
                wire.encode_status(agent, "n1", "online", 1.0),
                qos=1,
                retain=True,
            )

        await asyncio.sleep(1.0)  # the daemon reads the status, then deletes it
        got: list[str] = []
        async with aiomqtt.Client("127.0.0.1", daemon.mqtt_port, identifier="late", protocol=proto) as late:
            await late.subscribe(f"denpex/v1/jobs/{job}/#", qos=1)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.5):
                    async for msg in late.messages:
                        if msg.payload:
                            got.append(str(msg.topic))
        assert got == []
    finally:
        assert await daemon.stop() == 0
