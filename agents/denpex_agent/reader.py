"""Post-mortem reading: find a job's log files, attribute them, scan them into events.

`discover()` walks the paths the user gave; `read_files()` streams every file through a
`LineScanner` in 1 MiB chunks and yields events. Memory stays bounded by the chunk, the context
window and the events themselves, never by the size of a file. Nothing that goes wrong with one
file (unreadable, vanished, binary, a directory where a file was) stops the others: it becomes a
warning that names the file, and is counted.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from denpex_agent.attribution import Attribution, Layout, attribute_path
from denpex_agent.errors import DenpexAgentError, LayoutError
from denpex_agent.events import Event, file_identity
from denpex_agent.matcher import Matcher
from denpex_agent.scanner import LineScanner, ScanStats, Source, heartbeat

log = logging.getLogger(__name__)

CHUNK = 1 << 20
HEAD_SAMPLE = 64 * 1024

_LOG_NAME = re.compile(r"(?i)(?:\.(?:log|txt|out|err)|^(?:stdout|stderr))(?:\.\d+)?$")
_ROTATED = re.compile(r"^(?P<base>.+?)\.(?P<n>\d+)$")


@dataclass(frozen=True, slots=True)
class LogFile:
    path: Path
    rel: str
    who: Attribution
    size: int
    mtime: float
    identity: str
    by_layout: bool = False  # attributed by the user's --layout (not the built-in layouts)


class NoLogFiles(DenpexAgentError):
    """Nothing to read under the given paths."""

    def __init__(self, paths: tuple[str, ...]) -> None:
        self.paths = paths
        super().__init__(f"no log files (*.log *.txt *.out *.err stdout stderr) found in {', '.join(paths)}")


@dataclass(slots=True)
class ReadReport:
    """What reading found besides events: counts and warnings, each naming its file."""

    files: int = 0
    bytes: int = 0
    lines: int = 0
    events: int = 0
    progress: int = 0
    truncated_lines: int = 0
    warnings: list[str] = field(default_factory=list)

    def warn(self, message: str) -> None:
        self.warnings.append(message)
        log.warning("%s", message)

    def add(self, part: ReadReport | ScanStats) -> None:
        """Count in what one file's scan (`ScanStats`) or one worker's report read, its warnings
        after ours."""
        self.bytes += part.bytes
        self.lines += part.lines
        self.events += part.events
        self.progress += part.progress
        self.truncated_lines += part.truncated_lines
        for w in part.warnings:
            self.warn(w)


def is_log_name(name: str) -> bool:
    return bool(_LOG_NAME.search(name))


def _rotation_key(rel: str) -> tuple[str, int]:
    """``rank3.log.2`` sorts before ``rank3.log.1`` before ``rank3.log`` (oldest first)."""
    m = _ROTATED.match(rel)
    if m and is_log_name(m.group("base").rsplit("/", 1)[-1]):
        return m.group("base"), -int(m.group("n"))
    return rel, 0


def discover(
    paths: Iterable[str | os.PathLike[str]], layout: Layout | None, report: ReadReport
) -> list[LogFile]:
    """Every log file under ``paths`` with its node/rank attribution, oldest rotation first.

    One directory is the job's: its subdirectories are the nodes. Several arguments are each
    placed under their own name (a directory's, or a file's parent directory's), so
    ``diagnose node1/ node2/`` reads the same paths as ``diagnose .`` in their parent and a
    ``--layout`` such as ``{node}/rank{rank}.log`` means the same in both.

    Raises `NoLogFiles` when nothing readable was found and `LayoutError` when a ``--layout``
    matches none of the files (rather than a silent fallback to the built-in layouts)."""
    given = [Path(p) for p in paths]
    several = len(given) > 1
    names: dict[str, Path] = {}
    found: list[LogFile] = []
    for root in given:
        try:
            st = root.stat()
        except OSError as exc:
            report.warn(f"{root}: cannot read: {exc.strerror or exc}")
            continue
        if stat.S_ISDIR(st.st_mode):
            prefix = _placed_name(root, names) + "/" if several else ""
            candidates: list[tuple[Path, str]] = []
            for dirpath, dirnames, filenames in os.walk(
                root, onerror=lambda e: report.warn(f"{e.filename}: cannot list: {e.strerror}")
            ):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                for d in dirnames:
                    if is_log_name(d):
                        report.warn(
                            f"{Path(dirpath) / d}: a directory with a log file's name; searched as a folder"
                        )
                # one Path and one relative name per folder, not per file (a job of thousands
                # of files spent more time in pathlib than in reading their heads)
                folder = Path(dirpath)
                rel_dir = folder.relative_to(root).as_posix()
                rel_prefix = prefix if rel_dir == "." else f"{prefix}{rel_dir}/"
                for name in sorted(filenames):
                    if is_log_name(name):
                        candidates.append((folder / name, rel_prefix + name))
            if not candidates:
                report.warn(f"{root}: no log files (*.log *.txt *.out *.err stdout stderr) found")
        elif several:
            candidates = [(root, f"{_placed_name(root.parent, names, allow_same=True)}/{root.name}")]
        else:
            candidates = [(root, root.name)]
        for path, rel in sorted(candidates, key=lambda pr: _rotation_key(pr[1])):
            lf = _describe(path, rel, layout, report)
            if lf is not None:
                found.append(lf)
    if not found:
        raise NoLogFiles(tuple(str(p) for p in given))
    if layout is not None and not any(lf.by_layout for lf in found):
        example = found[0].rel
        raise LayoutError(
            f"--layout {layout.template!r} matches none of the {len(found)} log file(s) found "
            f"(paths are matched relative to the directory given, e.g. {example!r})"
        )
    return found


def _placed_name(directory: Path, names: dict[str, Path], allow_same: bool = False) -> str:
    """The name a directory argument is placed under; two different directories may not share one."""
    real = directory.resolve()
    name = real.name or "root"
    other = names.setdefault(name, real)
    if other != real and not allow_same:
        raise LayoutError(
            f"two directories are both named {name!r} ({other} and {real}); "
            "give their common parent instead, or one directory at a time"
        )
    return name


def _describe(path: Path, rel: str, layout: Layout | None, report: ReadReport) -> LogFile | None:
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            report.warn(f"{path}: not a regular file; skipped")
            return None
        with path.open("rb") as fh:
            head = fh.read(HEAD_SAMPLE)
    except OSError as exc:
        report.warn(f"{path}: cannot read: {exc.strerror or exc}")
        return None
    who = layout.match(rel) if layout is not None else None
    by_layout = who is not None
    if layout is not None and who is None:
        report.warn(f"{path}: does not match --layout {layout.template!r}; using the built-in layouts")
    if who is None:
        who = attribute_path(rel)
    if b"\x00" in head:
        report.warn(f"{path}: holds binary data (NUL bytes); read as text")
    elif not head.isascii():  # ASCII is UTF-8: only other heads need decoding
        try:
            head.decode("utf-8")
        except UnicodeDecodeError as exc:
            if exc.start < len(head) - 4:  # not merely a character cut at the sample's end
                report.warn(
                    f"{path}: not valid UTF-8 (first bad byte at offset {exc.start}); read with replacement"
                )
    return LogFile(
        path=path,
        rel=rel,
        who=who,
        size=st.st_size,
        mtime=st.st_mtime,
        identity=file_identity(st.st_dev, st.st_ino, head[:1024]),
        by_layout=by_layout,
    )


def scanner_for(
    lf: LogFile,
    matcher: Matcher,
    job: str,
    agent: str,
    context_lines: int,
    wants_context: Callable[[str, dict[str, Any]], bool] | None = None,
) -> LineScanner:
    year = time.gmtime(lf.mtime).tm_year
    source = Source(
        job=job,
        agent=agent,
        node=lf.who.node,
        rank=lf.who.rank,
        local_rank=lf.who.local_rank,
        file=str(lf.path),
        identity=lf.identity,
        default_year=year,
        ref_epoch=lf.mtime,
    )
    return LineScanner(matcher, source, context_lines=context_lines, wants_context=wants_context)


def log_end(scanner: LineScanner, identity: str) -> Event | None:
    """A read file's last word on time, as the agent's heartbeats say it of a followed file: its
    newest timestamp (the event's ``ts``) and, when it logged steps, ``quiet_since`` (from when it
    logged none). None when the file has no timestamp."""
    last = scanner.last_ts()
    if last is None:
        return None
    quiet = scanner.quiet_since()
    fields: dict[str, Any] = {} if quiet is None else {"quiet_since": quiet}
    return heartbeat(scanner.source, identity, scanner.offset, scanner.offset, scanner.line_no, last, fields)


def read_files(
    files: Iterable[LogFile],
    matcher: Matcher,
    job: str,
    report: ReadReport,
    *,
    agent: str = "diagnose",
    context_lines: int = 100,
    on_bytes: Callable[[int], None] | None = None,
    wants_context: Callable[[str, dict[str, Any]], bool] | None = None,
) -> Iterator[Event]:
    """Stream events out of every file; a failing file is a warning, never the end of the read.
    ``wants_context(role, fields)`` chooses the match events that carry context (default: all)."""
    for lf in files:
        scanner = scanner_for(lf, matcher, job, agent, context_lines, wants_context)
        report.files += 1
        try:
            with lf.path.open("rb") as fh:
                while True:
                    chunk = fh.read(CHUNK)
                    if not chunk:
                        break
                    if on_bytes is not None:
                        on_bytes(len(chunk))
                    yield from scanner.feed(chunk)
        except OSError as exc:
            report.warn(f"{lf.path}: read failed at offset {scanner.offset}: {exc.strerror or exc}")
        yield from scanner.finish()
        end = log_end(scanner, lf.identity)
        if end is not None:
            yield end
        st = scanner.stats
        report.add(st)
        if st.replaced_chars:
            report.warn(f"{lf.path}: {st.replaced_chars} undecodable byte(s) in matched lines replaced")
