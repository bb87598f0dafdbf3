"""Load generator for `denpexd serve`: 512 nodes x 8 ranks through a real Mosquitto.

The benchmark starts its own Mosquitto on a free loopback port with a generated configuration
(`mosquitto_conf()`: in-flight window and queue sized for thousands of agents, persistence off)
so that the broker's defaults (20 messages in flight, 1,000 queued) are not what is measured;
`--broker mqtt://HOST:PORT` uses an existing broker instead.

Phase 1 (throughput): every rank publishes progress events for STEPS steps as fast as the
publishers can, batched per node as agents do; the daemon's CPU seconds come from
/proc/<pid>/stat, so events per CPU second is its sustained rate on one core. Baseline in the
same run: the reference validator (the hand validator from before msgspec, kept unchanged in
bench_wire.py as `hand_decode_batch` so that the baseline stays comparable across rounds) alone on
the same kind of batch, timed in this process just before and just after phase 1
(`reference_events_per_cpu_s`); the ratio
of the two says how the daemon did independently of how fast the shared machine was just then.
Phase 2 (latency): TRIALS fresh jobs of 4,096 ranks each get a few steps of progress (a burst of
5 x 4,096 events), then, right behind that burst, a failure cascade: one rank's CUDA OOM (root
cause) followed, 50 ms later, by collateral on every other rank (each publisher connection
publishes its nodes' batches one after the other, the 16 connections at once, as independent
agents would; `--serial-collateral`: all 511 batches one after the other, the load of the rounds
before 2026-12-02). Latency = from publishing the initiating line
to receiving (a) the retained diagnosis naming that rank and (b) the MQTT alert. Each trial
starts once the daemon has ingested everything published before it (`--back-to-back`: as soon
as the previous trial's alert arrived, which offers more than the daemon absorbs once alerts
are fast). Phase 3 (stall): STALL_TRIALS fresh jobs of 4,096 ranks each log 5 steps (step lines
0.5 s apart by their timestamps) and then nothing: the daemon runs with `stall_floor_s` =
--stall-floor and `stall_factor` 2, so the threshold is the floor; latency = from publishing
the last step to receiving the stall's MQTT alert, minus nothing (the threshold is part of it and
reported next to it). Prints a JSON summary. `--memory-jobs K` runs `memory_mode` instead: the
daemon's RSS per open failed 4,096-rank job, optionally against another checkout's daemon.

    python bench/bench_serve.py [--nodes 512] [--ranks-per-node 8] [--steps 60] [--trials 10]
        [--back-to-back] [--stall-trials 5] [--stall-floor 2] [--broker mqtt://127.0.0.1:1883]
        [--mosquitto PATH] [--profile OUT.pstats]
    python bench/bench_serve.py --memory-jobs 4 [--memory-rounds 3] [--baseline-tree DIR]
        [--tracemalloc PATH]
    python bench/bench_serve.py --rounds 3 [--variant DENPEX_KEY=VALUE ...] [--baseline-tree DIR]

With `--rounds N` and a `--variant` (settings) or a `--baseline-tree` (another checkout), each
side gets a fresh daemon per round, the sides alternating, and the JSON holds every run and each
side's medians.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import aiomqtt
import orjson

from bench_wire import hand_decode_batch  # bench/ is on the path when run as python bench/NAME.py
from denpex_agent import wire
from denpex_agent.events import Event

PUBLISHERS = 16


SERIAL_COLLATERAL = {"on": False}  # --serial-collateral: one publish at a time across all publishers
TOPIC_MODE = {"mode": "sender"}  # --topic: sender (agents now; the daemon sends receipts) or first-revision


def _topic(job: str, node: str) -> str:
    """Where node's agent publishes: its own sender topic (receipts follow) or the first
    revision's topic (no receipts), to measure what receipts cost."""
    if TOPIC_MODE["mode"] == "first-revision":
        return wire.events_topic(job)
    return wire.sender_topic(job, f"{node}-agent", node, "events")


def mosquitto_conf(port: int) -> str:
    """The private broker's configuration (see bench/README.md for what each setting is for)."""
    return "\n".join(
        (
            f"listener {port} 127.0.0.1",
            "allow_anonymous true",
            "persistence false",
            # QoS 1 messages in flight per client (the daemon's own Receive Maximum caps it too)
            "max_inflight_messages 1000",
            # messages queued per client beyond the in-flight window before Mosquitto drops QoS 1
            "max_queued_messages 1000000",
            "max_queued_bytes 0",
            "set_tcp_nodelay true",
            "log_type error",
            "log_type warning",
            "",
        )
    )


@contextlib.asynccontextmanager
async def private_broker(binary: str) -> Any:
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="denpex-bench-mosq-") as tmp:
        conf = Path(tmp) / "mosquitto.conf"
        conf.write_text(mosquitto_conf(port))
        proc = await asyncio.create_subprocess_exec(binary, "-c", str(conf))
        try:
            for _ in range(100):
                with contextlib.suppress(OSError):
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                await asyncio.sleep(0.05)
            else:
                raise RuntimeError(f"mosquitto did not start on 127.0.0.1:{port}")
            yield ("127.0.0.1", port)
        finally:
            proc.terminate()
            await proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


async def _wait_ingested(url: str, base: float, sent: int) -> None:
    """Until the daemon has ingested `sent` events since its counter read `base`."""
    got, stalled = 0.0, time.monotonic()
    while got < sent:
        # a /metrics scrape costs the daemon ~10 ms of CPU (a few thousand series): Prometheus
        # scrapes every 15 s or so; twice a second is plenty here and still charges the daemon
        await asyncio.sleep(0.5)
        now_got = _metric(url, "denpex_ingest_events_total") - base
        if now_got > got:
            got, stalled = now_got, time.monotonic()
        elif time.monotonic() - stalled > 30:
            raise RuntimeError(f"daemon stalled: {got:.0f} of {sent} events ingested")


def reference_rate(seconds: float = 1.0) -> float:
    """Events per CPU second of the reference validator (`bench_wire.hand_decode_batch`, the hand
    validator the product used before msgspec, kept fixed as a yardstick) on phase 1's
    batches, in this process: the same-script baseline that tells how fast the machine is just
    now (on a shared machine the same code varies by 1.5-2x from hour to hour)."""
    evs = [progress("job-ref", "n000", r, r % 8, s, 1.8e9 + s * 0.5) for s in range(5) for r in range(8)]
    payload = wire.encode_batch("n000-agent", "job-ref", "n000", 1, time.time(), evs)
    n, c0 = 0, time.process_time()
    while time.process_time() - c0 < seconds:
        for _ in range(50):
            hand_decode_batch(payload, topic_job="job-ref")
        n += 50 * len(evs)
    return n / (time.process_time() - c0)


def progress(job: str, node: str, rank: int, local: int, step: int, ts: float) -> Event:
    return Event(
        id=f"{node}-{rank}-p{step}", kind="progress", job=job, node=node, rank=rank, local_rank=local,
        file=f"/logs/{node}/rank{rank}.log", offset=step * 120, line_no=step, ts=ts, ts_source="line",
        rule="megatron-iteration", severity="info", role="progress", category="progress",
        text=f"iteration {step} | lm loss: 2.31 | grad norm: 1.02", fields={"step": step, "loss": 2.31},
    )  # fmt: skip


def match(
    job: str, node: str, rank: int, local: int, rule: str, role: str, category: str, ts: float
) -> Event:
    return Event(
        id=f"{node}-{rank}-{rule}", kind="match", job=job, node=node, rank=rank, local_rank=local,
        file=f"/logs/{node}/rank{rank}.log", offset=10**6, line_no=9999, ts=ts, ts_source="line",
        rule=rule, severity="error", role=role, category=category, text=f"{rule} on rank {rank}",
        context=["previous line"] * 20,
    )  # fmt: skip


class Fleet:
    def __init__(self, nodes: int, per_node: int) -> None:
        self.nodes = [f"n{i:03d}" for i in range(nodes)]
        self.per_node = per_node
        self.clients: list[aiomqtt.Client] = []

    def ranks(self, node_idx: int) -> list[tuple[int, int]]:
        return [(node_idx * self.per_node + lr, lr) for lr in range(self.per_node)]

    async def publish_steps(self, job: str, steps: range, t0: float) -> int:
        sent = 0

        async def one(pub: int) -> None:
            nonlocal sent
            c = self.clients[pub]
            for ni in range(pub, len(self.nodes), PUBLISHERS):
                node = self.nodes[ni]
                evs = [progress(job, node, r, lr, s, t0 + s * 0.5) for s in steps for r, lr in self.ranks(ni)]
                await c.publish(_topic(job, node), wire.encode_batch(f"{node}-agent", job, node, 1,
                                                                          time.time(), evs), qos=1)  # fmt: skip
                sent += len(evs)

        await asyncio.gather(*(one(p) for p in range(PUBLISHERS)))
        return sent


async def run(args: argparse.Namespace) -> dict[str, Any]:
    TOPIC_MODE["mode"] = args.topic
    SERIAL_COLLATERAL["on"] = args.serial_collateral
    if args.broker:
        host, _, port = args.broker.removeprefix("mqtt://").rpartition(":")
        return await run_with(args, (host, int(port)))
    binary = shutil.which(args.mosquitto) or args.mosquitto
    async with private_broker(binary) as broker:
        return await run_with(args, broker)


# Run as the daemon under --tracemalloc: `denpexd serve` whose SIGUSR1 dumps a tracemalloc snapshot
_SNAPSHOT_ON_USR1 = (
    "import itertools, signal, sys, tracemalloc\n"
    "out, n = sys.argv.pop(1), itertools.count()\n"
    "signal.signal(signal.SIGUSR1, lambda *_: tracemalloc.take_snapshot().dump(f'{out}.{next(n)}'))\n"
    "from denpexd.cli import main\n"
    "raise SystemExit(main())\n"
)


@contextlib.asynccontextmanager
async def daemon(
    args: argparse.Namespace,
    broker: tuple[str, int],
    client_id: str,
    *,
    tree: str | None = None,
    snapshot: str | None = None,
    settings: dict[str, str] | None = None,
) -> Any:
    """`denpexd serve` against `broker` as a subprocess, from this checkout or from `tree` (another
    checkout's root: its daemon/, agents/ and itself on PYTHONPATH); yields (process, API URL).
    `snapshot`: run under tracemalloc, each SIGUSR1 dumps a snapshot to that path + ".0", ".1", ...;
    `settings`: DENPEX_* variables for the daemon (its configuration: `--variant`)."""
    http = _free_port()
    data = tempfile.mkdtemp(prefix="denpex-bench-")
    url = f"http://127.0.0.1:{http}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DENPEX_")}
    env.update(DENPEX_STALL_FLOOR_S=str(args.stall_floor), DENPEX_STALL_FACTOR="2")
    env.update(settings or {})
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(f"{tree}/{d}" for d in ("agents", "daemon", "."))
    if snapshot is not None:
        prog: tuple[str, ...] = ("-X", "tracemalloc=1", "-c", _SNAPSHOT_ON_USR1, snapshot)
    elif args.profile:
        prog = ("-m", "cProfile", "-o", args.profile, "-m", "denpexd")
    else:
        prog = ("-m", "denpexd")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *prog, "serve", "--broker", f"mqtt://{broker[0]}:{broker[1]}",
        "--client-id", client_id,
        "--http-listen", f"127.0.0.1:{http}", "--data-dir", data, "--log-level", "warning", env=env,
    )  # fmt: skip
    try:
        for _ in range(300):
            with contextlib.suppress(OSError):
                if (await asyncio.to_thread(urllib.request.urlopen, url + "/-/ready", None, 1)).status == 200:
                    break
            await asyncio.sleep(0.1)
        else:
            raise RuntimeError("the daemon did not get ready")
        yield proc, url
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            await proc.wait()
        async with aiomqtt.Client(
            *broker, identifier=client_id, protocol=aiomqtt.ProtocolVersion.V5, clean_start=True
        ):
            pass
        shutil.rmtree(data, ignore_errors=True)


async def run_with(args: argparse.Namespace, broker: tuple[str, int]) -> dict[str, Any]:
    if args.memory_jobs:
        return await memory_mode(args, broker)
    sides: list[tuple[str, str | None, dict[str, str]]] = [("this", None, {})]
    if args.variant:
        sides.append(("variant", None, dict(args.variant)))
    if args.baseline_tree:
        sides.append(("baseline", args.baseline_tree, {}))
    if len(sides) == 1 and args.rounds == 1:
        client_id = f"denpexd-bench-{uuid.uuid4().hex[:8]}"
        async with daemon(args, broker, client_id) as (proc, url):
            return await phases(args, broker, client_id, proc, url)
    # Compared: a fresh daemon per side and round, the sides alternating (each round reverses
    # the order), all against the same broker, so that every side sees the same minutes.
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in sides}
    for r in range(args.rounds):
        for name, tree, settings in sides if r % 2 == 0 else sides[::-1]:
            client_id = f"denpexd-bench-{uuid.uuid4().hex[:8]}"
            async with daemon(args, broker, client_id, tree=tree, settings=settings) as (proc, url):
                runs[name].append(await phases(args, broker, client_id, proc, url))
            print(f"round {r + 1} {name}: {_side_line(runs[name][-1])}", file=sys.stderr)
    summary = {name: _side_summary(got) for name, got in runs.items()}
    return {
        "compared": {name: {"tree": tree or ".", "settings": settings} for name, tree, settings in sides},
        "rounds": args.rounds,
        "summary": summary,
        "runs": runs,
    }


def _side_line(got: dict[str, Any]) -> str:
    lat = got["latency_ms"]
    return (
        f"{got['throughput']['events_per_cpu_s']} events/CPU-s "
        f"(ratio {got['throughput']['ratio_to_reference']}), alert p50/p99 {lat.get('alert_p50')}/"
        f"{lat.get('alert_p99')} ms, {got['diagnosis_runs']:.0f} diagnoses"
    )


def _side_summary(got: list[dict[str, Any]]) -> dict[str, Any]:
    """Per side, every round's figure and their median."""

    def each(f: Any) -> dict[str, Any]:
        xs = [f(g) for g in got]
        return {"each": xs, "median": statistics.median(xs)}

    return {
        "events_per_cpu_s": each(lambda g: g["throughput"]["events_per_cpu_s"]),
        "ratio_to_reference": each(lambda g: g["throughput"]["ratio_to_reference"]),
        "alert_p50_ms": each(lambda g: g["latency_ms"].get("alert_p50")),
        "alert_p99_ms": each(lambda g: g["latency_ms"].get("alert_p99")),
        "diagnosis_runs": each(lambda g: g["diagnosis_runs"]),
    }


async def phases(
    args: argparse.Namespace, broker: tuple[str, int], client_id: str, proc: Any, url: str
) -> dict[str, Any]:
    fleet = Fleet(args.nodes, args.ranks_per_node)
    out: dict[str, Any] = {
        "nodes": args.nodes, "ranks": args.nodes * args.ranks_per_node, "broker": f"{broker[0]}:{broker[1]}",
    }  # fmt: skip
    async with contextlib.AsyncExitStack() as stack:
        for i in range(PUBLISHERS):
            fleet.clients.append(
                await stack.enter_async_context(
                    aiomqtt.Client(*broker, identifier=f"bench-pub-{i}-{client_id}")
                )
            )
        # Phase 1: sustained throughput
        ref_before = reference_rate()
        job = f"bench-{uuid.uuid4().hex[:6]}"
        base = _metric(url, "denpex_ingest_events_total")
        cpu0, w0 = _cpu_s(proc.pid), time.perf_counter()
        sent = 0
        for chunk in range(0, args.steps, 5):
            sent += await fleet.publish_steps(job, range(chunk, min(chunk + 5, args.steps)), 1.8e9)
        await _wait_ingested(url, base, sent)
        cpu, wall = _cpu_s(proc.pid) - cpu0, time.perf_counter() - w0
        ref = (ref_before + reference_rate()) / 2
        out["throughput"] = {
            "events": sent, "wall_s": round(wall, 2), "daemon_cpu_s": round(cpu, 2),
            "events_per_cpu_s": round(sent / cpu), "events_per_wall_s": round(sent / wall),
            # baseline: the reference validator alone, before and after phase 1, and the ratio
            "reference_events_per_cpu_s": round(ref), "ratio_to_reference": round(sent / cpu / ref, 3),
        }  # fmt: skip
        out["rss_mb_after_throughput"] = round(_rss_mb(proc.pid))
        # Phase 2: failure cascades
        diag_lat, alert_lat, spread = [], [], []
        async with aiomqtt.Client(*broker, identifier=f"bench-sub-{client_id}") as sub:
            await sub.subscribe("denpex/v1/jobs/+/diagnosis", qos=1)
            await sub.subscribe("denpex/v1/alerts/+", qos=1)
            for trial in range(args.trials):
                if not args.back_to_back:
                    # the previous cascade is absorbed first: each trial offers one burst
                    await _wait_ingested(url, base, sent)
                job = f"cascade-{trial}-{uuid.uuid4().hex[:6]}"
                got_diag, got_alert, n = await cascade(fleet, sub, job, trial, spread)
                sent += n
                diag_lat.append(got_diag)
                alert_lat.append(got_alert)

        def pct(xs: list[float], q: float) -> float:
            xs = sorted(xs)
            return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 1)

        out["latency_ms"] = {
            "trials": args.trials,
            "diagnosis_p50": pct(diag_lat, 0.5), "diagnosis_p99": pct(diag_lat, 0.99),
            "alert_p50": pct(alert_lat, 0.5), "alert_p99": pct(alert_lat, 0.99),
            "alert_mean": round(statistics.mean(alert_lat) * 1000, 1),
            "alert_each": [round(x * 1000) for x in alert_lat],
            # the last node's collateral acknowledged by the broker: what the alert waits for
            "collateral_published_p50": pct(spread, 0.5), "collateral_published_p99": pct(spread, 0.99),
        }  # fmt: skip
        if args.stall_trials > 0:
            out["stall"] = await stall_phase(args, fleet, broker, client_id, url, base, sent)
        out["rss_mb_end"] = round(_rss_mb(proc.pid))
        out["diagnosis_duration_s_sum"] = _metric(url, "denpex_diagnosis_duration_seconds_sum")
        out["diagnosis_runs"] = _metric(url, "denpex_diagnosis_runs_total")
    return out


async def cascade(
    fleet: Fleet, sub: aiomqtt.Client, job: str, trial: int, spread: list[float] | None = None
) -> tuple[float, float, int]:
    """One failure cascade on a fresh job of every rank: 5 steps of progress, one rank's CUDA OOM,
    collateral on every other rank. Returns the seconds from publishing the OOM to the retained
    diagnosis naming its rank and to the MQTT alert, and the events published; ``spread`` gets
    the seconds from publishing the OOM to the broker's acknowledgement of the last node's
    collateral (the alert waits for every other node's batch read after the OOM: its floor)."""
    sent = await fleet.publish_steps(job, range(5), 1.8e9) + len(fleet.nodes) * fleet.per_node
    ni = (trial * 37) % len(fleet.nodes)
    rank, lr = fleet.ranks(ni)[3]
    node = fleet.nodes[ni]
    t_fail = 1.8e9 + 10.0
    first = match(job, node, rank, lr, "cuda-oom", "root-cause", "out-of-memory", t_fail)
    t_pub = time.perf_counter()
    await fleet.clients[ni % PUBLISHERS].publish(
        _topic(job, node), wire.encode_batch(f"{node}-agent", job, node, 2, time.time(), [first]), qos=1
    )
    got_diag = got_alert = None

    async def one(p: int) -> None:
        """Publisher ``p``'s nodes' collateral, one acknowledged publish after the other."""
        for nj in range(p, len(fleet.nodes), PUBLISHERS):
            n = fleet.nodes[nj]
            evs = [match(job, n, r, lr, "nccl-remote-error", "collateral", "communication",
                         t_fail + 0.5) for r, lr in fleet.ranks(nj) if r != rank]  # fmt: skip
            await fleet.clients[p].publish(_topic(job, n), wire.encode_batch(
                f"{n}-agent", job, n, 3, time.time(), evs), qos=1)  # fmt: skip

    async def collateral() -> None:
        await asyncio.sleep(0.05)
        if SERIAL_COLLATERAL["on"]:  # the first revision's load: every node's batch after the one before
            for p in range(PUBLISHERS):
                await one(p)
        else:  # the publishers at once, as the nodes' agents publish independently
            await asyncio.gather(*(one(p) for p in range(PUBLISHERS)))
        if spread is not None:
            spread.append(time.perf_counter() - t_pub)

    spreading = asyncio.create_task(collateral())
    async with asyncio.timeout(30):
        async for msg in sub.messages:
            topic = msg.topic.value
            if job not in topic:
                continue
            doc = orjson.loads(msg.payload) if isinstance(msg.payload, bytes) else {}
            if topic.endswith("/diagnosis") and got_diag is None:
                ini = doc.get("initiator") or {}
                if ini.get("rank") == rank:
                    got_diag = time.perf_counter() - t_pub
            elif "/alerts/" in topic and got_alert is None:
                got_alert = time.perf_counter() - t_pub
                assert doc["labels"]["rank"] == str(rank), doc["labels"]
            if got_diag is not None and got_alert is not None:
                break
    await spreading
    assert got_diag is not None and got_alert is not None
    return got_diag, got_alert, sent


async def memory_mode(args: argparse.Namespace, broker: tuple[str, int]) -> dict[str, Any]:
    """--memory-jobs K: what one open failed job of every rank costs the daemon. Per round, a fresh
    daemon takes one failed job (warm-up: code paths, caches and allocator arenas), its RSS is
    read once its diagnoses are done, then K more failed jobs (`cascade`), and the RSS again: the
    difference divided by K is the figure. With --baseline-tree, rounds alternate between this
    checkout's daemon and that one's, so both figures come from the same run."""
    trees: list[tuple[str, str | None]] = [("this", None)]
    if args.baseline_tree:
        trees.append(("baseline", args.baseline_tree))
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in trees}
    for r in range(args.memory_rounds):
        for name, tree in trees if r % 2 == 0 else trees[::-1]:
            rounds[name].append(await memory_round(args, broker, tree))
    out: dict[str, Any] = {
        "method": "RSS with K+1 failed jobs open minus RSS with 1 (the warm-up job), divided by K",
        "ranks_per_job": args.nodes * args.ranks_per_node, "jobs": args.memory_jobs,
    }  # fmt: skip
    for name, got in rounds.items():
        per_job = sorted(g["mb_per_job"] for g in got)
        out[name] = {
            "mb_per_job_min": per_job[0],
            "mb_per_job_median": statistics.median(per_job),
            "rounds": got,
        }
    if args.baseline_tree:
        out["ratio_median"] = round(
            out["this"]["mb_per_job_median"] / out["baseline"]["mb_per_job_median"], 3
        )
    if args.tracemalloc:
        # one more round of this checkout under tracemalloc (its RSS is not comparable): snapshots
        # at both points, and what grew most between them
        await memory_round(args, broker, None, snapshot=args.tracemalloc)
        import tracemalloc

        before = tracemalloc.Snapshot.load(args.tracemalloc + ".0")
        after = tracemalloc.Snapshot.load(args.tracemalloc + ".1")
        out["tracemalloc_grew_per_job"] = [
            f"{d.size_diff / args.memory_jobs / 2**20:.2f} MB {d.count_diff // args.memory_jobs} blocks "
            f"{d.traceback[0].filename.rsplit('/', 2)[-1]}:{d.traceback[0].lineno}"
            for d in after.compare_to(before, "lineno")[:25]
        ]
    return out


async def memory_round(
    args: argparse.Namespace, broker: tuple[str, int], tree: str | None, snapshot: str | None = None
) -> dict[str, Any]:
    client_id = f"denpexd-bench-{uuid.uuid4().hex[:8]}"
    async with daemon(args, broker, client_id, tree=tree, snapshot=snapshot) as (proc, url):
        fleet = Fleet(args.nodes, args.ranks_per_node)
        async with contextlib.AsyncExitStack() as stack:
            for i in range(PUBLISHERS):
                fleet.clients.append(
                    await stack.enter_async_context(
                        aiomqtt.Client(*broker, identifier=f"bench-pub-{i}-{client_id}")
                    )
                )
            sub = await stack.enter_async_context(
                aiomqtt.Client(*broker, identifier=f"bench-sub-{client_id}")
            )
            await sub.subscribe("denpex/v1/jobs/+/diagnosis", qos=1)
            await sub.subscribe("denpex/v1/alerts/+", qos=1)
            base, sent = _metric(url, "denpex_ingest_events_total"), 0

            async def settled() -> float:
                await _wait_ingested(url, base, sent)
                await _diagnoses_done(url)
                if snapshot is not None:
                    proc.send_signal(signal.SIGUSR1)
                    await asyncio.sleep(5)  # the dump takes a while under tracemalloc
                return _rss_mb(proc.pid)

            sent += (await cascade(fleet, sub, f"mem-warm-{uuid.uuid4().hex[:6]}", 0))[2]
            rss0 = await settled()
            for k in range(args.memory_jobs):
                await _wait_ingested(url, base, sent)
                sent += (await cascade(fleet, sub, f"mem-{k}-{uuid.uuid4().hex[:6]}", k + 1))[2]
            rss1 = await settled()
            jobs_open = _metric(url, "denpex_jobs_open")
    return {
        "rss_mb_one_job": round(rss0, 1), "rss_mb_after": round(rss1, 1), "jobs_open": jobs_open,
        "mb_per_job": round((rss1 - rss0) / args.memory_jobs, 2),
    }  # fmt: skip


async def _diagnoses_done(url: str) -> None:
    """Until no diagnosis ran for 2 s (the debounced ones after the last batch are done), at most
    8 s (a daemon before the stall watch's fix re-diagnosed a failed job whose ranks stopped
    twice a second)."""
    last, quiet = -1.0, 0
    for _ in range(16):
        if quiet >= 4:
            break
        await asyncio.sleep(0.5)
        runs = _metric(url, "denpex_diagnosis_runs_total")
        quiet = quiet + 1 if runs == last else 0
        last = runs


async def stall_phase(
    args: argparse.Namespace,
    fleet: Fleet,
    broker: tuple[str, int],
    client_id: str,
    url: str,
    base: float,
    sent: int,
) -> dict[str, Any]:
    """Phase 3: jobs whose every rank stops logging steps; from the last step published to the
    stall's alert."""
    lat = []
    async with aiomqtt.Client(*broker, identifier=f"bench-stall-{client_id}") as sub:
        await sub.subscribe("denpex/v1/alerts/+", qos=1)
        for trial in range(args.stall_trials):
            await _wait_ingested(url, base, sent)
            job = f"stall-{trial}-{uuid.uuid4().hex[:6]}"
            sent += await fleet.publish_steps(job, range(5), 1.8e9 + 100.0 * trial)
            t_last = time.perf_counter()
            async with asyncio.timeout(args.stall_floor + 30):
                async for msg in sub.messages:
                    if msg.topic.value.endswith(f"/{job}"):
                        doc = orjson.loads(msg.payload) if isinstance(msg.payload, bytes) else {}
                        assert doc["labels"]["rule"] == "job-progress-stalled", doc["labels"]
                        lat.append(time.perf_counter() - t_last)
                        break
    xs = sorted(lat)
    return {
        "trials": len(xs),
        "threshold_s": args.stall_floor,
        "alert_after_last_step_s_p50": round(xs[len(xs) // 2], 3),
        "alert_after_last_step_s_p99": round(xs[min(len(xs) - 1, int(0.99 * len(xs)))], 3),
        "beyond_threshold_s_p99": round(xs[min(len(xs) - 1, int(0.99 * len(xs)))] - args.stall_floor, 3),
        "each_s": [round(x, 3) for x in lat],
    }


def _setting(text: str) -> tuple[str, str]:
    key, eq, value = text.partition("=")
    if not eq or not key.startswith("DENPEX_"):
        raise argparse.ArgumentTypeError(f"expected DENPEX_KEY=VALUE, got {text!r}")
    return key, value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=512)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--broker", help="use this broker (mqtt://HOST:PORT) instead of a private Mosquitto")
    p.add_argument("--mosquitto", default="mosquitto", help="Mosquitto binary for the private broker")
    p.add_argument(
        "--back-to-back",
        action="store_true",
        help="start each trial as soon as the previous alert arrived, not once the daemon ingested "
        "everything published so far (offers more than the daemon absorbs once alerts are fast)",
    )
    p.add_argument(
        "--serial-collateral",
        action="store_true",
        help="phase 2: publish the cascade's collateral one node after the other across all publishers "
        "(the load of earlier rounds), instead of each publisher's nodes at the same time as the others'",
    )
    p.add_argument("--stall-trials", type=int, default=5, help="phase 3: jobs that stop logging steps")
    p.add_argument(
        "--stall-floor", type=float, default=2.0, help="the daemon's stall_floor_s (the threshold)"
    )
    p.add_argument("--profile", help="run the daemon under cProfile and write its stats here")
    p.add_argument(
        "--memory-jobs",
        type=int,
        default=0,
        metavar="K",
        help="instead of the phases: the daemon's RSS per open failed job (K jobs of every rank)",
    )
    p.add_argument("--memory-rounds", type=int, default=3, help="--memory-jobs: fresh daemons per checkout")
    p.add_argument(
        "--baseline-tree",
        metavar="DIR",
        help="also measure the daemon of another checkout (e.g. `git archive` of an earlier commit "
        "unpacked in DIR), rounds alternating (--memory-rounds with --memory-jobs, else --rounds)",
    )
    p.add_argument(
        "--variant",
        metavar="DENPEX_KEY=VALUE",
        action="append",
        type=_setting,
        default=[],
        help="also measure this checkout's daemon with these settings (repeatable; the DENPEX_* "
        "variables of `denpexd serve`), rounds alternating with the defaults",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="phases: fresh daemons per side (this checkout, --variant, --baseline-tree), alternating",
    )
    p.add_argument(
        "--tracemalloc",
        metavar="PATH",
        help="--memory-jobs: one more round under tracemalloc, snapshots dumped to PATH.0 and PATH.1",
    )
    p.add_argument(
        "--topic",
        choices=("sender", "first-revision"),
        default="sender",
        help="publish on the agents' sender topics (the daemon answers every batch with a receipt; "
        "default) or on the first revision's topic (no receipts), to measure what receipts cost",
    )
    args = p.parse_args()
    if args.baseline_tree:
        args.baseline_tree = str(Path(args.baseline_tree).resolve())
    result = asyncio.run(run(args))
    print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
