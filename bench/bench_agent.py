#!/usr/bin/env python3
"""denpex-agent benchmark: tail + match throughput, CPU cost while following live files, RSS,
and write-to-delivery latency — all against the real Mosquitto on 127.0.0.1:1883.

Usage: python bench/bench_agent.py [--size 512M] [--seed 42] [--follow-seconds 30] [--json OUT]
       python bench/bench_agent.py --follow-only [--follow-seconds 30] [--agent-arg=--follow-mode --agent-arg=poll]
       python bench/bench_agent.py --follow-only --baseline-tree DIR --rounds 3   (both agents at once)

The agent run is always the one of a source tree (this checkout, or --baseline-tree's: e.g.
``git archive <commit> agents daemon rules | tar -x -C DIR``), started with that tree's
``agents`` and ``daemon`` on PYTHONPATH, never an installed ``denpex-agent``.

1. Throughput: the agent starts on a training-like log of --size (bench/gen_training_log.py,
   the same file the orientation figures were measured on) and reads it from the beginning;
   measured: the agent process's CPU seconds (utime+stime from /proc) until its checkpoint
   reaches the end of the file, excluding the idle start-up cost measured separately. Baseline
   in the same run: ``grep -E -c -f`` over the same file with every rule pattern (translated to
   POSIX ERE by bench/bench_diagnose.py's translator).
2. Follow cost: the agent with its default settings, 8 files written at 1,000 lines/s each
   (training-like lines, a matched line every ~500) for --follow-seconds; measured: agent CPU
   seconds / wall seconds (% of one core). Before the writing starts, the same for 10 s with the
   8 files followed and nothing written (the idle agent). --follow-only runs phases 2 and 4
   alone; --agent-arg passes an option to the followed agent (--agent-arg=--follow-mode
   --agent-arg=poll: polling, to compare with inotify).
3. Peak RSS of the agent (VmHWM) over both phases.
4. Latency: each matched line carries its write time; a subscriber on the broker notes when the
   event arrives. Arrival happens after the broker's PUBACK to the agent plus one hop, so the
   figure is an upper bound of write → acknowledged. Reported as p50/p99.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import aiomqtt

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def proc_hwm_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def agent_proc(
    job: str, logs: list[str], state: Path, log: Path, *extra: str, tree: Path = REPO
) -> subprocess.Popen[bytes]:
    """The agent of the source tree ``tree`` (this checkout by default), not whatever
    ``denpex-agent`` an installed package points at."""
    cmd = [
        sys.executable,
        "-c",
        os.environ.get("BENCH_AGENT_MAIN", "import sys; from denpex_agent.cli import main; sys.exit(main())"),
        "--job",
        job,
        "--node",
        "bench",
        "--state-dir",
        str(state),
        *extra,
    ]
    for pattern in logs:
        cmd += ["--logs", pattern]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DENPEX_")}
    env["PYTHONPATH"] = os.pathsep.join(str(tree / d) for d in ("agents", "daemon"))
    with log.open("ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


def checkpoint_offset(state: Path) -> int:
    try:
        doc = json.loads((state / "checkpoints.json").read_text())
    except (OSError, ValueError):
        return 0
    return sum(p["offset"] for p in doc["files"].values())


def grep_baseline(log_file: Path, work: Path) -> dict[str, Any]:
    diag = _load("bench_diagnose")
    from denpex_agent.rules import load_rules

    info = diag.translate_rules(load_rules(), work)
    patterns = Path(info["file"]) if isinstance(info, dict) and "file" in info else work / "patterns.ere"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    out = subprocess.run(
        ["grep", "-E", "-c", "-f", str(patterns), str(log_file)],
        capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"}, check=False,
    )  # fmt: skip
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"cpu_s": cpu, "wall_s": wall, "matches": int(out.stdout.strip() or 0)}


def phase_throughput(log_file: Path, work: Path) -> dict[str, Any]:
    size = log_file.stat().st_size
    # idle cost first: an agent on an empty file for a few seconds (imports, rules, connect)
    empty = work / "empty"
    empty.mkdir(exist_ok=True)
    (empty / "rank0.log").write_text("")
    p = agent_proc(
        f"bench-idle-{uuid.uuid4().hex[:6]}",
        [str(empty / "*.log")],
        work / "state-idle",
        work / "agent-idle.log",
    )
    time.sleep(4.0)
    idle_cpu = proc_cpu(p.pid)
    time.sleep(4.0)
    idle_rate = (proc_cpu(p.pid) - idle_cpu) / 4.0
    p.send_signal(signal.SIGTERM)
    p.wait(30)
    state = work / "state-tp"
    shutil.rmtree(state, ignore_errors=True)
    p = agent_proc(
        f"bench-tp-{uuid.uuid4().hex[:6]}",
        [str(log_file)],
        state,
        work / "agent-tp.log",
        "--context-lines",
        "20",
        "--checkpoint-interval",  # the end of the file is noticed from the checkpoint
        "0.2",
    )
    t0 = time.monotonic()
    while checkpoint_offset(state) < size:
        if p.poll() is not None:
            raise RuntimeError(f"agent exited early, see {work / 'agent-tp.log'}")
        time.sleep(0.05)
    wall = time.monotonic() - t0
    cpu = proc_cpu(p.pid)
    hwm = proc_hwm_mb(p.pid)
    p.send_signal(signal.SIGTERM)
    p.wait(30)
    work_cpu = max(cpu - idle_cpu, 1e-9)
    with open(log_file, "rb") as fh:
        lines = sum(1 for _ in fh)
    return {
        "bytes": size,
        "lines": lines,
        "cpu_s_total": cpu,
        "startup_cpu_s": idle_cpu,
        "idle_cpu_per_s": idle_rate,
        "cpu_s": work_cpu,
        "wall_s": wall,
        "mb_per_cpu_s": size / 1e6 / work_cpu,
        "lines_per_s": lines / wall,
        "peak_rss_mb": hwm,
    }


class LiveWriter(threading.Thread):
    def __init__(self, logs: Path, files: int, rate: int, seconds: float, gen: Any) -> None:
        super().__init__(daemon=True, name="writer")
        self.logs, self.files, self.rate, self.seconds, self.gen = logs, files, rate, seconds, gen
        self.written = 0
        self.markers: dict[str, float] = {}

    def run(self) -> None:
        rng = random.Random(7)
        st = self.gen.State(rng)
        handles = [open(self.logs / f"rank{r}.log", "a", buffering=1) for r in range(self.files)]  # noqa: SIM115
        tick = 0.01
        per_tick = self.rate * tick
        carry = 0.0
        t_end = time.monotonic() + self.seconds
        next_t = time.monotonic()
        while time.monotonic() < t_end:
            carry += per_tick
            n = int(carry)
            carry -= n
            for fh in handles:
                chunk = []
                for _ in range(n):
                    st.clock.tick(rng)
                    if rng.random() < 0.002:
                        marker = uuid.uuid4().hex[:10]
                        self.markers[marker] = time.time()
                        chunk.append(
                            f"RuntimeError: CUDA error: an illegal memory access was encountered m={marker}\n"
                        )
                    else:
                        chunk.append(self.gen.step_line(st) + "\n")
                fh.write("".join(chunk))
                self.written += len(chunk)
            next_t += tick
            time.sleep(max(0.0, next_t - time.monotonic()))
        for fh in handles:
            fh.close()


async def _subscribe(
    job: str, arrivals: dict[str, float], ready: threading.Event, stop: threading.Event
) -> None:
    from denpex_agent import wire

    async with aiomqtt.Client("127.0.0.1", 1883) as client:
        await client.subscribe(f"denpex/v1/jobs/{job}/from/+/events", qos=1)  # the agent's own topic
        ready.set()
        async for msg in client.messages:
            now = time.time()
            if isinstance(msg.payload, bytes):
                for ev in wire.decode_batch(msg.payload).events:
                    if "m=" in ev.text:
                        arrivals.setdefault(ev.text.rsplit("m=", 1)[1].split()[0], now)
            if stop.is_set():
                return


def phase_follow(
    work: Path,
    seconds: float,
    gen: Any,
    extra: list[str] | None = None,
    idle_seconds: float = 10.0,
    tree: Path = REPO,
) -> dict[str, Any]:
    return phase_follow_many(work, seconds, gen, extra, idle_seconds, [tree])[0]


def phase_follow_many(
    work: Path,
    seconds: float,
    gen: Any,
    extra: list[str] | None,
    idle_seconds: float,
    trees: list[Path],
) -> list[dict[str, Any]]:
    """Phases 2 and 4 for one agent per tree, all following the same 8 files at the same time
    (each with a job, a state and a subscriber of its own): on a shared machine every agent sees
    the very same writes and the same load, which agents run one after the other do not."""
    logs = work / "live"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir()
    for r in range(8):
        (logs / f"rank{r}.log").write_text("")
    jobs = [f"bench-live-{uuid.uuid4().hex[:6]}" for _ in trees]
    arrivals: list[dict[str, float]] = [{} for _ in trees]
    stop = threading.Event()
    procs = []
    for i, (job, tree) in enumerate(zip(jobs, trees, strict=True)):
        ready = threading.Event()
        sub = threading.Thread(
            target=lambda j=job, a=arrivals[i], r=ready: asyncio.run(_subscribe(j, a, r, stop)), daemon=True
        )
        sub.start()
        ready.wait(10)
        state = work / f"state-live-{i}"
        shutil.rmtree(state, ignore_errors=True)
        procs.append(
            agent_proc(
                job,
                [str(logs / "rank*.log")],
                state,
                work / f"agent-live-{i}.log",
                # an MQTT client id of its own (two agents with one id take the session from each other)
                *(["--node", f"bench-{i}"] if len(trees) > 1 else []),
                *(extra or []),
                tree=tree,
            )
        )
    time.sleep(5.0)  # start-up done (imports, rules, connection, the first clock exchanges)
    idle0, ti0 = [proc_cpu(p.pid) for p in procs], time.monotonic()
    time.sleep(idle_seconds)  # the 8 files followed, nothing written
    idle1, ti1 = [proc_cpu(p.pid) for p in procs], time.monotonic()
    cpu0, t0 = [proc_cpu(p.pid) for p in procs], time.monotonic()
    writer = LiveWriter(logs, 8, 1000, seconds, gen)
    writer.start()
    writer.join()
    cpu1, t1 = [proc_cpu(p.pid) for p in procs], time.monotonic()
    time.sleep(2.0)
    stop.set()
    out = []
    for i, p in enumerate(procs):
        hwm = proc_hwm_mb(p.pid)
        p.send_signal(signal.SIGTERM)
        p.wait(30)
        lat = sorted(arrivals[i][m] - w for m, w in writer.markers.items() if m in arrivals[i])
        out.append(
            {
                "tree": str(trees[i]),
                "files": 8,
                "lines_per_s_per_file": 1000,
                "seconds": t1 - t0,
                "lines_written": writer.written,
                "cpu_s": cpu1[i] - cpu0[i],
                "core_percent": 100.0 * (cpu1[i] - cpu0[i]) / (t1 - t0),
                "idle_seconds": ti1 - ti0,
                "idle_core_percent": 100.0 * (idle1[i] - idle0[i]) / (ti1 - ti0),
                "peak_rss_mb": hwm,
                "latency_samples": len(lat),
                "latency_missing": len(writer.markers) - len(lat),
                "latency_p50_ms": 1000 * statistics.median(lat) if lat else None,
                "latency_p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None,
                "latency_max_ms": 1000 * lat[-1] if lat else None,
            }
        )
    return out


def _print_follow(label: str, follow: dict[str, Any]) -> None:
    print(
        f"{label}follow 8 x 1,000 lines/s: {follow['core_percent']:.2f}% of one core over "
        f"{follow['seconds']:.0f} s ({follow['lines_written']} lines); idle {follow['idle_core_percent']:.2f}%; "
        f"latency p50 {follow['latency_p50_ms']:.1f} ms, p99 {follow['latency_p99_ms']:.1f} ms, "
        f"max {follow['latency_max_ms']:.1f} ms over {follow['latency_samples']} lines "
        f"({follow['latency_missing']} missing)",
        flush=True,
    )


def follow_only(a: argparse.Namespace, gen: Any, work: Path) -> int:
    """Phases 2 and 4, ``--rounds`` times. With ``--baseline-tree`` the baseline's agent and this
    tree's follow the same files at the same time (started in turns: baseline first in odd
    rounds), so both see the same writes and the same load. Best of N: the lowest CPU."""
    trees = [("this", REPO)]
    if a.baseline_tree:
        trees.insert(0, ("baseline", Path(a.baseline_tree).resolve()))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in trees}
    for r in range(a.rounds):
        order = trees if r % 2 == 0 else trees[::-1]
        got = phase_follow_many(work, a.follow_seconds, gen, a.agent_arg, 10.0, [t for _, t in order])
        for (name, _), follow in sorted(zip(order, got, strict=True), key=lambda x: x[0][0]):
            runs[name].append(follow)
            _print_follow(f"round {r + 1} {name:8s} ", follow)
    print(f"agent args: {' '.join(a.agent_arg) or '-'}; trees: " + ", ".join(f"{n}={t}" for n, t in trees))
    for name, _ in trees:
        rs = runs[name]
        cpu = sorted(f["core_percent"] for f in rs)
        idle = sorted(f["idle_core_percent"] for f in rs)
        p99 = sorted(f["latency_p99_ms"] or float("nan") for f in rs)
        missing = sum(f["latency_missing"] for f in rs)
        print(
            f"{name:8s}: follow best {cpu[0]:.2f}% median {statistics.median(cpu):.2f}% of one core "
            f"(all: {' / '.join(f'{c:.2f}' for c in cpu)}); idle best {idle[0]:.2f}%; "
            f"p99 {' / '.join(f'{x:.0f}' for x in p99)} ms; {missing} missing"
        )
    if a.json:
        Path(a.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "follow": runs}, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="512M")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--follow-seconds", type=float, default=30.0)
    ap.add_argument("--workdir", default=str(BENCH / "out" / "agent"))
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--follow-only", action="store_true", help="phases 2 and 4 only (follow cost, latency)")
    ap.add_argument(
        "--agent-arg",
        action="append",
        default=[],
        help="an extra argument for the followed agent (repeatable)",
    )
    ap.add_argument(
        "--baseline-tree",
        metavar="DIR",
        help="with --follow-only: also run the agent of this source tree (e.g. `git archive` of "
        "an older commit), following the same files at the same time as this tree's",
    )
    ap.add_argument("--rounds", type=int, default=1, help="with --follow-only: rounds (best of N)")
    a = ap.parse_args()
    gen = _load("gen_training_log")
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    if a.follow_only:
        return follow_only(a, gen, work)
    log_file = work / f"train-{a.size}-s{a.seed}.log"
    size = gen.parse_size(a.size)
    if not log_file.exists() or abs(log_file.stat().st_size - size) > size // 100:
        print(f"generating {log_file} ({a.size}, seed {a.seed})", file=sys.stderr)
        gen.generate(str(log_file), size, a.seed)
    with open(log_file, "rb") as fh:  # warm the page cache so both readers see the same
        while fh.read(1 << 24):
            pass
    with tempfile.TemporaryDirectory() as tmp:
        base = grep_baseline(log_file, Path(tmp))
    base["mb_per_cpu_s"] = log_file.stat().st_size / 1e6 / max(base["cpu_s"], 1e-9)
    tp = phase_throughput(log_file, work)
    follow = phase_follow(work, a.follow_seconds, gen)
    res = {
        "date": time.strftime("%Y-%m-%d"),
        "cores": os.cpu_count(),
        "grep": base,
        "throughput": tp,
        "follow": follow,
    }
    print(f"input: {log_file.name}, {tp['bytes'] / 1e6:.0f} MB, {tp['lines']} lines")
    print(
        f"grep -E -c -f           : {base['cpu_s']:.2f} CPU s  {base['mb_per_cpu_s']:.0f} MB/CPU-s  ({base['matches']} lines)"
    )
    print(
        f"denpex-agent tail+match : {tp['cpu_s']:.2f} CPU s  {tp['mb_per_cpu_s']:.0f} MB/CPU-s  "
        f"{tp['lines_per_s']:.0f} lines/s wall  (start-up {tp['startup_cpu_s']:.2f} CPU s excluded; idle {100 * tp['idle_cpu_per_s']:.2f}% core)"
    )
    print(f"agent / grep            : {tp['mb_per_cpu_s'] / base['mb_per_cpu_s']:.2f}")
    print(
        f"follow 8 x 1,000 lines/s: {follow['core_percent']:.2f}% of one core over {follow['seconds']:.0f} s "
        f"({follow['lines_written']} lines)"
    )
    print(
        f"idle, 8 files unwritten : {follow['idle_core_percent']:.2f}% of one core over {follow['idle_seconds']:.0f} s"
    )
    print(
        f"peak RSS                : throughput {tp['peak_rss_mb']:.1f} MB, follow {follow['peak_rss_mb']:.1f} MB"
    )
    print(
        f"latency write->delivered: p50 {follow['latency_p50_ms']:.1f} ms, p99 {follow['latency_p99_ms']:.1f} ms, "
        f"max {follow['latency_max_ms']:.1f} ms over {follow['latency_samples']} lines ({follow['latency_missing']} missing)"
    )
    targets = [
        ("tail+match >= 400 MB/CPU-s", tp["mb_per_cpu_s"] >= 400),
        ("follow cost < 2% of a core", follow["core_percent"] < 2.0),
        ("RSS < 60 MB", max(tp["peak_rss_mb"], follow["peak_rss_mb"]) < 60),
        ("p99 latency < 200 ms", (follow["latency_p99_ms"] or 1e9) < 200),
    ]
    for name, ok in targets:
        print(f"target {name}: {'PASS' if ok else 'FAIL'}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
