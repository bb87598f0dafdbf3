#!/usr/bin/env python3
"""One QoS 1 publisher at full speed against `denpexd serve`: memory, API latency, time to stop.

A client publishes valid batches of failure events (each event distinct, 200 per batch) as fast
as the broker acknowledges them, for `--seconds`. Meanwhile, once a second: the daemon's RSS
(/proc), and the time `GET /api/v1/jobs/<job>/events?limit=100` takes. Then SIGTERM, and the
time until the process has exited (the bound is `shutdown_timeout_s` + 5 s). Printed per broker
mode: batches acknowledged, RSS start / half-time / max / end, API p50 / max, seconds to stop, exit code.

    python3 bench/fault_overload.py                      # embedded broker and a private Mosquitto
    python3 bench/fault_overload.py --seconds 45 --modes mosquitto
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiomqtt

from _mosquitto import PrivateMosquitto, free_port
from denpex_agent import wire
from denpex_agent.events import Event

_QUIET = logging.getLogger("fault_overload.flood")  # not aiomqtt's "pending publish calls" per call
_QUIET.setLevel(logging.ERROR)


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _batch(job: str, seq: int, n: int = 200) -> bytes:
    now = time.time()
    events = [
        Event(
            id=f"e{seq}-{i}",
            kind="match",
            job=job,
            node="n1",
            rank=i % 64,
            local_rank=i % 8,
            file="rank.log",
            offset=seq * n + i,
            line_no=seq * n + i,
            ts=now,
            ts_source="line",
            rule="nccl-remote-error",
            category="communication",
            severity="error",
            role="collateral",
            text=f"NCCL error: remote process exited or there was a network error seq={seq} i={i}",
        )
        for i in range(n)
    ]
    return wire.encode_batch("n1", job, "n1", seq, now, events)


def _get_ms(url: str) -> float:
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            resp.read()
    except OSError:
        return float("inf")
    return (time.monotonic() - t0) * 1000


def run(mode: str, seconds: float) -> dict[str, float]:
    work = Path(tempfile.mkdtemp(prefix=f"denpex-overload-{mode}-"))
    http, port = free_port(), free_port()
    broker = None
    if mode == "mosquitto":
        broker = PrivateMosquitto(work)
        broker.start()
        port = broker.port
        extra = ["--broker", f"mqtt://127.0.0.1:{port}", "--client-id", f"denpexd-overload-{os.getpid()}"]
    else:
        extra = ["--mqtt-listen", f"127.0.0.1:{port}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DENPEX_")}
    base = f"http://127.0.0.1:{http}"
    with (work / "denpexd.log").open("wb") as log:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "denpexd", "serve", "--http-listen", f"127.0.0.1:{http}", "--data-dir",
             str(work / "data"), *extra], stdout=log, stderr=log, env=env,
        )  # fmt: skip
        for _ in range(200):
            if _get_ms(f"{base}/-/ready") != float("inf"):
                break
            time.sleep(0.1)
        rss_start = _rss_mb(daemon.pid)
        acked, rss, api = asyncio.run(_load(mode, port, base, daemon.pid, seconds))
        t0 = time.monotonic()
        daemon.send_signal(signal.SIGTERM)
        try:
            code = daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            code = daemon.wait()
        stop_s = time.monotonic() - t0
    if broker is not None:
        broker.stop()
    if code != 0:  # show why before the directory goes
        tail = (work / "denpexd.log").read_text(errors="replace").splitlines()[-40:]
        print(f"--- {mode}: denpexd exited {code}; the end of its log:", *tail, sep="\n", file=sys.stderr)
    shutil.rmtree(work, ignore_errors=True)
    finite = [a for a in api if a != float("inf")]
    return {
        "acked": acked,
        "rss_start": rss_start,
        "rss_half": rss[len(rss) // 2] if rss else 0.0,
        "rss_max": max(rss, default=0.0),
        "rss_end": rss[-1] if rss else 0.0,
        "api_p50": statistics.median(finite) if finite else float("inf"),
        "api_max": max(api, default=float("inf")),
        "api_failed": len(api) - len(finite),
        "stop_s": stop_s,
        "exit": code,
    }


async def _load(
    mode: str, port: int, base: str, pid: int, seconds: float
) -> tuple[int, list[float], list[float]]:
    """Publish at full speed for ``seconds``; sample RSS and the API once a second."""
    job = f"overload-{os.getpid()}"
    acked = 0
    stop = asyncio.Event()

    async def publish() -> None:
        nonlocal acked
        proto = aiomqtt.ProtocolVersion.V311 if mode == "embedded" else aiomqtt.ProtocolVersion.V5
        async with aiomqtt.Client("127.0.0.1", port, identifier=f"flood-{os.getpid()}", protocol=proto,
                                  max_inflight_messages=100, logger=_QUIET) as c:  # fmt: skip
            seq = 0
            pending: set[asyncio.Task[None]] = set()
            while not stop.is_set():
                seq += 1
                pending.add(asyncio.create_task(c.publish(wire.events_topic(job), _batch(job, seq), qos=1)))
                if len(pending) >= 100:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    acked += sum(1 for t in done if t.exception() is None)
            if pending:
                done, _ = await asyncio.wait(pending, timeout=10)
                acked += sum(1 for t in done if not t.cancelled() and t.exception() is None)

    publisher = asyncio.create_task(publish())
    rss: list[float] = []
    api: list[float] = []
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        await asyncio.sleep(1.0)
        rss.append(_rss_mb(pid))
        api.append(await asyncio.to_thread(_get_ms, f"{base}/api/v1/jobs/{job}/events?limit=100"))
    stop.set()
    await asyncio.wait({publisher}, timeout=15)
    return acked, rss, api


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument(
        "--modes", nargs="*", default=["embedded", "mosquitto"], choices=["embedded", "mosquitto"]
    )
    args = ap.parse_args()
    print(
        f"{'mode':10} {'acked':>7} {'rss MB start/half/max/end':>27} {'API ms p50/max':>16} {'failed':>6} {'stop s':>7} exit"
    )
    for mode in args.modes:
        r = run(mode, args.seconds)
        print(
            f"{mode:10} {r['acked']:7.0f} {r['rss_start']:6.0f}/{r['rss_half']:6.0f}/{r['rss_max']:6.0f}/{r['rss_end']:6.0f}    "
            f"{r['api_p50']:7.0f}/{r['api_max']:7.0f} {r['api_failed']:6.0f} {r['stop_s']:7.1f} {r['exit']:.0f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
