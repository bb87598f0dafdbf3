"""Incremental scanner: bytes of one log file in, events out.

Both the post-mortem reader and the live tailer feed a file's bytes through one `LineScanner`,
chunk by chunk, so matching, folding, sampling, timestamps, attribution and masking exist once,
and the events depend on the bytes alone, never on how they were cut into reads.

Per chunk: one multi-pattern scan over the complete lines (`Matcher.scan`), then work only on
the lines that matched. A Python traceback is folded into one event classified by its final
exception line; torchrun's ChildFailedError block is folded and its root-cause entry read, and a
stall report that lists ranks (Horovod's stall inspector) with its listing, read for the ranks it
says are missing (`missing_ranks`, and `culprit_rank` when there is one). A
record whose end has not arrived yet stays open across reads; `flush()` closes it when the file
goes quiet (`idle`: a traceback whose exception line was read; `force`: anything, after a longer
fold timeout or when the file is closed).

Progress (step) lines are *sampled* by a rule of the bytes alone: a file's first `dense` step
lines, then the first step line that starts in each `stride`-byte bucket of the file not
sampled yet. Live and post-mortem reading therefore give the clock estimator the very same
samples (the state, `sampling`, is checkpointed with the read position). Besides samples, the newest step line of what was read goes out as a *tip*
(``fields["tip"]``): at `finish()` (the file's last one) and, live, at most every
`progress_interval` seconds; tips tell how far a rank got, they are not clock samples.
"""

from __future__ import annotations

import bisect
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from denpex_agent.attribution import (
    FILE_RANK_TAG,
    line_rank_prefixed,
    stream_key,
    strip_prefix,
)
from denpex_agent.events import Event, event_id
from denpex_agent.masking import mask, mask_lines
from denpex_agent.matcher import Hit, Matcher, line_bounds
from denpex_agent.rules import SEVERITIES
from denpex_agent.timestamps import parse_timestamp

TAIL_BYTES = 128 * 1024
MAX_CONTEXT_LINE = 1000
MAX_EVENT_TEXT = 16 * 1024
MAX_FOLD_LINES = 400
MAX_CARRY = 512 * 1024
TRUNCATED_MARKER = b" [denpex: line truncated]"
TS_LOOKBACK_LINES = 64
QUIET_WINDOW = 64 * 1024  # the processed bytes `quiet_since` looks at (the newest ones)
RANK_MAP_WINDOW = 1024  # bytes before `global_ranks=[...]` to look for its `local_ranks=[...]`
NEIGHBOUR_LINES = 20  # lines before an unprefixed record that may lend it their rank
HEAD_BYTES = 64 * 1024  # `[rankN]` tags in a file's first bytes tell whose file it is
DOMINANT_SHARE = 0.9
# a file's first step lines are all samples (a short job has few; the trends and the slow-rank
# test need a history) ...
DENSE_SAMPLES = 256
STRIDE = 1 << 18  # ... then the first one of each 256 KiB of the file

# How far `_process` may go when a record's end has not arrived: MORE (more bytes will come),
# IDLE (the file went quiet: close records whose last line was read), FINAL (close everything).
MORE, IDLE, FINAL = 0, 1, 2

_CHAIN = ("During handling of the above exception", "The above exception was the direct cause")
_CPP_FRAME = re.compile(r"\s*(?:frame #\d+: |Exception raised from \S.* \(most recent call first\):)")
# How a traceback's exception line starts: the exception's (dotted) class name, then ": message" or nothing.
# Any other unindented line after the frames (a log line, another program's output) means the traceback was
# cut off before its exception line.
_EXCEPTION_LINE = re.compile(r"[A-Za-z_][\w.]*(?::|\s*$)")
# A traceback read without its header (`Traceback (most recent call last):` cut off) is one only
# if its frames end in a line that names an exception class by the name such classes have.
_NAMED_EXCEPTION = re.compile(r"(?:[A-Za-z_][\w]*\.)*\w*(?:Error|Exception|Interrupt|Exit)(?::|\s*$)")
_TRACEBACK_HEADER = "Traceback (most recent call last)"
_ERROR = SEVERITIES.index("error")
_EL_RANK = re.compile(r"^\s*rank\s*:\s*(?P<rank>\d+)\s*\(local_rank:\s*(?P<local>\d+)\)")
_EL_EXIT = re.compile(r"^\s*exitcode\s*:\s*(?P<code>-?\d+)")
_EL_SIGNAL = re.compile(r"Signal\s+(?P<sig>\d+)\s+\((?P<name>SIG[A-Z0-9]+)\)")
_RANK_LIST = re.compile(rb"\b(local|global)_ranks=\[([\d, ]{0,4096})\]")
_RANK_TAG = re.compile(r"\[(?i:rank):? ?\d{1,6}\]")
_EL_HOST = re.compile(r"^\s*host\s*:\s*(?P<host>\S+)")
_EL_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):")
# the lines of a summary's entry: indented fields, the entry's `[N]:`, rules of `-` or `=`
_EL_ENTRY = re.compile(r"\s|\[\d+\]:|-{10}|={10}")
# NCCL's debug prefix, ``host:pid:tid [cudaDev]``, and the INFO lines in which a process states its
# rank in a communicator: ``comm 0x... rank R nranks N ... - Init COMPLETE`` (and ``Destroy``/``Abort``),
# and its links, ``Ring 00 : A[a] -> B[b] via ...`` / ``Channel 00/0 : A[a] -> B[b] [send|receive] via``
# (the printing process is A, or B on the receiving side)
_NCCL_HEAD = r"(?P<host>[A-Za-z0-9][\w.-]{0,62}):(?P<pid>\d{1,9}):\d{1,9} \[(?P<dev>\d{1,3})\] "
_NCCL_PREFIX = re.compile(r"(?:^|\s)" + _NCCL_HEAD)
_NCCL_RANK_LINE = re.compile(
    _NCCL_HEAD.encode() + rb"NCCL INFO (?:"
    rb"(?:Ring|Channel) \d{1,3}(?:/\d{1,3})? ?: +(?P<a>\d{1,6})(?:\[[0-9a-fA-F]{1,16}\])? -> "
    rb"(?P<b>\d{1,6})(?:\[[0-9a-fA-F]{1,16}\])?(?: \[(?P<dir>send|receive)\])? +via "
    rb"|(?:\w{1,40} )?comm 0x[0-9a-fA-F]{1,16} rank (?P<rank>\d{1,6}) n[Rr]anks (?P<nranks>\d{1,6}) )"
)
# A stall report that lists ranks (Horovod's stall inspector): `[ready ranks: 3, 0, 1]` / `[missing ranks: 2]`
# after each stalled op, or a `Stalled ranks:` heading and one `N: [ops]` line per missing rank (`N!:` when that
# rank is about to be shut down)
_RANK_LIST_TAG = re.compile(r"\[(?P<kind>ready|missing) ranks: ?(?P<ranks>\d{1,6}(?:, ?\d{1,6}){0,4095})\]")
_STALL_HEADING = re.compile(
    r"\bStalled (?:ranks|ops):|\bOne or more rank \(marked by \"!\"\) is stalled|which will cause deadlock\.\s*$"
)
_STALL_RANK_ENTRY = re.compile(r"^(?:\[[^\]\s]{1,80}\]<std(?:out|err)>:)?\s{0,6}(?P<rank>\d{1,6})!?: \[")
MAX_LISTED_RANKS = 64  # of the missing ranks a stall report names, those kept in the event's fields
# Open MPI's exit report after its heading: the process (`[[J,1],R]`: rank R of the primary job; PRRTE's
# `[prterun-host-pid@1,R]`) and its exit code, between blank lines, the heading's continuation and a rule
_MPI_PROCESS = re.compile(r"^\s*Process name:\s*\[(?:\[\d+,1\],|prterun-\S+@1,)(?P<rank>\d{1,6})\]")
_MPI_EXIT = re.compile(r"^\s*Exit code:\s*(?P<code>-?\d+)")
_MPI_BLOCK_LINE = re.compile(
    r"^\s*(?:$|the job to be terminated\b|The first process to do so was\b|Process name:|Exit code:|-{10,}\s*$)"
)
MPI_BLOCK_LINES = 8
# torch.multiprocessing.spawn's report of a worker's exception (in the parent's
# ProcessRaisedException): the worker's process index, right before its traceback; mp.spawn's
# index is the worker's local rank (detectron2, fairseq and most spawn launchers)
_SPAWN_HEADER = re.compile(r"^-- Process (?P<index>\d{1,6}) terminated with the following error:\s*$")
_FIELD_FOLDS = frozenset({"elastic-failure", "stalled-ranks", "mpi-exit-notice"})  # blocks that add fields


@dataclass(slots=True)
class ScanStats:
    bytes: int = 0
    lines: int = 0
    events: int = 0
    progress: int = 0
    truncated_lines: int = 0
    replaced_chars: int = 0
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Source:
    """Where the bytes come from and who wrote them (from the path)."""

    job: str
    agent: str
    node: str
    rank: int | None
    local_rank: int | None
    file: str
    identity: str
    default_year: int
    ref_epoch: float | None = None


def heartbeat(
    src: Source,
    identity: str,
    stamp: int,
    offset: int,
    line_no: int,
    ts: float | None,
    fields: dict[str, Any],
) -> Event:
    """A heartbeat of one file (`src`, whose ``identity`` may have grown with its first bytes
    since): how far it was read (``offset``, ``line_no``) and its newest time (``ts``);
    ``stamp`` tells one beat of the file from another in its id."""
    return Event(
        id=event_id(src.agent, identity, stamp, "heartbeat"),
        kind="heartbeat",
        job=src.job,
        node=src.node,
        rank=src.rank,
        local_rank=src.local_rank,
        file=src.file,
        offset=offset,
        line_no=line_no,
        ts=ts,
        ts_source="line" if ts is not None else "none",
        fields=fields,
    )


@dataclass(slots=True)
class _NcclProcess:
    """What one NCCL process's INFO lines said of its rank so far: the largest communicator's size
    and the ranks stated in it, the ranks of its links, and the decisions they gave, (file offset,
    rank or None when the evidence disagrees), in file order."""

    size: int = 0
    stated: set[int] = field(default_factory=set)
    linked: set[int] = field(default_factory=set)
    history: list[tuple[int, int | None]] = field(default_factory=list)


@dataclass
class _NcclHost:
    """What the NCCL processes of one host that stated their rank in the largest communicator
    said of it against their device (``host:pid:tid [dev]``): rank - dev, per process, and the
    decisions that gave, (file offset, the one offset every such process agrees on or None), in
    file order. Ranks are usually laid out node by node, a process per device, so a process
    that never stated its rank is ``dev + offset`` when two or more of its host agree on one."""

    size: int = 0
    offsets: dict[int, int | None] = field(default_factory=dict)  # pid -> rank - dev (None: several)
    history: list[tuple[int, int | None]] = field(default_factory=list)

    def decided(self) -> int | None:
        values = set(self.offsets.values())
        return next(iter(values)) if len(self.offsets) >= 2 and len(values) == 1 else None


class LineScanner:
    """Turns a file's bytes, fed in order, into match and progress events."""

    def __init__(
        self,
        matcher: Matcher,
        source: Source,
        *,
        start_offset: int = 0,
        start_line: int = 1,
        context_lines: int = 100,
        dense: int = DENSE_SAMPLES,
        stride: int = STRIDE,
        sampling: tuple[int, int] | None = None,
        progress_interval: float = 0.0,
        clock: Callable[[], float] | None = None,
        max_line_bytes: int = 1 << 20,
        wants_context: Callable[[str, dict[str, Any]], bool] | None = None,
    ) -> None:
        self.matcher = matcher
        # which match events carry their context lines, by (role, fields); None: all of them.
        # `diagnose` asks only for the context its engine keeps (building it is most of the
        # cost of a match event); the agent sends it all.
        self.wants_context = wants_context
        self.source = source
        self.context_lines = context_lines
        self.stride = stride
        self.max_line_bytes = max_line_bytes
        self.stats = ScanStats()
        self._buf = b""
        self._base = start_offset  # file offset of self._buf[0]
        self._line_no = start_line  # line number of self._buf[0]
        self._segments: deque[bytes] = deque()  # processed bytes just before self._buf (context)
        self._segments_len = 0
        self._last_ts: float | None = None
        self._ts_stale = False  # new bytes since _last_ts was computed
        self._skip_long = False
        self._continued = False  # the last line was closed without its newline (see flush)
        # `[rankN]` tags in the file's first HEAD_BYTES (only for a file whose path names no rank):
        # their offsets, and the dominant rank after the first k of them, for `_rank_of`
        self._track_tags = source.rank is None
        self._tag_offsets: list[int] = []
        self._tag_counts: dict[int, int] = {}
        self._tag_best: int | None = None  # the most counted rank so far (the lowest among equals)
        self._dominant: list[int | None] = [None]
        # torchrun's rendezvous results seen so far: (file offset, local rank -> global rank)
        self._rank_maps: list[tuple[int, dict[int, int]]] = []
        self._local_ranks: tuple[int, list[int]] | None = None  # the latest `local_ranks=[...]`
        self._rank_map_seen = 0  # file offset up to which lines were looked at for them
        # NCCL processes' ranks, from their own INFO lines, by (host, pid)
        self._nccl_seen = 0
        self._nccl_ranks: dict[tuple[str, int], _NcclProcess] = {}
        self._nccl_hosts: dict[str, _NcclHost] = {}
        # sampling state: dense samples still to take, and the newest bucket that gave a sample
        self.dense_left, self.sampled_bucket = sampling if sampling is not None else (dense, -1)
        self._last_progress_offset = -1
        # live tips: the newest step line, at most every interval, when bytes arrived
        self.progress_interval = progress_interval
        self._clock = clock
        self._progress_seen_upto = start_offset
        self._tip_from = -1  # file offset up to which `_newest_progress` searched (-1: nothing yet)
        self._last_emit = -1e18
        self._quiet: tuple[int, float | None] = (-1, None)  # (offset it was computed at, value)

    def prime(self, before: bytes, head: bytes = b"") -> None:
        """Resume after a restart: the bytes just before the start offset give context lines
        and the last timestamp, and the file's first bytes (``head``, up to the start offset)
        its rank tags, as if the scanner had read them."""
        if self._track_tags:
            self._add_tags(head[: min(self._base, HEAD_BYTES)], 0)
        nl = before.find(b"\n")
        tail = before[nl + 1 :] if nl >= 0 else b""
        self._set_tail(tail[-TAIL_BYTES:])
        self._ts_stale = True

    @property
    def _tail(self) -> bytes:
        """The processed bytes before the buffer (at most TAIL_BYTES, from a line start)."""
        if len(self._segments) > 1:
            self._set_tail(b"".join(self._segments))
        return self._segments[0] if self._segments else b""

    def _set_tail(self, tail: bytes) -> None:
        if len(tail) > TAIL_BYTES:
            tail = tail[-TAIL_BYTES:]
            nl = tail.find(b"\n")
            tail = tail[nl + 1 :] if nl >= 0 else b""
        self._segments.clear()
        if tail:
            self._segments.append(tail)
        self._segments_len = len(tail)

    def last_ts(self) -> float | None:
        """The newest timestamp in what was processed (computed only when asked)."""
        if self._ts_stale:
            self._ts_stale = False
            tail = self._tail
            ts = self._scan_back_ts(tail, len(tail))
            if ts is not None:
                self._last_ts = ts
        return self._last_ts

    def quiet_since(self) -> float | None:
        """From when, by the file's own clock, it has logged no step line: the timestamp of the
        first line at or after its last step line (a step line without a time of its own is
        dated by the next line that has one), looked for in the newest `QUIET_WINDOW` processed
        bytes; when the window holds no step line but the file logged some before it, the
        window's first timestamp. None when the file never logged a step, or no time follows its
        last one.

        It bounds the last step's time from above, so a silence measured from it (to `last_ts`)
        is never longer than the truth; and it depends on the processed bytes alone, not on how
        they were read, so the agent's heartbeats and `diagnose` end with the same value."""
        if self.sampled_bucket < 0:  # no step line yet: the first one is always a sample
            return None
        if self._quiet[0] == self._base:
            return self._quiet[1]
        tail = self._tail
        window = tail[-QUIET_WINDOW:]
        if len(tail) > QUIET_WINDOW:
            window = window[window.find(b"\n") + 1 :]
        last = self._last_step_line(window, (1024, 8192, len(window)))
        pos = window.rfind(b"\n", 0, last.start) + 1 if last is not None else 0
        found = None
        for _ in range(TS_LOOKBACK_LINES):
            if pos >= len(window):
                break
            end = window.find(b"\n", pos)
            end = len(window) if end < 0 else end
            found = self._line_ts(window, pos, end)
            if found is not None:
                break
            pos = end + 1
        self._quiet = (self._base, found)
        return found

    def due_progress(self) -> list[Event]:
        """Live tips: once per interval, and only when bytes arrived since the last look, the
        newest step line of what was processed (searched backwards in the tail)."""
        if self._clock is None or self.progress_interval <= 0 or self._base == self._progress_seen_upto:
            return []
        now = self._clock()
        if now - self._last_emit < self.progress_interval:
            return []
        self._progress_seen_upto = self._base
        self._last_emit = now
        return self._newest_progress()

    def progress_due_at(self) -> float | None:
        """When `due_progress` would have a tip to send (clock time), None if it has none."""
        if self._clock is None or self.progress_interval <= 0 or self._base == self._progress_seen_upto:
            return None
        return self._last_emit + self.progress_interval

    @property
    def offset(self) -> int:
        """File offset up to which every byte has been turned into events."""
        return self._base

    @property
    def line_no(self) -> int:
        return self._line_no

    @property
    def pending(self) -> int:
        """Bytes held back (an unfinished line or an open traceback)."""
        return len(self._buf)

    @property
    def open_record(self) -> bool:
        """Whether held-back bytes hold a complete line (an open record, not just a partial line)."""
        return b"\n" in self._buf

    def feed(self, data: bytes) -> list[Event]:
        self.stats.bytes += len(data)
        if self._continued and data:
            self._continued = False  # the rest of a line closed early: the same line goes on
            self._line_no -= 1
        buf = self._buf + data if self._buf else data
        if self._skip_long:
            nl = buf.find(b"\n")
            if nl < 0:
                self._base += len(buf)
                self._buf = b""
                return []
            self._base += nl + 1
            buf = buf[nl + 1 :]
            self._skip_long = False
        cut = buf.rfind(b"\n") + 1
        if cut == 0:
            if len(buf) > self.max_line_bytes:
                return self._truncate_long(buf)
            self._buf = buf
            return []
        events, consumed = self._process(buf, cut, MORE)
        rest = buf[consumed:]
        if len(rest) > MAX_CARRY and consumed < cut:  # a fold that never closes: give up on it
            events2, consumed2 = self._process(rest, rest.rfind(b"\n") + 1, FINAL)
            events.extend(events2)
            rest = rest[consumed2:]
        self._buf = rest
        return events

    def flush(self, *, force: bool = False) -> list[Event]:
        """The file went quiet. Close the open records whose end was read (a traceback up to its
        exception line); with ``force`` (after the fold timeout) close every open record and take
        an unfinished last line as a whole line, exactly as `finish()` would at the end of input.
        Bytes that arrive later continue from there."""
        buf = self._buf
        if not buf:
            return []
        if force:
            if buf.endswith(b"\n"):
                events, consumed = self._process(buf, len(buf), FINAL)
                self._buf = buf[consumed:]
                return events
            events, _ = self._process(buf + b"\n", len(buf) + 1, FINAL)
            self._base -= 1  # the newline was ours, not the file's
            self._buf = b""
            self._continued = True
            return events
        cut = buf.rfind(b"\n") + 1
        if cut == 0:
            return []
        events, consumed = self._process(buf, cut, IDLE)
        self._buf = buf[consumed:]
        return events

    def finish(self) -> list[Event]:
        """End of input: process what is held back, then the file's last step line (a tip)."""
        buf = self._buf
        if buf and not buf.endswith(b"\n"):
            buf += b"\n"
        events: list[Event] = []
        if buf:
            got, _ = self._process(buf, len(buf), FINAL)
            events.extend(got)
            self._buf = b""
        events.extend(self._final_progress())
        return events

    # ----------------------------------------------------------------------------------------

    def _truncate_long(self, buf: bytes) -> list[Event]:
        self.stats.truncated_lines += 1
        if self.stats.truncated_lines == 1:
            self.stats.warnings.append(
                f"{self.source.file}: line at offset {self._base} longer than {self.max_line_bytes} bytes; "
                "matched on its first bytes, the rest skipped"
            )
        head = buf[: self.max_line_bytes] + TRUNCATED_MARKER + b"\n"
        events, _ = self._process(head, len(head), FINAL)
        self._base += len(buf) - len(head)  # _process advanced by len(head); account for the rest
        self._buf = b""
        self._skip_long = True
        return events

    def _process(self, buf: bytes, cut: int, mode: int) -> tuple[list[Event], int]:
        rank_lines: list[int] | None = [] if self._track_tags else None
        hits = self.matcher.scan(buf, cut, rank_lines)
        if self._track_tags and self._base < HEAD_BYTES:
            # tags are a property of the file's bytes: counting them once, as soon as they are
            # seen, is the same whatever comes of the buffer (events only look at earlier ones)
            self._add_tags(buf[: min(cut, HEAD_BYTES - self._base)], self._base)
        if self._track_tags:
            self._add_rank_maps(buf, cut, self._base)
            if rank_lines:
                self._add_nccl_ranks(buf, cut, self._base, rank_lines)
        events: list[Event] = []
        spans: list[tuple[int, int]] = []  # (start, end) of each record in `events`
        consumed = cut
        # Where the last record of each interleaved stream (see `stream_key`) ends: hits inside
        # it belong to it. Another worker's lines between a traceback's lines are its own.
        absorbed: dict[str, int] = {}
        counter = _LineCounter(buf, self._line_no)
        for idx, hit in enumerate(hits):
            key = stream_key(hit.line)
            if hit.start < absorbed.get(key, -1):
                continue
            fields: dict[str, Any] = dict(hit.fields)
            rule = hit.rule
            block_end = hit.end
            if rule.fold == "python-traceback":
                headless = _TRACEBACK_HEADER not in hit.line  # it starts at a frame line
                folded = self._fold_traceback(buf, hit, hits[idx + 1 :], cut, mode, headless)
                if folded is None:
                    consumed = self._rewind(events, spans, hit.start)
                    break
                block_end, best, exc_text = folded
                if headless and best is None and not exc_text:
                    absorbed[key] = block_end  # frames and no exception (a printed stack): no failure
                    continue
                if best is not None:
                    rule, fields = best.rule, dict(best.fields)
                elif exc_text:
                    fields["exception"] = exc_text[:300]
            if rule.fold in _FIELD_FOLDS:  # a block that adds fields
                if rule.fold == "elastic-failure":
                    # a summary whose `ChildFailedError:` line the log lost starts at its root cause
                    headless = _EL_ROOT_CAUSE.search(hit.line) is not None
                    added = self._fold_elastic(buf, block_end, cut, mode, headless)
                elif rule.fold == "stalled-ranks":
                    added = self._fold_stalled(buf, hit, cut, mode)
                else:
                    added = self._fold_mpi_exit(buf, block_end, cut, mode)
                if added is None:
                    consumed = self._rewind(events, spans, hit.start)
                    break
                block_end, extra = added
                fields.update(extra)
            if rule.severity_level >= _ERROR:
                stack_end = self._fold_cpp_stack(buf, block_end, cut, mode)
                if stack_end is None:
                    consumed = self._rewind(events, spans, hit.start)
                    break
                block_end = stack_end
            absorbed[key] = block_end
            absorbed[""] = max(absorbed.get("", -1), block_end)  # unprefixed lines join any stream's record
            events.append(self._event(buf, hit, rule, fields, block_end, counter))
            spans.append((hit.start, block_end))
        if consumed > 0:
            # samples and `_advance` count their lines from the hits' nearest positions
            events.extend(self._sample_progress(buf, consumed, counter))
            self._advance(buf, consumed, counter)
            if self._clock is not None:
                events.extend(self.due_progress())
        self.stats.events += sum(1 for e in events if e.kind == "match")
        return events, consumed

    @staticmethod
    def _rewind(events: list[Event], spans: list[tuple[int, int]], cut: int) -> int:
        """The buffer may be consumed only up to ``cut`` (a record there is not complete yet):
        records of other streams that began before it but reach past it are taken back, to be
        read again whole with the bytes still to come."""
        while spans and max(end for _s, end in spans) > cut:
            i = max(range(len(spans)), key=lambda j: spans[j][1])
            cut = min(cut, spans[i][0])
            del spans[i], events[i]
        # records are in buffer order: drop the ones that start at or after the new cut
        while spans and spans[-1][0] >= cut:
            spans.pop()
            events.pop()
        return cut

    def _advance(self, buf: bytes, consumed: int, counter: _LineCounter | None = None) -> None:
        n = buf.count(b"\n", 0, consumed) if counter is None else counter.line_at(consumed) - self._line_no
        self.stats.lines += n
        self._line_no += n
        if consumed >= TAIL_BYTES:
            self._set_tail(buf[consumed - TAIL_BYTES : consumed])
        else:  # keep segments; join only when context is needed
            self._segments.append(buf[:consumed])
            self._segments_len += consumed
            while self._segments_len - len(self._segments[0]) >= TAIL_BYTES:
                self._segments_len -= len(self._segments.popleft())
        self._ts_stale = True
        self._base += consumed

    # -- folds --------------------------------------------------------------------------------

    def _lines_from(self, buf: bytes, pos: int, cut: int, key: str | None = None) -> Any:
        """(start, end, text without prefixes) of the lines from ``pos``; with ``key``, only the
        lines of that stream and unprefixed ones (lines of other streams are passed over)."""
        count = 0
        while pos < cut and count < MAX_FOLD_LINES:
            end = buf.find(b"\n", pos, cut)
            if end < 0:
                end = cut
            raw = buf[pos : min(end, pos + MAX_CONTEXT_LINE)].decode("utf-8", "replace")
            if key is None or stream_key(raw) in (key, ""):
                yield pos, end, strip_prefix(raw)
                count += 1
            pos = end + 1

    def _fold_traceback(
        self, buf: bytes, header: Hit, later: list[Hit], cut: int, mode: int, headless: bool = False
    ) -> tuple[int, Hit | None, str] | None:
        """(end of block, best hit inside it, exception line) or None when the block is cut off.
        ``headless``: the block starts at a frame line, and its exception line must name an
        exception class (`_NAMED_EXCEPTION`), not merely look like one."""
        exc_line = _NAMED_EXCEPTION if headless else _EXCEPTION_LINE
        exc_end = -1
        exc_text = ""
        state = "frames"
        block_end = -1
        blanks = 0
        last_frame = header.end  # the last frame line read (of any part of a chained traceback)
        key = stream_key(header.line)
        for _start, end, text in self._lines_from(buf, header.end + 1, cut, key):
            if state == "frames":
                if not text.strip() or text[0] in " \t" or text.startswith(_TRACEBACK_HEADER):
                    if text.strip():
                        last_frame = end
                    continue
                if exc_line.match(text) is None:  # cut off before its exception: the block ends
                    block_end = last_frame
                    break
                exc_end, exc_text, state = end, text.strip(), "after"
                continue
            # after an exception line: a chained traceback continues the block, anything else ends it
            if not text.strip():
                blanks += 1
                if blanks <= 2:
                    continue
            if text.startswith(_CHAIN):
                state, blanks = "frames", 0
                continue
            block_end = exc_end
            break
        else:
            # The data ends inside the block. Its end is known when the file is done (FINAL), or
            # when it went quiet right after an exception line (IDLE: a chained traceback would
            # have followed at once); otherwise wait for more.
            if (
                mode == FINAL
                or (mode == IDLE and state == "after")
                or (exc_end >= 0 and cut - header.start > MAX_CARRY)
            ):
                block_end = exc_end if exc_end >= 0 else last_frame  # no exception yet: its frames
            elif exc_end >= 0 and self._line_count(buf, header.end, cut) >= MAX_FOLD_LINES:
                block_end = exc_end
            else:
                return None
        if block_end < 0:
            block_end = header.end
        # the block's own headings and frames are not what it is: a line inside that a signature
        # knows (the exception line, an error the exception carries) is
        inside = [
            h
            for h in later
            if h.start <= block_end and stream_key(h.line) in (key, "") and h.rule.fold != "python-traceback"
        ]
        best = min(
            inside,
            key=lambda h: (h.rule.fallback, -h.rule.severity_level, _role_rank(h.rule.role)),
            default=None,
        )
        return block_end, best, exc_text

    def _fold_cpp_stack(self, buf: bytes, end: int, cut: int, mode: int) -> int | None:
        """A C++ stack printed right after an error (``Exception raised from ... (most recent
        call first):``, ``frame #N: ...``) belongs to it. Whether one follows is known only
        from the next line, so an error that ends the data waits for it (or for quiet)."""
        block_end = end
        count = 0
        for _start, line_end, text in self._lines_from(buf, end + 1, cut):
            if not _CPP_FRAME.match(text):
                return block_end
            block_end = line_end
            count += 1
        if mode != MORE or count >= MAX_FOLD_LINES or cut - end > MAX_CARRY:
            return block_end
        return None

    def _line_count(self, buf: bytes, start: int, end: int) -> int:
        return buf.count(b"\n", start, end)

    def _fold_elastic(
        self, buf: bytes, pos: int, cut: int, mode: int, headless: bool = False
    ) -> tuple[int, dict[str, Any]] | None:
        """Read torchrun's failure summary after a ChildFailedError line; ``headless``: after its
        `Root Cause (first observed failure):` heading, the summary's start being lost. A headless
        summary is its root-cause entry (``[0]:`` and indented lines) up to the closing rule of
        ``=``; any other line ends it."""
        fields: dict[str, Any] = {}
        in_root = headless
        seen_rule = 1 if headless else 0
        block_end = pos
        closed = False
        for _start, end, text in self._lines_from(buf, pos + 1, cut):
            stripped = text.strip()
            if headless and stripped and _EL_ENTRY.match(text) is None:
                closed = True
                break
            if stripped.startswith("=" * 10):
                seen_rule += 1
                block_end = end
                if seen_rule >= 2:
                    closed = True
                    break
                continue
            if seen_rule == 0 and stripped:  # the block starts with a ==== line; anything else ends it
                closed = True
                break
            block_end = end
            if stripped.startswith("Root Cause"):
                in_root = True
                continue
            if not in_root:
                continue
            m = _EL_RANK.match(text)
            if m and "culprit_rank" not in fields:
                fields["culprit_rank"] = int(m.group("rank"))
                fields["culprit_local_rank"] = int(m.group("local"))
            m = _EL_EXIT.match(text)
            if m and "exitcode" not in fields:
                fields["exitcode"] = int(m.group("code"))
            m = _EL_HOST.match(text)
            if m and "host" not in fields:
                fields["host"] = m.group("host")
            m2 = _EL_SIGNAL.search(text)
            if m2 and "signal" not in fields:
                fields["signal"] = int(m2.group("sig"))
        else:
            closed = mode == FINAL
        if not closed:
            return None
        if headless and "culprit_rank" in fields:
            # torchrun picks its root cause by a time in whole seconds (among failures of the same
            # second, the first of its list); the list of the other failures, before the heading,
            # is lost, so whether this one stood alone is unknown: it names no rank
            del fields["culprit_rank"], fields["culprit_local_rank"]
        return block_end, fields

    def _fold_mpi_exit(self, buf: bytes, pos: int, cut: int, mode: int) -> tuple[int, dict[str, Any]] | None:
        """Open MPI's report after its heading line (``... detected that one or more processes
        exited with non-zero status``): the first process to exit (``culprit_rank``) and its
        ``exitcode``. The report ends with its ``Exit code:`` line, a rule of dashes or any other
        line; one cut off before that waits for more, through a quiet spell too (the heading alone
        does not look complete), until the fold timeout."""
        fields: dict[str, Any] = {}
        block_end = pos
        for count, (_start, end, text) in enumerate(self._lines_from(buf, pos + 1, cut), 1):
            if not _MPI_BLOCK_LINE.match(text):
                return block_end, fields
            block_end = end
            proc = _MPI_PROCESS.match(text)
            if proc and "culprit_rank" not in fields:
                fields["culprit_rank"] = int(proc.group("rank"))
            code = _MPI_EXIT.match(text)
            if code:
                fields["exitcode"] = int(code.group("code"))
                return block_end, fields
            if text.lstrip().startswith("---") or count >= MPI_BLOCK_LINES:
                return block_end, fields
        if mode == FINAL or cut - pos > MAX_CARRY:
            return block_end, fields
        return None

    def _fold_stalled(self, buf: bytes, hit: Hit, cut: int, mode: int) -> tuple[int, dict[str, Any]] | None:
        """A stall report's heading line and the lines that list its ranks (``Stalled ops:``,
        ``Stalled ranks:``, ``N: [ops]``, ops with ``[ready ranks: ...]``/``[missing ranks: ...]``):
        the block's end and the ranks it says are missing (`stall_culprit`). The report ends at
        the first other line (the next report's heading included); one cut off waits for more,
        also while the file is quiet (a pause between the listing's lines says nothing of its
        end: only another line, the end of input or the fold timeout closes it)."""
        lines = [hit.line]
        block_end = hit.end
        closed = False
        count = 0
        pos = hit.end + 1
        while pos < cut and count < MAX_FOLD_LINES:
            end = buf.find(b"\n", pos, cut)
            if end < 0:
                end = cut
            text = buf[pos : min(end, pos + self.max_line_bytes)].decode("utf-8", "replace")
            if self.matcher.search(hit.rule, text) is not None or not (
                _STALL_HEADING.search(text) or _RANK_LIST_TAG.search(text) or _STALL_RANK_ENTRY.match(text)
            ):
                closed = True
                break
            lines.append(text)
            block_end = end
            count += 1
            pos = end + 1
        else:
            closed = mode == FINAL or count >= MAX_FOLD_LINES or cut - hit.start > MAX_CARRY
        if not closed:
            return None
        return block_end, stall_fields(lines)

    # -- events -------------------------------------------------------------------------------

    def _event(
        self, buf: bytes, hit: Hit, rule: Any, fields: dict[str, Any], block_end: int, counter: _LineCounter
    ) -> Event:
        src = self.source
        line = hit.line
        prefix_rank, prefix_local, prefixed = line_rank_prefixed(line)
        rank = self._rank_of(prefix_rank, prefixed, self._base + hit.start)
        if rank is None and isinstance(fields.get("rank"), int):
            rank = fields["rank"]
        local_rank = prefix_local if prefix_local is not None else src.local_rank
        if rank is None and local_rank is None and hit.rule.fold == "python-traceback":
            spawned = self._spawned_worker(buf, hit.start)
            if spawned is not None and "local_rank" not in fields:
                # the worker's own traceback, as its parent relays it: that worker's local rank
                # (also the event's, so it is not merged with the parent's traceback of the file)
                fields["local_rank"] = local_rank = spawned
        if rank is None:
            named_local = local_rank if local_rank is not None else fields.get("local_rank")
            if isinstance(named_local, int):
                rank = self._mapped_rank(named_local, self._base + hit.start)
        if rank is None and self._nccl_ranks:
            rank = self._nccl_rank(line, self._base + hit.start)
        ts, ts_source = self._timestamp(buf, hit.start, line)
        if block_end > hit.end:
            text = buf[hit.start : block_end].decode("utf-8", "replace")
            key = stream_key(line)
            lines = text.split("\n")
            # another stream's lines between the record's own are left out (the lines of a stall
            # report's listing are all its own: the fold took only those)
            if rule.fold != "stalled-ranks" and any(stream_key(x) not in (key, "") for x in lines[1:]):
                text = "\n".join(x for x in lines if stream_key(x) in (key, ""))
            if len(text) > MAX_EVENT_TEXT:
                text = text[: MAX_EVENT_TEXT // 4] + "\n[...]\n" + text[-MAX_EVENT_TEXT // 2 :]
        else:
            text = line
        self.stats.replaced_chars += text.count("\ufffd")
        if rank is None and prefix_local is None and rule.role in ("root-cause", "symptom"):
            rank = self._neighbour_rank(buf, hit.start, text)
        offset = self._base + hit.start
        return Event(
            id=event_id(src.agent, src.identity, offset),
            kind="match",
            job=src.job,
            node=src.node,
            rank=rank,
            local_rank=local_rank,
            file=src.file,
            offset=offset,
            line_no=counter.line_at(hit.start),
            ts=ts,
            ts_source=ts_source,
            rule=rule.id,
            severity=rule.severity,
            role=rule.role,
            category=rule.category,
            text=mask(text),
            context=self._context(buf, hit.start)
            if self.wants_context is None or self.wants_context(rule.role, fields)
            else [],
            fields=fields,
        )

    def _timestamp(self, buf: bytes, start: int, line: str) -> tuple[float | None, str]:
        ts = parse_timestamp(line, self.source.default_year, self.source.ref_epoch)
        if ts is not None:
            return ts, "line"
        ts = self._scan_back_ts(buf, start)
        if ts is None:
            ts = self.last_ts()
        return (ts, "inherited") if ts is not None else (None, "none")

    def _scan_back_ts(self, buf: bytes, pos: int) -> float | None:
        end = pos
        for _ in range(TS_LOOKBACK_LINES):
            if end <= 0:
                return None
            start = buf.rfind(b"\n", 0, end - 1) + 1
            ts = self._line_ts(buf, start, end)
            if ts is not None:
                return ts
            end = start
        return None

    def _line_ts(self, buf: bytes, start: int, end: int) -> float | None:
        """The timestamp at the head of the line ``buf[start:end]`` (its first 200 bytes), if any."""
        seg = buf[start : min(end, start + 200)].decode("utf-8", "replace")
        return parse_timestamp(seg, self.source.default_year, self.source.ref_epoch)

    def _context(self, buf: bytes, pos: int) -> list[str]:
        """The lines before ``pos`` (a line start), from the buffer and then the tail."""
        want = self.context_lines
        if want <= 0:
            return []
        return mask_lines(self._lines_before(buf, pos, want))

    def _lines_before(self, buf: bytes, pos: int, want: int) -> list[str]:
        """Up to ``want`` lines before ``pos`` (a line start), from the buffer and then the tail."""
        lines = _last_lines(buf, pos, want)
        for seg in reversed(self._segments):  # newest first; each segment starts at a line start
            if len(lines) >= want:
                break
            lines = _last_lines(seg, len(seg), want - len(lines)) + lines
        return lines

    # -- ranks --------------------------------------------------------------------------------

    def _rank_of(self, line_rank_: int | None, prefixed: bool, offset: int) -> int | None:
        """A ``[rankN]:`` prefix beats the file's rank (merged outputs); the file's rank (its
        path, else the rank that ≥ 90 % of the ``[rankN]`` tags before this line in the file's
        first bytes name) beats a rank the text mentions. Decided by the bytes before the line
        alone, so the same however the file was read."""
        if line_rank_ is not None and prefixed:
            return line_rank_
        if self.source.rank is not None:
            return self.source.rank
        if self._track_tags:
            dominant = self._dominant[bisect.bisect_left(self._tag_offsets, offset)]
            if dominant is not None:
                return dominant
        return line_rank_

    def _spawned_worker(self, buf: bytes, pos: int) -> int | None:
        """The process index torch.multiprocessing.spawn names on the line right before the
        traceback at ``pos`` (``-- Process 1 terminated with the following error:``), if it does."""
        before = self._lines_before(buf, pos, 1)
        m = _SPAWN_HEADER.match(strip_prefix(before[-1])) if before else None
        return int(m.group("index")) if m else None

    def _neighbour_rank(self, buf: bytes, pos: int, text: str) -> int | None:
        """The rank of an unprefixed record (a traceback in a merged stream) from the lines just
        before it: when the ranks they name are one and the same, and the record's own lines name
        no other. Decided by the bytes up to the record's end, so the same however they were read."""
        named = {r for r in map(_tagged_rank, self._lines_before(buf, pos, NEIGHBOUR_LINES)) if r is not None}
        if len(named) != 1:
            return None
        (rank,) = named
        for inner in text.split("\n")[1:NEIGHBOUR_LINES]:
            r = _tagged_rank(inner)
            if r is not None and r != rank:
                return None
        return rank

    def _add_rank_maps(self, data: bytes, cut: int, base: int) -> None:
        """torchrun's rendezvous result (printed at INFO when a worker group starts): the node's
        ``local_ranks=[...]`` and ``global_ranks=[...]``, which give every later line that names
        only a local rank (``[default3]:``, ``local_rank: 3``) its global rank. Each map applies
        from its own offset on, and the bytes are looked at once, in order: the same bytes give
        the same ranks however they were read."""
        start = max(self._rank_map_seen - base, 0)
        if data.find(b"_ranks=[", start, cut) < 0:
            return
        for m in _RANK_LIST.finditer(data, start, cut):
            at = base + m.start()
            ranks = [int(x) for x in m.group(2).split(b",") if x.strip()]
            if m.group(1) == b"local":
                self._local_ranks = (at, ranks)
            elif self._local_ranks is not None and at - self._local_ranks[0] <= RANK_MAP_WINDOW:
                locals_ = self._local_ranks[1]
                if len(locals_) == len(ranks) and ranks:
                    self._rank_maps.append((at, dict(zip(locals_, ranks, strict=True))))
        # a list cut off at the buffer's end is looked at again with the rest of its line
        last_nl = data.rfind(b"\n", 0, cut)
        self._rank_map_seen = max(self._rank_map_seen, base + last_nl + 1)

    def _add_nccl_ranks(self, data: bytes, cut: int, base: int, ends: list[int]) -> None:
        """The rank each NCCL process states in its own INFO lines (``NCCL_DEBUG=INFO``), for
        its later lines that carry only NCCL's ``host:pid:tid [dev]`` prefix (a ``NCCL WARN`` of
        that process). A process in several communicators is taken at its rank in the largest
        (the world's); one that states different ranks there (one process driving several GPUs),
        or only links that disagree, gets none. ``ends``: where the matcher's scan found such
        lines. Looked at once, in file order, like the rendezvous maps: the same bytes give the
        same ranks however they were read."""
        start = max(self._nccl_seen - base, 0)
        last_nl = data.rfind(b"\n", 0, cut)
        self._nccl_seen = max(self._nccl_seen, base + last_nl + 1)
        done = start  # a line holding several candidates is read once
        for end in sorted(ends):
            if end <= done or end > last_nl + 1:
                continue
            line_start = data.rfind(b"\n", 0, end - 1) + 1
            line_end = data.find(b"\n", end - 1, last_nl + 1)
            done = line_end
            if line_start < start:
                continue
            m = _NCCL_RANK_LINE.search(data, line_start, line_end)
            if m is None:
                continue
            key = (m.group("host").decode("ascii", "replace"), int(m.group("pid")))
            proc = self._nccl_ranks.setdefault(key, _NcclProcess())
            if m.group("rank") is not None:
                n = int(m.group("nranks"))
                if n > proc.size:
                    proc.size, proc.stated = n, {int(m.group("rank"))}
                elif n == proc.size:
                    proc.stated.add(int(m.group("rank")))
                self._add_nccl_device(key, n, int(m.group("rank")) - int(m.group("dev")), base + m.start())
            else:
                proc.linked.add(int(m.group("b") if m.group("dir") == b"receive" else m.group("a")))
            ranks = proc.stated or proc.linked
            decided = next(iter(ranks)) if len(ranks) == 1 else None
            if not proc.history or proc.history[-1][1] != decided:
                proc.history.append((base + m.start(), decided))

    def _add_nccl_device(self, key: tuple[str, int], size: int, offset: int, at: int) -> None:
        """A process of ``key``'s host stated its rank in a communicator of ``size`` ranks:
        ``offset`` is that rank minus its device (see `_NcclHost`). Only the largest communicator
        counts (a tensor-parallel group's ranks are not the world's); a process that states two
        offsets there (one process driving several devices) spoils the host's."""
        host = self._nccl_hosts.setdefault(key[0], _NcclHost())
        if size < host.size:
            return
        if size > host.size:
            host.size, host.offsets = size, {}
        pid = key[1]
        # a process that disagrees with itself holds None: no single offset holds on this host
        host.offsets[pid] = offset if host.offsets.get(pid, offset) == offset else None
        decided = host.decided()
        if not host.history or host.history[-1][1] != decided:
            host.history.append((at, decided))

    def _nccl_rank(self, line: str, offset: int) -> int | None:
        """The rank of the NCCL process whose prefix the line carries, as its INFO lines before
        ``offset`` stated it; for a process that stated none, its device plus the offset the
        other processes of its host agree on (`_NcclHost`)."""
        m = _NCCL_PREFIX.search(line, 0, 200)
        if m is None:
            return None
        proc = self._nccl_ranks.get((m.group("host"), int(m.group("pid"))))
        for at, rank in reversed(proc.history if proc else ()):
            if at < offset:
                return rank
        if proc is not None and proc.stated:
            return None  # it stated ranks, that disagree (or only later): no guess from its host
        host = self._nccl_hosts.get(m.group("host"))
        for at, shift in reversed(host.history if host else ()):
            if at < offset:
                return int(m.group("dev")) + shift if shift is not None else None
        return None

    def _mapped_rank(self, local: int, offset: int) -> int | None:
        """The global rank of ``local`` under the latest rendezvous result before ``offset``."""
        for at, mapping in reversed(self._rank_maps):
            if at < offset:
                return mapping.get(local)
        return None

    def _add_tags(self, data: bytes, base: int) -> None:
        """Count the tags in ``data`` (file offset ``base``) that were not counted yet."""
        start = self._tag_offsets[-1] + 1 - base if self._tag_offsets else 0
        counts, dominant, offsets = self._tag_counts, self._dominant, self._tag_offsets
        best = self._tag_best
        for m in FILE_RANK_TAG.finditer(data, max(start, 0)):
            rank = int(m.group(1))
            n = counts[rank] = counts.get(rank, 0) + 1
            offsets.append(base + m.start())
            # the most counted rank (the lowest among equals): only this rank's count moved
            if best is None or n > counts[best] or (n == counts[best] and rank < best):
                best = rank
            dominant.append(best if counts[best] >= DOMINANT_SHARE * len(offsets) else None)
        self._tag_best = best

    # -- progress -----------------------------------------------------------------------------

    @property
    def sampling(self) -> tuple[int, int]:
        """The sampling state at `offset`: what a scanner resumed there needs to go on alike."""
        return self.dense_left, self.sampled_bucket

    def _sample_progress(self, buf: bytes, consumed: int, counter: _LineCounter) -> list[Event]:
        """The samples among the step lines that start in ``buf[:consumed]`` (``buf[0]`` is a
        line start at file offset ``self._base``): the first ones while dense samples are left,
        then the first of each ``stride`` bucket not sampled yet. Decided by the bytes alone, so
        any cut of the same bytes into reads samples the same lines."""
        base, stride = self._base, self.stride
        hits: list[Hit] = []
        local = 0
        if self.dense_left > 0:
            hits = self.matcher.progress(buf, 0, consumed, limit=self.dense_left)
            self.dense_left -= len(hits)
            if hits:
                self.sampled_bucket = max(self.sampled_bucket, (base + hits[-1].start) // stride)
                local = hits[-1].end + 1
            if self.dense_left > 0:
                return [self._progress_event(buf, h, counter) for h in hits]
        while local < consumed:
            bucket = (base + local) // stride
            if bucket <= self.sampled_bucket:  # sampled: on to the first line of the next bucket
                nxt = (self.sampled_bucket + 1) * stride - base
                if nxt >= consumed:
                    break
                local = buf.find(b"\n", nxt - 1, consumed) + 1
                if local == 0:
                    break
                continue
            stop = _line_end_after(buf, (bucket + 1) * stride - base - 1, consumed)
            got = self._first_progress(buf, local, stop)
            if got is not None:
                hits.append(got)
                self.sampled_bucket = bucket
                local = got.end + 1  # on to the next bucket (skipped above)
            else:
                local = stop
        return [self._progress_event(buf, h, counter) for h in hits]

    def _first_progress(self, buf: bytes, start: int, stop: int) -> Hit | None:
        """The first step line in ``buf[start:stop]``, looked for in a window that widens (a
        step line is usually near: no need to scan, nor copy, the whole bucket)."""
        window = 4096
        while True:
            end = stop if start + window >= stop else _line_end_after(buf, start + window, stop)
            got = self.matcher.progress(buf, start, end, limit=1)
            if got or end >= stop:
                return got[0] if got else None
            window *= 16

    def _final_progress(self) -> list[Event]:
        events = self._newest_progress()
        for ev in events:
            ev.fields["last"] = True
        return events

    def _newest_progress(self) -> list[Event]:
        """The last step line in the processed tail, unless it was already sent. Only the bytes
        processed since the last search are searched: a step line before them was the answer
        then (sent then, or already sent), and a file that logs no step lines is not searched
        again and again. The newest segment (the last read) usually holds all of them, and the
        tail need not be joined."""
        fresh = self._base - max(self._tip_from, self._base - self._segments_len)
        self._tip_from = self._base
        if fresh <= 0:
            return []
        buf = self._segments[-1]
        last = self._last_step_line(buf, (1024, 8192, 65536, len(buf)), max(len(buf) - fresh, 0))
        if last is None and fresh > len(buf):
            buf = self._tail
            last = self._last_step_line(buf, (65536, len(buf)), max(len(buf) - fresh, 0))
        if last is None:
            return []
        offset = self._base - len(buf) + last.start
        if offset == self._last_progress_offset:
            return []
        line_no = self._line_no - buf.count(b"\n", last.start)
        return [self._make_progress(last, offset, line_no, buf, tip=True)]

    def _last_step_line(self, buf: bytes, windows: tuple[int, ...], lo: int = 0) -> Hit | None:
        """The last step line in ``buf[lo:]``, looked for in its last ``windows`` bytes, each
        window wider than the one before (the line is usually near the end: no need to scan it
        all). ``lo`` is a line start."""
        for window in windows:
            start = max(len(buf) - window, lo)
            last = self.matcher.last_progress(buf, start, len(buf))
            if last is not None or start <= lo:
                return last
        return None

    def _progress_event(self, buf: bytes, hit: Hit, counter: _LineCounter) -> Event:
        return self._make_progress(hit, self._base + hit.start, counter.line_at(hit.start), buf)

    def _make_progress(self, hit: Hit, offset: int, line_no: int, buf: bytes, tip: bool = False) -> Event:
        src = self.source
        self._last_progress_offset = offset
        self.stats.progress += 1
        prefix_rank, prefix_local, prefixed = line_rank_prefixed(hit.line)
        rank = self._rank_of(prefix_rank, prefixed, offset)
        local = prefix_local if prefix_local is not None else src.local_rank
        if rank is None and local is not None:
            rank = self._mapped_rank(local, offset)
        ts, ts_source = self._timestamp(buf, hit.start, hit.line)
        return Event(
            id=event_id(src.agent, src.identity, offset, "progress"),
            kind="progress",
            job=src.job,
            node=src.node,
            rank=rank,
            local_rank=prefix_local if prefix_local is not None else src.local_rank,
            file=src.file,
            offset=offset,
            line_no=line_no,
            ts=ts,
            ts_source=ts_source,
            rule=hit.rule.id,
            severity="info",
            role="progress",
            category="progress",
            text=mask(hit.line[:MAX_CONTEXT_LINE]),
            fields={**hit.fields, "tip": True} if tip else dict(hit.fields),
        )


class _LineCounter:
    """Line numbers of positions in a buffer, each byte counted about once: the positions asked
    for are kept (in increasing order) with their line numbers, and a position is counted from
    the nearest one before it (hits, then samples and the buffer's end, share one pass)."""

    __slots__ = ("_buf", "_counts", "_marks")

    def __init__(self, buf: bytes, first_line: int) -> None:
        self._buf = buf
        self._marks = [0]
        self._counts = [first_line]

    def line_at(self, pos: int) -> int:
        marks = self._marks
        last = marks[-1]
        if pos >= last:
            n = self._counts[-1] + self._buf.count(b"\n", last, pos)
            if pos > last:
                marks.append(pos)
                self._counts.append(n)
            return n
        # before the newest mark (the buffer's end is often asked for first): kept as a mark
        # too, so that the next position, usually just after it, is counted from here
        i = bisect.bisect_right(marks, pos) - 1
        n = self._counts[i] + self._buf.count(b"\n", marks[i], pos)
        if marks[i] != pos:
            marks.insert(i + 1, pos)
            self._counts.insert(i + 1, n)
        return n


def _line_end_after(buf: bytes, pos: int, limit: int) -> int:
    """The end (past its newline) of the line holding ``buf[pos]``, at most ``limit``."""
    if pos >= limit - 1:
        return limit
    nl = buf.find(b"\n", max(pos, 0), limit)
    return limit if nl < 0 else nl + 1


def _last_lines(data: bytes, end: int, count: int) -> list[str]:
    """Up to ``count`` whole lines ending just before ``end`` (``data[end - 1]`` is a newline),
    decoded in one go and cut to MAX_CONTEXT_LINE characters each."""
    if end <= 0 or count <= 0:
        return []
    stop = end - 1
    window = 160 * count  # a guess at the span, widened until it holds enough newlines
    while True:
        first = max(stop - window, 0)
        if first == 0 or data.count(b"\n", first, stop) >= count:
            break
        window *= 4
    piece = data[first:stop]
    if first > 0:  # drop the line cut by the window's start (maybe whole: one line too many)
        piece = piece[piece.find(b"\n") + 1 :]
    raw = piece.split(b"\n")
    if len(raw) > count:
        raw = raw[-count:]
    lines = b"\n".join(raw).decode("utf-8", "replace").split("\n")
    return [line[:MAX_CONTEXT_LINE] for line in lines]


def missing_ranks(lines: list[str]) -> set[int]:
    """The ranks a stall report says the others wait for: those it lists as missing (``[missing
    ranks: 2]``, a ``N:`` / ``N!:`` entry after ``Stalled ranks:``), and, where it lists the ranks that
    are ready (``[ready ranks: 3, 0, 1]``), every number from 0 to the highest rank listed anywhere in
    the report that one of those lists leaves out. Ranks above the highest listed are unknowable
    (the report does not give the world size)."""
    missing: set[int] = set()
    ready_lists: list[set[int]] = []
    listing = False  # after a `Stalled ranks:` heading
    for line in lines:
        for m in _RANK_LIST_TAG.finditer(line):
            ranks = {int(x) for x in m.group("ranks").split(",")}
            if m.group("kind") == "missing":
                missing |= ranks
            else:
                ready_lists.append(ranks)
        if "Stalled ranks:" in line:
            listing = True
            continue
        entry = _STALL_RANK_ENTRY.match(line)
        if listing and entry:
            missing.add(int(entry.group("rank")))
    if ready_lists:
        top = max(max(r) for r in ready_lists)
        top = max([top, *missing])
        for ready in ready_lists:
            missing |= set(range(top + 1)) - ready
    return missing


def stall_fields(lines: list[str]) -> dict[str, Any]:
    """A stall report's fields: ``missing_ranks`` (the ranks it says are missing, lowest first, as
    text) and, when exactly one rank is missing, ``culprit_rank``: the rank the others wait for."""
    missing = missing_ranks(lines)
    if not missing:
        return {}
    listed = sorted(missing)
    out: dict[str, Any] = {"missing_ranks": ", ".join(map(str, listed[:MAX_LISTED_RANKS]))}
    if len(listed) == 1:
        out["culprit_rank"] = listed[0]
    return out


def _tagged_rank(line: str) -> int | None:
    """The rank a line's launcher prefix or a bracketed ``[rank3]``/``[Rank 3]`` tag names (not a
    rank the prose mentions, as in "waiting for rank 0")."""
    rank, _local, prefixed = line_rank_prefixed(line)
    if rank is None or prefixed or _RANK_TAG.search(line, 0, 160):
        return rank
    return None


def _role_rank(role: str) -> int:
    return {"root-cause": 0, "symptom": 1, "collateral": 2}.get(role, 3)


__all__ = ["LineScanner", "ScanStats", "Source", "line_bounds"]
