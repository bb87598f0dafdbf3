"""Properties of the scanner that hold for any input, over the real rule library: scanning ends,
and the events do not depend on where the bytes were cut into reads, nor on the file going quiet
between reads (the live agent's flush), as long as no read leaves a line or a record unfinished
for longer than the fold timeout."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from denpex_agent.events import Event
from denpex_agent.matcher import Matcher
from denpex_agent.rules import RuleSet, load_rules
from denpex_agent.scanner import LineScanner, Source, _LineCounter

PREFIX = b"2026-11-29 10:00:00,000 INFO [rank0] step 1/10 | loss 1.0\n"
ENDINGS = (b"\n", b"", b"\r\n", b"   \n", b"\n\n")
EXAMPLES = sorted({ex.text.encode() for r in load_rules() for ex in r.examples})
RECORDS = (
    b"2026-11-29 10:00:01,000 INFO [rank0] step 2 | loss 1.0\n"
    b"[rank0]: Traceback (most recent call last):\n"
    b'[rank0]:   File "train.py", line 3, in <module>\n'
    b"[rank0]:     loss.backward()\n"
    b"[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    b"2026-11-29 10:00:02,000 INFO [rank0] after\n"
    b"Traceback (most recent call last):\n"
    b'  File "/usr/bin/torchrun", line 8, in <module>\n'
    b"torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
    b"============================================================\n"
    b"train.py FAILED\n"
    b"------------------------------------------------------------\n"
    b"Root Cause (first observed failure):\n"
    b"[0]:\n"
    b"  time      : 2026-11-29_12:00:05\n"
    b"  rank      : 3 (local_rank: 1)\n"
    b"  exitcode  : -9 (pid: 1234)\n"
    b"  traceback : Signal 9 (SIGKILL) received by PID 1234\n"
    b"============================================================\n"
    b"[rank1]:[E1129 10:00:03.000000 1 ProcessGroupNCCL.cpp:1] [Rank 1] Watchdog caught collective operation "
    b"timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600010 "
    b"milliseconds before timing out.\n"
    b"Exception raised from checkTimeout at ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:565 "
    b"(most recent call first):\n"
    b"frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x57 (0x7f in libc10.so)\n"
    b"frame #1: c10d::ProcessGroupNCCL::WorkNCCL::checkTimeout() + 0x1d2 (0x7f in libtorch_cuda.so)\n"
    b"--------------------------------------------------------------------------\n"
    b"Primary job  terminated normally, but 1 process returned\n"
    b"a non-zero exit code. Per user-direction, the job has been aborted.\n"
    b"--------------------------------------------------------------------------\n"
    b"mpirun detected that one or more processes exited with non-zero status, thus causing\n"
    b"the job to be terminated. The first process to do so was:\n"
    b"\n"
    b"  Process name: [[50371,1],2]\n"
    b"  Exit code:    1\n"
    b"--------------------------------------------------------------------------\n"
    b"Killed\n"
    b"heinzel135:151780:151928 [2] NCCL INFO Ring 00 : 2[2] -> 3[3] via direct shared memory\n"
    b"heinzel136:84299:84449 [0] NCCL INFO Ring 00 : 3 -> 4 [receive] via NET/IB/0\n"
    b"heinzel135:151780:151928 [2] include/shm.h:42 NCCL WARN Cuda failure 'invalid argument'\n"
    b"heinzel136:84299:84449 [0] include/shm.h:42 NCCL WARN Cuda failure 'invalid argument'\n"
)


class _Hang(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Fail (instead of hanging the suite) when the body runs longer than ``seconds``."""

    def fire(_sig: int, _frame: object) -> None:
        raise _Hang(f"did not finish within {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _source() -> Source:
    return Source(job="j", agent="a", node="n", rank=None, local_rank=None, file="f.log", identity="i",
                  default_year=2026)  # fmt: skip


def _key(e: Event) -> tuple[object, ...]:
    # repr: a NaN loss is a value like any other here (nan != nan)
    return (e.kind, e.rule, e.offset, e.line_no, e.rank, e.ts, e.text, repr(sorted(e.fields.items())))


def _scan(
    matcher: Matcher, pieces: list[bytes], quiet: frozenset[int] = frozenset()
) -> list[tuple[object, ...]]:
    """Feed ``pieces``; after the pieces whose index is in ``quiet`` the file goes quiet for less
    than the fold timeout (the agent's idle flush). Tips (live sampling by wall time) are left out."""
    sc = LineScanner(matcher, _source())
    out: list[Event] = []
    for i, piece in enumerate(pieces):
        out += sc.feed(piece)
        if i in quiet:
            out += sc.flush()
    out += sc.finish()
    return sorted(_key(e) for e in out if not e.fields.get("tip"))


@pytest.fixture(scope="module")
def matcher(library: RuleSet) -> Matcher:
    return Matcher(library)


def test_a_pattern_that_reaches_past_its_newline_cannot_stall_the_scan(matcher: Matcher) -> None:
    with _deadline(5):
        hits = matcher.scan(b"Traceback (most recent call last):\n")
        assert [h.rule.id for h in hits] == ["python-traceback"]
        assert matcher.scan(b"x\nTraceback (most recent call last):  \n\n\n")[0].start == 2
        events = _scan(matcher, [PREFIX + b"Traceback (most recent call last):\n"])
    assert [k[1] for k in events if k[0] == "match"] == ["python-traceback"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(example=st.sampled_from(EXAMPLES), ending=st.sampled_from(ENDINGS), tail=st.binary(max_size=64))
def test_every_cut_of_every_example_gives_the_same_events(
    matcher: Matcher, example: bytes, ending: bytes, tail: bytes
) -> None:
    data = PREFIX + example + ending + tail
    with _deadline(20):
        whole = _scan(matcher, [data])
        for cut in range(len(data) + 1):
            pieces = [data[:cut], data[cut:]]
            assert _scan(matcher, pieces) == whole, cut
            if data[:cut].endswith(b"\n"):  # quiet after a whole line, shorter than the fold timeout
                assert _scan(matcher, pieces, frozenset({0})) == whole, cut


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=2048))
def test_random_bytes_terminate_and_do_not_depend_on_cuts(matcher: Matcher, data: bytes) -> None:
    with _deadline(20):
        whole = _scan(matcher, [data])
        for cut in range(0, len(data) + 1, max(1, len(data) // 64)):
            assert _scan(matcher, [data[:cut], data[cut:]]) == whole


CHAINED = (
    b"Traceback (most recent call last):\n"
    b'  File "data.py", line 9, in load\n'
    b"KeyError: 'shard-7'\n"
    b"\n"
    b"During handling of the above exception, another exception occurred:\n"
    b"\n"
    b"Traceback (most recent call last):\n"
    b'  File "train.py", line 2, in <module>\n'
    b"RuntimeError: DataLoader worker (pid 77) exited unexpectedly\n"
    b"2026-11-29 10:00:05,000 INFO [rank0] shutting down\n"
)


def test_records_cut_anywhere_with_quiet_spells_between_whole_lines(matcher: Matcher) -> None:
    """Tracebacks, torchrun's summary and C++ stacks stay open across reads: a header read
    alone, a quiet spell, then the rest, is still one event. A quiet spell splits a record only
    right after a point where it looks complete and the writer prints the rest in the same
    breath (a chained traceback after its first exception line, a C++ stack after its error
    line): those boundaries, and only those, are where the live reader may differ, and only if
    the writer stalls there for longer than the quiet spell (FOLD_IDLE_S)."""
    data = RECORDS + CHAINED + RECORDS
    with _deadline(120):
        whole = _scan(matcher, [data])
        matches = [k for k in whole if k[0] == "match"]
        assert len(matches) == 2 * 8 + 1
        # an NCCL warning takes the rank its process's INFO line stated before it, cut where it may
        assert [k[4] for k in matches if "NCCL WARN Cuda failure" in str(k[6])] == [2, 4] * 2
        watchdog = next(k for k in matches if "Watchdog" in str(k[6]))
        assert str(watchdog[6]).endswith("(0x7f in libtorch_cuda.so)")  # the C++ stack is part of it
        mpi = next(k for k in matches if "detected that one or more" in str(k[6]))
        assert str(mpi[6]).endswith("Exit code:    1")  # Open MPI's report is part of its heading's event
        split_by_design = set()
        for cut in range(len(data) + 1):
            pieces = [data[:cut], data[cut:]]
            assert _scan(matcher, pieces) == whole, (cut, data[:cut][-60:])
            if data[:cut].endswith(b"\n") and _scan(matcher, pieces, frozenset({0})) != whole:
                split_by_design.add(data[:cut].rsplit(b"\n", 2)[-2][-40:])
    assert split_by_design == {
        b"r 600010 milliseconds before timing out.",  # the error line, before its C++ stack
        b"upNCCL.cpp:565 (most recent call first):",  # inside the stack
        b" std::string) + 0x57 (0x7f in libc10.so)",
        b"KeyError: 'shard-7'",  # the first exception line of a chained traceback
        b"",  # the blank line after it
    }


def test_open_mpis_exit_report_names_the_first_process_and_its_exit_code(matcher: Matcher) -> None:
    """The report under mpirun's heading gives its event the rank that exited first and the exit
    code (a launcher's witness); a report cut off after its heading waits for them through a
    quiet spell, and a heading with nothing after it still makes one event when the data ends."""
    block = RECORDS[RECORDS.index(b"mpirun detected") : RECORDS.index(b"Killed\n")]
    after_heading = block.index(b"\n") + 1

    def reports(pieces: list[bytes], quiet: bool = False) -> list[dict[str, object]]:
        sc = LineScanner(matcher, _source())
        out = sc.feed(pieces[0]) + (sc.flush() if quiet else [])
        for piece in pieces[1:]:
            out += sc.feed(piece)
        return [e.fields for e in out + sc.finish() if e.rule == "mpirun-nonzero-exit"]

    assert reports([block]) == [{"culprit_rank": 2, "exitcode": 1}]
    assert reports([block[:after_heading], block[after_heading:]], quiet=True) == reports([block])
    assert reports([block[:after_heading]]) == [{}]


def test_a_forced_close_after_the_fold_timeout_ends_the_record_where_the_data_ends(matcher: Matcher) -> None:
    """The writer died mid-traceback: after the fold timeout the open record is one event, as
    the post-mortem reader sees it at the end of the file."""
    data = PREFIX + b'Traceback (most recent call last):\n  File "x.py", line 1, in f\n'
    sc = LineScanner(matcher, _source())
    assert [e for e in sc.feed(data) if e.kind == "match"] == []
    assert [e for e in sc.flush() if e.kind == "match"] == []  # quiet, but no exception line yet
    forced = [e for e in sc.flush(force=True) if e.kind == "match"]
    post_mortem = [k for k in _scan(matcher, [data]) if k[0] == "match"]
    assert [_key(e) for e in forced] == post_mortem
    assert sc.pending == 0


class _CountingBytes(bytes):
    """A buffer that adds up the bytes its `count` is asked to look at."""

    looked = 0

    def count(self, sub: object, start: int = 0, end: int | None = None) -> int:  # type: ignore[override]
        stop = len(self) if end is None else end
        _CountingBytes.looked += max(0, stop - start)
        return super().count(sub, start, end)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from([b"a", b"bc", b"\n", b"def\n", b"\n\n"]), max_size=80),
    st.lists(st.integers(min_value=0, max_value=400), max_size=40),
    st.integers(min_value=0, max_value=10**6),
)
def test_line_numbers_are_right_in_any_order_asked(parts: list[bytes], asked: list[int], first: int) -> None:
    buf = b"".join(parts)
    counter = _LineCounter(buf, first)
    for pos in asked:
        pos = min(pos, len(buf))
        assert counter.line_at(pos) == first + buf.count(b"\n", 0, pos)


def test_each_byte_is_counted_about_once_when_the_end_is_asked_first() -> None:
    """The scanner asks for the buffer's end, then for the step lines before it in order: the
    lines are counted from the nearest position asked before, not from the buffer's start."""
    buf = _CountingBytes(b"step line\n" * 20_000)
    counter = _LineCounter(buf, 1)
    _CountingBytes.looked = 0
    assert counter.line_at(len(buf)) == 20_001
    for k in range(256):
        assert counter.line_at(k * 10) == 1 + k
    assert _CountingBytes.looked <= 2 * len(buf)
