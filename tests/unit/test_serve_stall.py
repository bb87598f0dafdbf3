"""The stall watch in the job table: a job whose ranks stop logging steps becomes an incident
after its adaptive threshold (not before), names the rank behind the others when one is, waits
out an announced pause, ignores a finished job, and resolves when the steps move on (real job
table and SQLite store, a controlled clock, no broker)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
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

T0 = 1.9e9
STEP_S = 0.1


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def mono(self) -> float:
        return self.t

    def wall(self) -> float:
        return T0 + self.t


class Sink:
    name = "test"

    def __init__(self) -> None:
        self.alerts: list[dict[str, Any]] = []

    async def send(self, alerts: Sequence[dict[str, Any]]) -> None:
        self.alerts.extend(alerts)


def _step(rank: int, step: int) -> Event:
    return Event(
        id=f"r{rank}-s{step}", kind="progress", job="job-s", node=f"n{rank // 2}", rank=rank,
        local_rank=rank % 2, file=f"/logs/rank{rank}.log", offset=step * 80, line_no=step,
        ts=T0 + step * STEP_S, ts_source="line", rule="progress-step-line", severity="info",
        role="progress", category="progress", text=f"[rank{rank}] step {step} | loss 2.3",
        fields={"step": step, "tip": True},
    )  # fmt: skip


def _marker(rank: int, rule: str, text: str, step: int) -> Event:
    return Event(
        id=f"r{rank}-{rule}-{step}", kind="match", job="job-s", node=f"n{rank // 2}", rank=rank,
        local_rank=rank % 2, file=f"/logs/rank{rank}.log", offset=step * 80 + 40, line_no=step,
        ts=T0 + step * STEP_S, ts_source="line", rule=rule, severity="info", role="marker",
        category="progress", text=text,
    )  # fmt: skip


class Harness:
    def __init__(self, table: JobTable, clock: Clock, sink: Sink) -> None:
        self.table, self.clock, self.sink = table, clock, sink
        self.seq = 0

    async def feed(self, events: list[Event]) -> None:
        done = asyncio.Event()
        self.seq += 1
        batch = wire.Batch(agent="a", job="job-s", node="n0", sent_at=1.0, seq=self.seq, events=events)
        await self.table.submit(batch, done.set)
        async with asyncio.timeout(10):
            await done.wait()

    async def steps(self, upto: int, ranks: range = range(4), start: int = 0) -> None:
        for s in range(start, upto + 1):
            self.clock.t = s * STEP_S
            await self.feed([_step(r, s) for r in ranks])

    async def at(self, t: float) -> dict[str, Any]:
        """The job's diagnosis at time ``t`` (as the stall watch's tick would make it)."""
        self.clock.t = t
        state = self.table.jobs["job-s"]
        doc = await self.table.diagnose(state)
        await asyncio.sleep(0.05)  # the alerter's delivery task
        return doc


@contextlib.asynccontextmanager
async def harness(tmp: Path, library: RuleSet, **cfg: Any) -> AsyncIterator[Harness]:
    clock, sink = Clock(), Sink()
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    config = ServeConfig(**{"stall_floor_s": 1.0, "stall_factor": 10.0, "stall_pause_s": 30.0, **cfg})
    async with Store(tmp / "denpex.db") as store:
        alerter = Alerter(store, metrics, [sink], generator="test", clock=clock.wall, monotonic=clock.mono)
        table = JobTable(config, library, store, metrics, alerter, wall=clock.wall, monotonic=clock.mono)
        alerter.gate = table.alert_wait
        tasks = [asyncio.create_task(t) for t in (table.run_worker(), table.writer.run(), alerter.run())]
        try:
            yield Harness(table, clock, sink)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.asyncio
async def test_every_rank_silent_past_the_threshold_is_a_job_wide_stall(
    tmp_path: Path, library: RuleSet
) -> None:
    async with harness(tmp_path, library) as h:
        await h.steps(20)  # 0.1 s per step: threshold max(1.0, 10 x 0.1) = 1.0 s
        quiet = await h.at(20 * STEP_S + 0.9)
        assert quiet["verdict"] == "healthy" and quiet["stall"] is None and h.sink.alerts == []
        doc = await h.at(20 * STEP_S + 1.2)
        assert doc["verdict"] == "failed" and doc["scope"] == "job" and doc["initiator"] is None
        assert doc["root_cause"]["rule"] == "job-progress-stalled" and doc["root_cause"]["category"] == "hang"
        stall = doc["stall"]
        assert (
            stall["last_step"] == 20 and stall["behind"] == [] and stall["threshold_s"] == pytest.approx(1.0)
        )
        assert [r["rank"] for r in stall["last_steps"]] == [0, 1, 2, 3]
        assert len(h.sink.alerts) == 1 and h.sink.alerts[0]["labels"]["rule"] == "job-progress-stalled"


@pytest.mark.asyncio
async def test_the_threshold_adapts_to_the_jobs_own_step_interval(tmp_path: Path, library: RuleSet) -> None:
    async with harness(tmp_path, library, stall_factor=30.0) as h:
        await h.steps(20)  # 30 x 0.1 s = 3 s > the 1 s floor
        assert (await h.at(20 * STEP_S + 2.5))["stall"] is None
        doc = await h.at(20 * STEP_S + 3.2)
        assert doc["stall"]["threshold_s"] == pytest.approx(3.0) and doc["verdict"] == "failed"


@pytest.mark.asyncio
async def test_a_rank_behind_the_others_is_the_suspect(tmp_path: Path, library: RuleSet) -> None:
    async with harness(tmp_path, library) as h:
        await h.steps(19)
        h.clock.t = 20 * STEP_S
        await h.feed([_step(r, 20) for r in (0, 1, 3)])
        doc = await h.at(20 * STEP_S + 1.2)
        ini = doc["initiator"]
        assert (ini["rank"], ini["kind"], ini["rule"]) == (2, "stall", "job-progress-stalled")
        assert doc["scope"] == "rank" and ini["confidence"] >= 0.6
        assert h.sink.alerts[-1]["labels"]["rank"] == "2"


@pytest.mark.asyncio
async def test_when_the_steps_move_on_the_incident_resolves(tmp_path: Path, library: RuleSet) -> None:
    async with harness(tmp_path, library) as h:
        await h.steps(20)
        assert (await h.at(20 * STEP_S + 1.5))["verdict"] == "failed"
        h.clock.t = 20 * STEP_S + 1.6
        await h.feed([_step(r, 21) for r in range(4)])
        doc = await h.at(20 * STEP_S + 1.7)
        assert doc["verdict"] == "healthy" and doc["stall"] is None
        assert [("endsAt" in a) for a in h.sink.alerts] == [False, True]
        again = await h.at(20 * STEP_S + 1.6 + 1.5)  # stalled once more: a new incident
        assert again["verdict"] == "failed" and [("endsAt" in a) for a in h.sink.alerts] == [
            False,
            True,
            False,
        ]


@pytest.mark.asyncio
async def test_an_announced_pause_gets_the_pause_allowance(tmp_path: Path, library: RuleSet) -> None:
    async with harness(tmp_path, library) as h:
        await h.steps(20)
        await h.feed(
            [_marker(r, "marker-evaluation-start", "***** Running Evaluation *****", 20) for r in range(4)]
        )
        assert (await h.at(20 * STEP_S + 20.0))["stall"] is None  # 20 s of evaluation: fine
        assert (await h.at(20 * STEP_S + 31.0))["verdict"] == "failed"  # past stall_pause_s


@pytest.mark.asyncio
async def test_a_finished_job_is_not_stalled_unless_a_rank_is_behind(
    tmp_path: Path, library: RuleSet
) -> None:
    async with harness(tmp_path, library) as h:
        await h.steps(20)
        await h.feed([_marker(0, "marker-training-finished", "training complete", 20)])
        assert (await h.at(100.0))["stall"] is None and h.sink.alerts == []
    async with harness(tmp_path / "uneven", library) as h:
        await h.steps(19)
        h.clock.t = 20 * STEP_S
        await h.feed([_step(0, 20), _marker(0, "marker-training-finished", "training complete", 20)])
        doc = await h.at(20 * STEP_S + 1.5)  # rank 0 finished at step 20, the others wait at 19
        assert doc["verdict"] == "failed" and doc["stall"]["behind_total"] == 3
        assert doc["initiator"] is None and doc["scope"] == "job"  # three of four behind: no suspect


@pytest.mark.asyncio
async def test_the_watch_is_off_with_a_zero_floor(tmp_path: Path, library: RuleSet) -> None:
    async with harness(tmp_path, library, stall_floor_s=0.0) as h:
        await h.steps(20)
        assert (await h.at(1000.0))["stall"] is None


def _epoch_step(rank: int, n: int, step: int, total: int | None = None) -> Event:
    """The n-th step line of a rank's file, numbered ``step`` (a counter that may restart)."""
    ev = _step(rank, step)
    fields: dict[str, Any] = {"step": step, "tip": True}
    if total is not None:
        fields["total"] = total
    return msgspec.structs.replace(ev, id=f"r{rank}-n{n}", offset=n * 80, line_no=n, fields=fields)


@pytest.mark.asyncio
async def test_a_counter_that_restarts_every_epoch_is_still_progress(
    tmp_path: Path, library: RuleSet
) -> None:
    async with harness(tmp_path, library) as h:
        for n in range(40):  # two epochs of 20 steps: 0..19, 0..19
            h.clock.t = n * STEP_S
            await h.feed([_epoch_step(r, n, n % 20) for r in range(4)])
        doc = await h.at(39 * STEP_S + 0.5)
        assert doc["stall"] is None and doc["verdict"] == "healthy"


@pytest.mark.asyncio
async def test_a_rank_at_its_planned_last_step_is_done(tmp_path: Path, library: RuleSet) -> None:
    async with harness(tmp_path, library) as h:
        for n in range(1, 31):
            h.clock.t = n * STEP_S
            await h.feed([_epoch_step(r, n, n, total=30) for r in range(4)])
        assert (await h.at(100.0))["stall"] is None and h.sink.alerts == []


def _oom(rank: int, step: int) -> Event:
    return Event(
        id=f"r{rank}-oom", kind="match", job="job-s", node=f"n{rank // 2}", rank=rank,
        local_rank=rank % 2, file=f"/logs/rank{rank}.log", offset=step * 80 + 40, line_no=step,
        ts=T0 + step * STEP_S + 0.05, ts_source="line", rule="cuda-oom", severity="error",
        role="root-cause", category="out-of-memory",
        text="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    )  # fmt: skip


@pytest.mark.asyncio
async def test_a_failed_job_that_stops_shows_its_stall_without_another_engine_pass(
    tmp_path: Path, library: RuleSet
) -> None:
    """Every failed job stops logging steps: when its stall turns, with no event since its last
    diagnosis, the document gains the stall and keeps the engine's answer, which is not made again
    (a pass over every rank of a large job); an event after that makes it again."""
    async with harness(tmp_path, library) as h:
        await h.steps(20)
        h.clock.t = 20 * STEP_S + 0.05
        await h.feed([_oom(2, 20)])
        before = await h.at(20 * STEP_S + 0.1)
        assert before["verdict"] == "failed" and before["initiator"]["rank"] == 2 and before["stall"] is None
        state = h.table.jobs["job-s"]
        passes: list[int] = []
        engine_diagnose = state.engine.diagnose

        def counted() -> dict[str, Any]:
            passes.append(1)
            return engine_diagnose()

        state.engine.diagnose = counted  # type: ignore[method-assign]
        h.clock.t = 20 * STEP_S + 1.5  # past the 1 s threshold
        await h.table.look_for_stalls()
        doc = state.last_diagnosis()
        assert doc is not None and passes == []
        assert doc["stall"] is not None and doc["stall"]["last_step"] == 20
        assert {k: v for k, v in doc.items() if k not in ("stall", "agents")} == {
            k: v for k, v in before.items() if k not in ("stall", "agents")
        }
        await h.table.look_for_stalls()  # shown already: nothing to do
        assert passes == []
        h.clock.t = 20 * STEP_S + 1.6
        await h.feed([_step(0, 21)])  # news: the engine's answer is made again
        await h.at(20 * STEP_S + 1.7)
        assert passes == [1]
