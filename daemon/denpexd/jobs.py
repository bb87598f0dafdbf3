"""Open jobs: one `Engine` per job, fed incrementally, diagnosed after each change (debounced).

Batches wait in a bounded queue per job (ingest waits when it is full); one worker drains the
jobs round-robin: duplicates are dropped by event id (bounded LRU per job), events go to the
engine and to the store (match events may have reached the engine earlier through `hoist`). A
diagnosis task recomputes dirty jobs at most every `debounce_s` (`progress_debounce_s` when
only progress and heartbeats arrived since the last diagnosis: on a large job a diagnosis costs
tens of milliseconds, and steady progress changes it slowly; a job whose verdict may turn
"failed", or whose initiator may move, is diagnosed at once instead), publishes the result
retained on `denpex/v1/jobs/<job>/diagnosis` (with the initiating node's record across the other
recent jobs, `nodehistory`), updates the per-job metrics, lets the alerter decide and stores it. Jobs idle for `job_idle_close_s` are closed; when
`max_open_jobs` is reached the least recently active job is evicted (and counted).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import re
import time
import zlib
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from denpex_agent import wire
from denpex_agent.events import Event
from denpex_agent.rules import RuleSet
from denpex_agent.timestamps import parse_iso
from denpexd import nodehistory
from denpexd.alerts import Alerter
from denpexd.analysis.evidence import root_cause
from denpexd.config import ServeConfig
from denpexd.engine import Engine, may_initiate
from denpexd.errors import StoreError
from denpexd.ingest import Ack
from denpexd.metrics import Metrics
from denpexd.stall import STALL_RULE, StallWatch, overlay
from denpexd.store import EventRow, EventWriter, Store, event_row, progress_batch_row
from denpexd.turns import Turns

log = logging.getLogger(__name__)

MAX_AGENT_JOBS = 100_000  # jobs whose agents' statuses are remembered
STALL_CHECK_S = 0.5  # how often the stall watch looks at the open jobs
HISTORICAL_S = 60.0  # a failure written longer ago than this is read from history (catch-up)
HISTORICAL_QUIET_S = 2.0  # ... and its alert waits for this long a pause in the job's batches
# The retained diagnosis on MQTT stays below what brokers take by default (EMQX 1 MB, our
# deploy/broker Mosquitto 1 MiB; a larger packet gets the daemon disconnected). A job with
# thousands of ranks in its collateral and rank table exceeds it: its MQTT copy carries the first
# entries of its long lists and says so; the HTTP API and the store keep the whole document.
MAX_DIAGNOSIS_BYTES = 900 * 1024
_WHOLE = (
    "job", "verdict", "initiator", "scope", "root_cause", "evidence", "fingerprints", "node_history", "truncated",
)  # fmt: skip


def diagnosis_json(doc: dict[str, Any]) -> bytes:
    return orjson.dumps(doc, option=orjson.OPT_NON_STR_KEYS)


def diagnosis_payload(
    doc: dict[str, Any], limit: int = MAX_DIAGNOSIS_BYTES, data: bytes | None = None
) -> bytes:
    """The diagnosis as published on MQTT: the document itself when it fits in ``limit`` bytes,
    else a copy whose long lists and maps keep their first entries, with ``"truncated"`` giving
    each one's full length and where the whole document is. ``data``: `diagnosis_json(doc)`, when
    the caller has it."""
    if data is None:
        data = diagnosis_json(doc)
    keep = 512
    while len(data) > limit and keep >= 0:
        short: dict[str, Any] = {}
        counts: dict[str, int] = {}
        for key, value in doc.items():
            if key not in _WHOLE and isinstance(value, (list, dict)) and len(value) > keep:
                counts[key] = len(value)
                value = (
                    value[:keep] if isinstance(value, list) else dict(itertools.islice(value.items(), keep))
                )
            short[key] = value
        short["truncated"] = {"counts": counts, "whole": f"/api/v1/jobs/{doc.get('job')}"}
        data = orjson.dumps(short, option=orjson.OPT_NON_STR_KEYS)
        keep = keep // 4 if keep else -1
    if len(data) > limit:
        log.warning(
            "diagnosis larger than the MQTT limit even shortened job=%s bytes=%d", doc.get("job"), len(data)
        )
    return data


# what `_diagnose` adds to the engine's document (the live stall, agents, the node's record)
_LIVE_KEYS = frozenset({"stall", "agents", "open", "node_history", "broken"})


def _stalled(doc: dict[str, Any]) -> bool:
    """Whether the diagnosis says "failed" because of a live stall alone."""
    return doc.get("stall") is not None and (doc.get("root_cause") or {}).get("rule") == STALL_RULE


def id_key(eid: str) -> int | str:
    """An event id as the window keeps it: the agents' ids are 24 hex digits, kept as the number
    they spell (an int of 40 bytes instead of a string of 73, exact: no two ids share a key);
    any other id is kept as it is."""
    if len(eid) == ID_HEX_DIGITS and _ID_HEX(eid) is not None:
        return int(eid, 16)
    return eid


ID_HEX_DIGITS = 24  # `events.event_id`: a 12-byte digest in lowercase hex
# exactly that form (`int(x, 16)` also takes upper case, a 0x prefix, underscores and spaces:
# other strings that would spell the same number)
_ID_HEX = re.compile(r"[0-9a-f]{24}").fullmatch


class IdWindow:
    """The ids of a job's latest `limit` new events, to drop re-sends: the oldest leaves first.
    A plain dict and a queue of the same keys (`id_key`; an `OrderedDict` costs a linked-list
    node per id on top of its table, a set's table is twice a dict's, and a job holds hundreds of
    thousands of ids)."""

    __slots__ = ("ids", "order")

    def __init__(self) -> None:
        self.ids: dict[int | str, None] = {}
        self.order: deque[int | str] = deque()

    def __contains__(self, eid: str) -> bool:
        return id_key(eid) in self.ids

    def __iter__(self) -> Iterator[int | str]:
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)

    def add(self, eid: str, limit: int) -> None:
        """Take a new id (not in the window)."""
        key = id_key(eid)
        self.ids[key] = None
        order = self.order
        order.append(key)
        while len(order) > limit:
            del self.ids[order.popleft()]

    def discard(self, eid: str) -> None:
        key = id_key(eid)
        if self.ids.pop(key, 0) is None:
            self.order.remove(key)


class Bus(Protocol):
    async def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None: ...


@dataclass(slots=True)
class JobState:
    job: str
    engine: Engine
    first_seen: float
    last_seen: float
    seen: IdWindow = field(default_factory=IdWindow)
    pending: deque[tuple[wire.Batch, Ack, float, bytes | None]] = field(default_factory=deque)
    room: asyncio.Event = field(default_factory=asyncio.Event)
    scheduled: bool = False
    dirty_since: float | None = None
    dirty_by_rule: bool = False  # besides progress and heartbeats, something else changed
    last_diagnosis_at: float = 0.0
    diagnosis_cost: float = 0.0
    verdict: str | None = None  # its last diagnosis's verdict
    # its last diagnosis: the document while it is being published, then its JSON compressed
    # (a 4,096-rank failure's document is ~1 MB of JSON, several MB as Python objects, ~60 KB
    # compressed); `last_diagnosis()` reads it
    fresh: dict[str, Any] | None = None
    packed: bytes | None = None
    # when the first event of each (node, rank, rule) that may name the initiator arrived
    arrivals: dict[tuple[str, int | None, str], float] = field(default_factory=dict)
    sent: dict[tuple[str, int | None, str], float] = field(default_factory=dict)  # its batch's sent_at
    failure_observed: bool = False
    labels: dict[str, Any] = field(default_factory=dict)
    suppressed: int = 0
    hoisted: set[str] = field(default_factory=set)  # ids of match events fed ahead of their batch
    broken: dict[str, Any] | None = None  # the first fault inside this job (stage, error, at)
    marks: dict[str, AgentMark] = field(default_factory=dict)  # agent -> its latest batch's arrival
    watch: StallWatch | None = None  # its progress as time passes (made on its first step line)
    stalled: bool = False  # its last diagnosis holds a stall the engine did not explain
    stall_shown: bool = False  # its last diagnosis holds a stall (also one a failure explains)
    settling: Settling | None = None  # the agents a held first alert waits on (alert_settle_s)
    settled: bool = False  # the last of them has read past the initiator's line: diagnose now

    def last_diagnosis(self) -> dict[str, Any] | None:
        if self.fresh is not None:
            return self.fresh
        if self.packed is None:
            return None
        doc: dict[str, Any] = orjson.loads(zlib.decompress(self.packed))
        return doc


@dataclass(slots=True)
class Settling:
    """The agents a new incident's held alert waits on to send a batch read after the
    initiator's line (`JobTable.alert_wait`), and how to tell: the initiator's batch's `sent_at`
    on the agents' clocks, else its arrival."""

    agents: set[str]
    sent: float | None
    arrived: float
    node: str = ""  # the initiator's node: its own agents are not waited on

    def past(self, mark: AgentMark, now: float) -> bool:
        """Whether ``mark``'s agent has sent a batch read after the initiator's line."""
        return mark.sent_at >= self.sent if self.sent is not None else now >= self.arrived


@dataclass(slots=True)
class AgentMark:
    """When an agent's latest batch arrived, and how far behind its files it said it was."""

    node: str
    arrived: float  # monotonic
    behind: int
    sent_at: float  # when the agent sent it (its clock: after the read it carries)
    read: float  # monotonic arrival of its latest batch with more than heartbeats (new lines read)


class JobTable:
    progress_shortcut = True  # `_process_progress` for batches of progress events alone

    def __init__(
        self,
        cfg: ServeConfig,
        rules: RuleSet,
        store: Store,
        metrics: Metrics,
        alerter: Alerter,
        *,
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg, self.rules, self.store, self.metrics, self.alerter = cfg, rules, store, metrics, alerter
        self.bus: Bus | None = None
        self._wall, self._mono = wall, monotonic
        self.jobs: OrderedDict[str, JobState] = OrderedDict()  # least recently active first
        self.agents: OrderedDict[str, dict[str, dict[str, Any]]] = OrderedDict()  # job -> agent -> status
        self._online_since: OrderedDict[tuple[str, str], float] = OrderedDict()  # (job, agent) -> monotonic
        self._online = 0
        self.writer = EventWriter(
            store,
            on_wait=metrics.backpressure.inc,
            on_full=metrics.store_full.set,
            on_failed=self._rows_failed,
        )
        self._ready: deque[str] = deque()
        self._work = asyncio.Event()
        self._dirty = asyncio.Event()
        self._dirty_jobs: dict[str, JobState] = {}
        self._busy = False

    # -- intake (called by ingest) ----------------------------------------------------------------

    def _open(self, job: str, first_seen: float | None = None) -> JobState:
        state = self.jobs.get(job)
        if state is not None:
            self.jobs.move_to_end(job)
            return state
        while len(self.jobs) >= self.cfg.max_open_jobs:
            old, _ = next(iter(self.jobs.items()))
            self._evict(old)
        now = self._wall()
        state = JobState(job, Engine(job, self.rules), first_seen or now, now)
        state.room.set()
        self.jobs[job] = state
        self.metrics.jobs_open.set(len(self.jobs))
        return state

    def _evict(self, job: str) -> None:
        state = self.jobs.pop(job)
        self.metrics.jobs_evicted.inc()
        dropped: Counter[str] = Counter()
        for batch, ack, _, _ in state.pending:
            dropped.update(e.kind for e in batch.events)
            ack()
        self.metrics.dropped(dropped)
        state.pending.clear()
        state.room.set()
        self.alerter.active.pop(job, None)
        self._forget(state)
        log.warning("open job evicted (max_open_jobs reached) job=%s", job)

    async def submit(self, batch: wire.Batch, ack: Ack, payload: bytes | None = None) -> None:
        """Queue a validated batch; `payload`, its wire form, lets a batch of progress events alone
        be stored as one row (see `store.progress_batch_row`)."""
        state = self._open(batch.job)
        self._mark(state, batch)
        while len(state.pending) >= self.cfg.job_queue_batches:
            self.metrics.backpressure.inc()
            state.room.clear()
            await state.room.wait()
            state = self._open(batch.job)  # it may have been evicted meanwhile
        state.pending.append((batch, ack, self._mono(), payload))
        if not state.scheduled:
            state.scheduled = True
            self._ready.append(batch.job)
            self._work.set()

    def settled(self, job: str) -> bool:
        """Whether the job's last diagnosis already says "failed" (ingest hoists other jobs'
        batches first)."""
        state = self.jobs.get(job)
        return state is not None and state.verdict == "failed"

    async def hoist(self, batch: wire.Batch) -> None:
        """Feed a batch's match events to the engine now, ahead of the batches queued before it.

        Ingest calls this for a batch that carries match events as soon as it is validated, then
        `submit`s the same batch in its arrival order; `_process` then stores those events at
        their place in the backlog. The engine's state does not depend on the order events are
        added in, so feeding them early changes nothing but how soon a failure is diagnosed.
        """
        state = self._open(batch.job)
        self._mark(state, batch)
        seen, hoisted, engine, received = state.seen, state.hoisted, state.engine, self._mono()
        limit = self.cfg.dedup_ids_per_job
        failing, candidates = engine.failing_aggs, engine.candidate_aggs
        fed = False
        for ev in batch.events:
            if ev.kind != "match" or ev.id in seen:
                continue
            seen.add(ev.id, limit)
            hoisted.add(ev.id)
            try:
                engine.add(ev)
            except Exception as exc:  # counted and marked here; the batch's own processing decides
                hoisted.discard(ev.id)
                seen.discard(ev.id)
                self._fault(state, "hoist", exc)
                continue
            fed = True
            if ev.rule is not None and may_initiate(ev):
                key = (ev.node, ev.rank, ev.rule)
                if key not in state.arrivals:
                    state.arrivals[key] = received
                    state.sent[key] = batch.sent_at
        if fed:
            await self._changed(state, failing, candidates)
        await self._settle(state)

    def _fault(self, state: JobState, stage: str, exc: BaseException) -> None:
        """A fault inside one job: counted, logged with the job id (the traceback the first
        time), the job marked broken (its document says so); the daemon goes on."""
        self.metrics.job_errors.labels(stage).inc()
        first = state.broken is None
        if first:
            state.broken = {"stage": stage, "error": f"{type(exc).__name__}: {exc}"[:500], "at": self._wall()}
        log.error(
            "fault inside a job; it is marked broken, the daemon goes on job=%s stage=%s error=%s: %s",
            state.job, stage, type(exc).__name__, exc, exc_info=exc if first else None,
        )  # fmt: skip

    async def _dead_letter(
        self, batch: wire.Batch, payload: bytes | None, stage: str, exc: BaseException
    ) -> None:
        """Keep a batch whose processing raised (as received, or re-encoded), counted."""
        data = (
            payload
            if payload is not None
            else wire.encode_batch(
                batch.agent, batch.job, batch.node, batch.seq, batch.sent_at, batch.events, batch.behind
            )
        )
        self.metrics.dead_letters.labels(stage).inc()
        try:
            await self.store.dead_letter(batch.job, batch.agent, stage, f"{type(exc).__name__}: {exc}", data)
        except Exception as err:
            log.error("dead letter not stored job=%s error=%s", batch.job, err)

    async def _rows_failed(self, rows: list[EventRow], job: str, exc: Exception) -> None:
        self.metrics.dead_letters.labels("store").inc()
        state = self.jobs.get(job)
        if state is not None:
            self._fault(state, "store", exc)
        data = b"[" + b",".join(r[7] for r in rows) + b"]"
        try:
            await self.store.dead_letter(job, None, "store", f"{type(exc).__name__}: {exc}", data)
        except Exception as err:
            log.error("dead letter not stored job=%s rows=%d error=%s", job, len(rows), err)

    def _mark(self, state: JobState, batch: wire.Batch) -> None:
        now = self._mono()
        mark = state.marks.get(batch.agent)
        if mark is None:
            mark = state.marks[batch.agent] = AgentMark(batch.node, now, batch.behind, batch.sent_at, -1e18)
        else:
            mark.node, mark.arrived, mark.behind = batch.node, now, batch.behind
            mark.sent_at = max(mark.sent_at, batch.sent_at)
        if any(ev.kind != "heartbeat" for ev in batch.events):
            mark.read = now
        settling = state.settling
        if settling is not None:
            if batch.agent in settling.agents:
                if settling.past(mark, now):
                    settling.agents.discard(batch.agent)
            elif (
                batch.node != settling.node
                and batch.behind <= 0
                and not settling.past(mark, now)
                and self.agents.get(state.job, {}).get(batch.agent, {}).get("state") != "offline"
            ):
                # first heard from in this job after the wait began (its batch was on its way,
                # behind the initiator's, which was taken ahead): waited on as well, so that the
                # diagnosis below comes once every agent has read past the line, not once per
                # agent found late
                settling.agents.add(batch.agent)
            if not settling.agents:
                # the last one: its events are fed, then a diagnosis lets the alert go now
                # rather than at the end of alert_settle_s (see `_settle`)
                state.settling, state.settled = None, True

    async def _settle(self, state: JobState) -> None:
        """Diagnose at once when the agents a held alert waited on have all read past the
        initiator's line (their events are in the engine now)."""
        if state.settled and self.jobs.get(state.job) is state:
            await self.diagnose(state)

    def alert_wait(self, job: str, doc: dict[str, Any], failing_since: float) -> float:
        """How long a new incident's first alert should still wait for evidence that may move its
        initiator (0: fire now). Agents of other nodes that sent nothing since the initiator's
        event arrived may hold an earlier warning (their next read is due within a poll): wait
        up to alert_settle_s after that arrival. An agent that said it is catching up on a
        backlog, that died without a goodbye (its last will) and is not back, or that (re)connected
        and has sent nothing since, may hold anything: wait up to
        alert_catchup_hold_s after the job first looked failed. A failure every rank shares so far
        (no single rank) is held that long too. Agents never heard from cannot be waited for."""
        state = self.jobs.get(job)
        if _stalled(doc):
            return 0.0  # the stall threshold was the wait: the silence is the evidence
        ini = doc.get("initiator")
        job_wide = not ini and doc.get("scope") == "job" and bool(doc.get("candidates"))
        if job_wide:
            # No single rank so far: a weaker answer than a rank, which an earlier warning still
            # on its way (any agent's) would replace; it is held for the catch-up bound.
            ini = doc["candidates"][0]
        if state is None:
            return 0.0
        now = self._mono()
        if not ini:
            if doc.get("scope") == "job" and doc.get("verdict") == "failed":
                # failed, and no rank stands out yet (ranks only wait alike): the rank that broke
                # may be on an agent still to be heard from; held for the catch-up bound
                return max(0.0, failing_since + self.cfg.alert_catchup_hold_s - now)
            return 0.0
        # an inferred initiator (a hang, a killed worker) has no event of its own: the evidence
        # that made the job look failed is what other agents may still contradict
        arrived = state.arrivals.get((ini["node"], ini["rank"], ini["rule"]), failing_since)
        wait = 0.0
        settle_left = arrived + self.cfg.alert_settle_s - now
        catchup_left = failing_since + self.cfg.alert_catchup_hold_s - now
        statuses = self.agents.get(job, {})
        for agent, status in statuses.items():
            since = self._online_since.get((job, agent))
            if since is None or catchup_left <= 0:
                continue
            mark = state.marks.get(agent)
            # died without a goodbye (a supervisor restarts it: systemd's RestartSec=2s, then the
            # agent's own start, which on a loaded node takes seconds more; what its node wrote
            # meanwhile is read then), or (re)connected and not heard from since (its first read
            # is on its way): its node may hold anything, as a backlog does; look again soon, up
            # to the catch-up bound
            awaited = status["state"] == "online" and (mark is None or mark.arrived < since)
            if status.get("lost") or awaited:
                wait = max(wait, min(catchup_left, 0.25))
        settling: set[str] = set()
        for agent, mark in state.marks.items():
            if statuses.get(agent, {}).get("state") == "offline":
                continue
            if mark.behind > 0 and catchup_left > 0:
                wait = max(wait, min(catchup_left, 0.25))  # look again soon: it may be done
            elif (
                mark.node != ini["node"]
                and settle_left > 0
                and not self._read_past(mark, state, ini, arrived)
            ):
                wait = max(wait, settle_left)
                settling.add(agent)
        # the batch that ends the last of these waits triggers a diagnosis (`_mark`, `_settle`)
        state.settling = (
            Settling(settling, state.sent.get((ini["node"], ini["rank"], ini["rule"])), arrived, ini["node"])
            if settling
            else None
        )
        if job_wide and catchup_left > 0:
            wait = max(wait, catchup_left)
        if catchup_left > 0 and self._historical(ini, doc):
            # the failure is old news: the agents are reading history (started after the job
            # failed, or catching up after an outage), agents may still be starting and may hold
            # anything: wait until the agents have read nothing new for HISTORICAL_QUIET_S
            last = max((m.read for m in state.marks.values()), default=now)
            quiet_left = last + HISTORICAL_QUIET_S - now
            if quiet_left > 0:
                wait = max(wait, min(catchup_left, quiet_left))
        return wait

    @staticmethod
    def _read_past(mark: AgentMark, state: JobState, ini: dict[str, Any], arrived: float) -> bool:
        """Whether an agent has sent a batch read after the initiator's line was read (so after
        it was written: anything its node wrote before is in): compared on the agents' clocks,
        which NTP keeps within milliseconds, when the initiator came in a batch of its own; else
        on arrival at the daemon."""
        sent = state.sent.get((ini["node"], ini["rank"], ini["rule"]))
        if sent is not None:
            return mark.sent_at >= sent
        return mark.arrived >= arrived

    def _historical(self, ini: dict[str, Any], doc: dict[str, Any]) -> bool:
        """Whether the initiator's line was written long before now on its node's clock (the
        node's offset from the diagnosis, so a skewed clock does not make fresh news old)."""
        local = ini.get("local_time")
        if not isinstance(local, str):
            return False
        ts = parse_iso(local)
        if ts is None:
            return False
        return self._wall() - ts > HISTORICAL_S

    async def _changed(
        self, state: JobState, failing: int, candidates: int, *, progress_only: bool = False
    ) -> None:
        """The engine took new rule events: diagnose now when the verdict may turn "failed" or the
        initiator may move (at most every 4 diagnosis costs); otherwise the debounce applies."""
        engine = state.engine
        was_failed = state.verdict == "failed"
        urgent = (engine.failing_aggs > failing and not was_failed) or (
            engine.candidate_aggs > candidates and (was_failed or engine.failing_aggs > 0)
        )
        if (
            urgent
            and state.settling is None  # a held alert's settle brings the next one (`_due`)
            and self._mono() >= state.last_diagnosis_at + 4 * state.diagnosis_cost
        ):
            await self.diagnose(state)
        else:
            self._mark_dirty(state, progress_only=progress_only)

    def agent_status(self, job: str, agent: str, node: str, state: str, lost: bool = False) -> None:
        """An agent's announced state; ``lost``: the broker's last will for an agent that died."""
        per_job = self.agents.setdefault(job, {})
        self.agents.move_to_end(job)
        old = per_job.get(agent)
        self._online -= 1 if old is not None and old["state"] == "online" else 0
        per_job[agent] = {"agent": agent, "node": node, "state": state, "at": self._wall()}
        if lost:
            per_job[agent]["lost"] = True
        if state == "online" or lost:
            self._online_since[(job, agent)] = self._mono()
            self._online_since.move_to_end((job, agent))
            while len(self._online_since) > MAX_AGENT_JOBS:
                self._online_since.popitem(last=False)
        self._online += 1 if state == "online" else 0
        while len(self.agents) > MAX_AGENT_JOBS:
            _, gone = self.agents.popitem(last=False)
            self._online -= sum(1 for a in gone.values() if a["state"] == "online")
        if state == "offline":
            self.metrics.agents_offline.inc()
            log.info("agent offline job=%s agent=%s node=%s", job, agent, node)
        if job in self.jobs:
            self._mark_dirty(self.jobs[job])  # the job view shows its agents
        self.metrics.agents_connected.set(self._online)

    # -- the worker ---------------------------------------------------------------------------------

    async def run_worker(self) -> None:
        turns = Turns()
        while True:
            await self._work.wait()
            self._work.clear()
            self._busy = True
            while self._ready:
                job = self._ready.popleft()
                state = self.jobs.get(job)
                if state is None:
                    continue
                state.scheduled = False
                while state.pending:
                    batch, ack, received, payload = state.pending.popleft()
                    state.room.set()
                    try:
                        await self._process(state, batch, ack, received, payload)
                    except Exception as exc:  # this job's problem: its batch is kept, the rest goes on
                        self._fault(state, "process", exc)
                        await self._dead_letter(batch, payload, "process", exc)
                        ack()
                    if self.jobs.get(job) is not state:
                        break
                    await turns.share()
            self._busy = False

    async def _process(
        self, state: JobState, batch: wire.Batch, ack: Ack, received: float, payload: bytes | None
    ) -> None:
        events = batch.events
        if (
            self.progress_shortcut
            and events
            and not state.hoisted
            and all(ev.kind == "progress" for ev in events)
        ):
            await self._process_progress(state, batch, ack, payload)
            return
        seen, engine, limit, hoisted = state.seen, state.engine, self.cfg.dedup_ids_per_job, state.hoisted
        failing, candidates = engine.failing_aggs, engine.candidate_aggs
        kinds: Counter[str] = Counter()
        dups: Counter[str] = Counter()
        nan: Counter[str] = Counter()
        accepted = []
        wall = self._wall()
        newest: float | None = None
        for ev in batch.events:
            if hoisted and ev.id in hoisted:
                hoisted.discard(ev.id)  # fed ahead by `hoist`: stored here, in arrival order
            elif ev.id in seen:
                dups[ev.kind] += 1
                continue
            else:
                seen.add(ev.id, limit)
                engine.add(ev)
            kinds[ev.kind] += 1
            accepted.append(ev)
            if ev.ts is not None and (newest is None or ev.ts > newest):
                newest = ev.ts
            if ev.kind == "progress":
                self._watch(state).progress(ev, received)
            elif ev.role == "marker" and ev.rule is not None:
                rule = self.rules.get(ev.rule)
                if rule is not None and rule.marker is not None:
                    self._watch(state).marker(ev, rule.marker, received)
            if ev.kind == "match" and ev.rule is not None:
                key = (ev.node, ev.rank, ev.rule)
                if key not in state.arrivals and may_initiate(ev):
                    state.arrivals[key] = received
                    state.sent[key] = batch.sent_at
                rule = self.rules.get(ev.rule)
                if rule is not None and rule.fingerprint == "nan":
                    nan["error" if ev.severity in ("error", "critical") else "warn"] += 1
            elif ev.kind == "progress":
                nan["info"] += 1
        state.last_seen = wall
        if payload is not None and len(accepted) == len(batch.events) and kinds.keys() == {"progress"}:
            rows = [progress_batch_row(batch, payload, wall)]  # progress only, nothing dropped
        else:
            rows = [event_row(ev, wall) for ev in accepted]
        self.metrics.ingested(kinds)
        self.metrics.duplicates(dups)
        for stage, n in nan.items():
            self.metrics.nan_events.labels(state.job, stage).inc(n)
        if newest is not None:
            self.metrics.ingest_lag.observe(max(0.0, wall - newest))
        if kinds:
            slow = kinds.keys() <= {"progress", "heartbeat"}
            await self._changed(state, failing, candidates, progress_only=slow)
        await self._settle(state)
        await self.writer.add(rows, state.job, state.first_seen, wall, ack)

    async def _process_progress(
        self, state: JobState, batch: wire.Batch, ack: Ack, payload: bytes | None
    ) -> None:
        """`_process` for a batch of progress events alone (the bulk of the traffic): the same
        outcome, without the per-event branching on kinds and rules."""
        ids, order = state.seen.ids, state.seen.order
        add, limit = state.engine.add_progress, self.cfg.dedup_ids_per_job
        pace, received = self._watch(state).progress, self._mono()
        accepted: list[Event] = []
        newest: float | None = None
        for ev in batch.events:
            eid = id_key(ev.id)
            if eid in ids:
                continue
            ids[eid] = None  # IdWindow.add, inline: the bulk of the traffic
            order.append(eid)
            if len(order) > limit:
                del ids[order.popleft()]
            add(ev)
            pace(ev, received)
            accepted.append(ev)
            ts = ev.ts
            if ts is not None and (newest is None or ts > newest):
                newest = ts
        wall = self._wall()
        state.last_seen = wall
        n, dups = len(accepted), len(batch.events) - len(accepted)
        if payload is not None and not dups:
            rows = [progress_batch_row(batch, payload, wall)]
        else:
            rows = [event_row(ev, wall) for ev in accepted]
        if n:
            self.metrics.ingested({"progress": n})
            self.metrics.nan_events.labels(state.job, "info").inc(n)
            self._mark_dirty(state, progress_only=True)
        if dups:
            self.metrics.duplicates({"progress": dups})
        if newest is not None:
            self.metrics.ingest_lag.observe(max(0.0, wall - newest))
        await self._settle(state)
        await self.writer.add(rows, state.job, state.first_seen, wall, ack)

    def _watch(self, state: JobState) -> StallWatch:
        if state.watch is None:
            cfg = self.cfg
            state.watch = StallWatch(
                factor=cfg.stall_factor, floor_s=cfg.stall_floor_s, pause_s=cfg.stall_pause_s
            )
        return state.watch

    def _stall(self, state: JobState) -> dict[str, Any] | None:
        """The job's stall now (see denpexd.stall), or None: also None while the watch is off or
        every agent of the job has said goodbye (the job ended, its files are no longer followed)."""
        if state.watch is None or self.cfg.stall_floor_s <= 0:
            return None
        statuses = self.agents.get(state.job)
        if statuses and all(a["state"] == "offline" for a in statuses.values()):
            return None
        return state.watch.check(self._mono(), self._wall())

    async def run_stall_watch(self) -> None:
        """Look at every open job's progress twice a second; a job that turns stalled, or whose
        stall ended, is diagnosed at once (its alert fires or resolves)."""
        while True:
            await asyncio.sleep(STALL_CHECK_S)
            await self.look_for_stalls()

    async def look_for_stalls(self) -> None:
        """One look of the stall watch at every open job."""
        for state in list(self.jobs.values()):
            if state.watch is None or self.jobs.get(state.job) is not state:
                continue
            try:
                # against what its last diagnosis showed: a failed job whose ranks stopped
                # shows the stall once, not a new diagnosis every look
                turned = (self._stall(state) is not None) != state.stall_shown
            except Exception as exc:  # this job's problem; the watch goes on with the others
                self._fault(state, "stall", exc)
                continue
            if turned:
                # a failure the engine found stands, whatever the stall: with no event since
                # its last diagnosis only the document's `stall` changes (no engine pass over
                # every rank of a large job that has just stopped)
                reuse = (
                    state.verdict == "failed"
                    and not state.stalled
                    and state.dirty_since is None
                    and state.broken is None
                )
                await self.diagnose(state, reuse=reuse)

    def _mark_dirty(self, state: JobState, *, progress_only: bool = False) -> None:
        wake = False
        if not progress_only and not state.dirty_by_rule:
            state.dirty_by_rule = True
            wake = True  # due after `debounce_s` now: the diagnoser recomputes its deadline
        if state.dirty_since is None:
            state.dirty_since = self._mono()
            wake = wake or not self._dirty_jobs  # the diagnoser may be sleeping without a deadline
            self._dirty_jobs[state.job] = state
        if wake:
            self._dirty.set()

    # -- diagnoses ----------------------------------------------------------------------------------

    def _due(self, state: JobState) -> float:
        assert state.dirty_since is not None
        debounce = self.cfg.debounce_s if state.dirty_by_rule else self.cfg.progress_debounce_s
        min_gap = max(debounce, 4 * state.diagnosis_cost)
        due = max(state.dirty_since + debounce, state.last_diagnosis_at + min_gap)
        if state.settling is not None:
            # a first alert is held for agents still to read past its initiator's line: the batch
            # of the last of them brings the next diagnosis (`_settle`), at the latest the end of
            # the wait does; one before would only take the loop from reading their batches
            due = max(due, state.settling.arrived + self.cfg.alert_settle_s)
        return due

    async def run_diagnoser(self) -> None:
        while True:
            dirty = [s for s in self._dirty_jobs.values() if s.dirty_since is not None]
            if not dirty:
                self._dirty.clear()
                await self._dirty.wait()
                continue
            now = self._mono()
            wake = min(self._due(s) for s in dirty)
            if wake > now:
                self._dirty.clear()
                try:
                    async with asyncio.timeout(wake - now):
                        await self._dirty.wait()
                except TimeoutError:
                    pass
                continue
            for state in dirty:
                if (
                    state.dirty_since is not None
                    and self._due(state) <= now
                    and self.jobs.get(state.job) is state
                ):
                    await self.diagnose(state)

    async def diagnose(self, state: JobState, *, reuse: bool = False) -> dict[str, Any]:
        """The job's diagnosis, published, alerted and stored. A fault in any of that is the
        job's: counted, the job marked broken (`broken` in its document), its last good
        diagnosis kept; the daemon and the other jobs go on. ``reuse``: the engine's part of the
        last diagnosis still holds (no event came since), only the live parts are made again."""
        state.dirty_since = None
        state.dirty_by_rule = False
        self._dirty_jobs.pop(state.job, None)
        try:
            return await self._diagnose(state, reuse=reuse)
        except StoreError as exc:
            log.error("diagnosis not stored job=%s error=%s", state.job, exc)  # the store's, not the job's
        except Exception as exc:
            self._fault(state, "diagnose", exc)
        doc: dict[str, Any] = dict(state.last_diagnosis() or {"job": state.job})
        doc.setdefault("verdict", "unknown")
        doc["broken"] = state.broken
        return doc

    async def _diagnose(self, state: JobState, *, reuse: bool = False) -> dict[str, Any]:
        state.settled = False
        t0 = time.perf_counter()
        last = state.last_diagnosis() if reuse else None
        if last is not None:
            doc = {k: v for k, v in last.items() if k not in _LIVE_KEYS}
        else:
            doc = state.engine.diagnose()
        stall = self._stall(state)
        overlay(doc, stall, root_cause(self.rules, STALL_RULE, "hang"))
        was_stalled, state.stalled = state.stalled, stall is not None and _stalled(doc)
        state.stall_shown = stall is not None
        if last is None:  # the cost of an engine pass (the diagnoser's pace), not of a reuse
            state.diagnosis_cost = time.perf_counter() - t0
            state.last_diagnosis_at = self._mono()
            self.metrics.diagnoses.inc()
            self.metrics.diagnosis_seconds.observe(state.diagnosis_cost)
        doc["agents"] = sorted(self.agents.get(state.job, {}).values(), key=lambda a: str(a["agent"]))
        doc["open"] = True
        record = await self._node_history(state.job, doc)
        if record is not None:
            doc["node_history"] = record
        if state.broken is not None:
            doc["broken"] = state.broken
        state.verdict, state.fresh, state.packed = doc["verdict"], doc, None
        self._export(state, doc)
        data = diagnosis_json(doc)
        if self.bus is not None:
            await self.bus.publish(
                wire.diagnosis_topic(state.job), diagnosis_payload(doc, data=data), retain=True
            )
        # the alert first: storing the diagnosis may wait behind a commit of events
        if was_stalled and not state.stalled and doc["verdict"] != "failed":
            await self.alerter.resolve(state.job)  # the steps moved on: the stall is over
        await self.alerter.on_diagnosis(state.job, doc)
        if state.fresh is doc:  # kept compressed from here on (not if a newer one took its place)
            state.fresh, state.packed = None, zlib.compress(data, 1)
        state.engine.compact()
        if state.watch is not None:
            state.watch.compact(state.engine.kept_step, state.engine.track_keys())
        if not state.hoisted:
            # a set emptied by discards keeps the table of its largest size (a burst of thousands
            # of ids hoisted at once) until cleared
            state.hoisted.clear()
        await self.store.save_diagnosis(state.job, doc)
        return doc

    async def _node_history(self, job: str, doc: dict[str, Any]) -> dict[str, Any] | None:
        """The initiating node's record over the other recent jobs (`nodehistory`), or None. The
        store being unreadable costs the field, not the diagnosis."""
        ini = doc.get("initiator")
        if doc.get("verdict") != "failed" or not ini:
            return None
        try:
            failures, jobs = await self.store.failures(self.cfg.node_history_jobs, other_than=job)
        except StoreError as exc:
            log.warning("node history not read job=%s error=%s", job, exc)
            return None
        return nodehistory.history(ini["node"], ini["category"], failures, jobs)

    def _export(self, state: JobState, doc: dict[str, Any]) -> None:
        m, job, ini = self.metrics, state.job, doc.get("initiator")
        if doc["verdict"] == "failed" and not ini and doc.get("scope") == "job":  # every rank alike
            ini = {"rank": None, "node": "", "category": (doc.get("root_cause") or {}).get("category") or ""}
        if doc["verdict"] == "failed" and ini:
            labels = (job, str(ini["rank"]) if ini["rank"] is not None else "", ini["node"], ini["category"])
            old = state.labels.get("failed")
            if old is not None and old != labels:
                m.job_failed.remove(*old)
            m.job_failed.labels(*labels).set(1)
            state.labels["failed"] = labels
            if not state.failure_observed:
                state.failure_observed = True
                arrived = state.arrivals.get((ini["node"], ini["rank"], ini.get("rule")))
                if arrived is not None:
                    m.warning_to_diagnosis.observe(self._mono() - arrived)
        stall = doc.get("stall")
        m.job_stalled_seconds.labels(job).set(stall["silent_s"] if stall else 0.0)
        slow = {
            (s["node"], str(s["rank"])): s["ratio"]
            for s in doc.get("stragglers", [])
            if s.get("metric") == "step_time"
        }
        for gone in set(state.labels.get("slow", ())) - slow.keys():
            m.rank_slowness.remove(job, *gone)
        for (node, rank), ratio in slow.items():
            m.rank_slowness.labels(job, node, rank).set(ratio)
        state.labels["slow"] = set(slow)
        nan = doc["fingerprints"]["nan"]
        per_rank = list(nan.get("per_rank", {}).values())
        for s in ("none", "info", "warn", "error"):
            m.nan_stage.labels(job, s).set(1 if s == nan["stage"] else 0)
            m.nan_ranks.labels(job, s).set(per_rank.count(s))
        if nan.get("first_rank") is not None:
            m.nan_first_rank.labels(job).set(nan["first_rank"])
        delta = doc.get("suppressed", 0) - state.suppressed
        if delta > 0:
            m.collateral_suppressed.labels(job).inc(delta)
            state.suppressed += delta
        nodes = set(doc.get("clock", {}))
        for node, c in doc.get("clock", {}).items():
            m.clock_offset.labels(node).set(c["offset_s"])
            m.clock_uncertainty.labels(node).set(c["uncertainty_s"])
        state.labels["nodes"] = nodes | set(state.labels.get("nodes", ()))

    async def current(self, job: str) -> dict[str, Any] | None:
        """The job's diagnosis, recomputed first when events arrived since the last one."""
        state = self.jobs.get(job)
        if state is None:
            return None
        doc = None if state.dirty_since is not None else state.last_diagnosis()
        return doc if doc is not None else await self.diagnose(state)

    # -- closing ------------------------------------------------------------------------------------

    async def run_closer(self) -> None:
        idle = self.cfg.job_idle_close_s
        while True:
            await asyncio.sleep(min(max(idle / 4, 0.05), 30.0))
            cutoff = self._wall() - self.cfg.job_idle_close_s
            for job in [j for j, s in self.jobs.items() if s.last_seen < cutoff and not s.pending]:
                await self.close(job)

    async def close(self, job: str) -> None:
        state = self.jobs.get(job)
        if state is None:
            return
        try:
            await self._close(job, state)
        except Exception as exc:  # closed anyway: nothing of it may stay behind to fail again
            self._fault(state, "close", exc)
            if self.jobs.get(job) is state:
                del self.jobs[job]
            with contextlib.suppress(Exception):
                await self.alerter.on_close(job)
            self._forget(state)

    async def _close(self, job: str, state: JobState) -> None:
        doc = await self.diagnose(state)
        doc["open"] = False
        await self.store.save_diagnosis(job, doc)
        if self.bus is not None:
            await self.bus.publish(wire.diagnosis_topic(job), diagnosis_payload(doc), retain=True)
        if self.jobs.get(job) is state:
            del self.jobs[job]
        await self.store.close_job(job, self._wall())
        await self.alerter.on_close(job)
        self._forget(state)
        self.metrics.jobs_closed.inc()
        log.info("job closed job=%s verdict=%s", job, doc["verdict"])

    def _forget(self, state: JobState) -> None:
        self._dirty_jobs.pop(state.job, None)
        self.metrics.remove_job(state.job, state.labels)
        self.metrics.jobs_open.set(len(self.jobs))

    # -- restore and drain ----------------------------------------------------------------------------

    async def restore(self) -> int:
        """Rebuild open jobs from stored events (after a restart, `kill -9` included)."""
        restored = 0
        for job, first_seen, last_seen in reversed(await self.store.open_jobs(self.cfg.max_open_jobs)):
            state = self._open(job, first_seen)
            state.last_seen = last_seen
            seen, limit = state.seen, self.cfg.dedup_ids_per_job
            for ev in await self.store.load_events(job):
                if ev.id in seen:
                    continue  # the live path dropped it too (rows of progress batches can repeat ids)
                seen.add(ev.id, limit)
                try:
                    state.engine.add(ev)
                except Exception as exc:  # a stored event the engine cannot take: counted, skipped
                    self._fault(state, "restore", exc)
            self.alerter.restore(job, await self.store.incidents(job))
            state.failure_observed = job in self.alerter.active
            self._mark_dirty(state)
            restored += 1
        if restored:
            log.info("restored open jobs from the store jobs=%d", restored)
        return restored

    async def drain(self) -> None:
        """Process what is queued, commit it, and publish the final diagnoses of dirty jobs."""
        while self._ready or self._busy:
            self._work.set()
            await asyncio.sleep(0.01)
        await self.writer.flush()
        for state in list(self.jobs.values()):
            if state.dirty_since is not None:
                await self.diagnose(state)
