"""deploy/broker/mosquitto.conf and mosquitto.acl on a real Mosquitto.

The test runs a copy of the shipped configuration, changed only where a test must: the listener
(a free loopback port), the persistence, password and ACL paths (tmp), and `user root` (as root,
Mosquitto would otherwise switch to the mosquitto user, who cannot read the tmp files). The
password file is made with the real mosquitto_passwd, as deploy/broker/mosquitto.conf documents.

What is observable: with MQTT v5 Mosquitto answers an unauthorised QoS 1 publish with a PUBACK
reason code >= 0x80 (0x87 not authorised) and never forwards it; an unauthorised subscription
gets a failing SUBACK or simply never receives anything.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.reasoncodes import ReasonCode

from tests.integration.replay import free_port

pytestmark = [pytest.mark.integration]

BROKER = Path(__file__).resolve().parents[2] / "deploy" / "broker"
USERS = {
    "denpexd": "daemon-secret",
    "node01": "agent-secret-1",
    "node02": "agent-secret-2",
    "trainer-7/node02": "agent-secret-3",  # agent trainer-7 on node02: its principal
    "denpex-reader": "reader-secret",
}
JOB = "job-4711"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed (Debian package mosquitto; .ci/run installs it)")
    return path


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[int]:
    mosquitto, passwd = _tool("mosquitto"), _tool("mosquitto_passwd")
    pw = tmp_path / "passwd"
    for i, (user, secret) in enumerate(USERS.items()):
        flags = ["-c"] if i == 0 else []
        subprocess.run([passwd, *flags, "-b", str(pw), user, secret], check=True, timeout=30)
    shutil.copy(BROKER / "mosquitto.acl", tmp_path / "acl")
    port = free_port()
    conf = (BROKER / "mosquitto.conf").read_text()
    for pattern, repl in [
        (r"(?m)^listener 1883$", f"listener {port} 127.0.0.1"),
        (r"(?m)^persistence_location .*$", f"persistence_location {tmp_path}/"),
        (r"(?m)^password_file .*$", f"password_file {pw}"),
        (r"(?m)^acl_file .*$", f"acl_file {tmp_path / 'acl'}"),
    ]:
        conf, n = re.subn(pattern, repl, conf)
        assert n == 1, f"mosquitto.conf no longer has {pattern!r}"
    (tmp_path / "mosquitto.conf").write_text(conf + "\nuser root\n")
    log = open(tmp_path / "mosquitto.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([mosquitto, "-c", str(tmp_path / "mosquitto.conf")], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 10
        while True:
            probe = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
            try:
                probe.connect("127.0.0.1", port)
                probe.disconnect()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise AssertionError((tmp_path / "mosquitto.log").read_text()) from None
                time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


@dataclass
class Client:
    """A paho MQTT v5 client that records CONNACK, PUBACK and SUBACK reason codes and messages."""

    port: int
    user: str
    password: str
    c: mqtt.Client = field(init=False)
    connack: ReasonCode | None = None
    pubacks: dict[int, ReasonCode] = field(default_factory=dict)
    subacks: dict[int, list[ReasonCode]] = field(default_factory=dict)
    messages: list[tuple[str, bytes]] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"test-{self.user}", protocol=mqtt.MQTTv5)
        self.c.username_pw_set(self.user, self.password)
        self.c.on_connect = self._on_connect
        self.c.on_publish = self._on_publish
        self.c.on_subscribe = self._on_subscribe
        self.c.on_message = self._on_message

    def _note(self, fn: Any) -> None:
        with self.cond:
            fn()
            self.cond.notify_all()

    def _on_connect(self, _c: Any, _u: Any, _f: Any, rc: ReasonCode, _p: Any) -> None:
        self._note(lambda: setattr(self, "connack", rc))

    def _on_publish(self, _c: Any, _u: Any, mid: int, rc: ReasonCode, _p: Any) -> None:
        self._note(lambda: self.pubacks.__setitem__(mid, rc))

    def _on_subscribe(self, _c: Any, _u: Any, mid: int, rcs: list[ReasonCode], _p: Any) -> None:
        self._note(lambda: self.subacks.__setitem__(mid, rcs))

    def _on_message(self, _c: Any, _u: Any, msg: mqtt.MQTTMessage) -> None:
        self._note(lambda: self.messages.append((msg.topic, msg.payload)))

    def _wait(self, pred: Any, timeout: float = 5.0) -> None:
        with self.cond:
            assert self.cond.wait_for(pred, timeout), "timed out"

    def __enter__(self) -> Client:
        self.c.connect("127.0.0.1", self.port)
        self.c.loop_start()
        self._wait(lambda: self.connack is not None)
        return self

    def __exit__(self, *exc: object) -> None:
        self.c.disconnect()
        self.c.loop_stop()

    def publish(self, topic: str, payload: bytes) -> ReasonCode:
        mid = self.c.publish(topic, payload, qos=1).mid
        self._wait(lambda: mid in self.pubacks)
        return self.pubacks[mid]

    def subscribe(self, topic: str) -> ReasonCode:
        _, mid = self.c.subscribe(topic, qos=1)
        self._wait(lambda: mid in self.subacks)
        return self.subacks[mid][0]

    def received(self, topic: str) -> list[bytes]:
        with self.cond:
            return [p for t, p in self.messages if t == topic]


def test_agent_acl(broker: int) -> None:
    """Each agent publishes as itself only: its principal (the broker user name) is the topic
    level the ACL pins; diagnoses, alerts and clock replies are denpexd's alone."""
    with (
        Client(broker, "denpexd", USERS["denpexd"]) as daemon,
        Client(broker, "node01", USERS["node01"]) as agent,
        Client(broker, "trainer-7/node02", USERS["trainer-7/node02"]) as pod,
        Client(broker, "denpex-reader", USERS["denpex-reader"]) as reader,
    ):
        for c in (daemon, agent, pod, reader):
            assert c.connack is not None and not c.connack.is_failure, c.user
        assert daemon.subscribe("denpex/v1/#").value < 0x80
        assert reader.subscribe("denpex/v1/#").value < 0x80
        own_clock, other_clock = "denpex/v1/agents/node01/clock", "denpex/v1/agents/node02/clock"
        assert agent.subscribe(own_clock).value < 0x80
        other_sub = agent.subscribe(other_clock)  # refused (0x87) or accepted but never delivered

        allowed = [
            (agent, f"denpex/v1/jobs/{JOB}/from/node01/events"),
            (agent, f"denpex/v1/jobs/{JOB}/from/node01/clock"),
            (agent, f"denpex/v1/jobs/{JOB}/from/node01/status"),
            (pod, f"denpex/v1/jobs/{JOB}/from/trainer-7/node02/events"),
        ]
        refused = [
            (agent, f"denpex/v1/jobs/{JOB}/from/node02/events"),  # another agent
            (agent, f"denpex/v1/jobs/{JOB}/from/node01/node02/events"),  # another node
            (pod, f"denpex/v1/jobs/{JOB}/from/trainer-7/events"),  # its node left out
            (agent, f"denpex/v1/jobs/{JOB}/events"),  # the first revision's topic names nobody
            (agent, f"denpex/v1/jobs/{JOB}/diagnosis"),  # a planted diagnosis
            (agent, f"denpex/v1/alerts/{JOB}"),
            (agent, "denpex/v1/agents/node01/clock"),
            (reader, f"denpex/v1/jobs/{JOB}/from/node01/events"),
            (reader, f"denpex/v1/jobs/{JOB}/diagnosis"),
        ]
        for client, topic in allowed:
            rc = client.publish(topic, b"allowed")
            assert rc.value < 0x80, (client.user, topic, rc)
        for client, topic in refused:
            rc = client.publish(topic, b"forbidden")
            assert rc.value >= 0x80, (client.user, topic, rc)
            assert rc.getName() == "Not authorized", (client.user, topic, rc)

        # The daemon answers clocks: the agent reads its own, never another agent's.
        assert daemon.publish(own_clock, b"reply-1").value < 0x80
        assert daemon.publish(other_clock, b"reply-2").value < 0x80
        daemon._wait(lambda: len([p for _, p in daemon.messages if p == b"allowed"]) == len(allowed))
        agent._wait(lambda: agent.received(own_clock) == [b"reply-1"])
        time.sleep(0.5)  # anything forbidden would have been delivered by now
        assert agent.received(other_clock) == [], other_sub
        # The subscribers with read rights got every allowed message and none of the forbidden ones.
        for c in (daemon, reader):
            assert all(p != b"forbidden" for _, p in c.messages), (c.user, c.messages)
            assert sorted(t for t, p in c.messages if p == b"allowed") == sorted(t for _, t in allowed)


def test_wrong_password_and_anonymous_refused(broker: int) -> None:
    for user, password in (("node01", "wrong"), ("nobody", "x")):
        c = Client(broker, user, password)
        c.c.connect("127.0.0.1", broker)
        c.c.loop_start()
        try:
            c._wait(lambda c=c: c.connack is not None)
            assert c.connack is not None and c.connack.is_failure, (user, c.connack)
        finally:
            c.c.loop_stop()
    anon = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    got: list[ReasonCode] = []
    anon.on_connect = lambda _c, _u, _f, rc, _p: got.append(rc)
    anon.connect("127.0.0.1", broker)
    anon.loop_start()
    try:
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
        assert got and got[0].is_failure, got
    finally:
        anon.loop_stop()


def test_scale_settings_present() -> None:
    conf = (BROKER / "mosquitto.conf").read_text()
    settings = dict(
        line.split(None, 1) for line in conf.splitlines() if line.strip() and not line.startswith("#")
    )
    assert settings["persistence"] == "true" and settings["allow_anonymous"] == "false"
    assert int(settings["max_inflight_messages"]) >= 1000
    assert int(settings["max_queued_messages"]) >= 100_000
    emqx = (BROKER / "emqx.conf").read_text()
    assert "$share/denpexd/denpex/v1/jobs/+/events" in emqx
    assert re.search(r"shared_subscription_strategy\s*=\s*hash_topic", emqx)
