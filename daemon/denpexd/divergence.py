"""The first divergence from a healthy run: where the failed run first logged something new.

A healthy run of the same job (the *control*) logged, line by line, everything a working run
says: start-up, progress, shutdown. Each of its lines is reduced to a template (`templates.py`:
numbers, ids, paths, times, hosts masked, rank prefixes and leading timestamps removed), and the
set of those templates is all that is kept. The failed run is then read line by line, and each
of its streams — a (node, rank), or a node's launcher — gets its first line whose template the
control never logged. Those first lines are put in aligned time (the line's timestamp, or the
nearest earlier one in its file, minus its node's clock offset from the diagnosis), and the
earliest is where the failed run first left the healthy path. It needs no rule: a message the
library has never heard of is found as well as a known one.

Lines without a rank (a launcher's) are compared only when the control has lines in files that
belong to no rank (a launcher's log, ``torchrun.log``): a control recorded without its launcher's
output says nothing about what a launcher logs.

Memory is the control's template set (one 64-bit hash per template, at most `MAX_TEMPLATES`;
more are counted, not kept, and said in a warning) and one line per stream of the failed run.
Lines are compared on their first `MAX_LINE` bytes.

`denpexd diagnose --control` compares whole files; `denpexd query --control` the lines a running
`serve` stored for two jobs: their events' lines and the context lines before them, the latter
only when the control job has context lines too (a healthy job's store may hold its progress
samples alone, and then says nothing about the lines around a failure).
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from denpex_agent.attribution import dominant_rank, has_prefix, line_rank
from denpex_agent.masking import mask
from denpex_agent.reader import HEAD_SAMPLE, LogFile
from denpex_agent.timestamps import format_iso, parse_timestamp
from denpexd.templates import PREFIX_HEAD, Templater

CHUNK = 1 << 20
MAX_LINE = 4096
MAX_TEMPLATES = 1_000_000
MAX_TEXT = 1000
TS_LOOKBACK = 64  # lines with a time of day kept per file for a line without a timestamp
TS_HEAD = 400  # bytes of a line in which a timestamp is looked for

_CLOCKISH = re.compile(rb"\d\d:\d\d:\d\d")

Line = tuple[int, bytes]  # (line number, the line without its newline)


@dataclass(slots=True)
class Source:
    """One file of a run: where it is, whose it is, and its lines."""

    node: str
    file: str
    rank: int | None  # the file's rank (its path, or the rank its tags name), if it has one
    local_rank: int | None
    year: int  # for timestamps without a year, as the reader takes them
    ref_epoch: float | None
    lines: Callable[[list[str]], Iterable[Line]]  # given a list for warnings


@dataclass(slots=True)
class Control:
    """What the control run logged: the hashes of its templates, and how much was read."""

    hashes: set[int] = field(default_factory=set)
    files: int = 0
    lines: int = 0
    launcher_lines: int = 0
    not_kept: int = 0
    warnings: list[str] = field(default_factory=list)

    def add(self, tpl: bytes) -> None:
        key = hash(tpl)
        if key in self.hashes:
            return
        if len(self.hashes) < MAX_TEMPLATES:
            self.hashes.add(key)
        else:
            self.not_kept += 1

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "files": self.files,
            "lines": self.lines,
            "templates": len(self.hashes),
            "launcher_lines": self.launcher_lines,
        }
        if self.not_kept:
            out["templates_not_kept"] = self.not_kept
        return out


@dataclass(slots=True)
class Divergent:
    """A stream's first line that the control never logged."""

    node: str
    rank: int | None
    ts: float | None  # the node's local time
    file: str
    line: int
    text: str
    order: int  # the file's place in the run


class _Ranks:
    """Whose a line is: a rank prefix beats the file's rank, which beats a rank the text names;
    a line that names only a local rank (``[default1]:``) takes the global rank the node's other
    lines or files gave that local rank."""

    def __init__(self, sources: Iterable[Source]) -> None:
        self.locals: dict[tuple[str, int], int] = {}
        for src in sources:
            if src.rank is not None and src.local_rank is not None:
                self.locals.setdefault((src.node, src.local_rank), src.rank)

    def of(self, src: Source, raw: bytes) -> int | None:
        head = raw[:PREFIX_HEAD].decode("utf-8", "replace")
        rank, local = line_rank(head)
        if rank is not None and local is not None:
            self.locals.setdefault((src.node, local), rank)
        if rank is not None and has_prefix(head):
            return rank
        if src.rank is not None:
            return src.rank
        if rank is not None:
            return rank
        local = local if local is not None else src.local_rank
        return None if local is None else self.locals.get((src.node, local))

    def learn(self, src: Source, raw: bytes) -> None:
        """Lines of a file without a rank of its own that pair a local rank with a global one."""
        if src.rank is None and b"[default" in raw[:200]:
            self.of(src, raw)


def read_control(sources: list[Source], nodes: Iterable[str]) -> Control:
    """The control's template set (see the module's description)."""
    control = Control()
    templater = Templater(nodes)
    for src in sources:
        control.files += 1
        for _line_no, raw in src.lines(control.warnings):
            control.lines += 1
            tpl = templater(raw)
            if tpl is not None:
                control.add(tpl)
                control.launcher_lines += src.rank is None and src.local_rank is None
    if control.not_kept:
        control.warnings.append(
            f"control: more than {MAX_TEMPLATES} distinct templates; those of {control.not_kept} line(s) "
            "were not kept (lines of the failed run with those templates count as new)"
        )
    return control


def first_divergences(
    sources: list[Source], control: Control, nodes: Iterable[str], warnings: list[str]
) -> list[Divergent]:
    """Each stream's first line whose template the control never logged: the first of each file,
    and of those (a rank's lines may be in several files: its own and a launcher's copy) the
    earliest by the node's clock, then in reading order."""
    templater = Templater(nodes)
    ranks = _Ranks(sources)
    firsts: dict[tuple[str, int | None], Divergent] = {}
    for order, src in enumerate(sources):
        done: set[int | None] = set()
        recent: deque[bytes] = deque(maxlen=TS_LOOKBACK)
        for line_no, raw in src.lines(warnings):
            ranks.learn(src, raw)
            tpl = templater(raw)
            if tpl is not None and hash(tpl) not in control.hashes:
                rank = ranks.of(src, raw)
                if rank not in done and (rank is not None or control.launcher_lines):
                    done.add(rank)
                    found = Divergent(
                        src.node, rank, _line_time(src, raw, recent), src.file, line_no, "", order
                    )
                    if _earlier(found, firsts.get((src.node, rank))):
                        found.text = _shown(raw)
                        firsts[src.node, rank] = found
            if _CLOCKISH.search(raw, 0, TS_HEAD):
                recent.append(raw[:TS_HEAD])
    return list(firsts.values())


def _earlier(new: Divergent, old: Divergent | None) -> bool:
    if old is None:
        return True
    if new.ts is None or old.ts is None:
        return old.ts is None and new.ts is not None
    return new.ts < old.ts


def _line_time(src: Source, raw: bytes, recent: deque[bytes]) -> float | None:
    """The line's own timestamp, else the nearest earlier line's (of the last `TS_LOOKBACK` with one)."""
    for candidate in (raw[:TS_HEAD], *reversed(recent)):
        ts = parse_timestamp(candidate.decode("utf-8", "replace"), src.year, src.ref_epoch)
        if ts is not None:
            return ts
    return None


def _shown(raw: bytes) -> str:
    text = raw[: MAX_TEXT * 4].decode("utf-8", "replace")
    return mask(text[:MAX_TEXT])


def in_aligned_time(firsts: list[Divergent], clock: dict[str, Any]) -> list[dict[str, Any]]:
    """The divergences as diagnosis entries, earliest aligned time first; lines without a time
    after those with one; ties in file order."""

    def aligned(d: Divergent) -> float | None:
        if d.ts is None:
            return None
        offset = (clock.get(d.node) or {}).get("offset_s", 0.0)
        return d.ts - float(offset)

    keyed = [(aligned(d), d) for d in firsts]
    keyed.sort(key=lambda td: (td[0] is None, td[0] or 0.0, td[1].order, td[1].line))
    return [
        {
            "node": d.node,
            "rank": d.rank,
            "time": None if t is None else format_iso(t),
            "local_time": None if d.ts is None else format_iso(d.ts),
            "file": d.file,
            "line": d.line,
            "text": d.text,
        }
        for t, d in keyed
    ]


def divergence(
    failed: list[Source], failed_nodes: Iterable[str], control: Control, clock: dict[str, Any]
) -> dict[str, Any]:
    """The diagnosis's ``divergence`` field (docs/diagnosis-json.md)."""
    warnings = list(control.warnings)
    per_rank = in_aligned_time(first_divergences(failed, control, failed_nodes, warnings), clock)
    return {
        "first": per_rank[0] if per_rank else None,
        "per_rank": per_rank,
        "control": control.summary(),
        "warnings": warnings,
    }


# Stored events as sources ----------------------------------------------------------------------


@dataclass(slots=True)
class _Stored:
    lines: dict[int, str] = field(default_factory=dict)
    ranks: set[int | None] = field(default_factory=set)
    locals: set[int | None] = field(default_factory=set)
    last_ts: float | None = None


def has_context(events: Iterable[dict[str, Any]]) -> bool:
    """Whether any of the events carries context lines (a job with matches; a healthy job's
    store often holds progress samples only)."""
    return any(ev.get("context") for ev in events)


def event_sources(events: Iterable[dict[str, Any]], *, context: bool = True) -> list[Source]:
    """The lines a running `serve` holds for a job, one source per (node, file): each event's
    own lines (a folded record's numbered on from its first) and, with ``context``, the context
    lines before them. A file whose events all name one rank has that rank."""
    files: dict[tuple[str, str], _Stored] = {}
    for ev in events:
        line_no, text = ev.get("line_no"), ev.get("text")
        if ev.get("kind") == "heartbeat" or not isinstance(line_no, int) or not isinstance(text, str):
            continue
        stored = files.setdefault((str(ev.get("node")), str(ev.get("file"))), _Stored())
        before = [c for c in ev.get("context") or [] if isinstance(c, str)] if context else []
        for n, line in enumerate([*before, *text.split("\n")], line_no - len(before)):
            stored.lines.setdefault(n, line)
        stored.ranks.add(_int(ev.get("rank")))
        stored.locals.add(_int(ev.get("local_rank")))
        ts = ev.get("ts")
        if isinstance(ts, int | float) and (stored.last_ts is None or ts > stored.last_ts):
            stored.last_ts = float(ts)
    return [_stored_source(node, file, stored) for (node, file), stored in sorted(files.items())]


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _stored_source(node: str, file: str, stored: _Stored) -> Source:
    lines = [(n, stored.lines[n].encode("utf-8", "surrogateescape")[:MAX_LINE]) for n in sorted(stored.lines)]
    return Source(
        node=node,
        file=file,
        rank=next(iter(stored.ranks)) if len(stored.ranks) == 1 else None,
        local_rank=next(iter(stored.locals)) if len(stored.locals) == 1 else None,
        year=time.gmtime(stored.last_ts).tm_year if stored.last_ts is not None else time.gmtime().tm_year,
        ref_epoch=stored.last_ts,
        lines=lambda _warnings: lines,
    )


# Log files as sources --------------------------------------------------------------------------


def file_sources(files: list[LogFile]) -> list[Source]:
    return [_file_source(lf) for lf in files]


def _file_source(lf: LogFile) -> Source:
    rank = lf.who.rank
    if rank is None:
        rank = dominant_rank(_head(lf.path))
    return Source(
        node=lf.who.node,
        file=str(lf.path),
        rank=rank,
        local_rank=lf.who.local_rank,
        year=time.gmtime(lf.mtime).tm_year,
        ref_epoch=lf.mtime,
        lines=lambda warnings: enumerate(read_lines(lf.path, warnings), 1),
    )


def _head(path: Path) -> bytes:
    try:
        with path.open("rb") as fh:
            return fh.read(HEAD_SAMPLE)
    except OSError:
        return b""


def read_lines(path: Path, warnings: list[str]) -> Iterator[bytes]:
    """The lines of a file without their line ends, each cut to `MAX_LINE` bytes; memory bounded
    by the read size however long a line is. A read error ends the file with a warning."""
    pending = b""
    skipping = False
    long_lines = 0
    try:
        with path.open("rb") as fh:
            while chunk := fh.read(CHUNK):
                if skipping:
                    nl = chunk.find(b"\n")
                    if nl < 0:
                        continue
                    chunk, skipping = chunk[nl + 1 :], False
                parts = (pending + chunk if pending else chunk).split(b"\n")
                pending = parts.pop()
                for part in parts:
                    if len(part) > MAX_LINE:
                        long_lines += 1
                    yield part[:MAX_LINE].rstrip(b"\r")
                if len(pending) > MAX_LINE:
                    long_lines += 1
                    yield pending[:MAX_LINE]
                    pending, skipping = b"", True
    except OSError as exc:
        warnings.append(f"{path}: read failed: {exc.strerror or exc}")
    if pending:
        yield pending.rstrip(b"\r")
    if long_lines:
        warnings.append(f"{path}: {long_lines} line(s) longer than {MAX_LINE} bytes compared on their start")
