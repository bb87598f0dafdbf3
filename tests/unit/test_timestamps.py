from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

from hypothesis import given
from hypothesis import strategies as st

from denpex_agent.timestamps import format_iso, parse_timestamp

moments = st.datetimes(min_value=datetime(2001, 1, 1), max_value=datetime(2098, 12, 30)).map(
    lambda d: d.replace(tzinfo=UTC)
)


def _epoch(d: datetime) -> float:
    return d.timestamp()


@given(moments)
def test_python_logging_shape(d: datetime) -> None:
    ms = d.microsecond // 1000
    line = d.strftime("%Y-%m-%d %H:%M:%S") + f",{ms:03d} INFO [rank3] step 1"
    got = parse_timestamp(line, 1999)
    assert got is not None
    assert abs(got - (_epoch(d.replace(microsecond=ms * 1000)))) < 1e-6


@given(moments, st.integers(min_value=-12 * 60, max_value=14 * 60).map(lambda m: m - m % 15))
def test_iso_with_zone(d: datetime, minutes: int) -> None:
    tz = timezone(timedelta(minutes=minutes))
    local = d.astimezone(tz)
    line = local.isoformat(timespec="microseconds") + " [rank1] hello"
    got = parse_timestamp(line, 1999)
    assert got is not None
    assert abs(got - _epoch(d)) < 1e-6


@given(moments)
def test_glog_shape_takes_default_year(d: datetime) -> None:
    line = (
        f"[rank0]:[E{d:%m%d %H:%M:%S}.{d.microsecond:06d} ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught"
    )
    got = parse_timestamp(line, d.year)
    assert got is not None
    assert abs(got - _epoch(d)) < 1e-6


def test_glog_year_rolls_back_for_december_lines_in_a_january_file() -> None:
    ref = datetime(2027, 1, 2, 0, 0, tzinfo=UTC).timestamp()
    got = parse_timestamp("W1231 23:59:58.000000 123 torch/distributed/elastic/agent.py:1] x", 2027, ref)
    assert got == datetime(2026, 12, 31, 23, 59, 58, tzinfo=UTC).timestamp()


def test_megatron_brackets_and_torchrun_agent_lines() -> None:
    assert (
        parse_timestamp("[2026-11-29 12:00:01.123] iteration 17/ 100 |", 2000)
        == datetime(2026, 11, 29, 12, 0, 1, 123000, tzinfo=UTC).timestamp()
    )
    got = parse_timestamp("I1129 12:00:01.123000 4242 torch/distributed/run.py:1] starting", 2026)
    assert got == datetime(2026, 11, 29, 12, 0, 1, 123000, tzinfo=UTC).timestamp()


def test_syslog_and_dmesg_shapes() -> None:
    assert (
        parse_timestamp("Nov 29 12:00:01 host kernel: NVRM: Xid", 2026)
        == datetime(2026, 11, 29, 12, 0, 1, tzinfo=UTC).timestamp()
    )
    assert (
        parse_timestamp("[Sun Nov 29 12:00:01 2026] NVRM: Xid (PCI:0000:1b:00): 79", 1990)
        == datetime(2026, 11, 29, 12, 0, 1, tzinfo=UTC).timestamp()
    )


@given(st.text(max_size=200))
def test_never_raises_on_arbitrary_text(text: str) -> None:
    got = parse_timestamp(text, 2026)
    assert got is None or isinstance(got, float)


def test_impossible_dates_are_not_timestamps() -> None:
    assert parse_timestamp("2026-02-30 12:00:00,000 INFO x", 2026) is None
    assert parse_timestamp("no time here", 2026) is None


def test_format_iso_round_trip() -> None:
    ts = datetime(2026, 11, 29, 12, 0, 1, 123000, tzinfo=UTC).timestamp()
    assert format_iso(ts) == "2026-11-29T12:00:01.123Z"
    assert parse_timestamp(format_iso(ts), 2000) == ts


def test_format_iso_agrees_with_datetime_everywhere_in_the_window() -> None:
    """The hand-rolled formatter (hot in every diagnosis) rounds as `datetime` does, carries into
    the next second, and formats every date of the accepted window alike."""
    import random
    from datetime import UTC, datetime

    def reference(epoch: float) -> str:
        dt = datetime.fromtimestamp(epoch, tz=UTC)
        return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond // 1000:03d}Z"

    rng = random.Random(7)
    samples = [rng.uniform(946684800, 4102444800) for _ in range(20000)]
    samples += [round(rng.uniform(1.7e9, 1.8e9), rng.randrange(0, 7)) for _ in range(20000)]
    samples += [1764417600.9999996, 1764417600.9995, 1764417599.0000004, 951782400.0]
    for epoch in samples:
        assert format_iso(epoch) == reference(epoch), epoch
