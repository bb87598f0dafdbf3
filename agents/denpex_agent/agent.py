"""The running agent: tail → match → batch → publish (QoS 1) → checkpoint, plus clock and heartbeats.

Reading runs in its own thread (``denpex-read``): discovery and `Tailer.poll`, the resulting
events and marks handed to the event loop within a bounded in-flight budget (when the broker is
away the budget fills and reading pauses: the log files are the buffer, memory stays bounded).
Whatever the reader is doing (a huge catch-up, a pathological line), the event loop stays free:

* ``send``: batches by size and delay, `Publisher.publish` (returns after PUBACK), then the marks
  advance the checkpoints, which are written (tmp → fsync → rename) at most every
  ``checkpoint_interval`` and at shutdown;
* ``watch``: heartbeats every ``heartbeat_interval`` (from the reader's last view of its files,
  plus how long its current scan has been running), and a warning and a counter when one scan
  runs longer than ``slow_scan_warning``;
* ``clock``: NTP-style requests; replies arrive through the publisher's callback.

Stop: `request_stop()` (SIGTERM/SIGINT) ends reading, flushes what was read within
``shutdown_timeout``, writes the checkpoints and says ``offline``. A reader that does not finish
its scan in time is left behind (a daemon thread): the stop is bounded whatever it is doing, and
what it had not handed over is read again at the next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
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
from denpex_agent.events import Event
from denpex_agent.matcher import Matcher
from denpex_agent.metrics import AgentMetrics
from denpex_agent.publisher import Publisher
from denpex_agent.rules import load_rules
from denpex_agent.scanner import Source, heartbeat
from denpex_agent.tailer import Mark, Tailer

log = logging.getLogger(__name__)

CLOCK_SAMPLES = 8
COALESCE_S = 0.02  # after inotify wakes the reader: let a burst of writes land, read it in one poll
WATCHED_DISCOVERY = 10  # globs whose directories inotify watches: rediscover this many times rarer


@dataclass(slots=True)
class _Item:
    """What one poll produced: its events, then the marks they make safe to checkpoint."""

    events: list[Event]
    marks: list[Mark]
    size: int
    read_at: float
    behind: int = 0  # bytes the reader had still to read after this poll


@dataclass(slots=True)
class _Sent:
    """Batches the broker acknowledged and the daemon has yet to confirm: their payloads (to send
    again if no receipt comes), and the marks and bytes they release once all are confirmed."""

    parts: dict[tuple[int, float], bytes]  # (seq, sent_at) -> payload, the unconfirmed ones
    marks: list[Mark]
    size: int
    sent: float  # monotonic time of the last (re)send


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


@dataclass(frozen=True, slots=True)
class _FileView:
    """What a heartbeat says about one followed file, as the reader last saw it."""

    source: Source
    identity: str
    pos: int
    line_no: int
    last_ts: float | None
    quiet_since: float | None  # `LineScanner.quiet_since`: when its last step line was logged, at most
    lag: int


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
            fold_timeout=cfg.fold_timeout,
            watch=cfg.follow_mode == "auto",
        )
        self._queue: asyncio.Queue[_Item | None] = asyncio.Queue()
        self._inflight = 0  # bytes handed to the loop and not yet acknowledged (under _lock)
        self._lock = threading.Lock()
        self._space = threading.Event()
        self._space.set()
        self._stop = asyncio.Event()
        self._stop_reading = threading.Event()
        self._reader_done = asyncio.Event()
        self._reader: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._busy_since: float | None = None  # monotonic start of the reader's current poll
        self._polled_at = 0.0  # monotonic start of the reader's latest poll
        # the reader's unread bytes after its last poll; None until its first poll is done (the
        # heartbeats then say the files' unread sizes: a first read of a backlog may take long)
        self._behind: int | None = None
        self._slow_reported = False
        self._views: list[_FileView] = []
        self._seq = 0
        # End-to-end delivery: once the daemon says (in its clock replies) that it sends receipts,
        # a batch's marks are checkpointed when the daemon confirms storing it, not at PUBACK.
        # Until it has said (None), batches wait for a receipt too: a broker may acknowledge a
        # batch it then drops (the embedded broker refuses batches while the daemon is full). A
        # daemon that says nothing within `receipt_timeout` is taken at the broker's PUBACK.
        self._receipts: bool | None = None
        self._unconfirmed: deque[_Sent] = deque()  # in send order
        self._awaiting: dict[tuple[int, float], _Sent] = {}
        self._early: set[tuple[int, float]] = set()  # receipts that overtook their PUBACK
        self._all_confirmed = asyncio.Event()
        self._all_confirmed.set()
        self._clock: deque[tuple[float, float]] = deque(maxlen=CLOCK_SAMPLES)
        self._pending_clock: dict[float, float] = {}
        self._reported: dict[str, int] = {}
        self._views_at = -1e18
        self._metrics_at = 0.0
        self._metrics_lock = threading.Lock()
        self.published_events = 0

    # -- control --------------------------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop.set()
        self._stop_reading.set()
        self._space.set()
        self.tailer.wake()

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
        self._loop = asyncio.get_running_loop()
        async with Publisher(self.cfg, self._on_clock_reply, self._on_receipt) as pub:
            self._reader = threading.Thread(target=self._read_thread, name="denpex-read", daemon=True)
            reader_done = False
            try:
                async with asyncio.TaskGroup() as tg:
                    send = tg.create_task(self._send_loop(pub), name="send")
                    watch = tg.create_task(self._watch_loop(), name="watch")
                    clock = tg.create_task(self._clock_loop(pub), name="clock")
                    resend = tg.create_task(self._resend_loop(pub), name="resend")
                    self._reader.start()
                    await self._stop.wait()
                    reader_done = await self._join_reader(self.cfg.shutdown_timeout / 2)
                    self._queue.put_nowait(None)
                    until = time.monotonic() + self.cfg.shutdown_timeout / 2
                    try:
                        await asyncio.wait_for(asyncio.shield(send), self.cfg.shutdown_timeout / 2)
                    except TimeoutError:
                        log.warning(
                            "shutdown: unsent events left; they will be re-read on restart pending=%d",
                            self._queue.qsize(),
                        )
                        send.cancel()
                    if self._receipts is None:  # no daemon ever answered: the PUBACKs will do
                        self._confirm_by_puback()
                    with contextlib.suppress(TimeoutError):  # the last receipts
                        await asyncio.wait_for(self._all_confirmed.wait(), max(0.0, until - time.monotonic()))
                    if self._unconfirmed:
                        log.info(
                            "shutdown: batches not confirmed by the daemon yet; their lines are read "
                            "again at the next start batches=%d",
                            sum(len(g.parts) for g in self._unconfirmed),
                        )
                    watch.cancel()
                    clock.cancel()
                    resend.cancel()
            finally:
                await self._save_checkpoints()
                if reader_done or not self._reader.is_alive():
                    self.tailer.close()
        log.info("agent stopped published_events=%d", self.published_events)

    async def _join_reader(self, seconds: float) -> bool:
        """Wait (bounded) for the reader to hand over its last poll; False if it is still busy."""
        try:
            async with asyncio.timeout(seconds):
                await self._reader_done.wait()
        except TimeoutError:
            log.warning(
                "shutdown: the reader is still scanning; stopping without it (its bytes are read "
                "again at the next start) busy_s=%.1f file=%s",
                time.monotonic() - (self._busy_since or time.monotonic()),
                self.tailer.scanning or "-",
            )
            return False
        return True

    # -- the reader thread ------------------------------------------------------------------------

    def _read_thread(self) -> None:
        loop = self._loop
        assert loop is not None
        try:
            self._read_forever()
        except Exception:  # a bug here must not pass silently: log it and stop the agent
            log.exception("reader failed; stopping")
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self.request_stop)
        finally:
            # queued after the reader's last hand-over, so it runs after it
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(self._reader_done.set)

    def _read_forever(self) -> None:
        cfg = self.cfg
        tailer = self.tailer
        next_discovery = last_discovery = 0.0
        stale = True  # something was read since the heartbeats' view of the files was taken
        stop = self._stop_reading
        while not stop.is_set():
            now = time.monotonic()
            if now >= next_discovery or (
                tailer.discover_wanted and now >= last_discovery + cfg.discover_interval
            ):
                tailer.discover()
                last_discovery = now
                next_discovery = now + cfg.discover_interval * (
                    WATCHED_DISCOVERY if tailer.roots_watched else 1
                )
                if len(self._views) != len(tailer.files):  # new files: heartbeats name them now
                    self._views = self._file_views()
            with self._lock:
                room = cfg.max_inflight_bytes - self._inflight
                if room <= 0:
                    self._space.clear()
            if room <= 0:
                self._space.wait(cfg.poll_interval * 4)
                continue
            self._busy_since = self._polled_at = time.monotonic()
            events, marks, more = self.tailer.poll(min(room, 8 * cfg.read_chunk))
            self._busy_since = None
            read_at = time.time()
            self._behind = behind = self.tailer.behind
            if events or marks:
                stale = True
                item = _Item(events, marks, sum(map(_event_size, events)), read_at, behind)
                self._hand_over(item)
            if (stale or not tailer.watching) and read_at - self._views_at >= cfg.heartbeat_interval / 2:
                self._views_at = read_at
                self._views = self._file_views()
                stale = False
            if read_at - self._metrics_at >= 1.0:
                self._update_metrics()
            if more:
                continue
            if not tailer.watching:
                stop.wait(cfg.poll_interval)
                continue
            # inotify: sleep until a followed file's directory reports a change or a deadline
            # (a fold, flush or progress tip; polled files; discovery; the heartbeats' view)
            timeout = min(tailer.due_in(cfg.poll_interval), next_discovery - time.monotonic())
            if tailer.discover_wanted:
                timeout = min(timeout, last_discovery + cfg.discover_interval - time.monotonic())
            if stale:
                timeout = min(timeout, self._views_at + cfg.heartbeat_interval / 2 - time.time())
            if tailer.muted:  # files written without pause: looked at every poll_interval
                timeout = min(timeout, self._polled_at + cfg.poll_interval - time.monotonic())
            if tailer.wait(max(timeout, 0.0)) and not stop.is_set():
                # let the burst land; and a file written without pause is read every
                # poll_interval at most, as when polling (one poll then takes it all)
                stop.wait(max(COALESCE_S, self._polled_at + cfg.poll_interval - time.monotonic()))

    def _hand_over(self, item: _Item) -> None:
        with self._lock:
            self._inflight += item.size
        loop = self._loop
        assert loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is closed: re-read at the next start
            loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def _file_views(self) -> list[_FileView]:
        views = []
        for f in list(self.tailer.files):
            views.append(
                _FileView(
                    f.scanner.source,
                    f.identity,
                    f.pos,
                    f.scanner.line_no,
                    f.scanner.last_ts(),
                    f.scanner.quiet_since(),
                    self.tailer.file_lag(f),
                )
            )
        return views

    # -- the loop's side --------------------------------------------------------------------------

    async def _watch_loop(self) -> None:
        """Metrics every second, heartbeats and the slow-scan watch every heartbeat interval:
        on the event loop, whatever the reader does."""
        tick = min(1.0, self.cfg.heartbeat_interval)
        next_beat = 0.0
        while True:
            busy = self._busy_since
            if busy is not None and time.monotonic() - busy >= 1.0:
                self._update_metrics()  # the reader, busy, cannot
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + self.cfg.heartbeat_interval
                self._watch()
            await asyncio.sleep(tick)

    def _watch(self) -> None:
        now = time.time()
        busy = self._busy_since
        busy_s = time.monotonic() - busy if busy is not None else 0.0
        if busy_s >= self.cfg.slow_scan_warning:
            if not self._slow_reported:
                self._slow_reported = True
                self.metrics.slow_scans.inc()
                log.warning(
                    "a scan is taking unusually long; heartbeats go on busy_s=%.1f file=%s",
                    busy_s,
                    self.tailer.scanning or "-",
                )
        elif busy is None:
            self._slow_reported = False
        self._heartbeats(now, busy_s)

    def _heartbeats(self, now: float, busy_s: float) -> None:
        est = self.clock_estimate
        beats: list[Event] = []
        for v in self._views:
            fields: dict[str, Any] = {"agent_time": now, "lag_bytes": v.lag}
            if v.quiet_since is not None:
                fields["quiet_since"] = v.quiet_since
            if busy_s >= self.cfg.slow_scan_warning:
                fields["scan_busy_s"] = round(busy_s, 3)
            if est is not None:
                fields["clock_offset_s"], fields["clock_uncertainty_s"] = est
            beats.append(
                heartbeat(v.source, v.identity, int(now * 1000), v.pos, v.line_no, v.last_ts, fields)
            )
        if beats:
            behind = self._behind
            if behind is None:
                behind = sum(v.lag for v in self._views)
            item = _Item(beats, [], sum(map(_event_size, beats)), now, behind)
            with self._lock:
                self._inflight += item.size
            self._queue.put_nowait(item)

    def _update_metrics(self) -> None:
        """Bring the counters up to the reader's figures (from the reader after a poll, at most
        once a second, or from the loop while the reader is busy)."""
        with self._metrics_lock:
            self._metrics_at = time.time()
            self._update_metrics_locked()

    def _update_metrics_locked(self) -> None:
        st = self.tailer.stats
        m = self.metrics
        files = list(self.tailer.files)  # the reader thread may change the list meanwhile
        lines = sum(f.scanner.stats.lines for f in files)
        for key, value, counter in (("bytes", st.bytes_read, m.bytes), ("lines", lines, m.lines)):
            prev = self._reported.get(key, 0)
            if value > prev:
                counter.inc(value - prev)
            self._reported[key] = value
        truncated = sum(f.scanner.stats.truncated_lines for f in files)
        prev = self._reported.get("truncated", 0)
        if truncated > prev:
            m.truncated.inc(truncated - prev)
        self._reported["truncated"] = truncated
        warnings = dict(st.warnings)
        if self.tailer.matcher.timeouts:
            warnings["pattern-timeout"] = sum(self.tailer.matcher.timeouts.values())
        for reason, n in warnings.items():
            key = f"warn:{reason}"
            if n > self._reported.get(key, 0):
                m.warnings.labels(reason=reason).inc(n - self._reported.get(key, 0))
                self._reported[key] = n
        m.files.set(len(files))
        m.read_lag.set(self.tailer.lag_bytes())
        m.checkpoint_lag.set(self._inflight)

    async def _send_loop(self, pub: Publisher) -> None:
        cfg = self.cfg
        topic = pub.topics["events"]
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
            sent: dict[tuple[int, float], bytes] = {}
            for part in _split(events, cfg.batch_max_bytes):
                self._seq += 1
                sent_at = time.time()
                payload = wire.encode_batch(
                    cfg.agent, cfg.job, cfg.node, self._seq, sent_at, part, behind=items[-1].behind
                )
                sent[(self._seq, sent_at)] = payload
                self.metrics.connected.set(1 if pub.connected else 0)
                await pub.publish(topic, payload)
                self.metrics.connected.set(1)
                self.metrics.batches.inc()
                self.metrics.publish_latency.observe(max(time.time() - items[0].read_at, 0.0))
                kinds: dict[str, int] = {}
                for ev in part:
                    kinds[ev.kind] = kinds.get(ev.kind, 0) + 1
                for kind, n in kinds.items():
                    self.metrics.events.labels(kind=kind).inc(n)
                self.published_events += len(part)
            marks = [mk for i in items for mk in i.marks]
            if self._receipts is not False:
                group = _Sent(sent, marks, size, time.monotonic())
                self._unconfirmed.append(group)
                for key in list(sent):  # group.parts is `sent`
                    if key in self._early:
                        self._early.discard(key)
                        del group.parts[key]
                    else:
                        self._awaiting[key] = group
                self._settle()
            else:
                self._confirm(marks, size)
            if time.monotonic() - last_save >= cfg.checkpoint_interval:
                await self._save_checkpoints()
                last_save = time.monotonic()

    def _confirm(self, marks: list[Mark], size: int) -> None:
        """What is before ``marks`` is safe: checkpoint it and release its bytes."""
        for mk in marks:
            self.checkpoints.advance(mk.identity, mk.path, mk.offset, mk.line_no, mk.sampling)
        with self._lock:
            self._inflight -= size
            if self._inflight < self.cfg.max_inflight_bytes:
                self._space.set()
            self.metrics.checkpoint_lag.set(self._inflight)

    def _settle(self) -> None:
        """Confirm, in send order, every group at the head whose batches all have receipts."""
        q = self._unconfirmed
        while q and not q[0].parts:
            group = q.popleft()
            self._confirm(group.marks, group.size)
        self.metrics.unconfirmed.set(sum(len(g.parts) for g in q))
        if q:
            self._all_confirmed.clear()
        else:
            self._all_confirmed.set()

    def _on_receipt(self, payload: bytes) -> None:
        try:
            receipt = wire.decode_receipt(payload)
        except wire.WireError as exc:
            log.warning("ignoring a malformed receipt error=%s", exc)
            return
        if receipt.job != self.cfg.job:
            return
        key = (receipt.seq, receipt.sent_at)
        if receipt.refused is not None:
            self.metrics.refused.inc()
            log.warning(
                "the daemon refused a batch for good; it is not sent again seq=%d reason=%s",
                receipt.seq,
                receipt.refused,
            )
        group = self._awaiting.pop(key, None)
        if group is None:
            if self._receipts is not False and len(self._early) < 4096:
                self._early.add(key)  # its PUBACK is still on its way (or it is a late duplicate)
            return
        group.parts.pop(key, None)
        self._settle()

    def _receipts_said(self, supported: bool) -> None:
        """The daemon's clock reply says whether it sends receipts."""
        if supported == self._receipts:
            return
        before, self._receipts = self._receipts, supported
        if supported:
            log.info("the daemon confirms what it stores; read positions now follow its receipts")
            return
        if before is None:
            log.info("the daemon sends no receipts; read positions follow the broker's acknowledgements")
        else:
            log.warning(
                "the daemon no longer sends receipts; read positions follow the broker's acknowledgements"
            )
        self._confirm_by_puback()

    def _confirm_by_puback(self) -> None:
        """Take every batch sent so far as confirmed by its PUBACK (each was acknowledged)."""
        for group in self._unconfirmed:
            group.parts.clear()
        self._awaiting.clear()
        self._early.clear()
        self._settle()

    async def _resend_loop(self, pub: Publisher) -> None:
        """Send again what the daemon has not confirmed within ``receipt_timeout`` (it drops the
        events it already has, by id, and confirms again)."""
        cfg = self.cfg
        topic = pub.topics["events"]
        said_at = -1e18
        while True:
            await asyncio.sleep(min(1.0, cfg.receipt_timeout / 2))
            if not pub.connected:
                continue
            now = time.monotonic()
            late = [g for g in list(self._unconfirmed) if g.parts and now - g.sent >= cfg.receipt_timeout]
            if not late:
                continue
            if self._receipts is None:  # no daemon has answered: the broker's PUBACKs will do
                log.info(
                    "no clock reply from the daemon yet; read positions follow the broker's "
                    "acknowledgements until it answers"
                )
                self._confirm_by_puback()
                continue
            n = sum(len(g.parts) for g in late)
            # said once a minute at most; every round is counted (denpex_agent_batches_resent_total)
            level = logging.WARNING if now - said_at >= 60.0 else logging.DEBUG
            said_at = now if level == logging.WARNING else said_at
            log.log(
                level,
                "no receipt from the daemon in time; sending batches again batches=%d timeout_s=%.1f",
                n,
                cfg.receipt_timeout,
            )
            for group in late:
                group.sent = time.monotonic()
                for payload in list(group.parts.values()):
                    await pub.publish(topic, payload)
                    self.metrics.resent.inc()

    async def _save_checkpoints(self) -> None:
        data = self.checkpoints.snapshot()
        if data is not None:
            await asyncio.to_thread(self.checkpoints.write, data)

    # -- clock ----------------------------------------------------------------------------------

    async def _clock_loop(self, pub: Publisher) -> None:
        topic = pub.topics["clock"]
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
            receipts = wire.clock_reply_receipts(payload)
        except wire.WireError as exc:
            log.warning("ignoring a malformed clock reply error=%s", exc)
            return
        self._receipts_said(receipts)
        if self._pending_clock.pop(t0, None) is None:
            return  # not ours, or a late duplicate
        offset, delay = wire.clock_sample(t0, t1, t2, t3)
        self._clock.append((offset, delay))
        est = self.clock_estimate
        if est is not None:
            self.metrics.clock_offset.set(est[0])
