"""A fault inside one job is that job's problem: its batch is kept as a dead letter and
acknowledged, the job is marked broken and stays queryable, and every other job goes on (real
job table, store and alerter; the fault is injected into one job's engine)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

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


def _oom(job: str, i: int) -> Event:
    return Event(
        id=f"{job}-{i}", kind="match", job=job, node="n1", rank=i, local_rank=None, file="/l/rank.log",
        offset=i, line_no=i + 1, ts=1.8e9 + i, ts_source="line", rule="cuda-oom", severity="error",
        role="root-cause", category="out-of-memory", text="CUDA out of memory", fields={},
    )  # fmt: skip


@pytest.mark.asyncio
async def test_a_job_whose_engine_raises_is_marked_broken_and_the_others_go_on(
    tmp_path: Path, library: RuleSet
) -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    async with Store(tmp_path / "denpex.sqlite") as store:
        table = JobTable(ServeConfig(), library, store, metrics, Alerter(store, metrics, [], generator="t"))
        tasks = [
            asyncio.create_task(t) for t in (table.run_worker(), table.writer.run(), table.run_diagnoser())
        ]
        state = table._open("bad-job")

        def explode(ev: Event) -> None:
            raise OverflowError("date value out of range")

        state.engine.add = explode  # type: ignore[method-assign]
        acks: list[str] = []
        for job in ("bad-job", "good-job"):
            batch = wire.Batch("a1", job, "n1", time.time(), 1, [_oom(job, 1)])
            await table.submit(batch, lambda job=job: acks.append(job))  # type: ignore[misc]
        for _ in range(100):
            if len(acks) == 2:
                break
            await asyncio.sleep(0.05)
        assert sorted(acks) == ["bad-job", "good-job"]  # both acknowledged: nothing redelivered forever
        bad = await table.current("bad-job")
        good = await table.current("good-job")
        assert bad is not None and bad["broken"]["stage"] == "process"
        assert "OverflowError" in bad["broken"]["error"]
        assert good is not None and good["verdict"] == "failed" and "broken" not in good
        letters = await store.dead_letters(10)
        assert [(d["job"], d["stage"]) for d in letters] == [("bad-job", "process")]
        assert b"CUDA out of memory" in letters[0]["head"].encode()
        assert registry.get_sample_value("denpex_job_errors_total", {"stage": "process"}) == 1.0
        assert registry.get_sample_value("denpex_ingest_dead_letters_total", {"stage": "process"}) == 1.0
        for t in tasks:
            t.cancel()
