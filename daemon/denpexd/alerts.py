"""Alerts: one per incident (never per rank, never for collateral alone), to Alertmanager's v2
API and to MQTT `denpex/v1/alerts/<job>`, resolved (endsAt) when the job closes. When later
evidence moves the initiator, the incident's alert is relabelled: the old labelset is resolved
and the new one fires, so at any moment one alert per incident is firing.

The incident is recorded in the store before it is sent, so a restarted daemon does not fire it
again; it keeps re-sending firing alerts every `repeat_s` so Alertmanager does not time them out.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol, Self

import aiohttp
import orjson

from denpex_agent import wire
from denpex_agent.timestamps import format_iso
from denpexd.metrics import Metrics
from denpexd.store import Store

log = logging.getLogger(__name__)

INCIDENT = "failure"  # one failure chain per job: the engine's initiator names it
QUEUE_MAX = 1024
HANG_HOLD_S = 3.0


class AlertSink(Protocol):
    name: str

    async def send(self, alerts: Sequence[dict[str, Any]]) -> None: ...


class BusLike(Protocol):
    async def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None: ...


class MqttSink:
    name = "mqtt"

    def __init__(self, bus: BusLike) -> None:
        self.bus = bus

    async def send(self, alerts: Sequence[dict[str, Any]]) -> None:
        for alert in alerts:
            await self.bus.publish(wire.alerts_topic(alert["labels"]["job"]), orjson.dumps(alert))


class AlertmanagerSink:
    """POST /api/v2/alerts with retries and backoff; `async with` owns the HTTP session."""

    name = "alertmanager"

    def __init__(self, url: str, *, retries: int = 5, backoff_s: float = 0.5) -> None:
        self.url = url.rstrip("/")
        self.retries, self.backoff_s = retries, backoff_s
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        try:
            async with self._session.get(f"{self.url}/-/ready") as resp:
                if resp.status >= 500:
                    log.warning("alertmanager not ready url=%s status=%d", self.url, resp.status)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning(
                "alertmanager unreachable at start; alerts will be retried url=%s error=%s", self.url, exc
            )
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._session is not None:
            await self._session.close()

    async def send(self, alerts: Sequence[dict[str, Any]]) -> None:
        assert self._session is not None
        body = orjson.dumps(list(alerts))
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                async with self._session.post(
                    f"{self.url}/api/v2/alerts", data=body, headers={"Content-Type": "application/json"}
                ) as resp:
                    if resp.status < 300:
                        return
                    error = f"HTTP {resp.status}"
                    if 400 <= resp.status < 500:
                        raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
            except aiohttp.ClientResponseError:
                raise
            except (aiohttp.ClientError, TimeoutError) as exc:
                error = str(exc) or type(exc).__name__
            if attempt < self.retries:
                log.warning(
                    "alertmanager send failed; retrying url=%s attempt=%d error=%s",
                    self.url,
                    attempt + 1,
                    error,
                )
                await asyncio.sleep(delay)
                delay *= 2
        raise ConnectionError(f"alertmanager {self.url}: {error}")


@dataclass(slots=True)
class Incident:
    key: str
    alert: dict[str, Any]
    fired_at: float
    last_sent: float


def alerts_on(doc: dict[str, Any]) -> bool:
    """A failure with an initiator, or one that every rank shares (no rank to name)."""
    return doc.get("verdict") == "failed" and bool(doc.get("initiator") or doc.get("scope") == "job")


def build_alert(job: str, doc: dict[str, Any], starts: float, generator: str) -> dict[str, Any]:
    rc = doc.get("root_cause") or {}
    ini = doc.get("initiator")
    if ini is None:  # the job failed as a whole: every rank alike, or its set-up
        ini = {"rank": None, "node": "", "rule": rc.get("rule"), "category": rc.get("category")}
        where = "the whole job (no single rank)"
    else:
        where = f"node {ini.get('node')} rank {ini.get('rank')}"
    return {
        "labels": {
            "alertname": "DenpexJobFailed",
            "job": job,
            "rank": str(ini.get("rank")) if ini.get("rank") is not None else "",
            "node": ini.get("node") or "",
            "rule": ini.get("rule") or "",
            "category": ini.get("category") or "",
            "role": "initiator",
            "severity": "critical",
        },
        "annotations": {
            "summary": f"job {job} failed: {rc.get('title') or ini.get('rule')} on {where}",
            "root_cause": rc.get("root_cause", ""),
            "fix": rc.get("fix", ""),
            "verify": rc.get("verify", ""),
            "collateral_ranks": ",".join(str(r) for r in doc.get("collateral_ranks", [])),
            "query": f"denpexd query --job {job}",
        },
        "startsAt": format_iso(starts),
        "generatorURL": f"{generator}/jobs/{job}",
    }


class Alerter:
    """Decides when an incident fires or resolves; a task delivers to every sink in order."""

    def __init__(
        self,
        store: Store,
        metrics: Metrics,
        sinks: list[AlertSink],
        *,
        generator: str,
        repeat_s: float = 60.0,
        hang_hold_s: float = HANG_HOLD_S,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store, self.metrics, self.sinks = store, metrics, sinks
        self.generator, self.repeat_s, self._clock = generator, repeat_s, clock
        self.active: dict[str, Incident] = {}
        self.hang_hold_s = hang_hold_s
        self._mono = monotonic
        # how much longer a new incident's first alert should wait for evidence (see
        # JobTable.alert_wait); set by the job table, none by default
        self.gate: Callable[[str, dict[str, Any], float], float] = lambda _job, _doc, _since: 0.0
        self._failing_since: dict[str, float] = {}
        self._held: dict[str, dict[str, Any]] = {}
        self._timers: dict[str, asyncio.Task[None]] = {}
        self._timer_due: dict[str, float] = {}  # when each armed timer fires (monotonic)
        self._queue: asyncio.Queue[list[dict[str, Any]]] = asyncio.Queue(QUEUE_MAX)
        self._episodes: dict[str, int] = {}  # incidents of an open job already resolved

    def restore(self, job: str, incidents: list[tuple[str, float, float | None, dict[str, Any]]]) -> None:
        for key, fired_at, resolved_at, alert in incidents:
            if resolved_at is None:
                self.active[job] = Incident(key, alert, fired_at, last_sent=self._clock())
        resolved = sum(1 for _, _, resolved_at, _ in incidents if resolved_at is not None)
        if resolved:
            self._episodes[job] = resolved

    async def on_diagnosis(self, job: str, doc: dict[str, Any]) -> None:
        now = self._clock()
        inc = self.active.get(job)
        if inc is not None:
            if alerts_on(doc):
                moved = build_alert(job, doc, inc.fired_at, self.generator)
                if moved["labels"] != inc.alert["labels"]:
                    # Later evidence moved the initiator (e.g. torchrun reported the SIGKILLed
                    # rank after the peers' timeouts): still one incident, so the old labelset
                    # is resolved and the new one fires.
                    old = {**inc.alert, "endsAt": format_iso(now)}
                    inc.alert, inc.last_sent = moved, now
                    await self.store.relabel_incident(job, inc.key, moved)
                    log.info("incident relabelled job=%s node=%s rank=%s rule=%s", job, moved["labels"]["node"],
                             moved["labels"]["rank"], moved["labels"]["rule"])  # fmt: skip
                    self._enqueue([old])
                    self._enqueue([moved])
                    return
            if now - inc.last_sent >= self.repeat_s:
                inc.last_sent = now
                self._enqueue([inc.alert])
            return
        if not alerts_on(doc):
            return  # collateral alone (no initiator) never alerts
        first = self._failing_since.setdefault(job, self._mono())
        wait = self.gate(job, doc, first)
        if (doc.get("initiator") or {}).get("kind") == "hang":
            # Only timeouts so far: the suspect is inferred from silence. A launcher's report of
            # a killed worker usually follows within seconds; wait for it (bounded) rather than
            # fire at a guess.
            wait = max(wait, first + self.hang_hold_s - self._mono())
        if wait > 0:
            # Newer diagnoses replace the held one; the timer looks again at the latest.
            self._held[job] = doc
            due = self._mono() + wait
            timer = self._timers.get(job)
            if timer is None or due < self._timer_due.get(job, due) - 0.001:
                # none armed, or this diagnosis may be sent sooner than the one armed for
                if timer is not None:
                    timer.cancel()
                task = asyncio.create_task(self._fire_held(job, wait), name=f"alert-hold-{job}")
                self._timers[job] = task
                self._timer_due[job] = due
                task.add_done_callback(functools.partial(self._forget_timer, job))
            return
        self._held.pop(job, None)
        alert = build_alert(job, doc, now, self.generator)
        n = self._episodes.get(job, 0)
        key = f"{INCIDENT}-{n + 1}" if n else INCIDENT
        self.active[job] = Incident(key, alert, now, now)
        log.info("incident fired job=%s node=%s rank=%s rule=%s", job, alert["labels"]["node"],
                 alert["labels"]["rank"], alert["labels"]["rule"])  # fmt: skip
        # The alert first: recording the incident may wait behind a commit of events, and a store
        # that fails must not hold the alert back. A daemon killed in between fires it again
        # after its restart (the incident was not recorded): a repeat, which Alertmanager
        # merges by its labels, never a loss.
        self._enqueue([alert])
        await self.store.record_incident(job, key, now, alert)

    def _forget_timer(self, job: str, task: asyncio.Task[None]) -> None:
        if self._timers.get(job) is task:
            del self._timers[job]
            self._timer_due.pop(job, None)

    async def _fire_held(self, job: str, delay: float) -> None:
        await asyncio.sleep(max(delay, 0.0) + 0.01)
        self._timers.pop(job, None)  # so that a still-held diagnosis can arm a new timer
        self._timer_due.pop(job, None)
        doc = self._held.pop(job, None)
        if doc is not None and job not in self.active:
            await self.on_diagnosis(job, doc)

    async def resolve(self, job: str) -> None:
        """End the job's incident while the job goes on (a stall whose steps moved on again); a
        later failure of the job is a new incident (its own key in the store)."""
        had = job in self.active or job in self._held
        await self.on_close(job)
        if had:
            self._episodes[job] = self._episodes.get(job, 0) + 1

    async def on_close(self, job: str) -> None:
        self._episodes.pop(job, None)
        self._failing_since.pop(job, None)
        self._held.pop(job, None)
        timer = self._timers.pop(job, None)
        self._timer_due.pop(job, None)
        if timer is not None:
            timer.cancel()
        inc = self.active.pop(job, None)
        if inc is None:
            return
        now = self._clock()
        await self.store.resolve_incident(job, inc.key, now)
        self._enqueue([{**inc.alert, "endsAt": format_iso(now)}])

    def _enqueue(self, alerts: list[dict[str, Any]]) -> None:
        try:
            self._queue.put_nowait(alerts)
        except asyncio.QueueFull:
            for sink in self.sinks:
                self.metrics.alerts_failed.labels(sink.name).inc()
            log.warning("alert queue full; alert dropped job=%s", alerts[0]["labels"]["job"])

    async def run(self) -> None:
        while True:
            alerts = await self._queue.get()
            await self._deliver(alerts)
            self._queue.task_done()

    async def _deliver(self, alerts: list[dict[str, Any]]) -> None:
        state = "resolved" if "endsAt" in alerts[0] else "firing"
        for sink in self.sinks:
            try:
                await sink.send(alerts)
                self.metrics.alerts_sent.labels(sink.name, state).inc(len(alerts))
            except Exception as exc:  # one failing sink must not stop the others
                self.metrics.alerts_failed.labels(sink.name).inc(len(alerts))
                log.warning("alert delivery failed sink=%s error=%s", sink.name, exc)

    async def drain(self) -> None:
        """Wait until every queued alert was attempted (the `run` task must be running)."""
        await self._queue.join()
