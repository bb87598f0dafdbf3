"""SQLite store: events, diagnoses and incidents per job (WAL, migrations by `user_version`).

One dedicated thread owns the connection; every method is a coroutine that runs its statement
there, so the event loop never waits on the disk. Events are keyed by (job, event id), so writing
a duplicate is a no-op and a restart can rebuild the dedup sets from what is stored. A batch of
progress events alone is one row (`progress_batch_row`, schema version 2): it is expanded when
events are restored or listed, and deduplicated in memory like the live path does. Each job's
row keeps its verdict and initiating node, rank, rule and category, so the recent failures of
all jobs (`failures`, node history) are read without opening their diagnoses.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

import orjson

from denpex_agent import wire
from denpex_agent.events import Event
from denpex_agent.wire import event_to_wire
from denpexd.errors import StoreError
from denpexd.nodehistory import Failure

T = TypeVar("T")
log = logging.getLogger(__name__)

_MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE jobs (
        job TEXT PRIMARY KEY, first_seen REAL NOT NULL, last_seen REAL NOT NULL, closed_at REAL,
        verdict TEXT, initiator_node TEXT, initiator_rank INTEGER, category TEXT);
    CREATE TABLE events (
        seq INTEGER PRIMARY KEY, job TEXT NOT NULL, id TEXT NOT NULL, node TEXT NOT NULL,
        rank INTEGER, kind TEXT NOT NULL, ts REAL, received REAL NOT NULL, doc BLOB NOT NULL,
        UNIQUE (job, id));
    CREATE INDEX events_job_rank ON events (job, rank, seq);
    CREATE TABLE diagnoses (job TEXT PRIMARY KEY, updated REAL NOT NULL, doc BLOB NOT NULL);
    CREATE TABLE incidents (
        job TEXT NOT NULL, incident TEXT NOT NULL, fired_at REAL NOT NULL, resolved_at REAL,
        alert BLOB NOT NULL, PRIMARY KEY (job, incident));
    """,
    # 2: a batch of progress events alone is one row of kind 'batch' (`progress_batch_row`):
    # `doc` is the batch as received, `id` its first event's id, `rank`..`rank_last` its ranks
    """
    ALTER TABLE events ADD COLUMN rank_last INTEGER;
    """,
    # 3: messages whose processing raised, kept as received (acknowledged, never redelivered)
    """
    CREATE TABLE dead_letters (
        seq INTEGER PRIMARY KEY, job TEXT, agent TEXT, received REAL NOT NULL, stage TEXT NOT NULL,
        error TEXT NOT NULL, payload BLOB NOT NULL);
    """,
    # 4: a job's events in arrival order without sorting them all (the API's first page)
    """
    CREATE INDEX events_job_seq ON events (job, seq);
    """,
    # 5: the initiator's rule beside its node and category (node history across jobs), and the
    # recent jobs without sorting them all
    """
    ALTER TABLE jobs ADD COLUMN initiator_rule TEXT;
    CREATE INDEX jobs_last_seen ON jobs (last_seen);
    """,
)

BATCH = "batch"  # the `kind` of a row that holds a whole batch of progress events

EventRow = tuple[str, str, str, int | None, str, float | None, float, bytes, int | None]


def event_row(ev: Event, received: float) -> EventRow:
    return (
        ev.job,
        ev.id,
        ev.node,
        ev.rank,
        ev.kind,
        ev.ts,
        received,
        # orjson's result keeps its whole output buffer (KiBs for a 400-byte event): keep a copy of
        # the exact size, since thousands of rows wait in the writer's buffer for their commit
        bytes(memoryview(orjson.dumps(event_to_wire(ev)))),
        ev.rank,
    )


def progress_batch_row(batch: wire.Batch, payload: bytes, received: float) -> EventRow:
    """One row for a whole batch of progress events: its payload as received (valid, since
    it decoded to `batch`), keyed by its first event's id. Restoring and listing decode it."""
    ranks = [ev.rank for ev in batch.events if ev.rank is not None]
    ts = [ev.ts for ev in batch.events if ev.ts is not None]
    return (
        batch.job,
        batch.events[0].id,
        batch.node,
        min(ranks) if ranks else None,
        BATCH,
        max(ts) if ts else None,
        received,
        payload,
        max(ranks) if ranks else None,
    )


def _batch_events(job: str, doc: bytes) -> list[Event]:
    return wire.decode_batch(doc, topic_job=job).events


RECOVER = (
    "start with --data-dir pointing elsewhere, or let denpexd set the damaged file aside and start "
    "with an empty store: denpexd serve --set-aside-damaged-store"
)


class StoreFull(StoreError):
    """The disk under the store is full: nothing was written (the caller keeps it and retries)."""


class Store:
    """`async with Store(path) as store:` opens (and migrates) the database in its own thread.

    Writes run in that thread; reads for the HTTP API run on a second, read-only connection in a
    thread of their own, so a busy writer never holds an API request back (WAL lets both go).
    A store that is empty, truncated or damaged is refused with a message that names the file and
    how to go on, unless ``set_aside_damaged`` moves it aside (and says so) for a fresh one."""

    def __init__(
        self, path: Path, *, clock: Callable[[], float] = time.time, set_aside_damaged: bool = False
    ) -> None:
        self.path = path
        self._clock = clock
        self._set_aside = set_aside_damaged
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="denpex-store")
        self._read_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="denpex-store-read")
        self._db: sqlite3.Connection | None = None
        self._rdb: sqlite3.Connection | None = None

    async def __aenter__(self) -> Self:
        await self._run(self._open)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await asyncio.get_running_loop().run_in_executor(self._read_pool, self._close_reader)
        await self._run(self._close)
        self._pool.shutdown(wait=True)
        self._read_pool.shutdown(wait=True)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        except sqlite3.Error as exc:
            raise self._translate(exc) from exc

    async def _read(self, fn: Callable[..., T], *args: Any) -> T:
        """A read on the reader connection (its own thread: never behind the writer)."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._read_pool, fn, *args)
        except sqlite3.Error as exc:
            raise self._translate(exc) from exc

    def _translate(self, exc: sqlite3.Error) -> StoreError:
        where = f"{self.path} (data dir {self.path.parent})"
        if getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
            return StoreFull(where, "the disk is full; events stay unacknowledged until space returns")
        if isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError):
            return StoreError(where, f"damaged ({exc}); {RECOVER}")
        return StoreError(where, str(exc))

    # -- in the store thread ----------------------------------------------------------------------

    def _open(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(str(self.path), f"cannot create its folder: {exc.strerror or exc}") from exc
        problem = self._damage()
        if problem is not None:
            if not self._set_aside:
                raise StoreError(str(self.path), f"{problem}; {RECOVER}")
            aside = self.path.with_name(f"{self.path.name}.damaged-{int(self._clock())}")
            for suffix in ("", "-wal", "-shm"):
                src = Path(str(self.path) + suffix)
                if src.exists():
                    os.replace(src, Path(str(aside) + suffix))
            log.warning("store set aside; starting with an empty one problem=%s moved_to=%s", problem, aside)
        try:
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            # progress batches are stored as received, ~14 KB a row: larger pages mean fewer
            # overflow pages per row (takes effect when the database is created)
            db.execute("PRAGMA page_size=16384")
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA busy_timeout=5000")
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > len(_MIGRATIONS):
                raise StoreError(str(self.path), f"schema version {version} is newer than this denpexd")
            for i in range(version, len(_MIGRATIONS)):
                db.executescript(f"BEGIN; {_MIGRATIONS[i]}; PRAGMA user_version={i + 1}; COMMIT;")
        except sqlite3.Error as exc:
            raise self._translate(exc) from exc
        except OSError as exc:
            raise StoreError(str(self.path), str(exc)) from exc
        self._db = db

    def _damage(self) -> str | None:
        """What is wrong with an existing store file, or None (a missing file is a new store)."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return None
        except OSError as exc:
            return f"cannot read it ({exc.strerror or exc})"
        if size == 0:
            wal = Path(str(self.path) + "-wal")
            if not (wal.exists() and wal.stat().st_size > 0):
                return "the file is empty (truncated?): every job it held would be gone"
        try:
            with self.path.open("rb") as fh:
                head = fh.read(16)
        except OSError as exc:
            return f"cannot read it ({exc.strerror or exc})"
        if size and head != b"SQLite format 3\x00":
            return "not an SQLite database (its first bytes are wrong)"
        try:  # the schema and the first page of every table (a full check would read it all)
            probe = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)
            try:
                tables = [r[0] for r in probe.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
                for table in tables:
                    probe.execute(f'SELECT * FROM "{table}" LIMIT 1').fetchall()
            finally:
                probe.close()
        except sqlite3.Error as exc:
            return f"damaged ({exc})"
        return None

    def _reader(self) -> sqlite3.Connection:
        if self._rdb is None:
            self._rdb = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, check_same_thread=False)
            self._rdb.execute("PRAGMA busy_timeout=5000")
        return self._rdb

    def _close_reader(self) -> None:
        if self._rdb is not None:
            self._rdb.close()
            self._rdb = None

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    @property
    def db(self) -> sqlite3.Connection:
        assert self._db is not None, "store is not open"
        return self._db

    def _write_events(self, rows: list[EventRow], jobs: dict[str, tuple[float, float]]) -> int:
        db = self.db
        db.execute("BEGIN")
        try:
            before = db.total_changes
            db.executemany(
                "INSERT OR IGNORE INTO events (job, id, node, rank, kind, ts, received, doc, rank_last)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                rows,
            )
            written = db.total_changes - before
            db.executemany(
                "INSERT INTO jobs (job, first_seen, last_seen) VALUES (?, ?, ?) ON CONFLICT (job) DO UPDATE"
                " SET last_seen = max(last_seen, excluded.last_seen), closed_at = NULL",
                [(job, first, last) for job, (first, last) in jobs.items()],
            )
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        return written

    def _dead_letter(
        self, job: str | None, agent: str | None, stage: str, error: str, payload: bytes
    ) -> None:
        self.db.execute(
            "INSERT INTO dead_letters (job, agent, received, stage, error, payload) VALUES (?, ?, ?, ?, ?, ?)",
            (job, agent, self._clock(), stage, error[:2000], payload),
        )

    def _dead_letters(self, limit: int) -> list[dict[str, Any]]:
        rows = self._reader().execute(
            "SELECT seq, job, agent, received, stage, error, length(payload), substr(payload, 1, 512)"
            " FROM dead_letters ORDER BY seq DESC LIMIT ?",
            (limit,),
        )
        keys = ("seq", "job", "agent", "received", "stage", "error", "bytes")
        return [
            {**dict(zip(keys, r[:7], strict=True)), "head": bytes(r[7]).decode("utf-8", "replace")}
            for r in rows
        ]

    def _save_diagnosis(self, job: str, doc: dict[str, Any]) -> None:
        ini = doc.get("initiator") or {}
        rc = doc.get("root_cause") or {}
        now = self._clock()
        db = self.db
        db.execute("BEGIN")
        db.execute(
            "INSERT INTO diagnoses (job, updated, doc) VALUES (?, ?, ?) ON CONFLICT (job) DO UPDATE"
            " SET updated = excluded.updated, doc = excluded.doc",
            (job, now, orjson.dumps(doc, option=orjson.OPT_NON_STR_KEYS)),
        )
        db.execute(
            "UPDATE jobs SET verdict = ?, initiator_node = ?, initiator_rank = ?, initiator_rule = ?,"
            " category = ? WHERE job = ?",
            (doc.get("verdict"), ini.get("node"), ini.get("rank"), ini.get("rule"), rc.get("category"), job),
        )
        db.execute("COMMIT")

    def _load_events(self, job: str) -> list[Event]:  # at start-up, on the writer's connection
        out = []
        sql = "SELECT node, kind, doc FROM events WHERE job = ? ORDER BY seq"
        for node, kind, doc in self.db.execute(sql, (job,)):
            if kind == BATCH:
                out.extend(_batch_events(job, doc))
            else:
                out.append(Event(job=job, node=node, **orjson.loads(doc)))
        return out

    def _events(
        self, job: str, rank: int | None, kind: str | None, limit: int, after: tuple[int, int] | None
    ) -> tuple[list[dict[str, Any]], str | None]:
        args: list[Any]
        where, args = "job = ?", [job]
        if after is not None:
            where += " AND seq >= ?"
            args.append(after[0])
        if rank is not None:
            where += " AND (rank = ? OR (kind = ? AND rank <= ? AND rank_last >= ?))"
            args += [rank, BATCH, rank, rank]
        if kind == "progress":
            where += " AND kind IN (?, ?)"
            args += ["progress", BATCH]
        elif kind is not None:
            where += " AND kind = ?"
            args.append(kind)
        out: list[dict[str, Any]] = []
        for seq, node, k, doc in self._reader().execute(
            f"SELECT seq, node, kind, doc FROM events WHERE {where} ORDER BY seq", args
        ):
            if k == BATCH:
                rows = [
                    {"job": job, "node": ev.node, **event_to_wire(ev)}
                    for ev in _batch_events(job, doc)
                    if rank is None or ev.rank == rank
                ]
            else:
                rows = [{"job": job, "node": node, **orjson.loads(doc)}]
            skip = after[1] if after is not None and seq == after[0] else 0
            for i in range(skip, len(rows)):
                out.append(rows[i])
                if len(out) >= limit:
                    return out, f"{seq}:{i + 1}"
        return out, None

    # -- coroutines -------------------------------------------------------------------------------

    async def write_events(self, rows: list[EventRow], jobs: dict[str, tuple[float, float]]) -> int:
        return await self._run(self._write_events, rows, jobs)

    async def save_diagnosis(self, job: str, doc: dict[str, Any]) -> None:
        await self._run(self._save_diagnosis, job, doc)

    async def close_job(self, job: str, at: float) -> None:
        await self._run(self._exec, "UPDATE jobs SET closed_at = ? WHERE job = ?", (at, job))

    async def record_incident(self, job: str, incident: str, fired_at: float, alert: dict[str, Any]) -> None:
        await self._run(
            self._exec,
            "INSERT OR IGNORE INTO incidents (job, incident, fired_at, alert) VALUES (?, ?, ?, ?)",
            (job, incident, fired_at, orjson.dumps(alert)),
        )

    async def relabel_incident(self, job: str, incident: str, alert: dict[str, Any]) -> None:
        """Later evidence moved the initiator: the incident keeps its start, the alert changes."""
        await self._run(
            self._exec,
            "UPDATE incidents SET alert = ? WHERE job = ? AND incident = ? AND resolved_at IS NULL",
            (orjson.dumps(alert), job, incident),
        )

    async def resolve_incident(self, job: str, incident: str, at: float) -> None:
        await self._run(
            self._exec,
            "UPDATE incidents SET resolved_at = ? WHERE job = ? AND incident = ? AND resolved_at IS NULL",
            (at, job, incident),
        )

    async def incidents(self, job: str) -> list[tuple[str, float, float | None, dict[str, Any]]]:
        rows = await self._run(
            self._query,
            "SELECT incident, fired_at, resolved_at, alert FROM incidents WHERE job = ? ORDER BY fired_at",
            (job,),
        )
        return [(i, f, r, orjson.loads(a)) for i, f, r, a in rows]

    async def open_jobs(self, limit: int) -> list[tuple[str, float, float]]:
        rows = await self._run(
            self._query,
            "SELECT job, first_seen, last_seen FROM jobs WHERE closed_at IS NULL ORDER BY last_seen DESC LIMIT ?",
            (limit,),
        )
        return [(j, f, last) for j, f, last in rows]

    async def load_events(self, job: str) -> list[Event]:
        return await self._run(self._load_events, job)

    async def list_jobs(self, limit: int) -> list[dict[str, Any]]:
        rows = await self._read(
            self._read_query,
            "SELECT job, first_seen, last_seen, closed_at, verdict, initiator_node, initiator_rank, category"
            " FROM jobs ORDER BY last_seen DESC LIMIT ?",
            (limit,),
        )
        keys = ("job", "first_seen", "last_seen", "closed_at", "verdict", "initiator_node")
        return [
            {**dict(zip(keys, r[:6], strict=True)), "initiator_rank": r[6], "category": r[7]} for r in rows
        ]

    async def failures(self, limit: int, other_than: str | None = None) -> tuple[list[Failure], int]:
        """The failures with an initiating node among the last ``limit`` jobs (by last activity,
        newest first; ``other_than`` left out), and how many jobs that window holds."""
        return await self._read(self._failures, limit, other_than)

    def _failures(self, limit: int, other_than: str | None) -> tuple[list[Failure], int]:
        rows = self._read_query(
            "SELECT job, verdict, initiator_node, initiator_rule, category FROM jobs WHERE job IS NOT ?"
            " ORDER BY last_seen DESC LIMIT ?",
            (other_than, limit),
        )
        out = []
        for job, verdict, node, rule, category in rows:
            if verdict != "failed" or node is None:
                continue
            if rule is None:  # diagnosed before the rule had a column of its own
                rule = self._stored_rule(job)
            out.append(Failure(job, node, rule or "?", category or "?"))
        return out, len(rows)

    def _stored_rule(self, job: str) -> str | None:
        rows = self._read_query("SELECT doc FROM diagnoses WHERE job = ?", (job,))
        if not rows:
            return None
        rule = (orjson.loads(rows[0][0]).get("initiator") or {}).get("rule")
        return rule if isinstance(rule, str) else None

    async def diagnosis(self, job: str) -> dict[str, Any] | None:
        rows = await self._read(self._read_query, "SELECT doc FROM diagnoses WHERE job = ?", (job,))
        return orjson.loads(rows[0][0]) if rows else None

    async def job_exists(self, job: str) -> bool:
        return bool(await self._read(self._read_query, "SELECT 1 FROM jobs WHERE job = ?", (job,)))

    async def dead_letter(
        self, job: str | None, agent: str | None, stage: str, error: str, payload: bytes
    ) -> None:
        """Keep a message whose processing raised (then it is acknowledged, never redelivered)."""
        await self._run(self._dead_letter, job, agent, stage, error, payload)

    async def dead_letters(self, limit: int) -> list[dict[str, Any]]:
        return await self._read(self._dead_letters, limit)

    async def events(
        self, job: str, rank: int | None, limit: int, kind: str | None = None
    ) -> list[dict[str, Any]]:
        """A job's events in arrival order (progress batches expanded), optionally of one rank
        and/or one kind."""
        return (await self.events_page(job, rank, limit, kind))[0]

    async def events_page(
        self,
        job: str,
        rank: int | None,
        limit: int,
        kind: str | None = None,
        after: tuple[int, int] | None = None,
    ) -> tuple[list[dict[str, Any]], str | None]:
        """`events` a page at a time: from the cursor ``after`` (a row, and how many of its events
        were given already), with the cursor of the next page, or None after the last."""
        return await self._read(self._events, job, rank, kind, limit, after)

    async def apply_retention(self, closed_before: float) -> int:
        return await self._run(self._retention, closed_before)

    def _retention(self, closed_before: float) -> int:
        db = self.db
        old = [r[0] for r in db.execute("SELECT job FROM jobs WHERE closed_at < ?", (closed_before,))]
        db.execute("BEGIN")
        for table in ("events", "diagnoses", "incidents", "jobs"):
            db.executemany(f"DELETE FROM {table} WHERE job = ?", [(j,) for j in old])
        db.execute("COMMIT")
        return len(old)

    def _exec(self, sql: str, args: Iterable[Any]) -> None:
        self.db.execute(sql, tuple(args))

    def _query(self, sql: str, args: Iterable[Any]) -> list[tuple[Any, ...]]:
        return self.db.execute(sql, tuple(args)).fetchall()

    def _read_query(self, sql: str, args: Iterable[Any]) -> list[tuple[Any, ...]]:
        return self._reader().execute(sql, tuple(args)).fetchall()


FULL_RETRY_S = (0.5, 1.0, 2.0, 5.0)  # waits between tries while the disk is full (the last repeats)


class EventWriter:
    """Batches event rows into one transaction per flush, then runs the deliveries' acks.

    `add()` waits while more than `max_rows` rows, or `max_bytes` of them, are buffered
    (back-pressure towards ingest).
    While the disk is full nothing is acknowledged: the same rows are tried again until they are
    written (`on_full(True)` / `on_full(False)` say when that starts and ends). Rows that cannot
    be written for any other reason go to `on_failed(rows, job, error)` one delivery at a time
    (the dead-letter table), and are then acknowledged: never redelivered forever.
    """

    def __init__(
        self,
        store: Store,
        *,
        max_rows: int = 50_000,
        max_bytes: int = 64 << 20,
        commit_rows: int = 1_000,
        on_wait: Callable[[], None] | None = None,
        on_full: Callable[[bool], None] | None = None,
        on_failed: Callable[[list[EventRow], str, Exception], Awaitable[None]] | None = None,
    ) -> None:
        self.store = store
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        self.commit_rows = commit_rows
        self._bytes = 0  # of the rows' documents in `_adds`
        self._on_wait = on_wait
        self._on_full = on_full
        self._on_failed = on_failed
        self._adds: deque[tuple[list[EventRow], str, float, float, Callable[[], None]]] = deque()
        self._buffered = 0  # rows in `_adds`
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._added = 0  # deliveries added so far ...
        self._settled = 0  # ... and written (or dead-lettered) and acknowledged, in order
        self._watchers: deque[tuple[int, asyncio.Future[None]]] = deque()
        self.written = 0

    async def add(
        self, rows: list[EventRow], job: str, first: float, last: float, ack: Callable[[], None]
    ) -> None:
        while self._buffered >= self.max_rows or self._bytes >= self.max_bytes:
            if self._on_wait is not None:
                self._on_wait()
            self._room.clear()
            await self._room.wait()
        self._adds.append((rows, job, first, last, ack))
        self._added += 1
        self._buffered += len(rows)
        self._bytes += sum(len(r[7]) for r in rows)
        self._idle.clear()
        self._wake.set()

    async def run(self) -> None:
        adds = self._adds
        while True:
            await self._wake.wait()
            self._wake.clear()
            while adds:
                # one transaction for what is buffered, up to `commit_rows` rows: a short commit
                # keeps the store thread free for incidents and diagnoses queued behind it
                rows: list[EventRow] = []
                jobs: dict[str, tuple[float, float]] = {}
                group = []
                while adds and (not rows or len(rows) + len(adds[0][0]) <= self.commit_rows):
                    entry = adds.popleft()
                    more, job, first, last, _ack = entry
                    rows.extend(more)
                    prev = jobs.get(job)
                    jobs[job] = (min(first, prev[0]), max(last, prev[1])) if prev else (first, last)
                    group.append(entry)
                self._buffered -= len(rows)
                self._bytes -= sum(len(r[7]) for r in rows)
                if self._buffered < self.max_rows and self._bytes < self.max_bytes:
                    self._room.set()
                try:
                    self.written += await self._write(rows, jobs)
                except Exception:  # not a full disk (that waits in _write): a fault of the rows
                    await self._one_by_one(group)
                    self._settle(len(group))
                    continue
                for entry in group:
                    entry[4]()
                self._settle(len(group))
            self._idle.set()

    def _settle(self, deliveries: int) -> None:
        self._settled += deliveries
        watchers = self._watchers
        while watchers and watchers[0][0] <= self._settled:
            _, fut = watchers.popleft()
            if not fut.done():
                fut.set_result(None)

    async def _write(self, rows: list[EventRow], jobs: dict[str, tuple[float, float]]) -> int:
        """Write, waiting (and trying again) for as long as the disk is full."""
        tries = 0
        while True:
            try:
                written = await self.store.write_events(rows, jobs)
            except StoreFull as exc:
                if tries == 0:
                    log.error("%s", exc)
                    if self._on_full is not None:
                        self._on_full(True)
                await asyncio.sleep(FULL_RETRY_S[min(tries, len(FULL_RETRY_S) - 1)])
                tries += 1
                continue
            if tries and self._on_full is not None:
                self._on_full(False)
                log.warning("the store's disk has room again; writing resumed after tries=%d", tries)
            return written

    async def _one_by_one(
        self, group: list[tuple[list[EventRow], str, float, float, Callable[[], None]]]
    ) -> None:
        """A transaction failed for a reason of its own: each delivery on its own, the failing
        ones to the dead letters; then every one is acknowledged."""
        for rows, job, first, last, ack in group:
            try:
                self.written += await self._write(rows, {job: (first, last)})
            except Exception as exc:
                log.error(
                    "rows could not be stored; kept as dead letters job=%s rows=%d error=%s",
                    job,
                    len(rows),
                    exc,
                )
                if self._on_failed is not None:
                    await self._on_failed(rows, job, exc)
            ack()

    @property
    def buffered_rows(self) -> int:
        """Rows added and not yet taken into a transaction."""
        return self._buffered

    async def flush(self) -> None:
        """Wait until everything added so far is committed and acknowledged (and nothing more:
        what is added meanwhile does not extend the wait)."""
        if self._settled >= self._added:
            return
        fut = asyncio.get_running_loop().create_future()
        self._watchers.append((self._added, fut))  # targets only grow: the deque stays sorted
        await fut
