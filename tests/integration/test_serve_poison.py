"""Messages under 1 KB that used to end `denpexd serve`: absurd timestamps, deeply nested
fields, a clock offset of 1e308. Each is refused and counted by reason, the daemon lives on and
takes the next valid batch; through Mosquitto the daemon restarted on the same session is not
killed again (the poison was acknowledged, not left to be redelivered)."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from pathlib import Path
from typing import Any

import aiomqtt
import orjson
import pytest

from tests.integration.agent_harness import broker_up
from tests.integration.replay import MOSQUITTO, Daemon, forget_session

pytestmark = [pytest.mark.integration]


def _event(i: int, **change: Any) -> dict[str, Any]:
    return {
        "id": f"e{i}", "kind": "match", "rank": 0, "local_rank": 0, "file": "/l/rank0.log", "offset": i,
        "line_no": i + 1, "ts": time.time(), "ts_source": "line", "rule": "cuda-oom", "severity": "error",
        "role": "root-cause", "category": "out-of-memory", "text": "CUDA out of memory", "context": [],
        "fields": {}, **change,
    }  # fmt: skip


def _batch(job: str, *events: dict[str, Any]) -> bytes:
    doc = {
        "v": 1,
        "agent": "a1",
        "job": job,
        "node": "n1",
        "seq": 1,
        "sent_at": time.time(),
        "events": list(events),
    }
    return orjson.dumps(doc)


def _poison(job: str) -> dict[str, bytes]:
    nested = _batch(job, _event(4, fields={"a": "NEST"})).replace(
        b'"NEST"', b'{"x":' * 300 + b"1" + b"}" * 300
    )
    beat = {"kind": "heartbeat", "rule": None, "severity": None, "role": None, "category": None}
    return {
        "range": _batch(job, _event(1, ts=1e300)),
        "range-negative": _batch(job, _event(2, ts=-1e12)),
        "range-year-10000": _batch(job, _event(3, ts=253402300810.0)),
        "nesting": nested,
        "range-clock": _batch(
            job, _event(5, **beat, fields={"clock_offset_s": 1e308, "clock_uncertainty_s": 0.1})
        ),
    }


def _count(metrics: str, reason: str) -> float:
    m = re.search(rf'^denpex_ingest_batches_invalid_total{{reason="{reason}"}} ([0-9.e+]+)$', metrics, re.M)
    return float(m.group(1)) if m else 0.0


async def _send(port: int, job: str, payloads: list[bytes], v5: bool) -> None:
    proto = aiomqtt.ProtocolVersion.V5 if v5 else aiomqtt.ProtocolVersion.V311
    async with aiomqtt.Client(
        "127.0.0.1", port, identifier=f"poison-{uuid.uuid4().hex[:6]}", protocol=proto
    ) as c:
        for p in payloads:
            await c.publish(f"denpex/v1/jobs/{job}/events", p, qos=1)


async def _valid_is_taken(daemon: Daemon, job: str) -> None:
    for _ in range(100):
        status, doc = await daemon.get(f"/api/v1/jobs/{job}")
        if status == 200 and doc["verdict"] == "failed":
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the valid batch after the poison was not taken: {doc}")


@pytest.mark.asyncio
@pytest.mark.parametrize("broker", ["embedded", "mosquitto"])
async def test_poison_is_refused_counted_and_survived(tmp_path: Path, broker: str) -> None:
    if broker == "mosquitto" and not broker_up():
        pytest.skip("no MQTT broker on 127.0.0.1:1883 (.ci/run starts one)")
    client_id = f"denpexd-poison-{uuid.uuid4().hex[:6]}"
    external = "mqtt://127.0.0.1:1883" if broker == "mosquitto" else None
    daemon = Daemon(tmp_path / "data", *(["--client-id", client_id] if external else []), broker=external)
    await daemon.start()
    job = f"poison-{uuid.uuid4().hex[:6]}"
    try:
        poison = _poison(job)
        port = MOSQUITTO[1] if external else daemon.mqtt_port
        await _send(port, job, list(poison.values()), v5=bool(external))
        await _send(port, job, [_batch(job, _event(9))], v5=bool(external))
        await _valid_is_taken(daemon, job)
        metrics = ""
        for _ in range(100):  # a batch with a failure may be taken ahead of those queued before it
            _, metrics = await daemon.get("/metrics")
            if _count(metrics, "range") >= 4 and _count(metrics, "nesting") >= 1:
                break
            await asyncio.sleep(0.1)
        assert _count(metrics, "range") == 4, metrics
        assert _count(metrics, "nesting") == 1
        assert daemon.proc is not None and daemon.proc.returncode is None
        if external:  # the same session again: nothing of the poison comes back to kill it
            assert await daemon.stop() == 0
            await daemon.start()
            await asyncio.sleep(2.0)
            assert daemon.proc is not None and daemon.proc.returncode is None
            status, doc = await daemon.get(f"/api/v1/jobs/{job}")
            assert status == 200 and doc["verdict"] == "failed"
        status, _ = await daemon.get(f"/api/v1/jobs/{job}/events?rank=99999999999999999999999")
        assert status == 400
        print(
            f"poison ({broker}): {len(poison)} messages refused by reason (range "
            f"{_count(metrics, 'range'):.0f}, nesting {_count(metrics, 'nesting'):.0f}), the daemon alive"
            f"{' across a restart on the same session' if external else ''}, the next valid batch taken"
        )
    finally:
        assert await daemon.stop() == 0
        if external:
            await forget_session(client_id)
    assert "internal error" not in daemon.log.read_text()
