#!/usr/bin/env python3
"""Mosquitto killed with SIGKILL under QoS 1 load: how many acknowledged messages are lost?

What denpexd relies on when it uses a site broker: once Mosquitto has acknowledged an agent's
QoS 1 batch, the batch reaches denpexd's persistent session even if Mosquitto dies right after.
Mosquitto keeps messages in memory and writes its whole database to disk now and then, so a
`kill -9` loses what arrived since the last save. This script measures that, for the
persistence settings of deploy/broker/mosquitto.conf and for the alternatives:

* a publisher (MQTT v5, QoS 1, persistent session) sends numbered messages as fast as the
  broker acknowledges them and records each acknowledged number;
* a subscriber with a persistent session (like denpexd's, QoS 1) records what it receives;
* every few seconds the broker gets SIGKILL and is started again on the same database.

Printed per setting: sent, acknowledged, received, lost (acknowledged, never received),
duplicates (received more than once: QoS 1 allows them, denpexd drops them by event id),
acknowledged messages per second (the cost of saving more often), kills.

This is the broker alone. Denpex does not depend on it: agents checkpoint on the daemon's
receipts and send again what was not confirmed, and tests/integration/test_fault_kill9.py shows
0 lost end to end under the same kills with the shipped settings.

    python3 bench/fault_broker_kill.py                  # all settings, 30 s each
    python3 bench/fault_broker_kill.py --seconds 60 --settings shipped
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from _mosquitto import PrivateMosquitto

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "deploy" / "broker" / "mosquitto.conf"
TOPIC = "denpex/v1/jobs/bench/from/n1/events"


def shipped_persistence() -> str:
    """The persistence lines of the shipped configuration, as they are."""
    keep = ("persistence ", "autosave_interval", "autosave_on_changes")
    return "\n".join(line for line in SHIPPED.read_text().splitlines() if line.startswith(keep))


SETTINGS = {
    "shipped": None,  # read from deploy/broker/mosquitto.conf
    "every-30s": "persistence true\nautosave_interval 30",
    "every-change": "persistence true\nautosave_on_changes true\nautosave_interval 1",
}


def _client(client_id: str) -> mqtt.Client:
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    c.max_inflight_messages_set(100)
    c.max_queued_messages_set(0)
    c.reconnect_delay_set(0.05, 0.5)
    return c


def _connect(c: mqtt.Client, port: int) -> None:
    props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
    props.SessionExpiryInterval = 86_400
    c.connect("127.0.0.1", port, clean_start=False, properties=props)
    c.loop_start()


def run(name: str, persistence: str, seconds: float, kill_every: float) -> dict[str, float]:
    work = Path(tempfile.mkdtemp(prefix=f"denpex-brokerkill-{name}-"))
    broker = PrivateMosquitto(
        work, f"{persistence}\npersistence_location {work}/\nmax_inflight_messages 1000"
    )
    broker.start()
    received: dict[int, int] = {}
    acked: set[int] = set()
    sent_mid: dict[int, int] = {}  # in flight: mid -> message number (the producer's alone)
    lock = threading.Lock()
    subscribed = threading.Event()

    sub = _client(f"sink-{name}")

    def on_connect(c: mqtt.Client, _u: object, _f: object, rc: object, _p: object) -> None:
        c.subscribe(TOPIC, qos=1)

    def on_subscribe(*_a: object) -> None:
        subscribed.set()

    def on_message(_c: mqtt.Client, _u: object, msg: mqtt.MQTTMessage) -> None:
        n = int(msg.payload)
        with lock:
            received[n] = received.get(n, 0) + 1

    sub.on_connect, sub.on_subscribe, sub.on_message = on_connect, on_subscribe, on_message
    _connect(sub, broker.port)
    subscribed.wait(10)

    pub = _client(f"source-{name}")
    # paho calls on_publish with its own lock held, and publish() takes that lock: the callback
    # only queues (mid, reason), and the producer thread resolves mids to message numbers.
    acks: deque[tuple[int, int]] = deque()

    def on_publish(_c: mqtt.Client, _u: object, mid: int, rc: object, _p: object) -> None:
        acks.append((mid, int(getattr(rc, "value", 0))))

    pub.on_publish = on_publish
    _connect(pub, broker.port)
    stop = threading.Event()
    sent = 0
    early: list[tuple[int, int]] = []  # acknowledgements that overtook their publish() return

    def resolve() -> None:
        pending = early + [acks.popleft() for _ in range(len(acks))]
        early.clear()
        for mid, value in pending:
            n = sent_mid.pop(mid, None)
            if n is None:
                early.append((mid, value))
            elif value < 0x80:
                with lock:
                    acked.add(n)

    def produce() -> None:
        nonlocal sent
        while not stop.is_set() or sent_mid:
            resolve()
            if stop.is_set() or len(sent_mid) >= 100 or not pub.is_connected():
                time.sleep(0.001)
                if stop.is_set() and time.monotonic() > drain_until:
                    return
                continue
            info = pub.publish(TOPIC, str(sent).encode(), qos=1)
            if info.rc in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
                sent_mid[info.mid] = sent
                sent += 1

    drain_until = float("inf")
    producer = threading.Thread(target=produce, daemon=True)
    t0 = time.monotonic()
    producer.start()
    kills = 0
    next_kill = t0 + kill_every
    while time.monotonic() - t0 < seconds:
        time.sleep(0.05)
        if time.monotonic() >= next_kill:
            broker.kill()
            kills += 1
            time.sleep(0.3)
            broker.start()
            next_kill = time.monotonic() + kill_every
    elapsed = time.monotonic() - t0
    # stop sending; what is in flight is re-sent by the publisher until acknowledged
    drain_until = time.monotonic() + 30
    stop.set()
    producer.join()
    last: tuple[int, int] | None = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the subscriber receives what the broker still holds
        with lock:
            now = (len(acked), len(received))
        if now == last:
            break
        last = now
        time.sleep(1.0)
    pub.loop_stop()
    sub.loop_stop()
    pub.disconnect()
    sub.disconnect()
    broker.stop()
    shutil.rmtree(work, ignore_errors=True)
    with lock:
        lost = len(acked - set(received))
        dups = sum(v - 1 for v in received.values())
        return {
            "sent": sent,
            "acked": len(acked),
            "received": len(received),
            "lost": lost,
            "lost_pct": 100.0 * lost / max(1, len(acked)),
            "duplicates": dups,
            "acked_per_s": len(acked) / elapsed,
            "kills": kills,
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0, help="load per setting (default 30)")
    ap.add_argument("--kill-every", type=float, default=4.0, help="seconds between kills (default 4)")
    ap.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    args = ap.parse_args(argv)
    if shutil.which("mosquitto") is None and not Path("/usr/sbin/mosquitto").exists():
        print("fault_broker_kill: mosquitto is not installed (apt-get install -y mosquitto)", file=sys.stderr)
        return 2
    print(f"shipped persistence: {shipped_persistence()!r}")
    print(
        f"{'setting':14} {'sent':>8} {'acked':>8} {'received':>9} {'lost':>6} {'lost%':>7} {'dups':>6} {'acked/s':>8} kills"
    )
    for name in args.settings:
        persistence = shipped_persistence() if name == "shipped" else SETTINGS[name]
        assert persistence is not None
        r = run(name, persistence, args.seconds, args.kill_every)
        print(
            f"{name:14} {r['sent']:8.0f} {r['acked']:8.0f} {r['received']:9.0f} {r['lost']:6.0f} "
            f"{r['lost_pct']:6.2f}% {r['duplicates']:6.0f} {r['acked_per_s']:8.0f} {r['kills']:.0f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
