"""The running agent: tail → match → batch → publish (QoS 1) → checkpoint, plus clock and heartbeats.

Tasks (one `asyncio.TaskGroup`):

* ``read``: discovery and `Tailer.poll` in a worker thread, the resulting events and marks into a
  bounded in-flight budget (when the broker is away the budget fills and reading pauses: the log
  files are the buffer, memory stays bounded);
* ``send``: batches by size and delay, `Publisher.publish` (returns after PUBACK), then the marks
  advance the checkpoints, which are written (tmp → fsync → rename) at most every
  ``checkpoint_interval`` and at shutdown;
* ``clock``: NTP-style requests; replies arrive through the publisher's callback.

Stop: `request_stop()` (SIGTERM/SIGINT) ends reading, flushes what was read within
``shutdown_timeout``, writes the checkpoints and says ``offline``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from denpex_agent import wire
from denpex_agent.attribution import Layout
from denpex_agent.checkpoint import Checkpoints
from denpex_agent.config import AgentConfig
from denpex_agent.errors import RuleError
from denpex_agent.events import Event, event_id
from denpex_agent.matcher import Matcher
from denpex_agent.metrics import AgentMetrics
from denpex_agent.publisher import Publisher
from denpex_agent.rules import load_rules
from denpex_agent.tailer import Mark, Tailer

log = logging.getLogger(__name__)

CLOCK_SAMPLES = 8
SMALL_POLL_BYTES = 256 * 1024  # steady-state reads at most this large run on the event loop


@dataclass(slots=True)
class _Item:
    """What one poll produced: its events, then the marks they make safe to checkpoint."""

    events: list[Event]
    marks: list[Mark]
    size: int
    read_at: float


def _split(events: list[Event], max_bytes: int) -> list[list[Event]]:
    """Consecutive slices of ``events``, each within ``max_bytes`` (a single event may exceed it)."""
    parts: list[list[Event]] = []
    cur: list[Event] = []
    size = 0
    for ev in events:
        n = _event_size(ev)
        if cur and size + n > max_bytes:
            parts.append(cur)
            cur, size = [], 0
        cur.append(ev)
        size += n
    if cur:
        parts.append(cur)
    return parts


def _event_size(ev: Event) -> int:
    ctx = ev.context
    return 300 + len(ev.text) + (sum(map(len, ctx)) + 4 * len(ctx) if ctx else 0) + len(ev.file)


class Agent:
    def __init__(self, cfg: AgentConfig, registry: CollectorRegistry | None = None) -> None:
        self.cfg = cfg
        self.registry = registry or CollectorRegistry()
        self.metrics = AgentMetrics(self.registry)
        rules = load_rules(cfg.rules)
        self.matcher = Matcher(rules)
        self.checkpoints = Checkpoints(cfg.state_dir, cfg.agent)
        self.tailer = Tailer(
            cfg.logs,
            self.matcher,
            self.checkpoints,
            job=cfg.job,
            node=cfg.node,
            agent=cfg.agent,
            layout=Layout(cfg.layout) if cfg.layout else None,
            context_lines=cfg.context_lines,
            max_line_bytes=cfg.max_line_bytes,
            read_chunk=cfg.read_chunk,
            progress_interval=cfg.progress_interval,
        )
        self._queue: asyncio.Queue[_Item | None] = asyncio.Queue()
        self._inflight = 0
        self._space = asyncio.Event()
        self._space.set()
        self._stop = asyncio.Event()
        self._reading_done = asyncio.Event()
        self._seq = 0
        self._clock: deque[tuple[float, float]] = deque(maxlen=CLOCK_SAMPLES)
        self._pending_clock: dict[float, float] = {}
        self._reported: dict[str, int] = {}
        self._last_heartbeat = 0.0
        self._metrics_at = 0.0
        self._small_reads = False
        self.published_events = 0

    # -- control --------------------------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop.set()

    def reload_rules(self) -> bool:
        """SIGHUP: the same loader as startup; a bad library keeps the old rules."""
        try:
            matcher = Matcher(load_rules(self.cfg.rules))
        except RuleError as exc:
            log.error("rule reload failed; keeping the previous rules error=%s", exc)
            return False
        self.matcher = matcher
        self.tailer.matcher = matcher
        log.info("rules reloaded rules=%d", len(matcher.ruleset))
        return True

    @property
    def clock_estimate(self) -> tuple[float, float] | None:
        """(daemon minus agent offset, uncertainty) of the lowest-delay recent sample."""
        if not self._clock:
            return None
        offset, delay = min(self._clock, key=lambda s: s[1])
        return offset, delay / 2.0

    # -- run --------------------------------------------------------------------------------------

    async def run(self) -> None:
        for w in await asyncio.to_thread(self.checkpoints.load):
            log.warning("%s", w)
        async with Publisher(self.cfg, self._on_clock_reply) as pub:
            try:
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(self._read_loop(), name="read")
                    send = tg.create_task(self._send_loop(pub), name="send")
                    clock = tg.create_task(self._clock_loop(pub), name="clock")
                    await self._stop.wait()
                    await self._reading_done.wait()
                    self._queue.put_nowait(None)
                    try:
                        await asyncio.wait_for(asyncio.shield(send), self.cfg.shutdown_timeout)
                    except TimeoutError:
                        log.warning(
                            "shutdown: unsent events left; they will be re-read on restart pending=%d",
                            self._queue.qsize(),
                        )
                        send.cancel()
                    clock.cancel()
            finally:
                await self._save_checkpoints()
                self.tailer.close()
        log.info("agent stopped published_events=%d", self.published_events)

    async def _read_loop(self) -> None:
        cfg = self.cfg
        next_discovery = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_discovery:
                    await asyncio.to_thread(self.tailer.discover)
                    next_discovery = now + cfg.discover_interval
                if self._inflight >= cfg.max_inflight_bytes:
                    self._space.clear()
                    await self._wait(self._space.wait(), cfg.poll_interval * 4)
                    continue
                budget = min(cfg.max_inflight_bytes - self._inflight, 8 * cfg.read_chunk)
                if self._small_reads:  # a few KiB per file: cheaper inline than a thread hop
                    events, marks, more = self.tailer.poll(min(budget, SMALL_POLL_BYTES))
                    more = more or False
                else:
                    events, marks, more = await asyncio.to_thread(self.tailer.poll, budget)
                self._small_reads = not more
                read_at = time.time()
                if events or marks:
                    self._enqueue(_Item(events, marks, sum(map(_event_size, events)), read_at))
                self._heartbeats(read_at)
                if read_at - self._metrics_at >= 1.0:
                    self._metrics_at = read_at
                    self._update_metrics()
                if not more:
                    await asyncio.sleep(cfg.poll_interval)
        finally:
            self._reading_done.set()

    @staticmethod
    async def _wait(aw: Any, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(aw, seconds)

    def _enqueue(self, item: _Item) -> None:
        self._inflight += item.size
        self._queue.put_nowait(item)

    def _heartbeats(self, now: float) -> None:
        if now - self._last_heartbeat < self.cfg.heartbeat_interval:
            return
        self._last_heartbeat = now
        est = self.clock_estimate
        beats: list[Event] = []
        for f in self.tailer.files:
            ts = f.scanner.last_ts()
            fields: dict[str, Any] = {"agent_time": now, "lag_bytes": self.tailer.file_lag(f)}
            if est is not None:
                fields["clock_offset_s"], fields["clock_uncertainty_s"] = est
            src = f.scanner.source
            ev = Event(
                id=event_id(self.cfg.agent, f.identity, int(now * 1000), "heartbeat"),
                kind="heartbeat",
                job=self.cfg.job,
                node=self.cfg.node,
                rank=src.rank,
                local_rank=src.local_rank,
                file=f.path,
                offset=f.pos,
                line_no=f.scanner.line_no,
                ts=ts,
                ts_source="line" if ts is not None else "none",
                fields=fields,
            )
            beats.append(ev)
        if beats:
            self._enqueue(_Item(beats, [], sum(map(_event_size, beats)), now))

    def _update_metrics(self) -> None:
        st = self.tailer.stats
        m = self.metrics
        lines = sum(f.scanner.stats.lines for f in self.tailer.files)
        for key, value, counter in (("bytes", st.bytes_read, m.bytes), ("lines", lines, m.lines)):
            prev = self._reported.get(key, 0)
            if value > prev:
                counter.inc(value - prev)
            self._reported[key] = value
        truncated = sum(f.scanner.stats.truncated_lines for f in self.tailer.files)
        prev = self._reported.get("truncated", 0)
        if truncated > prev:
            m.truncated.inc(truncated - prev)
        self._reported["truncated"] = truncated
        for reason, n in st.warnings.items():
            key = f"warn:{reason}"
            if n > self._reported.get(key, 0):
                m.warnings.labels(reason=reason).inc(n - self._reported.get(key, 0))
                self._reported[key] = n
        m.files.set(len(self.tailer.files))
        m.read_lag.set(self.tailer.lag_bytes())
        m.checkpoint_lag.set(self._inflight)

    async def _send_loop(self, pub: Publisher) -> None:
        cfg = self.cfg
        topic = wire.events_topic(cfg.job)
        last_save = time.monotonic()
        done = False
        while not done:
            item = await self._queue.get()
            if item is None:
                break
            items = [item]
            size = item.size
            deadline = time.monotonic() + cfg.batch_max_delay
            # Gather for up to batch_max_delay: take what is queued, sleep, take again (one timer
            # per batch rather than a wait_for task per item).
            while size < cfg.batch_max_bytes and not done:
                while size < cfg.batch_max_bytes and not self._queue.empty():
                    nxt = self._queue.get_nowait()
                    if nxt is None:
                        done = True
                        break
                    items.append(nxt)
                    size += nxt.size
                remaining = deadline - time.monotonic()
                if done or size >= cfg.batch_max_bytes or remaining <= 0:
                    break
                await asyncio.sleep(remaining)
            events = [e for i in items for e in i.events]
            for part in _split(events, cfg.batch_max_bytes):
                self._seq += 1
                payload = wire.encode_batch(cfg.agent, cfg.job, cfg.node, self._seq, time.time(), part)
                self.metrics.connected.set(1 if pub.connected else 0)
                await pub.publish(topic, payload)
                self.metrics.connected.set(1)
                self.metrics.batches.inc()
                self.metrics.publish_latency.observe(max(time.time() - items[0].read_at, 0.0))
                for ev in part:
                    self.metrics.events.labels(kind=ev.kind).inc()
                self.published_events += len(part)
            for i in items:
                for mk in i.marks:
                    self.checkpoints.advance(mk.identity, mk.path, mk.offset, mk.line_no)
            self._inflight -= size
            if self._inflight < cfg.max_inflight_bytes:
                self._space.set()
            self.metrics.checkpoint_lag.set(self._inflight)
            if time.monotonic() - last_save >= cfg.checkpoint_interval:
                await self._save_checkpoints()
                last_save = time.monotonic()

    async def _save_checkpoints(self) -> None:
        data = self.checkpoints.snapshot()
        if data is not None:
            await asyncio.to_thread(self.checkpoints.write, data)

    # -- clock ----------------------------------------------------------------------------------

    async def _clock_loop(self, pub: Publisher) -> None:
        topic = wire.clock_request_topic(self.cfg.job, self.cfg.agent)
        quick = 3
        while True:
            if await pub.wait_connected(self.cfg.clock_interval):
                t0 = time.time()
                self._pending_clock[t0] = t0
                await pub.publish_nowait_ack(topic, wire.encode_clock_request(self.cfg.agent, t0))
            if quick > 0:
                quick -= 1
                await asyncio.sleep(0.5)
            else:
                await asyncio.sleep(self.cfg.clock_interval)
            if len(self._pending_clock) > 32:
                self._pending_clock.clear()

    def _on_clock_reply(self, payload: bytes, t3: float) -> None:
        try:
            t0, t1, t2 = wire.decode_clock_reply(payload)
        except wire.WireError as exc:
            log.warning("ignoring a malformed clock reply error=%s", exc)
            return
        if self._pending_clock.pop(t0, None) is None:
            return  # not ours, or a late duplicate
        offset, delay = wire.clock_sample(t0, t1, t2, t3)
        self._clock.append((offset, delay))
        est = self.clock_estimate
        if est is not None:
            self.metrics.clock_offset.set(est[0])
