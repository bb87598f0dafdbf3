"""Timestamps in the shapes training logs use, parsed to epoch seconds.

Recognised (searched in the first `HEAD_CHARS` characters of a line):

* ISO-8601 / python logging: ``2026-11-29 12:00:01,123``, ``2026-11-29T12:00:01.123456+02:00``,
  ``[2026-11-29 12:00:01.123]`` (Megatron), with or without a zone (``Z``, ``+hh:mm``, ``+hhmm``).
* glog / c10 / torchrun: ``I1129 12:00:01.123456`` and ``[E1129 12:00:01.123456 ...]`` — no year:
  the caller's ``default_year`` (the file's mtime year) is used, one year earlier when the date
  would otherwise lie in the future relative to ``ref_epoch``.
* syslog: ``Nov 29 12:00:01`` (year as for glog) and ``dmesg -T``: ``[Sun Nov 29 12:00:01 2026]``.

A timestamp without a zone is read as UTC. Only relative times matter to the engine, and every
file of one node is read the same way, so a consistent reading is what counts.
"""

from __future__ import annotations

import functools
import math
import re
import time
from datetime import UTC, datetime, timedelta, timezone

HEAD_CHARS = 96

_MONTHS = {
    m: i
    for i, m in enumerate(
        ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"), 1
    )
}

_TS_RE = re.compile(
    r"(?P<y>(?:19|20)\d\d)-(?P<mo>[01]\d)-(?P<d>[0-3]\d)[T ](?P<h>[0-2]\d):(?P<mi>[0-5]\d):(?P<s>[0-6]\d)"
    r"(?:[.,](?P<frac>\d{1,9}))?(?P<tz>Z|[+-][01]\d:?[0-5]\d)?"
    r"|(?<![A-Za-z0-9])[IWEF](?P<gmo>[01]\d)(?P<gd>[0-3]\d) (?P<gh>[0-2]\d):(?P<gmi>[0-5]\d):(?P<gs>[0-6]\d)"
    r"(?:\.(?P<gfrac>\d{1,9}))?"
    r"|(?<![A-Za-z0-9])(?P<smon>[A-Z][a-z]{2}) {1,2}(?P<sd>[0-3]?\d) (?P<sh>[0-2]\d):(?P<smi>[0-5]\d):(?P<ss>[0-6]\d)"
    r"(?: (?P<sy>(?:19|20)\d\d))?"
)


def _frac(text: str | None) -> float:
    if not text:
        return 0.0
    return int(text) / float(10 ** len(text))


def _tz(text: str | None) -> timezone:
    if not text or text == "Z":
        return UTC
    sign = -1 if text[0] == "-" else 1
    digits = text[1:].replace(":", "")
    return timezone(sign * timedelta(hours=int(digits[:2]), minutes=int(digits[2:4])))


# Times outside these are not taken for timestamps (a clock reset to 1970, a garbled year): the
# line gets an inherited or no time instead, and the receiver refuses such a time on the wire.
SANE_MIN = 946_684_800.0  # 2000-01-01T00:00:00Z
SANE_MAX = 4_102_444_800.0  # 2100-01-01T00:00:00Z


def parse_timestamp(line: str, default_year: int, ref_epoch: float | None = None) -> float | None:
    """Epoch seconds of the first timestamp near the start of ``line`` (within 2000-2100), or None."""
    ts = _parse(line, default_year, ref_epoch)
    return ts if ts is not None and SANE_MIN <= ts < SANE_MAX else None


@functools.lru_cache(maxsize=1024)
def _iso_seconds(text: str, tz: str | None) -> float:
    """Epoch seconds of ``YYYY-MM-DD?HH:MM:SS`` (as `_TS_RE` found it) in zone ``tz``. Cached: the
    lines of a log share their second with their neighbours, and building the datetime is most
    of the cost of a parse. Raises ValueError for a date that does not exist."""
    dt = datetime(
        int(text[0:4]),
        int(text[5:7]),
        int(text[8:10]),
        int(text[11:13]),
        int(text[14:16]),
        min(int(text[17:19]), 59),
        tzinfo=_tz(tz),
    )
    return dt.timestamp()


def _parse(line: str, default_year: int, ref_epoch: float | None) -> float | None:
    m = _TS_RE.search(line, 0, HEAD_CHARS)
    if m is None:
        return None
    try:
        g = m.group
        if g("y") is not None:
            return _iso_seconds(line[m.start("y") : m.end("s")], g("tz")) + _frac(g("frac"))
        if g("gmo") is not None:
            month, day = int(g("gmo")), int(g("gd"))
            hms = (int(g("gh")), int(g("gmi")), min(int(g("gs")), 59))
            frac = _frac(g("gfrac"))
            year = None
        else:
            mon = _MONTHS.get(g("smon").lower())
            if mon is None:
                return None
            month, day = mon, int(g("sd"))
            hms = (int(g("sh")), int(g("smi")), min(int(g("ss")), 59))
            frac = 0.0
            year = int(g("sy")) if g("sy") else None
        if year is None:
            year = default_year
            ts = datetime(year, month, day, *hms, tzinfo=UTC).timestamp() + frac
            # A year-less date more than a day past the reference belongs to the previous year
            # (a December line in a file last written in January).
            if ref_epoch is not None and ts > ref_epoch + 86400:
                ts = datetime(year - 1, month, day, *hms, tzinfo=UTC).timestamp() + frac
            return ts
        return datetime(year, month, day, *hms, tzinfo=UTC).timestamp() + frac
    except ValueError:  # 2026-02-30 and friends: not a timestamp after all
        return None


def format_iso(epoch: float) -> str:
    """ISO-8601 UTC with milliseconds, e.g. ``2026-11-29T12:00:01.123Z`` (microseconds rounded
    as `datetime.fromtimestamp` rounds them, then cut to milliseconds)."""
    whole = math.floor(epoch)
    micros = round((epoch - whole) * 1e6)
    if micros >= 1_000_000:
        whole, micros = whole + 1, micros - 1_000_000
    t = time.gmtime(whole)
    return (
        f"{t.tm_year:04d}-{t.tm_mon:02d}-{t.tm_mday:02d}T{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d}."
        f"{micros // 1000:03d}Z"
    )


def parse_iso(text: str) -> float | None:
    """The epoch seconds of a `format_iso` string (any ISO-8601 with a zone); None if it is not one."""
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        return None
    if when.tzinfo is None:
        return None
    return when.timestamp()
