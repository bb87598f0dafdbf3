"""`denpexd query`: ask a running `denpexd serve` over its HTTP API.

`--job ID` prints the same report as `denpexd diagnose` (`report.render_text`; with
`--format markdown` the Markdown of `markdown.render_markdown`), `--json` (or `--format json`) the
diagnosis document (docs/diagnosis-json.md), `--jobs` the recent jobs with their verdicts and
initiators; with `--control HEALTHY_JOB`, the job's first divergence from that healthy job
(`divergence.py`), compared over the lines the daemon stored for both jobs (their events and the
context lines before them, not every line of their logs), `--nodes` the nodes that initiated
hardware and communication failures in the last `--last` jobs (`nodehistory`). `--server` may omit the scheme (``host:8080`` means ``http://host:8080``); a daemon that
accepts the connection but does not answer within `--timeout` seconds is an error naming both.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson

from denpex_agent import wire
from denpex_agent.redact import Redactor, redact_url
from denpexd import divergence, nodehistory
from denpexd.errors import QueryError
from denpexd.markdown import render_markdown
from denpexd.report import render_text

DEFAULT_SERVER = "http://127.0.0.1:8080"
DEFAULT_TIMEOUT_S = 10.0
EVENTS_PAGE = 1000


def server_url(value: str) -> str:
    """``host:port`` → ``http://host:port``; an http(s) URL as given. Raises `QueryError`."""
    url = value.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 - urlsplit checks the port only when asked
    except ValueError:
        raise QueryError(f"--server {redact_url(value)!r}: the port is not a number") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise QueryError(f"--server {redact_url(value)!r}: expected [http[s]://]HOST[:PORT]")
    return url


async def fetch(server: str, path: str, token: str | None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    url = server.rstrip("/") + path
    shown = redact_url(server)
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session,
            session.get(url, headers=headers) as resp,
        ):
            body = await resp.read()
            if resp.status == 401:
                raise QueryError(
                    f"{redact_url(url)}: 401 unauthorized (pass --api-token or set DENPEX_API_TOKEN)"
                )
            if resp.status == 404:
                raise QueryError(f"{redact_url(url)}: not found ({_message(body)})")
            if resp.status >= 400:
                raise QueryError(f"{redact_url(url)}: HTTP {resp.status} ({_message(body)})")
            return orjson.loads(body)
    except aiohttp.ClientConnectorError as exc:
        raise QueryError(
            f"cannot reach denpexd at {shown} ({exc.os_error.strerror if exc.os_error else exc}): "
            "is `denpexd serve` running? (set --server or DENPEX_SERVER)"
        ) from exc
    except TimeoutError as exc:  # also aiohttp's ServerTimeoutError
        raise QueryError(
            f"no answer from {shown} within {timeout_s:g} s: is it `denpexd serve`? (raise --timeout "
            "for a busy daemon)"
        ) from exc
    except aiohttp.ClientError as exc:
        raise QueryError(f"{redact_url(url)}: {type(exc).__name__}: {exc}") from exc
    except orjson.JSONDecodeError as exc:
        raise QueryError(f"{redact_url(url)}: the answer is not JSON") from exc


async def fetch_events(server: str, job: str, token: str | None, timeout_s: float) -> list[dict[str, Any]]:
    """Every event the daemon stored for ``job`` (heartbeats left out), page after page."""
    out: list[dict[str, Any]] = []
    after: str | None = None
    while True:
        path = f"/api/v1/jobs/{job}/events?limit={EVENTS_PAGE}" + (f"&after={after}" if after else "")
        page = await fetch(server, path, token, timeout_s)
        out.extend(e for e in page.get("events", []) if isinstance(e, dict) and e.get("kind") != "heartbeat")
        after = page.get("next")
        if not isinstance(after, str) or not after:
            return out


async def with_divergence(
    server: str, job: str, control: str, token: str | None, timeout_s: float
) -> dict[str, Any]:
    """The job's diagnosis with its `divergence` from the healthy job ``control``."""
    doc: dict[str, Any] = await fetch(server, f"/api/v1/jobs/{job}", token, timeout_s)
    try:
        healthy_events = await fetch_events(server, control, token, timeout_s)
    except QueryError as exc:
        raise QueryError(f"--control {control}: {exc}") from exc
    healthy = divergence.event_sources(healthy_events)
    context = divergence.has_context(healthy_events)
    failed = divergence.event_sources(await fetch_events(server, job, token, timeout_s), context=context)
    ctl = divergence.read_control(healthy, {s.node for s in healthy})
    if not context:
        ctl.warnings.append(
            f"the daemon holds no context lines of {control}: only the events' own lines of {job} "
            "(progress samples, matched lines) were compared"
        )
    doc["divergence"] = divergence.divergence(failed, {s.node for s in failed}, ctl, doc.get("clock") or {})
    return doc


def _message(body: bytes) -> str:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:200].decode(errors="replace")
    return str(doc.get("error", doc)) if isinstance(doc, dict) else str(doc)


def render_jobs(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no jobs yet\n"
    out = [f"{'JOB':<32} {'STATE':<7} {'VERDICT':<9} INITIATOR"]
    for r in rows:
        who = "-"
        if r.get("initiator_node"):
            rank = r.get("initiator_rank")
            who = f"node {r['initiator_node']} rank {rank if rank is not None else '-'} ({r.get('category') or '?'})"
        state = "open" if r.get("open") else "closed"
        out.append(f"{r['job']:<32} {state:<7} {(r.get('verdict') or '-'):<9} {who}")
    return "\n".join(out) + "\n"


def render_nodes(doc: dict[str, Any]) -> str:
    """One line per node, most failures first (`nodehistory.ranking`)."""
    jobs, failures = doc["jobs"], doc["failures"]
    if not failures:
        return f"no {nodehistory.LABEL} failures in the last {jobs} job(s)\n"
    out = [f"{failures} {nodehistory.LABEL} failure(s) with an initiating node in the last {jobs} job(s)"]
    width = max(len(r["node"]) for r in doc["nodes"])
    for r in doc["nodes"]:
        rules = ", ".join(f"{rule} x{n}" for rule, n in r["rules"].items())
        out.append(
            f"{r['node']:<{width}}  initiated {r['initiated']} of the last {r['of']} "
            f"{nodehistory.LABEL} failures  ({rules})"
        )
    return "\n".join(out) + "\n"


def run(args: argparse.Namespace, redact: Redactor | None = None) -> int:
    redact = redact if redact is not None else Redactor()
    token = args.api_token or os.environ.get("DENPEX_API_TOKEN") or None
    timeout_s = getattr(args, "timeout", DEFAULT_TIMEOUT_S)
    nodes = getattr(args, "nodes", False)
    last = getattr(args, "last", nodehistory.DEFAULT_JOBS)
    if sum((bool(args.job), bool(args.jobs), bool(nodes))) != 1:
        print("denpexd query: choose one of --job ID, --jobs, --nodes", file=sys.stderr)
        return 2
    if not 1 <= last <= nodehistory.MAX_JOBS:
        print(f"denpexd query: --last must be between 1 and {nodehistory.MAX_JOBS}", file=sys.stderr)
        return 2
    if args.job and not wire.valid_id(args.job):
        print(f"denpexd query: invalid job id {args.job!r}", file=sys.stderr)
        return 2
    control = getattr(args, "control", None)
    if control is not None and (args.jobs or not args.job):
        print("denpexd query: --control goes with --job", file=sys.stderr)
        return 2
    if control is not None and not wire.valid_id(control):
        print(f"denpexd query: invalid --control job id {control!r}", file=sys.stderr)
        return 2
    if not timeout_s > 0:
        print("denpexd query: --timeout must be > 0", file=sys.stderr)
        return 2
    fmt = _format(args)
    if fmt is None:
        print("denpexd query: --json and --format text/markdown disagree; give one of them", file=sys.stderr)
        return 2
    if fmt == "markdown" and not args.job:
        print("denpexd query: --format markdown goes with --job", file=sys.stderr)
        return 2
    try:
        server = server_url(args.server or os.environ.get("DENPEX_SERVER") or DEFAULT_SERVER)
    except QueryError as exc:
        print(redact(f"denpexd query: {exc}"), file=sys.stderr)
        return 2
    try:
        if nodes:
            doc = asyncio.run(fetch(server, f"/api/v1/nodes?limit={last}", token, timeout_s))
            if fmt == "json":
                _dump(doc)
            else:
                sys.stdout.write(render_nodes(doc))
            return 0
        if args.jobs:
            doc = asyncio.run(fetch(server, "/api/v1/jobs", token, timeout_s))
            if fmt == "json":
                _dump(doc)
            else:
                sys.stdout.write(render_jobs(doc["jobs"]))
            return 0
        if control is not None:
            doc = asyncio.run(with_divergence(server, args.job, control, token, timeout_s))
        else:
            doc = asyncio.run(fetch(server, f"/api/v1/jobs/{args.job}", token, timeout_s))
    except QueryError as exc:
        print(redact(f"denpexd query: {exc}"), file=sys.stderr)
        return 1
    if fmt == "json":
        _dump(doc)
    elif fmt == "markdown":
        sys.stdout.write(render_markdown(doc))
    else:
        sys.stdout.write(render_text(doc))
    sys.stdout.flush()
    return 0


def _format(args: argparse.Namespace) -> str | None:
    """``--format``, with ``--json`` its older spelling of json; None when the two disagree."""
    fmt = getattr(args, "format", None)
    if args.json:
        return "json" if fmt in (None, "json") else None
    return fmt or "text"


def _dump(doc: Any) -> None:
    sys.stdout.buffer.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    sys.stdout.buffer.write(b"\n")
    sys.stdout.flush()
