"""The job table's shortcut for batches of progress events alone ends where the general path
does: same engine state, same stored events, same counters (real SQLite store, no broker)."""

from __future__ import annotations

import asyncio
import random
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


def _progress(node: str, rank: int, step: int, **fields: Any) -> Event:
    return Event(
        id=f"{node}-r{rank}-s{step}", kind="progress", job="job-1", node=node, rank=rank,
        local_rank=rank % 4, file=f"/logs/rank{rank}.log", offset=step * 80, line_no=step,
        ts=1.8e9 + step * 0.5 + rank * 0.01, ts_source="line", rule="megatron-iteration",
        severity="info", role="progress", category="progress", text=f"iteration {step}",
        fields={"step": step, "loss": 2.0, **fields},
    )  # fmt: skip


def _batches(seed: int) -> list[wire.Batch]:
    rng = random.Random(seed)
    out = []
    for node in ("n1", "n2"):
        for start in range(0, 30, 5):
            evs = [_progress(node, r, s) for s in range(start, start + 5) for r in range(4)]
            if rng.random() < 0.3:
                evs[0].fields["data_time"] = 0.25
            out.append(
                wire.Batch(agent=f"{node}-a", job="job-1", node=node, sent_at=1.0, seq=start, events=evs)
            )
    rng.shuffle(out)
    # re-sent batches (an agent restarted before its checkpoint), whole or in part, soon after
    # (ids still in the window: dropped) or long after (ids already out of it: taken again)
    for i in sorted(rng.sample(range(len(out)), 4), reverse=True):
        b = out[i]
        part = b.events[rng.randrange(len(b.events)) :]
        out.insert(i + 1 if i % 2 else len(out), wire.Batch(b.agent, b.job, b.node, b.sent_at, b.seq, part))
    return out


async def _run(tmp: Path, library: RuleSet, batches: list[wire.Batch], shortcut: bool) -> dict[str, Any]:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    cfg = ServeConfig(dedup_ids_per_job=50)  # small: eviction from the id window is exercised
    async with Store(tmp / "denpex.db") as store:
        table = JobTable(cfg, library, store, metrics, Alerter(store, metrics, [], generator="test"))
        table.progress_shortcut = shortcut
        worker = asyncio.create_task(table.run_worker())
        writer = asyncio.create_task(table.writer.run())
        acks: list[int] = []
        all_acked = asyncio.Event()

        def acker(i: int) -> Any:
            def ack() -> None:
                acks.append(i)
                if len(acks) == len(batches):
                    all_acked.set()

            return ack

        for i, b in enumerate(batches):
            payload = wire.encode_batch(b.agent, b.job, b.node, b.seq, b.sent_at, b.events)
            await table.submit(b, acker(i), payload)
        async with asyncio.timeout(30):
            await all_acked.wait()
        worker.cancel()
        writer.cancel()
        state = table.jobs["job-1"]
        engine = state.engine
        events = await store.load_events("job-1")
        return {
            "acks": sorted(acks),
            "seen": list(state.seen),
            "tracks": {
                k: (
                    t.last_step,
                    t.last_step_ts,
                    t.last_progress and t.last_progress.id,
                    t.data_times.values() if t.data_times else [],
                )
                for k, t in engine.tracks.items()
            },
            "votes": {k: t.votes() for k, t in engine.tracks.items()},
            "events_seen": engine.events_seen,
            "diagnosis": engine.diagnose(),
            "stored": sorted(e.id for e in events),
            "dirty": state.dirty_since is not None,
            "metrics": {
                name: registry.get_sample_value(name, labels)
                for name, labels in (
                    ("denpex_ingest_events_total", {"kind": "progress"}),
                    ("denpex_ingest_events_duplicate_total", {"kind": "progress"}),
                    ("denpex_nan_fingerprint_events_total", {"job": "job-1", "stage": "info"}),
                    ("denpex_ingest_lag_seconds_count", {}),
                )
            },
        }


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_progress_shortcut_matches_the_general_path(
    tmp_path: Path, library: RuleSet, seed: int
) -> None:
    batches = _batches(seed)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    fast = await _run(tmp_path / "a", library, batches, shortcut=True)
    general = await _run(tmp_path / "b", library, batches, shortcut=False)
    assert fast["metrics"]["denpex_ingest_events_duplicate_total"]  # re-sends were dropped
    assert fast == general


@pytest.mark.asyncio
async def test_progress_alone_is_rediagnosed_after_the_longer_debounce(
    tmp_path: Path, library: RuleSet
) -> None:
    now = [100.0]
    metrics = Metrics(CollectorRegistry())
    cfg = ServeConfig(debounce_s=0.2, progress_debounce_s=1.0)
    async with Store(tmp_path / "denpex.db") as store:
        table = JobTable(
            cfg,
            library,
            store,
            metrics,
            Alerter(store, metrics, [], generator="test"),
            monotonic=lambda: now[0],
        )
        writer = asyncio.create_task(table.writer.run())
        batch = _batches(1)[0]
        state = table._open("job-1")
        await table._process(state, batch, lambda: None, now[0], None)
        assert state.dirty_since == 100.0 and not state.dirty_by_rule
        assert table._due(state) == pytest.approx(101.0)
        table._dirty.clear()
        now[0] = 100.1
        table._mark_dirty(state)  # a rule event or an agent's status: the short debounce
        assert table._dirty.is_set()  # the diagnoser recomputes its deadline
        assert table._due(state) == pytest.approx(100.2)
        await table.diagnose(state)
        assert state.dirty_since is None and not state.dirty_by_rule
        writer.cancel()
