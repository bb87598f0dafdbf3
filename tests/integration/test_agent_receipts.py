"""Receipts, the agent's side: a real `denpex-agent` and a scripted daemon on Mosquitto.

Once the daemon's clock reply says that it sends receipts, the agent checkpoints a batch's lines
only when the daemon confirmed that batch and every batch sent before it; it sends unconfirmed
batches again, byte for byte, after `receipt_timeout`; a refused batch is not sent again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from pathlib import Path

import aiomqtt
import orjson
import pytest

from denpex_agent import wire
from tests.integration.agent_harness import BROKER_PORT, agent_cmd, broker_up, eventually, start_agent, stop

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not broker_up(), reason="no MQTT broker on 127.0.0.1:1883 (.ci/run starts one)"),
]

LINE = "[rank0]: RuntimeError: CUDA error: an illegal memory access was encountered marker={}\n"


def _checkpointed(state: Path) -> int:
    path = state / "checkpoints.json"
    if not path.exists():
        return 0
    files = orjson.loads(path.read_bytes())["files"]
    return max((f["offset"] for f in files.values()), default=0)


@pytest.mark.asyncio
async def test_checkpoints_follow_receipts_in_order_and_unconfirmed_batches_are_sent_again(
    tmp_path: Path,
) -> None:
    job, agent, node = f"rcpt-{uuid.uuid4().hex[:8]}", f"a-{uuid.uuid4().hex[:6]}", "n1"
    log, state = tmp_path / "logs" / "rank0.log", tmp_path / "state"
    log.parent.mkdir()
    log.write_text("")
    batches: list[bytes] = []  # payloads, in arrival order (re-sends included)
    replied = asyncio.Event()

    async with aiomqtt.Client("127.0.0.1", BROKER_PORT, identifier=f"fake-daemon-{job}") as daemon:
        await daemon.subscribe(f"denpex/v1/jobs/{job}/#", qos=1)

        async def serve() -> None:
            async for msg in daemon.messages:
                where = wire.parse_topic(msg.topic.value)
                payload = msg.payload if isinstance(msg.payload, bytes) else b""
                if where.kind == "events":
                    if b'"kind":"match"' in payload:
                        batches.append(payload)  # confirmed (or not) by the test below
                    else:  # heartbeats and progress: confirmed at once, as a daemon would
                        b = wire.decode_batch(payload)
                        await daemon.publish(
                            wire.receipt_topic(agent, node), wire.encode_receipt(job, b.seq, b.sent_at), qos=0
                        )
                elif where.kind == "clock":
                    _, t0 = wire.decode_clock_request(payload)
                    now = time.time()
                    reply = wire.encode_clock_reply(t0, now, now, receipts=True)
                    await daemon.publish(wire.clock_reply_topic(agent, node), reply, qos=0)
                    replied.set()

        server = asyncio.create_task(serve())
        cmd = agent_cmd(job, node, [str(log.parent / "*.log")], state, "--agent-id", agent,
                        "--receipt-timeout", "1.5", "--checkpoint-interval", "0.1")  # fmt: skip
        proc = start_agent(cmd, tmp_path / "agent.log")
        try:
            await asyncio.wait_for(replied.wait(), 20)
            await asyncio.sleep(0.5)
            sizes = []
            for i in range(3):  # three reads, three batches
                with log.open("a") as fh:
                    fh.write(LINE.format(i))
                sizes.append(log.stat().st_size)
                await eventually(lambda i=i: len({wire.decode_batch(b).seq for b in batches}) > i, within=10)
            sent = {}
            for b in batches:
                batch = wire.decode_batch(b)
                sent.setdefault(batch.seq, (batch, b))
            seqs = sorted(sent)
            assert len(seqs) == 3

            # Nothing confirmed: nothing checkpointed, and after receipt_timeout all three come again.
            await eventually(lambda: len(batches) >= 6, within=10)
            assert _checkpointed(state) == 0
            again = {}
            for b in batches[3:]:
                again.setdefault(wire.decode_batch(b).seq, b)
            assert all(again[s] == sent[s][1] for s in seqs), "re-sent byte for byte"

            def receipt(seq: int, refused: str | None = None) -> bytes:
                b = sent[seq][0]
                return wire.encode_receipt(job, b.seq, b.sent_at, refused)

            topic = wire.receipt_topic(agent, node)
            # The second and third confirmed (the third refused for good): the first still holds all.
            await daemon.publish(topic, receipt(seqs[2], refused="schema: a test"), qos=0)
            await daemon.publish(topic, receipt(seqs[1]), qos=0)
            await asyncio.sleep(1.0)
            assert _checkpointed(state) == 0
            # The first confirmed: the checkpoint moves past all three at once.
            await daemon.publish(topic, receipt(seqs[0]), qos=0)
            await eventually(lambda: _checkpointed(state) == sizes[-1], within=10)
            # Confirmed batches are not sent again.
            count = len(batches)
            await asyncio.sleep(3.5)
            assert len(batches) == count
        finally:
            stop(proc)
            server.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await server
    text = (tmp_path / "agent.log").read_text()
    assert "the daemon confirms what it stores" in text
    assert "sending batches again" in text
    assert "refused a batch for good" in text and "schema: a test" in text
