"""A log line's template: what stays the same when the same code logs the same thing in another run.

The template of a line is its text without the launcher's and PyTorch's rank prefixes
(`attribution.strip_prefix`) and without a leading timestamp, with every value that differs
from run to run replaced by a placeholder:

========================  ====================================================  ===========
what                      for instance                                          becomes
========================  ====================================================  ===========
UUIDs                     ``3f2b…-…-…``                                         ``<uuid>``
timestamps, dates, times  ``2026-11-29 20:18:40,301``, ``2026-11-29_20:18:43``  ``<ts>``
IP addresses (and port)   ``127.0.0.1:29500``, ``[::1]:5``                      ``<ip>``
paths                     ``/tmp/torchelastic_x/attempt_0``, ``torch/run.py``   ``<path>``
the run's node names      ``host-a``, ``node2`` (as the files were attributed)  ``<node>``
host and node values      ``host : gpu-a``, ``node=node1``                      ``host : <node>``
run, job, rendezvous ids  ``run_id: my-run``                                    ``run_id: <id>``
hexadecimal               ``0x7f3a``, ``d41d8cd98f00b204``                      ``<hex>``
random letter-digit ids   ``y3zmje5l``                                          ``<id>``
durations                 ``10000ms``, ``10 s``, ``2 hours``                    ``<dur>``
numbers                   ``12``, ``-2.31``, ``5.000E-02`` (in words too:       ``<n>``
                          ``rank3`` → ``rank<n>``); lists of them ``[0, 1]``
========================  ====================================================  ===========

and runs of blanks made one space. `nan` and `inf` are words, not numbers: a loss that became NaN
is a new template. The template depends on the line and the run's node names only, never on
which lines came before, so a line has the same template in the failed run and in the control
whatever else either of them logged.

Everything works on bytes with compiled patterns; only the start of a line is decoded, to find
its prefix. A digit's value never matters, only where digits are and whether one is a zero
(``[host:0123]`` is a process id, ``[host:123]`` a rank): the template is made from the line's
*shape*, the line with every other digit made a ``1``, and the shapes seen last are cached, so
the step lines of a long run, which differ only in their numbers, are templated once.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from denpex_agent.attribution import DEFAULT_NODE, strip_prefix

PREFIX_HEAD = 512  # bytes of a line in which a launcher or rank prefix is looked for
CACHE_ENTRIES = 16_384  # shapes whose templates are kept ...
CACHE_LINE = 1024  # ... when they are this short (the cache stays under ~20 MB)

_SHAPE = bytes.maketrans(b"23456789", b"11111111")
_UNSEEN = b"\x00"

_GLOG_TS = re.compile(
    rb"^[ \t]*\[?([IWEF])\d{4} \d\d:\d\d:\d\d(?:\.\d+)?(?: +\d+)?(?: +[^\s\]]+:\d+\])?[ \t]*"
)
_LEADING_TS = re.compile(
    rb"^[ \t]*\[?(?:"
    rb"\d{4}-\d\d-\d\d[T _]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?"
    rb"|(?:[A-Z][a-z]{2} )?[A-Z][a-z]{2} {1,2}\d{1,2} \d\d:\d\d:\d\d(?: \d{4})?"
    rb"|\d+\.\d+(?=\])"
    rb")\]?[ \t]*(?:[-|][ \t]+)?"
)
_GLOG_LEVELS = {b"I": b"INFO ", b"W": b"WARNING ", b"E": b"ERROR ", b"F": b"FATAL "}
_LEVEL_WORDS = rb"(?i:debug|info|warn(?:ing)?|error|critical|fatal)"
_HEADER = re.compile(
    rb"^(?:(?:\[(?i:rank) ?\d{1,6}\]|\[?" + _LEVEL_WORDS + rb"\]?)(?:[ \t]*[-|:][ \t]*|[ \t]+|$))+"
)
_LEVEL = re.compile(rb"(?<![\w])(" + _LEVEL_WORDS + rb")(?![\w])")
_LEVEL_NAMES = {b"WARN": b"WARNING"}
_BEFORE_NODES: tuple[tuple[re.Pattern[bytes], bytes], ...] = (
    (re.compile(rb"(?i)\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b"), b"<uuid>"),
    (
        re.compile(
            rb"\d{4}-\d\d-\d\d(?:[T _]\d\d:\d\d(?::\d\d(?:[.,]\d+)?)?"
            rb"(?:Z|[+-]\d\d:?\d\d)?)?"
            rb"|(?<![\d:])\d{1,2}:\d\d:\d\d(?:[.,]\d+)?(?![\d:])"
        ),
        b"<ts>",
    ),
    (
        re.compile(
            rb"(?<![\w.])\d{1,3}(?:\.\d{1,3}){3}(?::\d{1,5})?(?![\w.])"
            rb"|\[[0-9A-Fa-f]*:[0-9A-Fa-f:.]*\](?::\d{1,5})?"
        ),
        b"<ip>",
    ),
    (
        re.compile(
            rb"(?<![\w.~/-])(?:~|\.\.?)?/[\w.@+~%-]+(?:/[\w.@+~%-]*)*"
            rb"|(?<![\w./-])[A-Za-z_][\w.@+~-]*(?:/[\w.@+~-]+){2,}/?"
            rb"|(?<![\w./-])[A-Za-z_][\w.-]*/[\w.-]*\.[A-Za-z]\w{0,5}\b"
        ),
        b"<path>",
    ),
)
_AFTER_NODES: tuple[tuple[re.Pattern[bytes], bytes], ...] = (
    (
        re.compile(rb"(?i)\b(node_?name|host_?name|node|host)([\"']?[ \t]*[:=][ \t]*[\"']?)[^\s\"',;)}\]]+"),
        rb"\1\2<node>",
    ),
    (
        re.compile(
            rb"(?i)\b(run_?id|rdzv_?id|job_?id|run_?name)([\"']?[ \t]*[:=][ \t]*[\"']?)[^\s\"',;)}\]]+"
        ),
        rb"\1\2<id>",
    ),
    (
        re.compile(
            rb"\b0[xX][0-9a-fA-F]+\b"
            rb"|(?<![A-Za-z0-9])(?=[0-9a-fA-F]*[a-fA-F])(?=[0-9a-fA-F]*\d)[0-9a-fA-F]{8,}(?![A-Za-z0-9])"
        ),
        b"<hex>",
    ),
    (
        re.compile(
            rb"(?<![A-Za-z0-9])(?=[A-Za-z]*\d+[A-Za-z]+\d)(?=[A-Za-z0-9]{6})[A-Za-z0-9]+(?![A-Za-z0-9])"
        ),
        b"<id>",
    ),
    (
        re.compile(
            rb"(?<![\w.])\d+(?:\.\d+)?[ ]?(?:ns|us|\xc2\xb5s|ms|s|secs?|seconds?|mins?|minutes?|h|hrs?|hours?)"
            rb"(?![A-Za-z0-9])"
        ),
        b"<dur>",
    ),
    (re.compile(rb"(?:(?<![\w)\].])[-+])?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"), b"<n>"),
    (re.compile(rb"<n>(?:[ \t]*,[ \t]*<n>)+"), b"<n>"),
    (re.compile(rb"[ \t\r\v\f][ \t\r\v\f]+|[\t\r\v\f]"), b" "),
)
# A letter that is not part of a placeholder: a template without one is punctuation and numbers
# (a rule of asterisks, an empty prefix, a bare counter) and says nothing.
_WORD = re.compile(rb"[A-Za-z\x80-\xff](?![a-z]*>)")


def prefix_length(raw: bytes) -> int:
    """How many bytes at the start of ``raw`` are launcher and rank prefixes."""
    head_b = raw[:PREFIX_HEAD]
    head = head_b.decode("utf-8", "surrogateescape")
    cut = len(head) - len(strip_prefix(head))
    if cut == 0 or head_b.isascii():
        return cut
    return len(head[:cut].encode("utf-8", "surrogateescape"))


def split_head(raw: bytes) -> tuple[bytes, bytes]:
    """(level, message): the line without its prefixes, its leading timestamp and the record
    header after it (rank tags and the level, in any order and bracketing: ``[rank0] INFO``,
    ``INFO [rank0]``, ``[rank0] [INFO]``, a glog or c10 ``W1129 20:18:37.348000 10246 run.py:874]``);
    the level comes back as one word (``WARNING ``), or ``b""`` when the line has none."""
    rest = raw[prefix_length(raw) :]
    glog = _GLOG_TS.match(rest)
    if glog is not None:
        return _GLOG_LEVELS[glog.group(1)], rest[glog.end() :]
    rest = _LEADING_TS.sub(b"", rest, count=1)
    header = _HEADER.match(rest)
    if header is None:
        return b"", rest
    level = _LEVEL.search(rest, 0, header.end())
    name = b"" if level is None else _LEVEL_NAMES.get(level.group(1).upper(), level.group(1).upper()) + b" "
    return name, rest[header.end() :]


class Templater:
    """Templates of one run's lines: the shared masks plus that run's node names."""

    def __init__(self, nodes: Iterable[str] = ()) -> None:
        names = sorted({n for n in nodes if len(n) >= 3 and n != DEFAULT_NODE}, key=lambda n: (-len(n), n))
        shapes = [re.escape(n.encode().translate(_SHAPE)) for n in names]
        self._nodes = re.compile(rb"(?<![\w.-])(?:" + b"|".join(shapes) + rb")(?![\w-])") if names else None
        self._cache: dict[bytes, bytes | None] = {}

    def __call__(self, raw: bytes) -> bytes | None:
        """The template of one line (without its newline); None for a line with nothing to compare."""
        shape = raw.translate(_SHAPE)
        cached = self._cache.get(shape, _UNSEEN)
        if cached is not _UNSEEN:
            return cached
        tpl = self._template(shape)
        if len(shape) <= CACHE_LINE:
            if len(self._cache) >= CACHE_ENTRIES:
                self._cache.clear()
            self._cache[shape] = tpl
        return tpl

    def _template(self, shape: bytes) -> bytes | None:
        level, text = split_head(shape)
        for rx, repl in _BEFORE_NODES:
            text = rx.sub(repl, text)
        if self._nodes is not None:
            text = self._nodes.sub(b"<node>", text)
        for rx, repl in _AFTER_NODES:
            text = rx.sub(repl, text)
        text = text.strip()
        return level + text if _WORD.search(text) else None


def template(line: str | bytes, nodes: Iterable[str] = ()) -> str | None:
    """The template of one line as text (see the module's description); None when it is skipped."""
    raw = line.encode("utf-8", "surrogateescape") if isinstance(line, str) else line
    out = Templater(nodes)(raw.rstrip(b"\r\n"))
    return None if out is None else out.decode("utf-8", "replace")
