"""The store keeps a batch of progress events as one row (schema version 2) and still restores
and lists every event; a version 1 database is migrated in place."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

from denpex_agent import wire
from denpex_agent.events import Event
from denpexd import store as store_mod
from denpexd.store import BATCH, Store, event_row, progress_batch_row


def _ev(i: int, kind: str, rank: int) -> Event:
    return Event(
        id=f"e{i}", kind=kind, job="j1", node="n1", rank=rank, local_rank=rank, file=f"rank{rank}.log",
        offset=i, line_no=i + 1, ts=1.8e9 + i, ts_source="line",
        rule="megatron-iteration" if kind == "progress" else "cuda-oom", severity="info" if kind == "progress"
        else "error", role="progress" if kind == "progress" else "root-cause",
        category="progress" if kind == "progress" else "out-of-memory", text=f"line {i}",
        fields={"step": i} if kind == "progress" else {},
    )  # fmt: skip


def _batch(events: list[Event]) -> tuple[wire.Batch, bytes]:
    payload = wire.encode_batch("a1", "j1", "n1", 1, 1.8e9, events)
    return wire.decode_batch(payload), payload


def test_progress_batch_rows_restore_and_list(tmp_path: Path) -> None:
    progress = [_ev(i, "progress", i % 4) for i in range(8)]
    match = _ev(8, "match", 2)
    more = [_ev(i, "progress", 4 + i % 2) for i in range(9, 11)]

    async def run() -> None:
        async with Store(tmp_path / "s.db") as st:
            b1, p1 = _batch(progress)
            b2, p2 = _batch(more)
            rows = [progress_batch_row(b1, p1, 1.0), event_row(match, 2.0), progress_batch_row(b2, p2, 3.0)]
            assert rows[0][4] == BATCH and (rows[0][3], rows[0][8]) == (0, 3)
            await st.write_events(rows, {"j1": (1.0, 3.0)})
            loaded = await st.load_events("j1")
            assert [e.id for e in loaded] == [e.id for e in [*progress, match, *more]]
            assert loaded == [*progress, match, *more]
            everything = await st.events("j1", None, 100)
            assert [e["id"] for e in everything] == [e.id for e in loaded]
            assert all(e["job"] == "j1" and e["node"] == "n1" for e in everything)
            rank2 = await st.events("j1", 2, 100)
            assert [e["id"] for e in rank2] == ["e2", "e6", "e8"]
            assert [e["id"] for e in await st.events("j1", 2, 2)] == ["e2", "e6"]
            assert [e["id"] for e in await st.events("j1", None, 100, "match")] == ["e8"]
            assert len(await st.events("j1", None, 100, "progress")) == 10
            assert [e["id"] for e in await st.events("j1", 5, 100, "progress")] == ["e9"]
            for rank, size in ((None, 3), (None, 1), (2, 1), (None, 11)):
                pages, after = [], None
                while True:
                    page, after = await st.events_page("j1", rank, size, after=_cursor(after))
                    pages.append([e["id"] for e in page])
                    if after is None:
                        break
                every = [e["id"] for e in await st.events("j1", rank, 100)]
                assert [i for p in pages for i in p] == every
                assert all(len(p) == size for p in pages[:-1])

    asyncio.run(run())


def _cursor(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    row, given = text.split(":")
    return int(row), int(given)


def test_version_1_database_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    db = sqlite3.connect(path, isolation_level=None)
    db.executescript(f"BEGIN; {store_mod._MIGRATIONS[0]}; PRAGMA user_version=1; COMMIT;")
    ev = _ev(1, "match", 3)
    db.execute(
        "INSERT INTO events (job, id, node, rank, kind, ts, received, doc) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        event_row(ev, 1.0)[:8],
    )
    db.close()

    async def run() -> None:
        async with Store(path) as st:
            assert st.db.execute("PRAGMA user_version").fetchone()[0] == len(store_mod._MIGRATIONS)
            assert await st.load_events("j1") == [ev]
            assert [e["id"] for e in await st.events("j1", 3, 10)] == ["e1"]

    asyncio.run(run())
