"""Rules compiled for speed: one multi-pattern scan per chunk, per-line verification.

Stage 1 scans a whole chunk (about 1 MiB) at once with one hyperscan database holding every
pattern of every rule, and reports the end offsets of candidate matches. Stage 2 decodes only the
lines that hold a candidate and runs the rule's Python regex on them, which is exact (named
groups, look-arounds) and rejects hyperscan's approximations (patterns compiled in prefilter mode,
``\\s`` spanning a newline). Benign lines are never split, decoded or touched by Python.

Without the hyperscan module (an unusual platform) the same API runs every pattern with ``re``
over the chunk: correct, much slower, and announced once with a warning.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from denpex_agent.diskcache import cache_dir, write_atomic
from denpex_agent.errors import PatternTimeout
from denpex_agent.rules import LEVEL_MARKER, LEVEL_WORDS, ROLES, Rule, RuleSet

log = logging.getLogger(__name__)

_hs: Any
try:
    import hyperscan as _hs
except ImportError:  # pragma: no cover - exercised only where the wheel is missing
    _hs = None

_CACHE_FORMAT = 1
_NAMED_GROUP = re.compile(r"\(\?P<[A-Za-z_][A-Za-z0-9_]*>")
_ROLE_ORDER = {role: i for i, role in enumerate(ROLES)}


@dataclass(frozen=True, slots=True)
class Hit:
    """A verified match: the line's span in the buffer, its text, the rule and its fields."""

    start: int
    end: int
    line: str
    rule: Rule
    fields: dict[str, Any]


# The lines in which an NCCL process states its rank (``NCCL_DEBUG=INFO``: its communicator's
# ``comm 0x... rank R nranks N``, its ring and channel links), for the scanner to give a later
# ``NCCL WARN`` of that process its rank. Found by the same scan as the rules, handed over as
# offsets: never events.
NCCL_RANK_SCAN = (
    r"NCCL INFO (?:Ring|Channel) \d{1,3}(?:/\d{1,3})? ?: +\d{1,6}(?:\[[0-9a-fA-F]{1,16}\])? -> \d",
    r"NCCL INFO (?:\w{1,40} )?comm 0x[0-9a-fA-F]{1,16} rank \d{1,6} n[Rr]anks \d",
)


def _vocabulary(patterns: Sequence[str]) -> str:
    """What the scan looks for of the fallback patterns, all in one: the level marker, then
    anywhere later on the line any of their vocabularies without look-arounds (a superset of the
    lines they match, which each then verifies; a bounded gap, or one entry per rule, would cost
    the scan far more than this one)."""
    words = "|".join(_LOOKAROUND.sub("", p[len(LEVEL_MARKER) :]) for p in patterns)
    return LEVEL_WORDS + r"[^\n]*(?:" + words + ")"


_LEVEL = re.compile(LEVEL_WORDS)  # the marker alone: a quick test before a fallback's regex
_LOOKAROUND = re.compile(r"\(\?<?[=!][^()]*\)")


def _preference(rule: Rule) -> tuple[bool, int, int]:
    """Lower sorts first: a signature before a vocabulary fallback, then higher severity, then
    root-cause before symptom before collateral."""
    return (rule.fallback, -rule.severity_level, _ROLE_ORDER[rule.role])


class PatternDatabase:
    """One multi-pattern scanner over a list of (rule index, pattern, ignore_case).

    Compiling ~170 patterns (and probing each for the form hyperscan accepts) costs a few tenths
    of a second, so the result is cached on disk, keyed by the patterns and the hyperscan
    version; a missing or unwritable cache only costs the compile."""

    def __init__(self, entries: Sequence[tuple[int, str, bool]]) -> None:
        self._owner: list[int] = []
        self._slow: list[tuple[int, re.Pattern[bytes]]] = []
        self._db: Any = None
        if _hs is None:
            self._slow = [(i, _bytes_regex(p, ic)) for i, p, ic in entries]
            return
        key = hashlib.sha256(
            orjson.dumps([_CACHE_FORMAT, getattr(_hs, "__version__", "?"), list(entries)])
        ).hexdigest()
        if self._load(key, entries):
            return
        self._compile(entries)
        self._store(key)

    def _compile(self, entries: Sequence[tuple[int, str, bool]]) -> None:
        expressions: list[bytes] = []
        flags: list[int] = []
        for rule_idx, pattern, ignore_case in entries:
            # "...[^\n]*$" makes a pattern report once per line (at its end) instead of once
            # per possible end position of its optional parts; patterns hyperscan cannot take in
            # that form go in as they are, or approximated (prefilter mode, verified later).
            plain = _NAMED_GROUP.sub("(?:", pattern)
            base = _hs.HS_FLAG_MULTILINE | (_hs.HS_FLAG_CASELESS if ignore_case else 0)
            chosen: tuple[bytes, int] | None = None
            for text, extra in (
                ("(?:" + plain + ")[^\n]*$", 0),
                (plain, 0),
                ("(?:" + plain + ")[^\n]*$", _hs.HS_FLAG_PREFILTER),
                (plain, _hs.HS_FLAG_PREFILTER),
            ):
                try:
                    probe = _hs.Database()
                    probe.compile(expressions=[text.encode()], ids=[0], elements=1, flags=[base | extra])
                except Exception:
                    continue
                chosen = (text.encode(), base | extra)
                break
            if chosen is None:
                log.warning("pattern runs without hyperscan (slower) pattern=%s", pattern)
                self._slow.append((rule_idx, _bytes_regex(pattern, ignore_case)))
                continue
            expressions.append(chosen[0])
            flags.append(chosen[1])
            self._owner.append(rule_idx)
        if expressions:
            self._db = _hs.Database()
            self._db.compile(
                expressions=expressions,
                ids=list(range(len(expressions))),
                elements=len(expressions),
                flags=flags,
            )

    def _load(self, key: str, entries: Sequence[tuple[int, str, bool]]) -> bool:
        path = cache_dir() / f"{key}.hsdb"
        try:
            raw = path.read_bytes()
            n = int.from_bytes(raw[:4], "big")
            meta = orjson.loads(raw[4 : 4 + n])
            self._db = None
            if meta["has_db"]:
                db = _hs.loadb(raw[4 + n :], _hs.HS_MODE_BLOCK)
                db.scratch = _hs.Scratch(db)
                self._db = db
        except Exception:  # missing or damaged: never worse than no cache
            return False
        by_idx = {i: (p, ic) for i, p, ic in entries}
        self._owner = list(meta["owner"])
        self._slow = [(i, _bytes_regex(*by_idx[i])) for i in meta["slow"]]
        return True

    def _store(self, key: str) -> None:
        try:
            meta = orjson.dumps(
                {"owner": self._owner, "slow": [i for i, _ in self._slow], "has_db": self._db is not None}
            )
            blob = _hs.dumpb(self._db) if self._db is not None else b""
            write_atomic(cache_dir() / f"{key}.hsdb", len(meta).to_bytes(4, "big") + meta + blob)
        except Exception as exc:  # read-only home, full disk: just compile next time
            log.debug("pattern database cache not written error=%s", exc)

    def any_match(self, data: bytes) -> bool:
        """Whether any pattern has a candidate match in ``data`` (stops at the first; called for
        every text that leaves the reader, so without a Python callback per call)."""
        if self._db is not None:
            try:
                self._db.scan(data, match_event_handler=_stop_at_first)
            except _hs.ScanTerminated:
                return True
        return any(rx.search(data) is not None for _, rx in self._slow)

    def scan(self, data: bytes, on_hit: Callable[[int, int], bool | None]) -> None:
        """Call ``on_hit(rule_index, end_offset)`` for candidate matches; a true return stops."""
        if self._db is not None:
            owner = self._owner

            def cb(pid: int, _from: int, to: int, _flags: int, _ctx: Any) -> bool | None:
                return on_hit(owner[pid], to)

            try:
                self._db.scan(data, match_event_handler=cb)
            except _hs.ScanTerminated:  # on_hit asked to stop
                return
        for rule_idx, rx in self._slow:
            for m in rx.finditer(data):
                if on_hit(rule_idx, max(m.end(), m.start() + 1)):
                    return


HAVE_HYPERSCAN = _hs is not None


def _stop_at_first(_pid: int, _from: int, _to: int, _flags: int, _ctx: Any) -> bool:
    return True


def _bytes_regex(pattern: str, ignore_case: bool) -> re.Pattern[bytes]:
    return re.compile(pattern.encode(), re.MULTILINE | (re.IGNORECASE if ignore_case else 0))


def line_bounds(buf: bytes, pos: int, limit: int) -> tuple[int, int]:
    """Start and end (exclusive, without the newline) of the line holding byte ``pos``."""
    start = buf.rfind(b"\n", 0, pos) + 1
    end = buf.find(b"\n", pos, limit)
    return start, (limit if end < 0 else end)


class Matcher:
    """The compiled form of a `RuleSet`: failure rules and progress rules, scanned separately."""

    def __init__(self, rules: RuleSet, max_line_chars: int = 65536, *, release_gil: bool = True) -> None:
        self.ruleset = rules
        # whether each verification gives the interpreter lock up while it runs: the agent's
        # reader thread does (its event loop keeps running); `diagnose`, one thread per
        # process, does not (under load, taking the lock back costs far more than the search)
        self.release_gil = release_gil
        self.rules: list[Rule] = [r for r in rules if r.role != "progress"]
        self.progress_rules: list[Rule] = [r for r in rules if r.role == "progress"]
        self.max_line_chars = max_line_chars
        self.timeouts: dict[str, int] = {}  # rule id -> lines on which a pattern timed out
        self._order = {r.id: i for i, r in enumerate(self.rules)}
        # A rule's `scan` superset, when it gives one, stands for its patterns in the scan; the
        # patterns then verify the few lines it finds.
        entries = [
            (i, p, r.ignore_case)
            for i, r in enumerate(self.rules)
            if not r.fallback
            for p in (r.scan or r.patterns)
        ]
        # the fallbacks share one entry, under the index len(rules): a line it finds is every
        # fallback's candidate
        self._fallbacks = [i for i, r in enumerate(self.rules) if r.fallback]
        if self._fallbacks:
            vocab = _vocabulary([p for i in self._fallbacks for p in self.rules[i].patterns])
            entries.append((len(self.rules), vocab, False))
        self._rank_index = len(self.rules) + 1
        entries.extend((self._rank_index, p, False) for p in NCCL_RANK_SCAN)
        self._db = PatternDatabase(entries)
        self._progress_db = PatternDatabase(
            [(i, p, r.ignore_case) for i, r in enumerate(self.progress_rules) for p in r.patterns]
        )
        if _hs is None:
            log.warning("hyperscan is not installed; matching falls back to Python re (much slower)")

    @property
    def accelerated(self) -> bool:
        return _hs is not None

    def search(self, rule: Rule, line: str) -> dict[str, Any] | None:
        """``rule.search(line)``; a pattern that times out on the line is counted (per rule, in
        `timeouts`), logged the first time, and taken as not matching."""
        try:
            return rule.search(line, self.release_gil)
        except PatternTimeout as exc:
            n = self.timeouts.get(rule.id, 0) + 1
            self.timeouts[rule.id] = n
            if n == 1:
                log.warning("%s; taken as no match (counted) line_chars=%d", exc, len(line))
            return None

    def _decode(self, buf: bytes, start: int, end: int) -> str:
        if end - start > self.max_line_chars:
            end = start + self.max_line_chars
        return buf[start:end].decode("utf-8", "replace")

    def scan(self, buf: bytes, limit: int | None = None, rank_lines: list[int] | None = None) -> list[Hit]:
        """Verified failure-rule hits in ``buf[:limit]``, one per line, in buffer order. With
        ``rank_lines``, the end offsets of candidate NCCL rank lines (`NCCL_RANK_SCAN`) found by
        the same pass are appended to it (unverified, possibly several per line)."""
        limit = len(buf) if limit is None else limit
        data = buf  # scanned whole (no copy); hits past ``limit`` belong to the next call
        raw: list[tuple[int, int]] = []
        rank_index = self._rank_index

        def collect(idx: int, to: int) -> None:
            if to <= limit:
                if idx != rank_index:
                    raw.append((to, idx))
                elif rank_lines is not None:
                    rank_lines.append(to)

        self._db.scan(data, collect)
        if not raw:
            return []
        raw.sort()
        hits: list[Hit] = []
        i = 0
        n = len(raw)
        while i < n:
            to = raw[i][0]
            # A candidate belongs to the line holding its last byte; a pattern such as `\s*$`
            # may end just past the newline it consumed, and still belongs to the line before it.
            # The first candidate always belongs to its line, so every turn consumes at least
            # one and the loop ends on any input.
            start, end = line_bounds(data, max(to - 1, 0), limit)
            candidates: set[int] = set()
            while i < n and raw[i][0] <= end + 1:
                candidates.add(raw[i][1])
                i += 1
            if len(self.rules) in candidates:
                candidates.discard(len(self.rules))
                candidates.update(self._fallbacks)
            hit = self.classify_line(data, start, end, candidates)
            if hit is not None:
                hits.append(hit)
        return hits

    def classify_line(
        self, buf: bytes, start: int, end: int, candidates: set[int] | None = None
    ) -> Hit | None:
        """Verify a line against candidate rules (all rules when None) and pick the best."""
        line = self._decode(buf, start, end)
        pool = self.rules if candidates is None else [self.rules[c] for c in candidates]
        best: tuple[tuple[bool, int, int, int], Rule, dict[str, Any]] | None = None
        for rule in pool:
            if rule.fallback and _LEVEL.search(line) is None:
                continue  # its vocabulary without a level marker ("INFO ... 0 non-finite values")
            fields = self.search(rule, line)
            if fields is None:
                continue
            key = (*_preference(rule), self._order[rule.id])
            if best is None or key < best[0]:
                best = (key, rule, fields)
        if best is None:
            return None
        return Hit(start=start, end=end, line=line, rule=best[1], fields=best[2])

    def progress(self, buf: bytes, start: int, stop: int, limit: int | None = None) -> list[Hit]:
        """Verified progress lines whose match ends in ``buf[start:stop]`` (the first ``limit``
        of them), in buffer order. ``start`` must be a line start. Candidates arrive in order of
        their end (hyperscan reports them so): those of one line are gathered, and the line is
        verified against each candidate rule in library order when the first candidate of a
        later line arrives; the scan stops once ``limit`` lines are verified."""
        if not self.progress_rules:
            return []
        data = buf[start:stop]
        found: list[Hit] = []
        line = [-1, -1]  # bounds of the line whose candidates are being gathered
        pending: list[int] = []

        def verify() -> bool:
            """Verify the gathered line; True once ``limit`` lines are found."""
            hit = self._verify_progress(data, line[0], line[1], pending)
            pending.clear()
            if hit is not None:
                found.append(Hit(hit.start + start, hit.end + start, hit.line, hit.rule, hit.fields))
            return limit is not None and len(found) >= limit

        def on_hit(idx: int, to: int) -> bool | None:
            if line[1] < 0 or to > line[1] + 1:  # the first candidate of another line
                if pending and verify():
                    return True
                line[0], line[1] = line_bounds(data, max(to - 1, 0), len(data))
            pending.append(idx)
            return None

        self._progress_db.scan(data, on_hit)
        if pending and not (limit is not None and len(found) >= limit):
            verify()
        return found

    def _verify_progress(self, data: bytes, ls: int, le: int, candidates: Sequence[int]) -> Hit | None:
        text = self._decode(data, ls, le)
        for idx in sorted(set(candidates)):
            rule = self.progress_rules[idx]
            fields = self.search(rule, text)
            if fields is not None and "step" in fields:
                return Hit(start=ls, end=le, line=text, rule=rule, fields=fields)
        return None

    def last_progress(self, buf: bytes, start: int, stop: int) -> Hit | None:
        """The last verified progress line whose match ends in ``buf[start:stop]``: candidates
        are collected without verification, then checked from the end until one holds."""
        if not self.progress_rules:
            return None
        data = buf[start:stop]
        ends: list[tuple[int, int]] = []

        def collect(idx: int, to: int) -> None:
            ends.append((to, idx))

        self._progress_db.scan(data, collect)
        seen: set[tuple[int, int]] = set()
        for to, idx in reversed(ends):
            ls, le = line_bounds(data, max(to - 1, 0), len(data))
            if (ls, idx) in seen:
                continue
            seen.add((ls, idx))
            line = self._decode(data, ls, le)
            rule = self.progress_rules[idx]
            fields = self.search(rule, line)
            if fields is not None and "step" in fields:
                return Hit(start=start + ls, end=start + le, line=line, rule=rule, fields=fields)
        return None
