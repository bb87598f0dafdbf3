"""Replaying recorded jobs through real agents into one long-running `denpexd serve`, to measure
the live/post-mortem invariant (tests/integration/test_live_invariant.py).

A replay writes a recorded job's log files, byte for byte, into a fresh directory while one
`denpex-agent` per node directory follows them and publishes to the daemon; then it waits for the
live diagnosis to settle and compares `denpexd query --json` with `denpexd diagnose <original>`.
The writing follows one of four variants:

* ``paced``: each line at its true time (its timestamp minus the node's ``skew_s``; a line
  without a timestamp inherits the previous one's), ``SPEED`` times faster, whole lines, every
  timestamp moved by one constant so that the job starts now (the failure is news, as in a live
  job; `catchup` keeps the recorded times: history);
* ``split``: the same pacing, but every file's byte stream is cut at random offsets (inside
  lines, inside tracebacks, and at every pause of the pacing), with a random pause of up to
  ``SPLIT_PAUSE_S`` before each piece that continues a line; seeded per job (`split_seed`);
* ``catchup``: every file written completely before the agents start;
* ``kill9``: paced, and once half the lines are written every agent is SIGKILLed and started
  again with the same ``--state-dir`` while the writing goes on.

The daemon, the brokers, the alert receiver, the query CLI and the agent command line come from
replay.py and agent_harness.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, SupportsIndex

import aiohttp
import aiomqtt

from denpex_agent import wire
from denpex_agent.reader import ReadReport, discover
from denpex_agent.timestamps import parse_timestamp
from tests.fixtures.make_jobs import shift_text
from tests.integration.agent_harness import agent_cmd, free_port, start_agent, stop
from tests.integration.replay import JOBS, MOSQUITTO, AlertReceiver, Daemon, forget_session, query_json

VARIANTS = ("paced", "split", "catchup", "kill9")
SPEED = 4.0  # pacing compression
SPLIT_PAUSE_S = 0.4  # longest pause before a piece that continues a line
SPLIT_LINES_PER_CUT = 4  # about one random cut per this many lines ...
SPLIT_MAX_RANDOM_CUTS = 24  # ... and at most this many per file (plus one per traceback)
SPLIT_GAP_S = 0.25  # a pacing pause longer than this (true time) always ends a piece
AGENT_READY_S = 30.0
QUIESCE_TIMEOUT_S = 30.0  # after the writers are done
FOLD_TIMEOUT_S = 3.0  # the agents' --fold-timeout: how long they hold an unfinished record
SETTLE_MIN_S = FOLD_TIMEOUT_S + 1.5  # never accept a diagnosis sooner after the writers are done
STABLE_EQUAL_S = 2.0  # unchanged this long and equal to diagnose: settled
STABLE_S = 6.0  # unchanged this long (not equal): settled
ALERT_WAIT_S = 6.0  # after settling, for the alert to name the initiator (hang hold is 3 s)
ALERT_WAIT_NONE_S = 2.0  # ... and, when diagnose names no initiator, to see that none fires
POLL_S = 0.25
AGENT_FLAGS = (
    "--poll-interval", "0.05",
    "--discover-interval", "0.2",
    "--progress-interval", "0.1",
    "--heartbeat-interval", "1",
    "--checkpoint-interval", "0.2",  # a compressed job is only seconds long: checkpoints before kill9
    "--fold-timeout", str(FOLD_TIMEOUT_S),
)  # fmt: skip
LOG_TROUBLE = re.compile(r" (ERROR|CRITICAL) |Traceback \(most recent call last\)")
_TRACEBACK = b"Traceback (most recent call last):"
_PREFIX = re.compile(rb"^(?:\[[^\]\n]*\]: ?)*")  # "[default0]:[rank2]: " before the text


# ------------------------------------------------------------------------------- the corpus


def corpus_jobs(root: Path = JOBS) -> list[str]:
    """Every recorded job: each directory under ``root`` holding an expected.json."""
    return sorted(p.parent.name for p in root.glob("*/expected.json"))


@dataclass(frozen=True)
class SourceFile:
    rel: str  # path relative to the job directory, "<node>/..."
    lines: tuple[tuple[float, bytes], ...]  # (seconds since the job's first line, the line's bytes)

    @property
    def node(self) -> str:
        return self.rel.split("/", 1)[0]


@dataclass(frozen=True)
class Corpus:
    name: str
    src: Path
    files: tuple[SourceFile, ...]
    t0: float = 0.0  # the epoch time of the first line (true time)
    year: int = 2026  # the year of the recording (for timestamps that carry none)

    def starting_now(self) -> Corpus:
        """The same bytes with every timestamp moved by one constant so the job starts now (the
        nodes' skew kept): timestamps keep their width, offsets stay the same."""
        shift = time.time() - self.t0
        return Corpus(
            self.name,
            self.src,
            tuple(
                SourceFile(
                    f.rel,
                    tuple(
                        (
                            t,
                            shift_text(line.decode("utf-8", "surrogateescape"), shift, self.year).encode(
                                "utf-8", "surrogateescape"
                            ),
                        )
                        for t, line in f.lines
                    ),
                )
                for f in self.files
            ),
            self.t0 + shift,
            self.year,
        )

    def compressed(self, max_gap_s: float) -> Corpus:
        """The same bytes on a shorter true-time axis: every gap between consecutive moments of
        the job (all files together, so the order across files stays) cut to at most
        ``max_gap_s``. For logs that span hours (a logbook's excerpt), whose timestamps the
        engine reads from the bytes anyway."""
        moments = sorted({t for f in self.files for t, _ in f.lines})
        mapped: dict[float, float] = {}
        prev, now = None, 0.0
        for t in moments:
            now += 0.0 if prev is None else min(t - prev, max_gap_s)
            mapped[t], prev = now, t
        return dataclasses.replace(
            self,
            files=tuple(
                SourceFile(f.rel, tuple((mapped[t], line) for t, line in f.lines)) for f in self.files
            ),
        )

    @property
    def nodes(self) -> list[str]:
        return sorted({f.node for f in self.files})

    @property
    def total_lines(self) -> int:
        return sum(len(f.lines) for f in self.files)

    @property
    def duration(self) -> float:
        return max((t for f in self.files for t, _ in f.lines), default=0.0)

    def globs(self, dest: Path, node: str) -> list[str]:
        """The agent's --logs for ``node``: ``<dest>/<node>/**/*.<ext>`` per extension present
        (a bare name such as ``stdout`` as itself)."""
        out: set[str] = set()
        for f in self.files:
            if f.node == node:
                name = f.rel.rsplit("/", 1)[-1]
                out.add(f"*{Path(name).suffix}" if Path(name).suffix else name)
        return [str(dest / node / "**" / pattern) for pattern in sorted(out)]


def load_corpus(name: str, root: Path = JOBS) -> Corpus:
    """The job's log files (those `diagnose` reads) as timed lines on one true-time axis."""
    src = root / name
    skew = json.loads((src / "expected.json").read_text()).get("skew_s", {})
    report = ReadReport()
    raw: list[tuple[str, list[tuple[float | None, bytes]]]] = []
    for lf in discover([src], None, report):
        if "/" not in lf.rel:
            raise ValueError(f"{src / lf.rel}: a log file outside a node directory")
        node = lf.rel.split("/", 1)[0]
        year = time.gmtime(lf.mtime).tm_year
        timed: list[tuple[float | None, bytes]] = []
        last: float | None = None
        for line in lf.path.read_bytes().splitlines(keepends=True):
            ts = parse_timestamp(line[:512].decode("utf-8", "replace"), year, lf.mtime)
            if ts is not None:
                last = ts - float(skew.get(node, 0.0))
            timed.append((last, line))
        raw.append((lf.rel, timed))
    t0 = min((t for _, timed in raw for t, _ in timed if t is not None), default=0.0)
    files = tuple(
        SourceFile(rel, tuple((max((t if t is not None else t0) - t0, 0.0), line) for t, line in timed))
        for rel, timed in raw
    )
    return Corpus(name, src, files, t0, time.gmtime(t0).tm_year)


def split_seed(job: str) -> int:
    """The split variant's seed for ``job``: stable across runs, overridable by DENPEX_SPLIT_SEED."""
    base = int(os.environ.get("DENPEX_SPLIT_SEED", "0"))
    return base ^ zlib.crc32(job.encode())


# ------------------------------------------------------------------------------- the writers


@dataclass(frozen=True)
class Piece:
    due: float  # true seconds since the job's start
    data: bytes
    pause: float  # wall seconds to wait after the previous piece at least
    lines: int  # lines completed by this piece


def _continues(line: bytes) -> bool:
    """A traceback's frame line (indented after an optional ``[rankN]:`` prefix)."""
    m = _PREFIX.match(line)
    body = line[m.end() :] if m else line
    return body[:1] in (b" ", b"\t")


def whole_lines(f: SourceFile) -> list[Piece]:
    if not f.lines:
        return [Piece(0.0, b"", 0.0, 0)]  # an empty file is still created
    return [Piece(t, line, 0.0, 1) for t, line in f.lines]


def split_pieces(f: SourceFile, rng: random.Random) -> list[Piece]:
    """``f``'s bytes cut at random offsets, inside every traceback and at every pacing pause."""
    if not f.lines:
        return whole_lines(f)
    data = b"".join(line for _, line in f.lines)
    starts: list[int] = []  # the offset where each line starts
    pos = 0
    for _, line in f.lines:
        starts.append(pos)
        pos += len(line)
    cuts: set[int] = set()
    n_random = min(SPLIT_MAX_RANDOM_CUTS, max(2, len(f.lines) // SPLIT_LINES_PER_CUT))
    if len(data) > 1:
        cuts.update(rng.randrange(1, len(data)) for _ in range(n_random))
    for i, (t, line) in enumerate(f.lines):
        if i and t - f.lines[i - 1][0] > SPLIT_GAP_S:
            cuts.add(starts[i])  # a piece never spans a pause of the original pacing
        if _TRACEBACK in line:  # the whole record: header, indented frames, the exception line
            j = i + 1
            while j < len(f.lines) - 1 and _continues(f.lines[j][1]):
                j += 1
            end = starts[j] + len(f.lines[j][1]) if j < len(f.lines) else len(data)
            if end - starts[i] > 1:
                cuts.add(rng.randrange(starts[i] + 1, end))
    cuts.discard(0)
    cuts.discard(len(data))
    bounds = [0, *sorted(cuts), len(data)]
    pieces: list[Piece] = []
    line_idx = 0
    for a, b in itertools.pairwise(bounds):
        while line_idx + 1 < len(starts) and starts[line_idx + 1] <= a:
            line_idx += 1
        mid_line = starts[line_idx] != a
        done = sum(1 for s, (_, line) in zip(starts, f.lines, strict=True) if a < s + len(line) <= b)
        pieces.append(
            Piece(f.lines[line_idx][0], data[a:b], rng.uniform(0.0, SPLIT_PAUSE_S) if mid_line else 0.0, done)
        )
    assert b"".join(p.data for p in pieces) == data
    return pieces


def _append(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as fh:
        fh.write(data)


@dataclass
class Progress:
    """Lines written so far; `half` is set once half of them are."""

    total: int
    written: int = 0
    half: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, n: int) -> None:
        self.written += n
        if self.written * 2 >= self.total:
            self.half.set()


async def write_file(path: Path, pieces: Sequence[Piece], start: float, progress: Progress) -> None:
    """Append ``pieces`` to ``path`` at their due time (``SPEED`` times faster, measured from
    ``start``) and after their pause; the file appears with its first piece."""
    for p in pieces:
        wait = max(start + p.due / SPEED - time.monotonic(), p.pause)
        if wait > 0:
            await asyncio.sleep(wait)
        _append(path, p.data)
        progress.add(p.lines)


def write_all_now(corpus: Corpus, dest: Path) -> None:
    for f in corpus.files:
        _append(dest / f.rel, b"".join(line for _, line in f.lines))


# ------------------------------------------------------------------------------- comparing


def fields(doc: dict[str, Any] | None) -> dict[str, Any]:
    """What must be equal live and post-mortem."""
    if not doc:
        return {}
    ini = doc.get("initiator") or {}
    rc = doc.get("root_cause") or {}
    nan = (doc.get("fingerprints") or {}).get("nan") or {}
    return {
        "verdict": doc.get("verdict"),
        "initiator.node": ini.get("node"),
        "initiator.rank": ini.get("rank"),
        "initiator.rule": ini.get("rule"),
        "root_cause.category": rc.get("category"),
        "collateral_ranks": list(doc.get("collateral_ranks") or []),
        "nan.stage": nan.get("stage"),
        "nan.first_rank": nan.get("first_rank"),
        "nan.ranks": list(nan.get("ranks") or []),
    }


def _clock_samples(doc: dict[str, Any], nodes: Iterable[str]) -> dict[str, Any]:
    clock = doc.get("clock") or {}
    return {n: (clock.get(n) or {}).get("samples") for n in nodes}


def differences(live: dict[str, Any], want: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, live value, diagnose value) for every field that differs; and the clock estimator
    must rest on as many step samples live as post-mortem, for every node whose offset diagnose
    takes from progress (catch-up, cuts and restarts included)."""
    got, exp = fields(live), fields(want)
    out = [(k, got.get(k), exp[k]) for k in exp if got.get(k) != exp[k]]
    nodes = [n for n, c in (want.get("clock") or {}).items() if c.get("method") in ("reference", "progress")]
    if _clock_samples(live, nodes) != _clock_samples(want, nodes):
        out.append(("clock.samples", _clock_samples(live, nodes), _clock_samples(want, nodes)))
    return out


async def diagnose_json(src: Path) -> dict[str, Any]:
    """`denpexd diagnose SRC --format json`, the real CLI."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "denpexd", "diagnose", str(src), "--format", "json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"denpexd diagnose {src} exited {proc.returncode}: {err.decode()[-2000:]}")
    return dict(json.loads(out))


# ------------------------------------------------------------------------------- alerts


class TimedAlerts(list[dict[str, Any]]):
    """AlertReceiver's alert list, remembering when each alert arrived (monotonic seconds)."""

    def __init__(self) -> None:
        super().__init__()
        self.arrived: list[float] = []

    def extend(self, alerts: Iterable[dict[str, Any]]) -> None:
        new = list(alerts)
        self.arrived.extend([time.monotonic()] * len(new))
        super().extend(new)

    def append(self, alert: dict[str, Any]) -> None:
        self.extend([alert])

    def insert(self, i: SupportsIndex, alert: dict[str, Any]) -> None:
        raise NotImplementedError


@dataclass
class AlertFacts:
    first: tuple[str, str] | None  # (node, rank) labels of the first firing alert
    first_ok: bool  # it names diagnose's initiator (or no alert fired where diagnose names none)
    relabel_s: float | None  # first firing alert → first one naming diagnose's initiator
    final: list[tuple[str, str]]  # labels of the alerts firing at the end
    final_ok: bool

    def describe(self) -> str:
        if self.first is None:
            return "no alert" + ("" if self.first_ok else " (diagnose names an initiator)")
        first = _who(self.first)
        if self.first_ok:
            note = f"first={first} ok"
        elif self.relabel_s is not None:
            note = f"first={first} WRONG, relabel after {self.relabel_s:.2f}s"
        else:
            note = f"first={first} WRONG, never relabelled"
        if not self.final_ok:
            note += f"; firing at end=[{', '.join(_who(w) for w in self.final)}]"
        return note


def _who(labels: tuple[str, str]) -> str:
    node, rank = labels
    return f"{node}/rank={rank if rank else repr(rank)}"


def alert_facts(alerts: TimedAlerts, job: str, want: dict[str, Any]) -> AlertFacts:
    ini = want.get("initiator")
    # the labels an alert naming diagnose's initiator has (an unknown rank is "")
    target = (str(ini["node"]), "" if ini.get("rank") is None else str(ini["rank"])) if ini else None
    firing = [
        (t, (str(a["labels"].get("node")), str(a["labels"].get("rank"))))
        for t, a in zip(alerts.arrived, alerts, strict=True)
        if a["labels"].get("job") == job and "endsAt" not in a
    ]
    latest: dict[str, dict[str, Any]] = {}
    for a in alerts:
        if a["labels"].get("job") == job:
            latest[json.dumps(a["labels"], sort_keys=True)] = a
    final = sorted(
        (str(a["labels"].get("node")), str(a["labels"].get("rank")))
        for a in latest.values()
        if "endsAt" not in a
    )
    first = firing[0][1] if firing else None
    first_ok = first == target
    relabel = None
    if firing and target is not None and not first_ok:
        relabel = next((t - firing[0][0] for t, who in firing if who == target), None)
    final_ok = final == ([target] if target else [])
    return AlertFacts(first, first_ok, relabel, final, final_ok)


# ------------------------------------------------------------------------------- one replay


@dataclass
class Result:
    job: str
    variant: str
    broker: str
    job_id: str = ""
    agent_nodes: list[tuple[str, str]] = field(default_factory=list)  # (agent id, node)
    seed: int | None = None
    diffs: list[tuple[str, Any, Any]] = field(default_factory=list)
    alerts: AlertFacts | None = None
    error: str | None = None
    settled: str = ""  # "equal", "stable" or "timeout"
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)  # trouble: exit codes, log lines, CLI failures
    resumed: tuple[int, int] | None = None  # kill9: (files resumed past offset 0, files taken up)
    t0: float = 0.0
    phases: list[tuple[str, float]] = field(default_factory=list)  # (what, seconds since t0)

    def phase(self, what: str) -> None:
        self.phases.append((what, time.monotonic() - self.t0))

    @property
    def agree(self) -> bool:
        return self.error is None and not self.diffs

    def line(self) -> str:
        if self.error is not None:
            verdict = f"ERROR {self.error}"
        elif not self.diffs:
            verdict = "agree"
        else:
            verdict = "DIFF " + "; ".join(f"{k}: live={v!r} diagnose={w!r}" for k, v, w in self.diffs)
        alerts = self.alerts.describe() if self.alerts else "-"
        seed = f" seed={self.seed}" if self.seed is not None else ""
        if self.resumed is not None:
            seed += f" resumed={self.resumed[0]}/{self.resumed[1]}"
        phases = " ".join(f"{what} {t:.1f}" for what, t in self.phases)
        notes = f" | NOTES {' / '.join(self.notes)}" if self.notes else ""
        return (
            f"{self.job:22} {self.variant:8} {self.broker:9} {verdict} | alerts: {alerts} | "
            f"settled={self.settled} {self.seconds:.1f}s ({phases}) job={self.job_id}{seed}{notes}"
        )


@dataclass
class Site:
    """One running daemon (one broker) and its alert receiver, shared by many replays."""

    name: str  # "embedded" or "mosquitto"
    daemon: Daemon
    alerts: TimedAlerts
    workdir: Path
    exit_code: int | None = None  # the daemon's once stopped (None: it ignored SIGTERM 15 s)
    cpu_s: float | None = None  # the daemon's CPU time (user + system) before it was stopped

    @property
    def agent_flags(self) -> list[str]:
        # the embedded broker speaks 3.1.1 only: saves each agent start the v5 attempt's timeout
        # (the automatic fallback has its own test in test_live_e2e.py)
        return ["--mqtt-version", "3.1.1"] if self.name == "embedded" else []


async def agent_lag(ports: Sequence[int]) -> int | None:
    """Bytes the agents have not read or not had acknowledged yet (their documented metrics
    ``denpex_agent_read_lag_bytes`` + ``_checkpoint_lag_bytes``); None when one does not answer."""
    total = 0
    async with aiohttp.ClientSession() as session:
        for port in ports:
            try:
                async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
                    text = await resp.text()
            except aiohttp.ClientError:
                return None
            found = 0
            for ln in text.splitlines():
                name, _, value = ln.partition(" ")
                if name in ("denpex_agent_read_lag_bytes", "denpex_agent_checkpoint_lag_bytes"):
                    total += int(float(value))
                    found += 1
            if found != 2:
                return None
    return total


async def _settle(
    site: Site, job_id: str, want: dict[str, Any], writers_done: float, metric_ports: Sequence[int]
) -> str:
    """Wait until the agents have caught up (read and delivered every byte) and, since then, the
    live diagnosis has not changed for a while: ``STABLE_EQUAL_S`` when it equals diagnose's,
    ``STABLE_S`` otherwise; never sooner than ``SETTLE_MIN_S`` after the writers finished (the
    agents hold an unfinished record up to their fold timeout, invisible in their lag metrics);
    at most ``QUIESCE_TIMEOUT_S``."""
    exp = fields(want)
    last: Any = None
    since = time.monotonic()
    caught_up_at: float | None = None
    lag: int | None = None
    while True:
        now = time.monotonic()
        status, doc = await site.daemon.get(f"/api/v1/jobs/{job_id}")
        key: str | None = None  # the whole document but its counters (heartbeats count as events)
        if status == 200:
            key = json.dumps({k: v for k, v in doc.items() if k != "stats"}, sort_keys=True, default=str)
        if key != last:
            last, since = key, now
        if caught_up_at is None:
            lag = await agent_lag(metric_ports)
            if lag == 0:
                caught_up_at = now
        if key is not None and caught_up_at is not None and now - writers_done >= SETTLE_MIN_S:
            quiet = now - max(since, caught_up_at)
            if fields(doc) == exp and quiet >= STABLE_EQUAL_S:
                return "equal"
            if quiet >= STABLE_S:
                return "stable"
        if now - writers_done > QUIESCE_TIMEOUT_S:
            return "timeout" + (f" (agents' lag {lag} bytes)" if caught_up_at is None else "")
        await asyncio.sleep(POLL_S)


async def _wait_alerts(site: Site, job_id: str, want: dict[str, Any]) -> AlertFacts:
    deadline = time.monotonic() + (ALERT_WAIT_S if want.get("initiator") else ALERT_WAIT_NONE_S)
    while True:
        facts = alert_facts(site.alerts, job_id, want)
        if (want.get("initiator") and facts.final_ok) or time.monotonic() > deadline:
            return facts
        await asyncio.sleep(POLL_S)


async def _stop_agent(node: str, proc: subprocess.Popen[bytes], result: Result) -> None:
    try:
        code = await asyncio.to_thread(stop, proc)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = await asyncio.to_thread(proc.wait)
        result.notes.append(f"agent {node} did not stop within 15 s of SIGTERM")
    if code != 0:
        result.notes.append(f"agent {node} exited {code}")


def log_trouble(path: Path, limit: int = 3) -> list[str]:
    if not path.exists():
        return [f"{path.name}: missing"]
    hits = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if LOG_TROUBLE.search(ln)]
    return [f"{path.name}: {h[:300]}" for h in hits[:limit]] + (
        [f"{path.name}: … {len(hits) - limit} more"] if len(hits) > limit else []
    )


class Agents:
    """One `denpex-agent` per node of a replay, each with its own --state-dir and --metrics-listen
    (a port taken by someone else between choosing and binding it: started again on another)."""

    def __init__(self, corpus: Corpus, site: Site, job_id: str, tag: str, work: Path) -> None:
        self.corpus, self.site, self.job_id, self.tag, self.work = corpus, site, job_id, tag, work
        self.logs = {node: work / f"agent-{node}.log" for node in corpus.nodes}
        self.ports: dict[str, int] = {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.starts: dict[str, int] = {}  # "agent starting" lines in a node's log before its start

    def _started(self, node: str) -> int:
        log = self.logs[node]
        return log.read_text(errors="replace").count("agent starting") if log.exists() else 0

    def start(self, node: str) -> None:
        self.starts[node] = self._started(node)
        self.ports[node] = free_port()
        cmd = agent_cmd(
            self.job_id, node, self.corpus.globs(self.work / "logs", node), self.work / f"state-{node}",
            "--agent-id", f"{node}-{self.tag}", "--metrics-listen", f"127.0.0.1:{self.ports[node]}",
            *AGENT_FLAGS, *self.site.agent_flags, port=self.site.daemon.mqtt_port,
        )  # fmt: skip
        self.procs[node] = start_agent(cmd, self.logs[node])

    async def start_all(self, *, connected: bool) -> None:
        """Start every agent and wait for its metrics endpoint (and, with ``connected``, for its
        first connection to the broker)."""
        for node in self.corpus.nodes:
            self.start(node)
        await asyncio.gather(*(self._up(node, connected) for node in self.corpus.nodes))

    async def kill9_and_restart(self) -> None:
        for proc in self.procs.values():
            proc.send_signal(signal.SIGKILL)
        for proc in self.procs.values():
            await asyncio.to_thread(proc.wait)
        await self.start_all(connected=False)  # the same --state-dir: resume from the checkpoints

    async def _up(self, node: str, connected: bool) -> None:
        deadline = time.monotonic() + AGENT_READY_S
        retries = 3
        while True:
            proc = self.procs[node]
            if proc.poll() is not None:
                tail = self.logs[node].read_text(errors="replace")[-500:]
                if proc.returncode == 2 and "cannot listen" in tail and retries > 0:
                    retries -= 1
                    self.start(node)
                    continue
                raise RuntimeError(f"agent {node} exited {proc.returncode} while starting: {tail[-300:]}")
            # The port answers, and it is this agent that answers (it logs its start only once it
            # listens): another process may have taken the port meanwhile and answer instead.
            ready = (
                self._started(node) > self.starts[node] and await agent_lag([self.ports[node]]) is not None
            )
            if ready and connected:
                ready = "connected to broker" in self.logs[node].read_text(errors="replace")
            if ready:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"agent {node} not ready within {AGENT_READY_S} s")
            await asyncio.sleep(0.1)

    def resumed(self) -> tuple[int, int]:
        """(files the restarted agents took up past offset 0, files they took up), from the
        agents' "following file ... offset=N" log lines after their second start."""
        past, total = 0, 0
        for log in self.logs.values():
            after = log.read_text(errors="replace").split("agent starting")[2:]
            for m in re.finditer(r"following file .*? offset=(\d+)", "".join(after)):
                total += 1
                past += int(m.group(1)) > 0
        return past, total

    async def stop(self, result: Result) -> None:
        await asyncio.gather(*(_stop_agent(node, proc, result) for node, proc in self.procs.items()))
        for node in self.corpus.nodes:
            trouble = log_trouble(self.logs[node])
            result.notes.extend(t for t in trouble if t not in result.notes)


async def replay_job(
    corpus: Corpus, variant: str, site: Site, want: dict[str, Any], result: Result
) -> Result:
    """One replay of ``corpus`` under ``variant`` through ``site``; fills ``result``."""
    t_begin = result.t0 = time.monotonic()
    tag = uuid.uuid4().hex[:6]
    job_id = f"inv-{corpus.name.replace('_', '-')}-{variant}-{site.name[:4]}-{tag}"
    result.job_id = job_id
    result.agent_nodes = [(f"{node}-{tag}", node) for node in corpus.nodes]
    work = site.workdir / job_id
    dest = work / "logs"
    dest.mkdir(parents=True)
    progress = Progress(corpus.total_lines)
    agents = Agents(corpus, site, job_id, tag, work)
    try:
        if variant == "split":
            result.seed = split_seed(corpus.name)
        if variant == "catchup":
            write_all_now(corpus, dest)
        else:
            corpus = corpus.starting_now()
        await agents.start_all(connected=True)
        result.phase("agents up")
        if variant != "catchup":
            plans: list[tuple[Path, list[Piece]]] = []
            for f in corpus.files:
                if variant == "split":
                    rng = random.Random(f"{result.seed}:{f.rel}")
                    plans.append((dest / f.rel, split_pieces(f, rng)))
                else:
                    plans.append((dest / f.rel, whole_lines(f)))
            start = time.monotonic()
            writers = [asyncio.create_task(write_file(p, pcs, start, progress)) for p, pcs in plans]
            if variant == "kill9":
                await progress.half.wait()
                await agents.kill9_and_restart()  # the writers go on meanwhile
                result.phase("restarted")
            await asyncio.gather(*writers)
        writers_done = time.monotonic()
        result.phase("written")
        result.settled = await _settle(site, job_id, want, writers_done, list(agents.ports.values()))
        result.phase("settled")
        try:
            live = await query_json(site.daemon.url, job_id)
        except AssertionError as exc:  # the CLI failed: noted, and asked once more
            result.notes.append(f"denpexd query failed: {' '.join(str(exc).split())[:300]}")
            live = await query_json(site.daemon.url, job_id)
        result.phase("queried")
        result.diffs = differences(live, want)
        result.alerts = await _wait_alerts(site, job_id, want)
        result.phase("alerted")
    except Exception as exc:
        result.error = " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
    finally:
        await agents.stop(result)
        if variant == "kill9":
            result.resumed = agents.resumed()
        result.phase("stopped")
        result.seconds = time.monotonic() - t_begin
    return result


# ------------------------------------------------------------------------------- the sites


def _cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.asynccontextmanager
async def site(name: str, workdir: Path) -> AsyncIterator[Site]:
    """A `denpexd serve` on ``name``'s broker with an alert receiver; stopped (and its
    Mosquitto session and retained messages cleared) on exit."""
    alerts = TimedAlerts()
    async with AlertReceiver(alerts=alerts).serve() as receiver:
        client_id = f"denpexd-inv-{uuid.uuid4().hex[:8]}"
        extra = ["--alertmanager", f"http://127.0.0.1:{receiver.port}", "--client-id", client_id]
        broker = None if name == "embedded" else f"mqtt://{MOSQUITTO[0]}:{MOSQUITTO[1]}"
        daemon = Daemon(workdir / "data", *extra, broker=broker)
        await daemon.start()
        s = Site(name, daemon, alerts, workdir)
        try:
            yield s
        finally:
            s.cpu_s = _cpu_seconds(daemon.proc.pid if daemon.proc else 0)
            try:
                s.exit_code = await daemon.stop()
            except TimeoutError:  # killed by Daemon.stop
                s.exit_code = None
            if broker is not None:
                await forget_session(client_id)


async def clear_retained(job_ids: Sequence[str], agents: Sequence[tuple[str, str, str]]) -> None:
    """Remove what the replays left retained on Mosquitto (diagnoses, agent statuses)."""
    async with aiomqtt.Client(*MOSQUITTO, identifier=f"inv-clean-{uuid.uuid4().hex[:8]}") as client:
        for job in job_ids:
            await client.publish(wire.diagnosis_topic(job), b"", qos=1, retain=True)
        for job, agent, node in agents:
            await client.publish(wire.sender_topic(job, agent, node, "status"), b"", qos=1, retain=True)
