"""A store that is empty, truncated or damaged is named, never silently replaced; set aside on
request; a full disk holds the acknowledgements back until there is room (real SQLite files)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from denpexd.errors import StoreError
from denpexd.store import EventWriter, Store


async def _store_with_a_job(path: Path) -> None:
    async with Store(path) as store:
        row = ("job-1", "e1", "n1", 0, "match", 1.8e9, 1.8e9, b'{"id":"e1"}', 0)
        await store.write_events([row], {"job-1": (1.8e9, 1.8e9)})


@pytest.mark.asyncio
@pytest.mark.parametrize("damage", ["empty", "garbage", "truncated"])
async def test_a_damaged_store_is_refused_with_its_name_and_the_way_on(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "data" / "denpex.sqlite"
    await _store_with_a_job(path)
    data = path.read_bytes()
    if damage == "empty":
        path.write_bytes(b"")
    elif damage == "garbage":
        path.write_bytes(b"\x00garbage" * 1000)
    else:
        path.write_bytes(data[: len(data) // 2 + 100])
    with pytest.raises(StoreError) as err:
        async with Store(path):
            pass
    message = str(err.value)
    assert str(path) in message and "--set-aside-damaged-store" in message
    assert path.read_bytes() != b"" or damage == "empty"  # nothing was overwritten
    async with Store(path, set_aside_damaged=True) as store:
        assert await store.list_jobs(10) == []
    kept = [p for p in path.parent.glob("denpex.sqlite.damaged-*") if not p.name.endswith(("-wal", "-shm"))]
    assert len(kept) == 1  # set aside for inspection, not deleted


@pytest.mark.asyncio
async def test_a_missing_store_is_a_new_one(tmp_path: Path) -> None:
    async with Store(tmp_path / "new" / "denpex.sqlite") as store:
        assert await store.list_jobs(10) == []


@pytest.mark.asyncio
async def test_a_full_disk_holds_acknowledgements_until_there_is_room(tmp_path: Path) -> None:
    """The store's file may not grow (SQLite's page limit stands in for a full disk): nothing
    is acknowledged, the writer tries again, and once there is room every row is written and
    acknowledged."""
    full: list[bool] = []
    async with Store(tmp_path / "denpex.sqlite") as store:
        pages = (await store._run(store._query, "PRAGMA page_count", ()))[0][0]
        await store._run(store._exec, f"PRAGMA max_page_count={pages}", ())
        writer = EventWriter(store, on_full=full.append)
        task = asyncio.create_task(writer.run())
        acked: list[int] = []
        done = asyncio.Event()
        rows = [
            (
                "job-1",
                f"e{i}",
                "n1",
                0,
                "match",
                1.8e9,
                1.8e9,
                orjson.dumps({"id": f"e{i}", "pad": "x" * 4000}),
                0,
            )
            for i in range(50)
        ]

        def ack() -> None:
            acked.append(1)
            done.set()

        await writer.add(rows, "job-1", 1.8e9, 1.8e9, ack)
        await asyncio.sleep(1.5)
        assert acked == [] and full == [True]
        await store._run(store._exec, "PRAGMA max_page_count=1000000", ())
        async with asyncio.timeout(10):
            await done.wait()
        assert acked == [1] and full == [True, False]
        assert len(await store.events("job-1", None, 100)) == 50
        task.cancel()
