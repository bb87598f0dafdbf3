#!/usr/bin/env python3
"""Does the broker respect a subscriber's MQTT v5 Receive Maximum while acknowledgements flow?

denpexd acknowledges a QoS 1 delivery only after storing it and connects with Receive Maximum
256, counting on the broker to hold back the rest. This script checks that promise without the
daemon: a subscriber (Receive Maximum 256, manual acknowledgement) acknowledges the oldest
delivery every 10 ms while a publisher floods the topic; it prints how many deliveries the
subscriber holds unacknowledged over time. A broker that respects the limit keeps that at 256.

    python3 bench/broker_receive_maximum.py                       # a private Mosquitto
    python3 bench/broker_receive_maximum.py --broker 127.0.0.1:1883

Found on 2026-11-30 with Mosquitto 2.0.11 (Debian): with nothing acknowledged the subscriber
holds exactly 256; once acknowledgements trickle in, thousands (see bench/README.md).
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
import uuid
from collections import deque
from pathlib import Path

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from _mosquitto import PrivateMosquitto

RECEIVE_MAXIMUM = 256


def measure(host: str, port: int, messages: int, payload_bytes: int) -> list[tuple[int, int]]:
    """(acknowledged, held unacknowledged) every 0.5 s (paho's public API, threads)."""
    topic = f"denpex-bench/receive-maximum/{uuid.uuid4().hex}"
    props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
    props.ReceiveMaximum = RECEIVE_MAXIMUM
    held: deque[int] = deque()  # mids, oldest first
    subscribed = threading.Event()
    sub = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5, manual_ack=True)
    sub.on_message = lambda _c, _u, msg: held.append(msg.mid)
    sub.on_subscribe = lambda *_a: subscribed.set()
    sub.connect(host, port, properties=props)
    sub.loop_start()
    sub.subscribe(topic, qos=1)
    subscribed.wait(10)
    pub = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    pub.max_inflight_messages_set(100)
    pub.connect(host, port)
    pub.loop_start()
    stop = threading.Event()

    def flood() -> None:
        sent: deque[mqtt.MQTTMessageInfo] = deque()
        for _ in range(messages):
            sent.append(pub.publish(topic, b"x" * payload_bytes, qos=1))
            while len(sent) > 100:  # at most 100 unacknowledged towards the broker
                if stop.is_set():
                    return
                if sent[0].is_published():
                    sent.popleft()
                else:
                    time.sleep(0.001)

    publisher = threading.Thread(target=flood, daemon=True)
    publisher.start()
    acked = 0
    samples: list[tuple[int, int]] = []
    t_next = time.monotonic()
    for _ in range(400):
        time.sleep(0.01)
        if held:
            sub.ack(held.popleft(), 1)
            acked += 1
        if time.monotonic() >= t_next:
            samples.append((acked, len(held)))
            t_next += 0.5
    stop.set()
    for c in (pub, sub):
        c.loop_stop()
        c.disconnect()
    return samples


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--broker", help="HOST:PORT of a running broker (default: a private Mosquitto)")
    ap.add_argument("--messages", type=int, default=6000)
    ap.add_argument("--payload-bytes", type=int, default=40_000)
    args = ap.parse_args()
    broker = None
    if args.broker:
        host, _, port_text = args.broker.rpartition(":")
        port = int(port_text)
    else:
        broker = PrivateMosquitto(Path(tempfile.mkdtemp(prefix="denpex-receive-max-")))
        broker.start()
        host, port = "127.0.0.1", broker.port
        print(f"private broker: {broker.version}")
    try:
        samples = measure(host, port, args.messages, args.payload_bytes)
    finally:
        if broker is not None:
            broker.stop()
    print(f"Receive Maximum {RECEIVE_MAXIMUM}; acknowledging the oldest delivery every 10 ms")
    print(f"{'t s':>5} {'acknowledged':>13} {'held unacknowledged':>20}")
    for i, (acked, held) in enumerate(samples):
        print(f"{i * 0.5:5.1f} {acked:13d} {held:20d}")
    worst = max((h for _, h in samples), default=0)
    print(f"most held at once: {worst} ({'within' if worst <= RECEIVE_MAXIMUM else 'beyond'} the limit)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
