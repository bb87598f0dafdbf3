"""Follow every file matching the agent's globs: appends, new files, rotation, truncation.

`Tailer.poll()` is synchronous and is run in a worker thread by the agent; it reads what is new
in every followed file (up to a budget), feeds it through that file's `LineScanner` and returns
events plus *marks* — the offset up to which a file's bytes are fully turned into events. A mark
is what the checkpoint may advance to once every event before it was acknowledged.

Files are keyed by identity (device, inode, hash of their first bytes), never by path:

* rename rotation: the old file keeps being read to its end (then closed after a grace period),
  the new file at the path is picked up by the next discovery;
* copytruncate: a size below the read position, or first bytes that changed, restart the file
  at offset 0 under a new identity (the lines written after the copy are read, not lost);
* deletion: read to the end, then closed; a glob matching nothing, a directory, a dangling
  link or an unreadable file: one warning per path, counted, retried at the next discovery.

With ``watch=True`` the tailer learns of writes from inotify (`denpex_agent.watcher`): it watches
the directories of its files and of its globs' roots, and `poll()` looks only at the files an
event named, plus those inotify cannot vouch for (on a network filesystem, being drained after a
rotation, holding an unfinished line or record, owing a progress tip). `wait()` blocks until an
event or a deadline; `due_in()` says when the next look is owed without any event.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from denpex_agent.attribution import Attribution, Layout, attribute_path
from denpex_agent.checkpoint import Checkpoints
from denpex_agent.events import Event, file_identity, identity_matches
from denpex_agent.matcher import Matcher
from denpex_agent.reader import HEAD_SAMPLE, is_log_name
from denpex_agent.scanner import TAIL_BYTES, LineScanner, Source
from denpex_agent.watcher import Changes, fstype, is_network_fs, open_watcher, parse_mounts, read_mounts

log = logging.getLogger(__name__)

HEAD_BYTES = 256
DRAIN_GRACE_S = 2.0
FOLD_IDLE_S = 0.3  # a traceback whose exception line was read is complete after this much quiet
# An unfinished line (or open record) begun this recently counts as unread in `behind`: the rest
# of it is on its way. Older ones (a progress bar redrawn with \r, a writer that stalled) do not.
HELD_FRESH_S = 1.0
FOLD_TIMEOUT_S = 5.0  # any open record (and an unfinished last line) is complete after this much


@dataclass(frozen=True, slots=True)
class Mark:
    identity: str
    path: str
    offset: int
    line_no: int
    sampling: tuple[int, int] | None = None  # the scanner's sampling state at offset (LineScanner)


@dataclass(slots=True)
class Followed:
    path: str
    fh: BinaryIO
    dev: int
    ino: int
    identity: str
    head_len: int
    scanner: LineScanner
    pos: int
    draining: bool = False
    last_growth: float = 0.0
    last_heartbeat: float = 0.0
    last_seen: tuple[int, int] = (-1, -1)
    head: bytes | None = None  # the first bytes (up to HEAD_BYTES) as read; None until checked
    flushed: int = 0  # 0: nothing closed since the last growth, 1: closed when idle, 2: forced
    lag: int = 0  # bytes written but not read, as of the last look
    held_since: float | None = None  # when the scanner began holding an unfinished line/record
    key: str = ""  # the resolved path, as inotify events name it
    watched: bool = False  # inotify reports its writes (its directory is watched, on a local fs)


@dataclass(slots=True)
class TailStats:
    files_opened: int = 0
    files_closed: int = 0
    rotations: int = 0
    truncations: int = 0
    bytes_read: int = 0
    lines_read: int = 0
    truncated_lines: int = 0
    warnings: dict[str, int] = field(default_factory=dict)


class Tailer:
    def __init__(
        self,
        globs: tuple[str, ...],
        matcher: Matcher,
        checkpoints: Checkpoints,
        *,
        job: str,
        node: str,
        agent: str,
        layout: Layout | None = None,
        context_lines: int = 100,
        max_line_bytes: int = 1 << 20,
        read_chunk: int = 1 << 20,
        progress_interval: float = 1.0,
        fold_timeout: float = FOLD_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
        watch: bool = False,
        mounts: Callable[[], str] = read_mounts,
    ) -> None:
        self.globs = globs
        self.matcher = matcher
        self.checkpoints = checkpoints
        self.job, self.node, self.agent = job, node, agent
        self.layout = layout
        self.context_lines = context_lines
        self.max_line_bytes = max_line_bytes
        self.read_chunk = read_chunk
        self.progress_interval = progress_interval
        self.fold_timeout = fold_timeout
        self.clock = clock
        self.files: list[Followed] = []
        self.scanning: str | None = None  # the file poll() is reading now (for slow-scan reports)
        self.stats = TailStats()
        self._now = 0.0  # the clock at the latest poll
        self._warned: set[tuple[str, str]] = set()
        # inotify (None: every poll looks at every file, as on platforms without it)
        self.watcher = open_watcher() if watch else None
        self._read_mounts = mounts
        self._mounts: list[tuple[str, str]] | None = None  # parsed once per discovery, when needed
        self._changed: set[str] = set()  # paths events named since the last poll
        self._look_all = True  # the next poll looks at every file (start, discovery, overflow)
        self.discover_wanted = False  # a name appeared, went or moved in a watched directory
        self.roots_watched = False  # every glob's directories are watched: new files are heard of
        self.polls = 0  # calls of poll()
        self.looks = 0  # files looked at (fstat) by those calls
        self.grew = False  # the latest poll read new bytes

    # -- warnings -------------------------------------------------------------------------------

    def _warn(self, path: str, reason: str, message: str) -> None:
        self.stats.warnings[reason] = self.stats.warnings.get(reason, 0) + 1
        if (path, reason) not in self._warned:
            self._warned.add((path, reason))
            log.warning("%s path=%s", message, path)

    # -- discovery ------------------------------------------------------------------------------

    def discover(self) -> None:
        """Open files that match the globs and are not followed yet; notice rotations."""
        self._mounts = None
        self.discover_wanted = False
        if self.watcher is not None:
            self._look_all = True  # a missed event costs at most one discovery interval
            self.roots_watched = self._watch_roots()
        for f in self.files:
            if f.draining:
                continue
            try:
                st = os.stat(f.path)
                moved = (st.st_dev, st.st_ino) != (f.dev, f.ino)
            except OSError:
                moved = True
            if moved:
                f.draining = True
                self.stats.rotations += 1
                log.info("file rotated or removed; reading it to its end path=%s", f.path)
        followed_ids = {(f.dev, f.ino) for f in self.files}
        followed_paths = {f.path for f in self.files if not f.draining}
        for pattern in self.globs:
            matches = sorted(glob.glob(pattern, recursive=True))
            if not matches:
                self._warn(pattern, "glob-empty", "no file matches the pattern (yet)")
                continue
            for path in matches:
                if path in followed_paths:
                    continue
                self._maybe_open(path, pattern, followed_ids)

    # -- inotify --------------------------------------------------------------------------------

    def _fstype(self, path: str) -> str:
        if self._mounts is None:
            self._mounts = parse_mounts(self._read_mounts())
        return fstype(path, self._mounts)

    def _watch_dir(self, directory: str) -> bool:
        """Watch a directory; False where inotify would not report its changes."""
        w = self.watcher
        if w is None:
            return False
        real = os.path.realpath(directory)
        if w.watching(real):
            return True
        if not os.path.isdir(real) or is_network_fs(self._fstype(real)):
            return False
        return w.add(real)

    def _watch_roots(self) -> bool:
        """Watch each glob's static root and the directories its directory part matches (new
        files, rotations and new sub-directories are heard of); True if all could be."""
        ok = True
        for pattern in self.globs:
            d = os.path.dirname(pattern) or "."
            dirs = {_static_prefix(pattern) or "."}
            if any(c in d for c in "*?["):
                dirs.update(glob.glob(d, recursive=True))
            else:
                dirs.add(d)
            for directory in dirs:
                ok = self._watch_dir(directory) and ok
        return ok

    @property
    def watching(self) -> bool:
        return self.watcher is not None

    @property
    def muted(self) -> bool:
        """inotify does not report writes now: the files are being written without pause and
        are looked at every poll interval (`poll`)."""
        return self.watcher is not None and self.watcher.muted

    def wake(self) -> None:
        """Interrupt `wait` (any thread)."""
        if self.watcher is not None:
            self.watcher.wake()

    def wait(self, timeout: float) -> bool:
        """Block until inotify reports a change (True), a `wake`, or ``timeout`` seconds."""
        if self.watcher is None:
            return False
        ch = self.watcher.wait(timeout)
        self._take(ch)
        return bool(ch)

    def _take(self, ch: Changes) -> None:
        if ch.overflow:  # the kernel dropped events: look at everything
            self._look_all = True
            self.discover_wanted = True
        if ch.structure:
            self.discover_wanted = True
        if ch.paths:
            self._changed |= ch.paths

    def due_in(self, poll_interval: float) -> float:
        """Seconds until a look is owed even if no event comes: ``poll_interval`` without
        inotify or for a file it cannot vouch for; else the next fold, flush or progress tip."""
        if self.watcher is None or self.watcher.muted:
            return poll_interval
        if self._look_all:  # writes were not reported for a while (see `poll`)
            return 0.0
        now = self.clock()
        due = float("inf")
        for f in self.files:
            if not f.watched or f.draining or f.lag:
                return poll_interval
            sc = f.scanner
            if sc.pending and f.flushed < 2:
                idle = now - f.last_growth
                limit = FOLD_IDLE_S if f.flushed < 1 and sc.open_record else self.fold_timeout
                due = min(due, limit - idle)
            tip = sc.progress_due_at()
            if tip is not None:
                due = min(due, max(tip, f.last_growth + poll_interval) - now)
        return max(due + 0.005, 0.0)

    def _skip(self, f: Followed, changed: set[str], now: float) -> bool:
        """Nothing can have happened to this file since the last look (inotify said nothing)."""
        if not f.watched or f.draining or f.lag or f.key in changed or f.scanner.pending:
            return False
        tip = f.scanner.progress_due_at()
        return tip is None or tip > now

    def _maybe_open(self, path: str, pattern: str, followed_ids: set[tuple[int, int]]) -> None:
        try:
            st = os.stat(path)
        except OSError as exc:
            self._warn(path, "stat-failed", f"cannot stat ({exc.strerror})")
            return
        if stat.S_ISDIR(st.st_mode):
            if is_log_name(os.path.basename(path)):
                self._warn(path, "not-a-file", "a directory where a log file was expected")
            return
        if not stat.S_ISREG(st.st_mode):
            self._warn(path, "not-a-file", "not a regular file; skipped")
            return
        if (st.st_dev, st.st_ino) in followed_ids:
            return  # a rotated name of a file already followed
        try:
            fh = open(path, "rb")  # noqa: SIM115 - kept open while followed
        except OSError as exc:
            self._warn(path, "open-failed", f"cannot open ({exc.strerror})")
            return
        try:
            self._follow(path, pattern, fh, st)
        except OSError as exc:
            fh.close()
            self._warn(path, "open-failed", f"cannot read ({exc.strerror})")
        followed_ids.add((st.st_dev, st.st_ino))

    def _follow(self, path: str, pattern: str, fh: BinaryIO, st: os.stat_result) -> None:
        def read_head(n: int) -> bytes:
            return os.pread(fh.fileno(), n, 0)

        start, line_no, identity = 0, 1, None
        sampling: tuple[int, int] | None = None
        for ident in list(self.checkpoints.positions):
            if identity_matches(ident, st.st_dev, st.st_ino, read_head):
                pos = self.checkpoints.positions[ident]
                if pos.offset <= st.st_size:
                    start, line_no, identity, sampling = pos.offset, pos.line_no, ident, pos.sampling
                else:
                    self._warn(
                        path,
                        "checkpoint-past-end",
                        f"checkpoint offset {pos.offset} is past the file's end ({st.st_size} bytes); "
                        "read again from its start",
                    )
                break
        head = read_head(HEAD_BYTES)
        known_head: bytes | None = None
        if identity is None:
            identity = file_identity(st.st_dev, st.st_ino, head)
            known_head = head
        scanner, sample = self._scanner(path, pattern, identity, start, line_no, sampling)
        if start > 0:
            before = os.pread(fh.fileno(), min(start, TAIL_BYTES), start - min(start, TAIL_BYTES))
            scanner.prime(before, sample)
        now = self.clock()
        key = os.path.realpath(path)
        watched = self._watch_dir(os.path.dirname(key))
        if self.watcher is not None and not watched:
            kind = self._fstype(key)
            log.info(
                "inotify cannot report this file's writes; polling it path=%s fstype=%s",
                path,
                kind or "unknown",
            )
        self.files.append(
            Followed(
                path,
                fh,
                st.st_dev,
                st.st_ino,
                identity,
                _head_len(identity),
                scanner,
                start,
                last_growth=now,
                head=known_head,
                key=key,
                watched=watched,
            )
        )
        self.stats.files_opened += 1
        log.info("following file path=%s offset=%d identity=%s", path, start, identity)

    def _attribution(self, path: str, pattern: str) -> Attribution:
        """Rank and local rank from the path (the lines' own tags are the scanner's business)."""
        base = _static_prefix(pattern)
        rel = os.path.relpath(path, base) if base else path
        who = self.layout.match(rel) if self.layout is not None else None
        if who is None:
            who = attribute_path(rel)
        return Attribution(node=self.node, rank=who.rank, local_rank=who.local_rank)

    def _scanner(
        self,
        path: str,
        pattern: str,
        identity: str,
        start: int,
        line_no: int,
        sampling: tuple[int, int] | None,
    ) -> tuple[LineScanner, bytes]:
        """The file's scanner, and its first bytes before ``start`` (to prime a resumed one)."""
        sample = b""
        if start > 0:
            with open(path, "rb") as fh:
                sample = fh.read(min(start, HEAD_SAMPLE))
        who = self._attribution(path, pattern)
        source = Source(
            job=self.job,
            agent=self.agent,
            node=self.node,
            rank=who.rank,
            local_rank=who.local_rank,
            file=path,
            identity=identity,
            default_year=time.gmtime(self.clock()).tm_year,
            ref_epoch=self.clock(),
        )
        return self._line_scanner(source, start, line_no, sampling), sample

    def _line_scanner(
        self, source: Source, start: int = 0, line_no: int = 1, sampling: tuple[int, int] | None = None
    ) -> LineScanner:
        return LineScanner(
            self.matcher,
            source,
            start_offset=start,
            start_line=line_no,
            sampling=sampling,
            context_lines=self.context_lines,
            progress_interval=self.progress_interval,
            clock=self.clock,
            max_line_bytes=self.max_line_bytes,
        )

    # -- reading --------------------------------------------------------------------------------

    def poll(self, budget: int) -> tuple[list[Event], list[Mark], bool]:
        """Read new bytes of every file, at most ``budget`` in all. Returns (events, marks, more)
        where ``more`` says some file still has unread bytes."""
        events: list[Event] = []
        marks: list[Mark] = []
        more = grew = False
        now = self._now = self.clock()
        self.polls += 1
        look_all = True
        changed: set[str] = set()
        w = self.watcher
        if w is not None:
            self._take(w.read_events())
            look_all, changed = self._look_all or w.muted, self._changed
            self._look_all, self._changed = False, set()
        for f in list(self.files):
            if not look_all and self._skip(f, changed, now):
                continue
            self.scanning = f.path
            f.scanner.matcher = self.matcher  # a reload swaps the matcher between polls
            if budget <= 0:
                more = True
                self._look_all |= look_all  # the files not reached are looked at next time
                self._changed |= changed
                break
            self.looks += 1
            try:
                fd = f.fh.fileno()
                st = os.fstat(fd)
                if self._truncated(f, st):
                    events.extend(f.scanner.finish())
                    self._restart(f)
                    st = os.fstat(fd)
                size = st.st_size
                got = 0
                while f.pos < size and budget > 0:
                    # exactly what the stat showed, in one system call: a whole chunk would
                    # allocate (and give back) a chunk-sized buffer for every small read
                    data = os.pread(fd, min(self.read_chunk, budget, size - f.pos), f.pos)
                    if not data:
                        break
                    f.pos += len(data)
                    got += len(data)
                    budget -= len(data)
                    events.extend(f.scanner.feed(data))
                    marks.append(self._mark(f))
                f.lag = max(size - f.pos, 0)
                if f.pos < size:
                    more = True
                if got:
                    grew = True
                    f.last_growth = now
                    f.flushed = 0
                    self.stats.bytes_read += got
                else:
                    events.extend(f.scanner.due_progress())
                    if f.scanner.pending:
                        self._close_records(f, now - f.last_growth, events, marks)
                if not f.scanner.pending:
                    f.held_since = None
                elif f.held_since is None:
                    f.held_since = now
            except OSError as exc:
                self._warn(f.path, "read-failed", f"read failed ({exc.strerror}); file closed")
                self._close(f, events, marks)
                continue
            if f.draining and f.pos >= size and now - f.last_growth > DRAIN_GRACE_S:
                self._close(f, events, marks)
        self.scanning = None
        if w is not None:
            if grew and self.grew and not w.muted:
                # written since each of the last two looks: while that goes on every file is
                # looked at every poll interval, and inotify's event per write(2) is only work
                self.discover_wanted |= not w.mute(True)
            elif not grew and w.muted:
                self.discover_wanted |= not w.mute(False)
                self._look_all = True  # a write made while muted raised no event: look again now
        self.grew = grew
        return events, marks, more

    def _close_records(self, f: Followed, idle: float, events: list[Event], marks: list[Mark]) -> None:
        """The file went quiet: records whose end was read are complete after FOLD_IDLE_S; any
        open record, and an unfinished last line, after ``fold_timeout`` (the writer died or
        stalled in the middle of it). Each step runs once per quiet spell."""
        if idle >= self.fold_timeout and f.flushed < 2:
            f.flushed = 2
            events.extend(f.scanner.flush(force=True))
        elif idle >= FOLD_IDLE_S and f.flushed < 1 and f.scanner.open_record:
            f.flushed = 1
            events.extend(f.scanner.flush())
        else:
            return
        marks.append(self._mark(f))

    @staticmethod
    def _mark(f: Followed) -> Mark:
        sc = f.scanner
        return Mark(f.identity, f.path, sc.offset, sc.line_no, sc.sampling)

    def _truncated(self, f: Followed, st: os.stat_result) -> bool:
        """Shrunk below the read position, or (copytruncate followed by fast regrowth, even to
        the same size) the first bytes are no longer the ones known. A file that was shorter
        than HEAD_BYTES when it was opened has its known first bytes completed as it grows."""
        if st.st_size < f.pos:
            return True
        seen = (st.st_size, st.st_mtime_ns)
        if seen == f.last_seen:
            return False
        f.last_seen = seen
        fd = f.fh.fileno()
        if f.head is None:  # resumed from a checkpoint: compare with the identity's hash once
            if f.head_len and not identity_matches(f.identity, f.dev, f.ino, lambda n: os.pread(fd, n, 0)):
                return True
            f.head = os.pread(fd, HEAD_BYTES, 0)
            return False
        head = os.pread(fd, HEAD_BYTES, 0)
        if head[: len(f.head)] != f.head:
            return True
        f.head = head
        return False

    def _restart(self, f: Followed) -> None:
        self.stats.truncations += 1
        head = os.pread(f.fh.fileno(), HEAD_BYTES, 0)
        f.identity = file_identity(f.dev, f.ino, head)
        f.head_len = len(head)
        f.head = head
        f.last_seen = (-1, -1)
        f.scanner = self._line_scanner(dataclasses.replace(f.scanner.source, identity=f.identity))
        f.pos = 0
        log.info("file truncated; reading it again from the start path=%s identity=%s", f.path, f.identity)

    def _close(self, f: Followed, events: list[Event], marks: list[Mark]) -> None:
        events.extend(f.scanner.finish())
        marks.append(Mark(f.identity, f.path, f.pos, f.scanner.line_no, f.scanner.sampling))
        f.fh.close()
        self.files.remove(f)
        self.stats.files_closed += 1
        log.info("stopped following file path=%s offset=%d", f.path, f.pos)

    @property
    def behind(self) -> int:
        """Bytes written to the followed files and not read into events yet, as of each file's
        last look (no system call: the reader's own view, to tell the daemon it is catching up):
        the unread bytes, and an unfinished line or record begun less than HELD_FRESH_S ago (its
        end is on its way, and it may be an event older than what the daemon has)."""
        fresh = self._now - HELD_FRESH_S
        return sum(
            f.lag + (f.scanner.pending if f.held_since is not None and f.held_since > fresh else 0)
            for f in self.files
        )

    @staticmethod
    def file_lag(f: Followed) -> int:
        """Bytes written to a followed file that were not read yet (0 if it cannot be stat'ed)."""
        try:
            return max(os.fstat(f.fh.fileno()).st_size - f.pos, 0)
        except OSError:
            return 0

    def lag_bytes(self) -> int:
        return sum(self.file_lag(f) for f in self.files)

    def close(self) -> None:
        for f in self.files:
            f.fh.close()
        self.files.clear()
        if self.watcher is not None:
            self.watcher.close()


def _head_len(identity: str) -> int:
    """How many first bytes an identity was made from (see events.file_identity)."""
    try:
        return int(identity.split(":")[2])
    except (IndexError, ValueError):
        return 0


def _static_prefix(pattern: str) -> str:
    """The directory part of a glob before its first wildcard: the base for layouts."""
    parts = Path(pattern).parts
    out: list[str] = []
    for p in parts:
        if any(c in p for c in "*?["):
            break
        out.append(p)
    if len(out) == len(parts):
        out = out[:-1]
    return str(Path(*out)) if out else ""
