"""Only the right writers on the embedded broker: with `agent_secret`, every client needs the
password `denpexd credential` derives for it; an agent publishes only on its own topics (and the
daemon refuses a payload that claims another sender), only the daemon publishes diagnoses,
alerts and clock replies, and a reader reads but never writes. Without a secret (local
development, loopback only) anonymous agents are accepted, but they still cannot plant a
diagnosis. A real `denpexd serve` and real MQTT clients."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import aiomqtt
import orjson
import pytest

from denpex_agent import wire
from denpex_agent.events import Event
from tests.integration.replay import Daemon

pytestmark = [pytest.mark.integration]

SECRET = "an-agent-secret-of-the-test-" + "s" * 12
V311 = aiomqtt.ProtocolVersion.V311


def _credential(*args: str) -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DENPEX_")}
    env["DENPEX_AGENT_SECRET"] = SECRET
    out = subprocess.run(
        [sys.executable, "-m", "denpexd", "credential", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    lines = dict(line.split("=", 1) for line in out.stdout.splitlines())
    return lines["DENPEX_USERNAME"], lines["DENPEX_PASSWORD"]


def _batch(agent: str, node: str, job: str, seq: int, rank: int, text: str) -> bytes:
    ev = Event(
        id=f"{agent}-{seq}", kind="match", job=job, node=node, rank=rank, local_rank=rank, file=f"rank{rank}.log",
        offset=seq, line_no=seq, ts=time.time(), ts_source="line", rule="nccl-timeout", category="communication",
        severity="error", role="root-cause", text=text,
    )  # fmt: skip
    return wire.encode_batch(agent, job, node, seq, time.time(), [ev])


def _client(port: int, user: str | None, password: str | None, **kw: object) -> aiomqtt.Client:
    return aiomqtt.Client(
        "127.0.0.1", port, username=user, password=password, protocol=V311,
        identifier=f"t-{uuid.uuid4().hex[:10]}", timeout=5, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


async def _refused(port: int, user: str | None, password: str | None, **kw: object) -> bool:
    try:
        async with _client(port, user, password, **kw):
            return False
    except aiomqtt.MqttError:
        return True


async def _collect(client: aiomqtt.Client, into: list[tuple[str, bytes]]) -> None:
    async for m in client.messages:
        into.append((m.topic.value, m.payload if isinstance(m.payload, bytes) else b""))


@pytest.mark.asyncio
async def test_with_a_secret_each_agent_speaks_for_itself_only(tmp_path: Path) -> None:
    conf = tmp_path / "serve.toml"
    conf.write_text(f'agent_secret = "{SECRET}"\n')
    daemon = Daemon(tmp_path / "data", "--config", str(conf))
    await daemon.start()
    port, job = daemon.mqtt_port, f"acl-{uuid.uuid4().hex[:8]}"
    n1 = _credential("--agent", "n1")
    n2 = _credential("--agent", "n2")
    pod = _credential("--agent", "pod-7", "--node", "n2")
    reader = _credential("--reader", "dashboard")
    assert n1[0] == "n1" and pod[0] == "pod-7/n2" and len({n1[1], n2[1], pod[1], reader[1]}) == 4
    try:
        # Nobody in without a password derived for that very name.
        for user, password in ((None, None), ("n1", "wrong"), ("n1", n2[1]), ("n2", reader[1]),
                               ("denpexd", "guess"), ("dashboard", n1[1])):  # fmt: skip
            assert await _refused(port, user, password), (user, password)
        # A last will on someone else's topic (it would be published, retained, on disconnect).
        will = aiomqtt.Will(wire.diagnosis_topic(job), b'{"forged": true}', qos=1, retain=True)
        assert await _refused(port, *n1, will=will)

        seen: list[tuple[str, bytes]] = []
        async with _client(port, *reader) as r:
            await r.subscribe("denpex/v1/#", qos=1)
            watcher = asyncio.create_task(_collect(r, seen))
            async with _client(port, *n1) as c:
                own = wire.sender_topic(job, "n1", "n1", "events")
                await c.publish(own, _batch("n1", "n1", job, 1, 0, "genuine"), qos=1)
                # the broker drops these: another agent's topic, the first revision's, a daemon topic
                await c.publish(
                    wire.sender_topic(job, "n2", "n2", "events"),
                    _batch("n2", "n2", job, 1, 1, "forged-a"),
                    qos=1,
                )
                await c.publish(wire.events_topic(job), _batch("n2", "n2", job, 2, 1, "forged-b"), qos=1)
                await c.publish(wire.diagnosis_topic(job), b'{"forged": true}', qos=1, retain=True)
                await c.publish(wire.alerts_topic(job), b'{"forged": true}', qos=1)
                await c.publish(wire.clock_reply_topic("n2"), b"[1,2,3]", qos=1)
                # the daemon refuses these: its own topic, a payload naming another sender
                await c.publish(own, _batch("n2", "n2", job, 3, 1, "forged-c"), qos=1)
                await c.publish(own, _batch("n1", "n9", job, 4, 1, "forged-d"), qos=1)
                # an agent reads nothing but its own clock replies (3.1.1: a refused filter is 0x80)
                with contextlib.suppress(aiomqtt.MqttError):
                    granted = await c.subscribe("#", qos=1)
                    assert 128 in [getattr(g, "value", g) for g in granted], granted
            async with _client(port, *pod) as p:  # agent pod-7 on node n2: its own two-level topic
                await p.publish(
                    wire.sender_topic(job, "pod-7", "n2", "events"),
                    _batch("pod-7", "n2", job, 1, 1, "genuine-pod"),
                    qos=1,
                )
            doc = await daemon.wait_events(job, 2)
            # a reader cannot publish either
            await r.publish(
                wire.sender_topic(job, "n1", "n1", "events"), _batch("n1", "n1", job, 9, 0, "forged-e"), qos=1
            )
            await asyncio.sleep(1.5)
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        status, events = await daemon.get(f"/api/v1/jobs/{job}/events?limit=100")
        assert status == 200
        texts = sorted(e["text"] for e in events["events"])
        assert texts == ["genuine", "genuine-pod"], texts
        assert doc["stats"]["events"] == 2
        metrics = (await daemon.get("/metrics"))[1]
        m = re.search(r'denpex_ingest_batches_invalid_total\{reason="topic_mismatch"\} (\S+)', metrics)
        assert m is not None and float(m.group(1)) == 2.0, metrics[-3000:]
        # The reader saw the genuine traffic and the daemon's diagnosis. Of the forgeries only those
        # n1 sent on its own topic went out (the broker cannot read payloads; the daemon refused them).
        forged = sorted((t, orjson.loads(p)["events"][0]["text"]) for t, p in seen if b"forged" in p)
        own = wire.sender_topic(job, "n1", "n1", "events")
        assert forged == [(own, "forged-c"), (own, "forged-d")], forged
        assert any(t == wire.diagnosis_topic(job) for t, _ in seen)
        log = daemon.log.read_text()
        assert "broker client refused" in log and SECRET not in log
    finally:
        await daemon.stop()


@pytest.mark.asyncio
async def test_local_development_mode_accepts_anonymous_agents_but_not_forged_diagnoses(
    tmp_path: Path,
) -> None:
    daemon = Daemon(tmp_path / "data")  # no secret: loopback only
    await daemon.start()
    port, job = daemon.mqtt_port, f"dev-{uuid.uuid4().hex[:8]}"
    try:
        async with _client(port, None, None) as c:
            await c.publish(
                wire.sender_topic(job, "n1", "n1", "events"), _batch("n1", "n1", job, 1, 0, "genuine"), qos=1
            )
            await c.publish(wire.events_topic(job), _batch("n2", "n2", job, 1, 1, "first-revision"), qos=1)
            await daemon.wait_events(job, 2)
            await asyncio.sleep(1.0)  # the daemon has published its diagnosis by now
            await c.publish(wire.diagnosis_topic(job), b'{"forged": true}', qos=1, retain=True)
        will = aiomqtt.Will(wire.diagnosis_topic(job), b'{"forged": true}', qos=1, retain=True)
        assert await _refused(port, None, None, will=will)
        got: list[tuple[str, bytes]] = []
        async with _client(port, None, None) as late:
            await late.subscribe(wire.diagnosis_topic(job), qos=1)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2.0):
                    await _collect(late, got)
        assert got, "the daemon's retained diagnosis"
        assert all(orjson.loads(p).get("forged") is None for _, p in got), got
    finally:
        await daemon.stop()


def _agent(tmp_path: Path, daemon: Daemon, job: str, node: str, *args: str) -> subprocess.Popen[bytes]:
    """A real agent of ``node`` (with ``args``) reading one rank's NCCL watchdog timeout."""
    from tests.integration.agent_harness import agent_cmd, start_agent

    logs = tmp_path / node
    logs.mkdir()
    (logs / "rank0.log").write_text(
        "[E ProcessGroupNCCL.cpp:1234] Watchdog caught collective operation timeout: "
        f"WorkNCCL(SeqNum=1, OpType=ALLREDUCE) ran for 600000 milliseconds before timing out. {node}\n"
    )
    cmd = agent_cmd(job, node, [str(logs / "*.log")], tmp_path / f"state-{node}", *args,
                    "--mqtt-version", "3.1.1", port=daemon.mqtt_port)  # fmt: skip
    return start_agent(cmd, tmp_path / f"agent-{node}.log")


async def _nodes_stored(daemon: Daemon, job: str, expected: set[str]) -> set[str]:
    """The nodes whose events the daemon stored for ``job``, once they are ``expected`` (or 30 s)."""
    nodes: set[str] = set()
    for _ in range(100):
        status, doc = await daemon.get(f"/api/v1/jobs/{job}/events?limit=100")
        nodes = {e["node"] for e in doc["events"]} if status == 200 else set()
        if nodes == expected:
            break
        await asyncio.sleep(0.3)
    return nodes


@pytest.mark.asyncio
async def test_real_agents_connect_with_their_credentials(tmp_path: Path) -> None:
    """`denpex-agent` with the password `denpexd credential` printed (the user name defaults to
    its principal), and with the shared `agent_password`; the wrong one is refused and says so."""
    from tests.integration.agent_harness import eventually, stop

    shared = "one-password-for-all-agents"
    conf = tmp_path / "serve.toml"
    conf.write_text(f'agent_secret = "{SECRET}"\nagent_password = "{shared}"\n')
    daemon = Daemon(tmp_path / "data", "--config", str(conf))
    await daemon.start()
    job = f"cred-{uuid.uuid4().hex[:8]}"
    procs = []
    try:
        for node, agent, password in (
            ("n1", "n1", _credential("--agent", "n1")[1]),
            ("n2", "pod-2", _credential("--agent", "pod-2", "--node", "n2")[1]),
            ("n3", "n3", shared),
            ("n4", "n4", _credential("--agent", "n1")[1]),  # someone else's password
        ):
            procs.append(
                (node, _agent(tmp_path, daemon, job, node, "--agent-id", agent, "--password", password))
            )
        assert await _nodes_stored(daemon, job, {"n1", "n2", "n3"}) == {"n1", "n2", "n3"}
        n4_log = tmp_path / "agent-n4.log"
        await eventually(
            lambda: "the broker refused this agent's credentials" in n4_log.read_text(), within=10
        )
    finally:
        for _, proc in procs:
            stop(proc)
        await daemon.stop()
    assert SECRET not in daemon.log.read_text() and shared not in daemon.log.read_text()


def test_credential_says_what_is_missing() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DENPEX_")}
    run = [sys.executable, "-m", "denpexd", "credential"]
    none = subprocess.run([*run, "--agent", "n1"], capture_output=True, text=True, env=env, timeout=30)
    assert none.returncode == 2 and "no agent_secret configured" in none.stderr
    env["DENPEX_AGENT_SECRET"] = SECRET
    bad = subprocess.run([*run, "--agent", "a/b"], capture_output=True, text=True, env=env, timeout=30)
    assert bad.returncode == 2 and "invalid agent id" in bad.stderr
    both = subprocess.run(
        [*run, "--reader", "r", "--node", "n"], capture_output=True, text=True, env=env, timeout=30
    )
    assert both.returncode == 2 and "--node is for agents" in both.stderr
    neither = subprocess.run(run, capture_output=True, text=True, env=env, timeout=30)
    assert neither.returncode == 2
    ok = subprocess.run([*run, "--agent", "n1"], capture_output=True, text=True, env=env, timeout=30)
    assert ok.returncode == 0 and SECRET not in ok.stdout


@pytest.mark.asyncio
async def test_pods_log_in_with_their_service_account_tokens(tmp_path: Path) -> None:
    """Kubernetes: `agent_token_keys` holds the cluster's public keys; each `denpex-agent` reads
    its pod's token from `password_file` (renewed there: read again at every connection). A
    token names its pod and node: an agent claiming another node with it is refused, and so is a
    token signed by another cluster; the right ones are stored."""
    from tests.integration.agent_harness import eventually, stop
    from tests.unit.test_pod_identity import AUDIENCE, ISSUER, Cluster

    cluster, foreign = Cluster(), Cluster(kid="k1")
    conf = tmp_path / "serve.toml"
    conf.write_text(
        f'agent_token_keys = "{cluster.jwks(tmp_path)}"\nagent_token_audience = "{AUDIENCE}"\n'
        f'agent_token_issuer = "{ISSUER}"\n'
    )
    daemon = Daemon(tmp_path / "data", "--config", str(conf))
    await daemon.start()
    job = f"pods-{uuid.uuid4().hex[:8]}"
    procs = []
    try:
        for node, pod, token in (
            ("gpu-1", "train-0", cluster.token("train-0", "gpu-1")),
            ("gpu-2", "train-1", cluster.token("train-1", "gpu-2")),
            ("gpu-3", "train-0", cluster.token("train-0", "gpu-1")),  # pod train-0 claims gpu-3
            ("gpu-4", "train-4", foreign.token("train-4", "gpu-4")),  # another cluster's
        ):
            token_file = tmp_path / f"token-{node}"
            token_file.write_text(token + "\n")
            procs.append(
                _agent(tmp_path, daemon, job, node, "--agent-id", pod, "--password-file", str(token_file))
            )
        assert await _nodes_stored(daemon, job, {"gpu-1", "gpu-2"}) == {"gpu-1", "gpu-2"}
        for node in ("gpu-3", "gpu-4"):
            log = tmp_path / f"agent-{node}.log"
            await eventually(
                lambda log=log: "the broker refused this agent's credentials" in log.read_text(), within=10
            )  # type: ignore[misc]
        text = daemon.log.read_text()
        assert "pod 'train-0' on node 'gpu-1', not 'train-0' on 'gpu-3'" in text
        assert "Signature verification failed" in text
        # refused at CONNECT (their logs say so above): nothing of theirs can have been stored
        assert await _nodes_stored(daemon, job, {"gpu-1", "gpu-2"}) == {"gpu-1", "gpu-2"}
    finally:
        for proc in procs:
            stop(proc)
        await daemon.stop()
    logs = [daemon.log, *(tmp_path / f"agent-{n}.log" for n in ("gpu-1", "gpu-2", "gpu-3", "gpu-4"))]
    logged = "".join(path.read_text() for path in logs)
    for node in ("gpu-1", "gpu-2", "gpu-3", "gpu-4"):
        token = (tmp_path / f"token-{node}").read_text().strip()
        assert token.split(".")[2] not in logged  # tokens are never logged
