"""A new incident's first alert waits (bounded) for evidence other agents may still hold, so it
names the rank the final diagnosis names: real job table, engine, store and alerter; the alert
sink at the seam records what would be sent."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from denpex_agent import wire
from denpex_agent.events import Event
from denpex_agent.rules import RuleSet
from denpexd.alerts import Alerter
from denpexd.config import ServeConfig
from denpexd.jobs import JobTable
from denpexd.metrics import Metrics
from denpexd.store import Store

T0 = 1.8e9


class Recorder:
    name = "recorder"

    def __init__(self) -> None:
        self.sent: list[tuple[float, dict[str, Any]]] = []

    async def send(self, alerts: Sequence[dict[str, Any]]) -> None:
        self.sent.extend((time.monotonic(), a) for a in alerts)


def _ev(library: RuleSet, node: str, rank: int, rule: str, ts: float, offset: int) -> Event:
    r = library.get(rule)
    assert r is not None
    return Event(
        id=f"{node}-{rank}-{rule}-{offset}", kind="match", job="job-1", node=node, rank=rank, local_rank=None,
        file=f"/logs/{node}/rank{rank}.log", offset=offset, line_no=offset, ts=ts, ts_source="line",
        rule=rule, severity=r.severity, role=r.role, category=r.category, text=rule, fields={},
    )  # fmt: skip


def _steps(node: str, ranks: Sequence[int], shift: float = 0.0) -> list[Event]:
    return [
        Event(
            id=f"{node}-{r}-s{s}",
            kind="progress",
            job="job-1",
            node=node,
            rank=r,
            local_rank=None,
            file=f"/logs/{node}/rank{r}.log",
            offset=s,
            line_no=s,
            ts=T0 + s,
            ts_source="line",
            rule="progress-step-line",
            severity="info",
            role="progress",
            category="progress",
            text=f"step {s}",
            fields={"step": s},
        )
        for s in range(1, 6)
        for r in ranks
    ]


async def _scenario(
    tmp: Path,
    library: RuleSet,
    script: Any,
    *,
    node2_first: bool = True,
    node2_lost: bool = False,
    shift: float = 0.0,
    **cfg: Any,
) -> Recorder:
    metrics = Metrics(CollectorRegistry())
    rec = Recorder()
    async with Store(tmp / "denpex.db") as store:
        alerter = Alerter(store, metrics, [rec], generator="test")
        table = JobTable(ServeConfig(**cfg), library, store, metrics, alerter)
        alerter.gate = table.alert_wait
        tasks = [asyncio.create_task(t) for t in (table.run_worker(), table.writer.run(), alerter.run())]

        async def send(node: str, events: list[Event], behind: int = 0, online: bool = False) -> None:
            if online:  # the agent (re)connected: its status comes first
                table.agent_status("job-1", f"{node}-agent", node, "online")
            batch = wire.Batch(f"{node}-agent", "job-1", node, time.time(), 1, events, behind=behind)
            if any(e.kind == "match" for e in events):
                await table.hoist(batch)
            await table.submit(batch, lambda: None)

        await send("node1", _steps("node1", [0, 1], shift))
        if node2_first:
            await send("node2", _steps("node2", [2, 3], shift))
        else:  # its agent connected (its status says online) and has not read anything yet
            table.agent_status("job-1", "node2-agent", "node2", "online")
        if node2_lost:
            table.agent_status("job-1", "node2-agent", "node2", "offline", lost=True)
        await asyncio.sleep(0.05)
        await script(send)
        await asyncio.sleep(1.5)
        for t in tasks:
            t.cancel()
    return rec


@pytest.mark.asyncio
async def test_the_first_alert_waits_for_the_other_node_s_earlier_warning(
    tmp_path: Path, library: RuleSet
) -> None:
    """The collateral NaN loss of rank 0 arrives first; rank 3's earlier warning 150 ms later
    (the other agent's next read). One alert, naming rank 3."""

    async def script(send: Any) -> None:
        await send("node1", [_ev(library, "node1", 0, "loss-non-finite", T0 + 6.007, 100)])
        await asyncio.sleep(0.15)
        await send("node2", [_ev(library, "node2", 3, "megatron-nan-grad-norm", T0 + 6.0, 100)])

    rec = await _scenario(tmp_path, library, script)
    firing = [a for _, a in rec.sent if "endsAt" not in a]
    assert [a["labels"]["rank"] for a in firing] == ["3"], rec.sent


@pytest.mark.asyncio
async def test_a_silent_agent_delays_the_alert_by_the_settle_time_at_most(
    tmp_path: Path, library: RuleSet
) -> None:
    started = time.monotonic()

    async def script(send: Any) -> None:
        await send("node1", [_ev(library, "node1", 0, "loss-non-finite", T0 + 6.007, 100)])

    rec = await _scenario(tmp_path, library, script, alert_settle_s=0.5)
    (at, alert), *_ = rec.sent
    assert alert["labels"]["rank"] == "0"
    assert 0.5 <= at - started < 0.5 + 0.6  # bounded by alert_settle_s (plus the test's own pauses)


@pytest.mark.asyncio
async def test_an_agent_catching_up_holds_the_alert_until_it_is_done(
    tmp_path: Path, library: RuleSet
) -> None:
    """node2's agent says it has a backlog: the alert waits for it (here 0.9 s, under the
    catch-up bound), and names the warning that was in the backlog."""

    async def script(send: Any) -> None:
        await send("node2", _steps("node2", [2]), behind=1 << 20)
        await send("node1", [_ev(library, "node1", 0, "loss-non-finite", T0 + 6.007, 100)])
        await asyncio.sleep(0.9)
        await send("node2", [_ev(library, "node2", 3, "megatron-nan-grad-norm", T0 + 6.0, 100)], behind=0)

    rec = await _scenario(tmp_path, library, script, alert_settle_s=0.2)
    firing = [a for _, a in rec.sent if "endsAt" not in a]
    assert [a["labels"]["rank"] for a in firing] == ["3"], rec.sent


@pytest.mark.asyncio
async def test_an_inferred_initiator_is_held_no_longer_than_the_bounds(
    tmp_path: Path, library: RuleSet
) -> None:
    """Only timeouts: the hang suspect is held for the hang hold, then alerted, however often
    new diagnoses come in meanwhile."""
    started = time.monotonic()

    async def script(send: Any) -> None:
        for i in range(8):
            await send("node1", [_ev(library, "node1", 0, "gloo-timeout", T0 + 16 + i * 0.01, 200 + i)])
            await asyncio.sleep(0.3)

    rec = await _scenario(tmp_path, library, script, alert_settle_s=0.5)
    firing = [(at - started, a) for at, a in rec.sent if "endsAt" not in a]
    assert firing, "the hang suspect is alerted"
    assert firing[0][1]["labels"]["rule"] == "hang-rank-stopped-progress"
    assert firing[0][0] < 3.0 + 1.0


@pytest.mark.asyncio
async def test_an_agent_that_just_connected_is_waited_for(tmp_path: Path, library: RuleSet) -> None:
    """Agents started after the logs were written: node2's agent is online but its first read
    comes 0.8 s after node1's (longer than the settle time): the alert waits for it."""

    async def script(send: Any) -> None:
        await send("node1", [_ev(library, "node1", 0, "loss-non-finite", T0 + 6.007, 100)])
        await asyncio.sleep(0.8)
        await send(
            "node2",
            [*_steps("node2", [2, 3]), _ev(library, "node2", 3, "megatron-nan-grad-norm", T0 + 6.0, 100)],
        )

    rec = await _scenario(tmp_path, library, script, node2_first=False, alert_settle_s=0.3)
    firing = [a for _, a in rec.sent if "endsAt" not in a]
    assert [a["labels"]["rank"] for a in firing] == ["3"], rec.sent


@pytest.mark.asyncio
async def test_old_news_waits_for_agents_that_are_still_starting(tmp_path: Path, library: RuleSet) -> None:
    """Agents started on logs of a job that failed an hour ago: node2's agent, never heard of
    before, delivers 0.8 s after node1's. The failure is history: the alert waits for a pause in
    the job's batches, and names the rank the whole evidence names."""
    old = time.time() - 3600 - T0

    async def script(send: Any) -> None:
        await send("node1", [_ev(library, "node1", 0, "loss-non-finite", T0 + old + 6.007, 100)])
        await asyncio.sleep(0.8)
        await send("node2", [_ev(library, "node2", 3, "megatron-nan-grad-norm", T0 + old + 6.0, 100)])
        await asyncio.sleep(2.0)  # the pause the alert waits for

    rec = await _scenario(tmp_path, library, script, node2_first=False, alert_settle_s=0.3, shift=old)
    firing = [a for _, a in rec.sent if "endsAt" not in a]
    assert [a["labels"]["rank"] for a in firing] == ["3"], rec.sent


@pytest.mark.asyncio
@pytest.mark.parametrize(("lost_before_s", "back_after_s"), [(0.0, 1.0), (0.5, 5.0)], ids=["soon", "slowly"])
async def test_an_agent_that_died_is_waited_for_until_it_is_back(
    tmp_path: Path, library: RuleSet, lost_before_s: float, back_after_s: float
) -> None:
    """node2's agent was killed (its last will says so) and comes back with the warning its node
    wrote meanwhile: 1 s after node1's collateral error, or (``slowly``: on a loaded node the
    supervisor's restart and the agent's own start take seconds) 5.5 s after its last will. The
    alert waits for it (the catch-up bound, 10 s) and names rank 3, nobody before it."""

    async def script(send: Any) -> None:
        await asyncio.sleep(lost_before_s)
        await send("node1", [_ev(library, "node1", 0, "loss-non-finite", T0 + 6.007, 100)])
        await asyncio.sleep(back_after_s)
        await send("node2", [_ev(library, "node2", 3, "megatron-nan-grad-norm", T0 + 6.0, 100)], online=True)

    rec = await _scenario(tmp_path, library, script, node2_lost=True, alert_settle_s=0.3)
    firing = [a for _, a in rec.sent if "endsAt" not in a]
    assert [a["labels"]["rank"] for a in firing] == ["3"], rec.sent


@pytest.mark.asyncio
async def test_heartbeats_do_not_keep_old_news_waiting(tmp_path: Path, library: RuleSet) -> None:
    """Agents idle after reading history still send heartbeats: they read nothing new, so the
    alert does not wait for them beyond the pause."""
    old = time.time() - 3600 - T0
    started = time.monotonic()

    def beat(node: str) -> Event:
        return Event(
            id=f"hb-{node}-{time.monotonic()}", kind="heartbeat", job="job-1", node=node, rank=None,
            local_rank=None, file=f"/logs/{node}/rank0.log", offset=0, line_no=1, ts=None, ts_source="none",
        )  # fmt: skip

    async def script(send: Any) -> None:
        await send("node1", [_ev(library, "node1", 0, "cuda-oom", T0 + old + 6.0, 100)])
        for _ in range(12):
            await asyncio.sleep(0.3)
            await send("node1", [beat("node1")])
            await send("node2", [beat("node2")])

    rec = await _scenario(tmp_path, library, script, shift=old, alert_settle_s=0.3)
    (at, alert), *_ = rec.sent
    assert alert["labels"]["rank"] == "0"
    assert at - started < 2.0 + 1.0


@pytest.mark.asyncio
async def test_a_failure_every_rank_shares_so_far_still_waits_for_an_earlier_warning(
    tmp_path: Path, library: RuleSet
) -> None:
    """node1's two ranks report the NaN loss at once, which alone would be "no single rank";
    node2's agent then brings rank 3's earlier warning: the one alert names rank 3."""

    async def script(send: Any) -> None:
        await send(
            "node1",
            [_ev(library, "node1", r, "loss-non-finite", T0 + 6.007, 100 + r) for r in (0, 1)],
        )
        await asyncio.sleep(0.15)
        await send("node2", [_ev(library, "node2", 3, "megatron-nan-grad-norm", T0 + 6.0, 100)])

    rec = await _scenario(tmp_path, library, script)
    firing = [a for _, a in rec.sent if "endsAt" not in a]
    assert [a["labels"]["rank"] for a in firing] == ["3"], rec.sent


@pytest.mark.asyncio
async def test_the_last_awaited_agent_s_batch_ends_the_wait(tmp_path: Path, library: RuleSet) -> None:
    """The other agent sends its next batch (collateral, read after the initiator's line) 100 ms
    later: the alert goes with the diagnosis made at once after it, well before alert_settle_s,
    and names the rank the final diagnosis names."""
    sent_at: list[float] = []

    async def script(send: Any) -> None:
        await send("node1", [_ev(library, "node1", 0, "cuda-oom", T0 + 6.0, 100)])
        await asyncio.sleep(0.1)
        sent_at.append(time.monotonic())
        await send("node2", [_ev(library, "node2", 3, "nccl-remote-error", T0 + 6.5, 100)])

    # neither the settle time nor the next debounced diagnosis would come within the scenario
    rec = await _scenario(tmp_path, library, script, alert_settle_s=5.0, debounce_s=5.0)
    firing = [(at, a) for at, a in rec.sent if "endsAt" not in a]
    assert [a["labels"]["rank"] for _, a in firing] == ["0"], rec.sent
    assert firing[0][0] - sent_at[0] < 0.5


@pytest.mark.asyncio
async def test_a_held_alert_takes_one_diagnosis_for_the_agents_it_waits_on(
    tmp_path: Path, library: RuleSet
) -> None:
    """A cascade while the first alert is held: node3's agent is first heard from after the wait
    began, with a batch read before the initiator's line (it was on its way), and node2's agent
    brings a symptom of the story. The agents are waited on together, and the batches that come
    meanwhile bring no diagnosis of their own: one diagnosis for the initiator, one once the last
    awaited agent read past its line."""
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    rec = Recorder()
    async with Store(tmp_path / "denpex.db") as store:
        alerter = Alerter(store, metrics, [rec], generator="test")
        table = JobTable(ServeConfig(alert_settle_s=5.0, debounce_s=0.05), library, store, metrics, alerter)
        alerter.gate = table.alert_wait
        tasks = [asyncio.create_task(t) for t in (table.run_worker(), table.writer.run(), alerter.run())]

        def runs() -> float:
            return registry.get_sample_value("denpex_diagnosis_runs_total") or 0.0

        async def send(node: str, events: list[Event], sent_at: float | None = None) -> None:
            batch = wire.Batch(f"{node}-agent", "job-1", node, sent_at or time.time(), 1, events)
            if any(e.kind == "match" for e in events):
                await table.hoist(batch)
            await table.submit(batch, lambda: None)

        try:
            await send("node1", _steps("node1", [0, 1]))
            await send("node2", _steps("node2", [2, 3]))
            await asyncio.sleep(0.1)
            before = runs()
            oom_sent = time.time()
            await send("node1", [_ev(library, "node1", 0, "cuda-oom", T0 + 6.0, 100)], sent_at=oom_sent)
            await asyncio.sleep(0.1)  # the first diagnosis; the alert is held for node2
            assert runs() == before + 1 and rec.sent == []
            await send("node3", _steps("node3", [4, 5]), sent_at=oom_sent - 0.01)  # read before it
            for i in range(3):  # node2's symptoms of the story while node3 is still awaited
                await send("node2", [_ev(library, "node2", 2, "cuda-oom", T0 + 6.3 + i, 200 + i)])
                await asyncio.sleep(0.1)
            assert runs() == before + 1 and rec.sent == []
            await send("node3", [_ev(library, "node3", 5, "nccl-remote-error", T0 + 6.5, 100)])  # read past
            await asyncio.sleep(0.3)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    firing = [a for _, a in rec.sent if "endsAt" not in a]
    assert [a["labels"]["rank"] for a in firing] == ["0"], rec.sent
    assert runs() == before + 2
