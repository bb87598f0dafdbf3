"""`denpexd diagnose PATH...`: the reader and the engine in one process, no broker; the diagnosis
printed as text, JSON or Markdown, and drawn as an HTML page with `--html`."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import orjson

from denpex_agent.attribution import Layout
from denpex_agent.errors import LayoutError, RuleError
from denpex_agent.heap import keep_freed_memory
from denpex_agent.matcher import Matcher
from denpex_agent.reader import LogFile, NoLogFiles, ReadReport, discover, read_files
from denpex_agent.rules import RuleSet, load_rules
from denpexd import parallelread
from denpexd.engine import Engine, keeps_context
from denpexd.errors import DenpexdError

PROGRESS_MIN_BYTES = 64 << 20


class ControlError(DenpexdError):
    """The control run given with ``--control`` cannot be read (a usage error)."""


def diagnose_paths(
    paths: list[str],
    *,
    job: str | None = None,
    rules: RuleSet | None = None,
    layout: str | None = None,
    context_lines: int = 100,
    progress: TextIO | None = None,
    progress_min_bytes: int = PROGRESS_MIN_BYTES,
    control: list[str] | None = None,
    jobs: int = 1,
    start_method: str = parallelread.START_METHOD,
) -> dict[str, Any]:
    """Read, match and correlate; return the diagnosis (docs/diagnosis-json.md) (plus `read` statistics,
    and `divergence` from the ``control`` run's paths when given). ``jobs`` > 1 reads the files in
    that many worker processes (`parallelread`); the diagnosis is the same."""
    rules = rules if rules is not None else load_rules()
    lay = Layout(layout) if layout else None
    control_files = discover_control(control) if control else None
    report = ReadReport()
    files = discover(paths, lay, report)
    job_id = job or default_job_id(paths)
    engine = Engine(job_id, rules)
    total = sum(f.size for f in files)
    bar = _Bar(progress, total) if progress is not None and total >= progress_min_bytes else None
    on_bytes = bar.advance if bar else None
    timeouts: dict[str, int] = {}
    if jobs > 1 and len(parallelread.plan_tasks(files, jobs)) > 1:
        events = parallelread.read_parallel(
            files,
            rules,
            job_id,
            report,
            timeouts,
            jobs=jobs,
            context_lines=context_lines,
            on_bytes=on_bytes,
            start_method=start_method,
        )
    else:
        matcher = Matcher(rules, release_gil=False)
        timeouts = matcher.timeouts
        events = read_files(
            files,
            matcher,
            job_id,
            report,
            context_lines=context_lines,
            on_bytes=on_bytes,
            wants_context=keeps_context,
        )
    for ev in events:
        engine.add(ev)
    if bar:
        bar.close()
    for rule_id, n in sorted(timeouts.items()):
        report.warn(f"rule {rule_id}: a pattern timed out on {n} line(s) (taken as no match)")
    result = engine.diagnose()
    result["read"] = {
        "files": report.files,
        "bytes": report.bytes,
        "lines": report.lines,
        "events": report.events,
        "progress_samples": report.progress,
        "truncated_lines": report.truncated_lines,
        "warnings": report.warnings,
    }
    if control_files is not None:
        result["divergence"] = compare_with_control(files, control_files, result["clock"])
    return result


def discover_control(paths: list[str]) -> list[LogFile]:
    """The control run's log files, found as `diagnose` finds a job's (its node names come from the
    built-in layouts). Raises `ControlError` when there are none."""
    missing = [p for p in paths if not Path(p).exists()]
    if missing:
        raise ControlError(f"--control: no such file or directory: {', '.join(missing)}")
    try:
        return discover(paths, None, ReadReport())
    except (NoLogFiles, LayoutError) as exc:
        raise ControlError(f"--control: {exc}") from exc


def compare_with_control(
    files: list[LogFile], control_files: list[LogFile], clock: dict[str, Any]
) -> dict[str, Any]:
    """The diagnosis's `divergence`: the failed run's files against the control's."""
    from denpexd import divergence  # only with --control: its import is a fifth of diagnose's start

    control = divergence.read_control(
        divergence.file_sources(control_files), {lf.who.node for lf in control_files}
    )
    failed_nodes = {lf.who.node for lf in files}
    return divergence.divergence(divergence.file_sources(files), failed_nodes, control, clock)


def default_job_id(paths: list[str]) -> str:
    """The directory's name; for several paths, the name of the directory that holds them all."""
    resolved = [Path(p).resolve() for p in paths]
    if len(resolved) == 1:
        return resolved[0].name or "job"
    common = Path(os.path.commonpath(resolved))
    if common in resolved and common.is_file():
        common = common.parent
    return common.name or "job"


class _Bar:
    """A one-line progress bar on a terminal's stderr, redrawn at most 10 times a second."""

    def __init__(self, out: TextIO, total: int) -> None:
        self.out, self.total, self.done, self._last = out, total, 0, 0.0
        self._t0 = time.monotonic()

    def advance(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self._last < 0.1 and self.done < self.total:
            return
        self._last = now
        frac = self.done / self.total if self.total else 1.0
        rate = self.done / max(now - self._t0, 1e-6) / 1e6
        filled = int(frac * 30)
        self.out.write(f"\rreading [{'#' * filled}{'.' * (30 - filled)}] {frac:6.1%} {rate:7.1f} MB/s")
        self.out.flush()

    def close(self) -> None:
        self.out.write("\r" + " " * 64 + "\r")
        self.out.flush()


def run(args: argparse.Namespace) -> int:
    missing = [p for p in args.paths if not Path(p).exists()]
    if missing:
        print(f"denpexd diagnose: no such file or directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    jobs = getattr(args, "jobs", None)
    jobs = parallelread.default_jobs() if jobs is None else jobs
    if jobs < 1:
        print("denpexd diagnose: -j/--jobs must be >= 1", file=sys.stderr)
        return 2
    if args.context_lines < 0:
        print("denpexd diagnose: --context-lines must be >= 0", file=sys.stderr)
        return 2
    html_path = getattr(args, "html", None)
    if html_path is not None and not _writable_target(Path(html_path)):
        print(
            f"denpexd diagnose: --html {html_path}: cannot write there (no such directory, or a directory)",
            file=sys.stderr,
        )
        return 2
    try:
        rules = load_rules(args.rules) if args.rules else load_rules()
    except RuleError as exc:
        print(f"denpexd diagnose: invalid rules: {exc}", file=sys.stderr)
        return 2
    show_bar = args.progress == "always" or (args.progress == "auto" and sys.stderr.isatty())
    keep_freed_memory()  # before the read: the workers, forked, inherit it
    try:
        result = diagnose_paths(
            args.paths,
            job=args.job,
            rules=rules,
            layout=args.layout,
            context_lines=args.context_lines,
            progress=sys.stderr if show_bar else None,
            progress_min_bytes=0 if args.progress == "always" else PROGRESS_MIN_BYTES,
            control=args.control,
            jobs=jobs,
        )
    except (LayoutError, NoLogFiles, ControlError) as exc:
        print(f"denpexd diagnose: {exc}", file=sys.stderr)
        return 2
    # the renderers are imported when one is used: together they are a third of the start
    if html_path is not None:
        from denpexd.htmlreport import render_html

        page = render_html(result).encode()
        try:
            Path(html_path).write_bytes(page)
        except OSError as exc:
            print(f"denpexd diagnose: --html {html_path}: {exc.strerror or exc}", file=sys.stderr)
            return 1
        print(f"denpexd diagnose: wrote {html_path} ({len(page) / 1024:.0f} KiB)", file=sys.stderr)
    if args.format == "json":
        sys.stdout.buffer.write(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
        sys.stdout.buffer.write(b"\n")
    elif args.format == "markdown":
        from denpexd.markdown import render_markdown

        sys.stdout.write(render_markdown(result))
    else:
        from denpexd.report import render_text

        sys.stdout.write(render_text(result))
    sys.stdout.flush()
    return 0


def _writable_target(path: Path) -> bool:
    """Whether ``path`` can be a file we write: not a directory, in a directory that exists."""
    parent = path.parent if str(path.parent) else Path(".")
    return not path.is_dir() and parent.is_dir() and os.access(parent, os.W_OK)
