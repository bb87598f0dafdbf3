"""The HTTP API (aiohttp): jobs, one job's diagnosis (docs/diagnosis-json.md), its events, health, metrics.

An optional bearer token guards everything but `/-/healthy` and `/-/ready`. Job ids are checked
with the wire protocol's rules before anything looks them up: a hostile id is a 400, an unknown
one a 404. `/api/v1/jobs/<id>/events?rank=&kind=&limit=&after=` lists a job's events in arrival
order, optionally of one rank and/or one kind (`match`, `progress`, `heartbeat`), a page at a time:
`next` is the `after` of the next page (`null` after the last); progress events stored as one row
per batch are expanded. `/api/v1/dead-letters?limit=` lists the messages whose
processing raised (kept, acknowledged, newest first). `/api/v1/nodes?limit=` ranks the nodes
that initiated hardware and communication failures in the last `limit` jobs (`nodehistory`).
Reads go to the store's reader connection:
a busy writer does not hold them back.

Two pages for people: `/jobs` (the job list) and `/jobs/<id>` (the diagnosis drawn as `diagnose
--html` draws it, polling for its newer versions: the page's ETag is the document's hash, an
unchanged job answers 304). A browser cannot send the bearer header when it navigates, so these
two also take the token once as `?token=` (kept in an HttpOnly, same-site cookie for the page's
polls) and answer with `Referrer-Policy: no-referrer` and a content policy that allows no
network access beyond the page's own origin.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import re
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, Literal, Self

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from denpex_agent import wire
from denpex_agent.events import KINDS
from denpexd import nodehistory
from denpexd.config import split_listen
from denpexd.errors import HttpError
from denpexd.htmlreport import render_html, render_job_list
from denpexd.jobs import JobTable
from denpexd.store import Store

log = logging.getLogger(__name__)
# How long an events request waits for the rows received before it to be written: they usually
# are within one commit; under a backlog the answer does not queue behind the writer.
FLUSH_WAIT_S = 0.25

MAX_EVENTS = 10_000
PAGE_JOBS = 500  # jobs the /jobs page lists
PAGE_POLL_MS = 2000  # how often a live job page asks whether its job changed
TOKEN_COOKIE = "denpex_token"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS),
        status=status,
        content_type="application/json",
    )


def _page(html: str) -> web.Response:
    resp = web.Response(text=html, content_type="text/html", charset="utf-8")
    resp.headers["Cache-Control"] = "no-store"
    resp.headers["Referrer-Policy"] = "no-referrer"  # a ?token= never leaves in a Referer
    resp.headers["Content-Security-Policy"] = (
        "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:; "
        "connect-src 'self'"
    )
    return resp


def _error(status: int, message: str) -> web.Response:
    return _json({"error": message}, status)


_CURSOR = re.compile(r"(\d{1,18}):(\d{1,9})")


def _cursor(text: str) -> tuple[int, int] | Literal[False] | None:
    """An events page's ``after``: None when absent, False when it is not a cursor."""
    if not text:
        return None
    m = _CURSOR.fullmatch(text)
    return (int(m.group(1)), int(m.group(2))) if m else False


class Api:
    """`async with Api(listen, ...)` serves until the block exits."""

    def __init__(
        self,
        listen: str,
        table: JobTable,
        store: Store,
        registry: CollectorRegistry,
        *,
        token: str | None,
        ready: Callable[[], bool],
    ) -> None:
        self.listen = listen
        self.table, self.store, self.registry = table, store, registry
        self.token = token
        self._ready = ready
        self._runner: web.AppRunner | None = None
        self.port = 0

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth], client_max_size=64 * 1024)
        app.router.add_get("/-/healthy", self.healthy)
        app.router.add_get("/-/ready", self.ready)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/api/v1/jobs", self.jobs)
        app.router.add_get("/api/v1/jobs/{job}", self.job)
        app.router.add_get("/api/v1/jobs/{job}/events", self.events)
        app.router.add_get("/api/v1/dead-letters", self.dead_letters)
        app.router.add_get("/api/v1/nodes", self.nodes)
        app.router.add_get("/jobs", self.page_jobs)
        app.router.add_get("/jobs/{job}", self.page_job)
        return app

    async def __aenter__(self) -> Self:
        host, port = split_listen(self.listen)
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            raise HttpError(
                self.listen, f"cannot listen ({exc.strerror}); choose another with --http-listen"
            ) from exc
        # the bound port (``port`` may be 0): the runner's public list of its sites' addresses
        bound = [addr[1] for addr in self._runner.addresses if isinstance(addr, tuple) and len(addr) >= 2]
        self.port = bound[0] if bound else port
        log.info("HTTP API listening address=%s:%d", host, self.port)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if not self.token or request.path.startswith("/-/"):
            return await handler(request)
        given = request.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
            return await handler(request)
        if request.path == "/jobs" or request.path.startswith("/jobs/"):
            # a browser cannot send a bearer header on navigation: the pages also take the token
            # once as ?token= (then kept in an HttpOnly same-site cookie) or from that cookie
            query = request.query.get("token", "")
            cookie = request.cookies.get(TOKEN_COOKIE, "")
            for candidate in (query, cookie):
                if candidate and hmac.compare_digest(candidate.encode(), self.token.encode()):
                    resp = await handler(request)
                    if query:
                        resp.set_cookie(TOKEN_COOKIE, query, httponly=True, samesite="Strict", path="/jobs")
                    return resp
        return _error(401, "missing or wrong bearer token")

    async def healthy(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def ready(self, request: web.Request) -> web.Response:
        if self._ready():
            return web.Response(text="ready\n")
        return web.Response(text="not ready: waiting for the MQTT broker\n", status=503)

    async def metrics(self, request: web.Request) -> web.Response:
        resp = web.Response(body=generate_latest(self.registry))
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp

    async def jobs(self, request: web.Request) -> web.Response:
        try:
            limit = max(1, min(int(request.query.get("limit", "100")), 10_000))
        except ValueError:
            return _error(400, "limit must be an integer")
        rows = await self.store.list_jobs(limit)
        for row in rows:
            row["open"] = row["job"] in self.table.jobs
        return _json({"jobs": rows})

    def _job_id(self, request: web.Request) -> str | None:
        job = request.match_info["job"]
        return job if wire.valid_id(job) else None

    async def _diagnosis(self, request: web.Request) -> dict[str, Any] | web.Response:
        """The requested job's diagnosis (open: current; closed: stored), or the error to answer."""
        job = self._job_id(request)
        if job is None:
            return _error(400, "invalid job id")
        doc = await self.table.current(job)
        if doc is None:
            doc = await self.store.diagnosis(job)
        if doc is None:
            return _error(404, f"unknown job {job}")
        return doc

    async def job(self, request: web.Request) -> web.Response:
        doc = await self._diagnosis(request)
        return doc if isinstance(doc, web.Response) else _json(doc)

    async def events(self, request: web.Request) -> web.Response:
        job = self._job_id(request)
        if job is None:
            return _error(400, "invalid job id")
        try:
            rank = int(request.query["rank"]) if request.query.get("rank", "") != "" else None
            limit = max(1, min(int(request.query.get("limit", "100")), MAX_EVENTS))
        except ValueError:
            return _error(400, "rank and limit must be integers")
        if rank is not None and not -1 <= rank < 1 << 31:
            return _error(400, "rank must be between -1 and 2147483647")
        after = _cursor(request.query.get("after") or "")
        if after is False:
            return _error(400, "after must be a cursor from a previous page's next")
        kind = request.query.get("kind") or None
        if kind is not None and kind not in KINDS:
            return _error(400, f"kind must be one of {', '.join(KINDS)}")
        if job not in self.table.jobs and not await self.store.job_exists(job):
            return _error(404, f"unknown job {job}")
        # What was received a moment ago is shown too, when it is about to be written; behind a
        # backlog the answer is what is committed, at once.
        writer = self.table.writer
        if writer.buffered_rows <= writer.commit_rows:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(FLUSH_WAIT_S):
                    await writer.flush()
        events, cursor = await self.store.events_page(job, rank, limit, kind, after)
        return _json({"job": job, "events": events, "next": cursor})

    async def nodes(self, request: web.Request) -> web.Response:
        unknown = sorted(set(request.query) - {"limit"})
        if unknown:
            return _error(400, f"unknown parameter {unknown[0]!r} (known: limit)")
        raw = request.query.get("limit", str(nodehistory.DEFAULT_JOBS))
        try:
            limit = int(raw)
        except ValueError:
            return _error(400, f"limit must be an integer, got {raw[:40]!r}")
        if not 1 <= limit <= nodehistory.MAX_JOBS:
            return _error(400, f"limit must be between 1 and {nodehistory.MAX_JOBS}")
        failures, jobs = await self.store.failures(limit)
        return _json({"limit": limit, **nodehistory.ranking(failures, jobs)})

    async def page_jobs(self, request: web.Request) -> web.Response:
        """The job list as a page, newest first, each linked to its live page."""
        rows = await self.store.list_jobs(PAGE_JOBS)
        for row in rows:
            row["open"] = row["job"] in self.table.jobs
        return _page(render_job_list(rows))

    async def page_job(self, request: web.Request) -> web.Response:
        """One job's diagnosis as a live page: the same document the API returns, drawn as
        `diagnose --html` draws it, with a version (its ETag) the page polls for."""
        doc = await self._diagnosis(request)
        if isinstance(doc, web.Response):
            return doc
        version = hashlib.blake2b(
            orjson.dumps(doc, option=orjson.OPT_NON_STR_KEYS), digest_size=12
        ).hexdigest()
        if request.headers.get("If-None-Match") == version:
            return web.Response(status=304, headers={"ETag": version})
        resp = _page(render_html(doc, live={"version": version, "poll_ms": PAGE_POLL_MS}))
        resp.headers["ETag"] = version
        return resp

    async def dead_letters(self, request: web.Request) -> web.Response:
        try:
            limit = max(1, min(int(request.query.get("limit", "100")), 1000))
        except ValueError:
            return _error(400, "limit must be an integer")
        return _json({"dead_letters": await self.store.dead_letters(limit)})
