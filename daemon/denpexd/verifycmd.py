"""`denpexd verify`: is a failure's signature gone from a run repeated after a targeted change?

Each side is a diagnosis: of log files read as `denpexd diagnose` reads them (NEW as PATHs, OLD
as `--against-dir`), or of a job stored by a running `denpexd serve` (NEW as `--job`, OLD as
`--against`), fetched over its HTTP API as `denpexd query` does. `verify.py` compares them.

Exit codes: 0 verified, 1 not verified, 2 nothing to verify or nothing to compare with (OLD is
healthy, a missing path or unknown job, no log files, an unreachable daemon, bad arguments).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import orjson

from denpex_agent import wire
from denpex_agent.errors import LayoutError, RuleError
from denpex_agent.reader import NoLogFiles
from denpex_agent.redact import Redactor
from denpex_agent.rules import RuleSet, load_rules
from denpexd.diagnosecmd import diagnose_paths
from denpexd.errors import QueryError
from denpexd.querycmd import DEFAULT_SERVER, fetch, server_url
from denpexd.verify import NothingToVerify, render_text, verify

EXIT_VERIFIED = 0
EXIT_NOT_VERIFIED = 1
EXIT_CANNOT = 2


class _Cannot(Exception):
    """Nothing to compare: the message says why (exit 2)."""


def run(args: argparse.Namespace, redact: Redactor | None = None) -> int:
    redact = redact if redact is not None else Redactor()
    try:
        new, old = _diagnoses(args)
        result = verify(new, old)
    except (_Cannot, NothingToVerify, QueryError) as exc:
        print(redact(f"denpexd verify: {exc}"), file=sys.stderr)
        return EXIT_CANNOT
    if args.format == "json":
        sys.stdout.buffer.write(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
        sys.stdout.buffer.write(b"\n")
    else:
        sys.stdout.write(render_text(result))
    sys.stdout.flush()
    return EXIT_VERIFIED if result["verified"] else EXIT_NOT_VERIFIED


def _diagnoses(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """NEW's and OLD's diagnoses, each from its log files or from the daemon."""
    _check_sides(args)
    stored = [job for job in (args.job, args.against) if job]
    fetched = _fetch(args, stored) if stored else {}
    rules = _rules(args) if args.paths or args.against_dir else None
    new = fetched[args.job] if args.job else _read(args.paths, args, rules)
    old = fetched[args.against] if args.against else _read(args.against_dir, args, rules)
    return new, old


def _check_sides(args: argparse.Namespace) -> None:
    if bool(args.paths) == bool(args.job):
        raise _Cannot("give NEW as log PATHs or as --job ID (one of them)")
    if bool(args.against_dir) == bool(args.against):
        raise _Cannot("give OLD as --against-dir PATH or as --against ID (one of them)")
    for job in (args.job, args.against):
        if job and not wire.valid_id(job):
            raise _Cannot(f"invalid job id {job!r}")
    missing = [p for p in [*(args.paths or []), *(args.against_dir or [])] if not Path(p).exists()]
    if missing:
        raise _Cannot(f"no such file or directory: {', '.join(missing)}")
    if not args.timeout > 0:
        raise _Cannot("--timeout must be > 0")


def _rules(args: argparse.Namespace) -> RuleSet:
    try:
        return load_rules(args.rules) if args.rules else load_rules()
    except RuleError as exc:
        raise _Cannot(f"invalid rules: {exc}") from exc


def _read(paths: list[str], args: argparse.Namespace, rules: RuleSet | None) -> dict[str, Any]:
    try:
        return diagnose_paths(paths, rules=rules, layout=args.layout)
    except (LayoutError, NoLogFiles) as exc:
        raise _Cannot(str(exc)) from exc


def _fetch(args: argparse.Namespace, jobs: list[str]) -> dict[str, dict[str, Any]]:
    """The stored diagnoses of ``jobs``, from the daemon at --server (as `denpexd query` asks)."""
    server = server_url(args.server or os.environ.get("DENPEX_SERVER") or DEFAULT_SERVER)
    token = args.api_token or os.environ.get("DENPEX_API_TOKEN") or None

    async def both() -> list[Any]:
        return list(
            await asyncio.gather(*(fetch(server, f"/api/v1/jobs/{job}", token, args.timeout) for job in jobs))
        )

    return dict(zip(jobs, asyncio.run(both()), strict=True))
