"""`denpexd query`: ask a running `denpexd serve` over its HTTP API.

`--job ID` prints the same report as `denpexd diagnose` (`report.render_text`), `--json` the
DESIGN §7 document, `--jobs` the recent jobs with their verdicts and initiators.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

import aiohttp
import orjson

from denpex_agent import wire
from denpexd.errors import QueryError
from denpexd.report import render_text

DEFAULT_SERVER = "http://127.0.0.1:8080"


async def fetch(server: str, path: str, token: str | None, timeout_s: float = 10.0) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    url = server.rstrip("/") + path
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session,
            session.get(url, headers=headers) as resp,
        ):
            body = await resp.read()
            if resp.status == 401:
                raise QueryError(f"{url}: 401 unauthorized (pass --api-token or set DENPEX_API_TOKEN)")
            if resp.status == 404:
                raise QueryError(f"{url}: not found ({_message(body)})")
            if resp.status >= 400:
                raise QueryError(f"{url}: HTTP {resp.status} ({_message(body)})")
            return orjson.loads(body)
    except aiohttp.ClientConnectorError as exc:
        raise QueryError(
            f"cannot reach denpexd at {server} ({exc.os_error.strerror if exc.os_error else exc}): "
            "is `denpexd serve` running? (set --server or DENPEX_SERVER)"
        ) from exc
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise QueryError(f"{url}: {type(exc).__name__}: {exc}") from exc
    except orjson.JSONDecodeError as exc:
        raise QueryError(f"{url}: the answer is not JSON") from exc


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


def run(args: argparse.Namespace) -> int:
    server = args.server or os.environ.get("DENPEX_SERVER") or DEFAULT_SERVER
    token = args.api_token or os.environ.get("DENPEX_API_TOKEN") or None
    if not args.jobs and not args.job:
        print("denpexd query: choose --job ID or --jobs", file=sys.stderr)
        return 2
    if args.job and not wire.valid_id(args.job):
        print(f"denpexd query: invalid job id {args.job!r}", file=sys.stderr)
        return 2
    try:
        if args.jobs:
            doc = asyncio.run(fetch(server, "/api/v1/jobs", token))
            if args.json:
                _dump(doc)
            else:
                sys.stdout.write(render_jobs(doc["jobs"]))
            return 0
        doc = asyncio.run(fetch(server, f"/api/v1/jobs/{args.job}", token))
    except QueryError as exc:
        print(f"denpexd query: {exc}", file=sys.stderr)
        return 1
    if args.json:
        _dump(doc)
    else:
        sys.stdout.write(render_text(doc))
    sys.stdout.flush()
    return 0


def _dump(doc: Any) -> None:
    sys.stdout.buffer.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    sys.stdout.buffer.write(b"\n")
    sys.stdout.flush()
