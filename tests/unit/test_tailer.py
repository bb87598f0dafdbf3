"""Tailer on real files (no broker): truncation detection and exact reads."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from denpex_agent.checkpoint import Checkpoints
from denpex_agent.events import Event
from denpex_agent.matcher import Matcher
from denpex_agent.rules import load_rules
from denpex_agent.tailer import HEAD_BYTES, Tailer

MATCHER = Matcher(load_rules())
ILLEGAL = "RuntimeError: CUDA error: an illegal memory access was encountered"
AFTER = "2026-11-29 12:01:00,000 INFO the next line\n"  # an error waits for the line after it (a C++ stack?)


@pytest.fixture
def tailers() -> Iterator[list[Tailer]]:
    made: list[Tailer] = []
    yield made
    for t in made:
        t.close()


def _tailer(tmp_path: Path, made: list[Tailer]) -> Tailer:
    t = Tailer(
        (str(tmp_path / "logs" / "rank*.log"),),
        MATCHER,
        Checkpoints(tmp_path / "state", "a"),
        job="j",
        node="n",
        agent="a",
        context_lines=5,
        progress_interval=0.0,
    )
    made.append(t)
    return t


def _lines(prefix: str, n: int) -> str:
    return "".join(
        f"2026-11-29 12:00:{i % 60:02d},000 INFO {prefix} line {i:05d} of the log\n" for i in range(n)
    )


def _matches(events: list[Event]) -> list[Event]:
    return [e for e in events if e.kind == "match"]


def _one_file(tmp_path: Path, tailers: list[Tailer], text: str) -> tuple[Path, Tailer]:
    """logs/rank0.log holding ``text``, and a tailer that has discovered it."""
    logs = tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    path = logs / "rank0.log"
    path.write_text(text)
    t = _tailer(tmp_path, tailers)
    t.discover()
    return path, t


def test_copytruncate_regrowing_past_the_position_is_noticed_for_a_file_that_started_empty(
    tmp_path: Path, tailers: list[Tailer]
) -> None:
    path, t = _one_file(tmp_path, tailers, "")
    assert len(t.files) == 1 and t.files[0].pos == 0

    path.write_text(_lines("old", 40) + ILLEGAL + " first\n" + AFTER)
    events, _, _ = t.poll(1 << 20)
    assert [e.line_no for e in _matches(events)] == [41]
    old_size = path.stat().st_size

    # copytruncate, then the writer goes on and the file is larger than before by the next look
    shutil.copy(path, path.with_name("rank0.log.1"))
    with path.open("r+") as fh:
        fh.truncate(0)
    with path.open("a") as fh:
        fh.write(_lines("new", 60) + ILLEGAL + " second\n" + AFTER)
    assert path.stat().st_size > old_size
    events, _, _ = t.poll(1 << 20)

    assert t.stats.truncations == 1
    got = _matches(events)
    assert [(e.line_no, e.text.endswith("second")) for e in got] == [(61, True)]
    assert t.files[0].pos == path.stat().st_size


def test_known_first_bytes_grow_to_the_bound_and_stop(tmp_path: Path, tailers: list[Tailer]) -> None:
    path, t = _one_file(tmp_path, tailers, "short\n")
    t.poll(1 << 20)
    assert t.files[0].head == b"short\n"
    with path.open("a") as fh:
        fh.write(_lines("more", 20))
    t.poll(1 << 20)
    assert t.files[0].head == path.read_bytes()[:HEAD_BYTES]
    assert t.stats.truncations == 0


def test_a_file_resumed_from_a_checkpoint_then_rewritten_in_place_restarts(
    tmp_path: Path, tailers: list[Tailer]
) -> None:
    path, t = _one_file(tmp_path, tailers, _lines("old", 30))
    _, marks, _ = t.poll(1 << 20)
    for m in marks:
        t.checkpoints.advance(m.identity, m.path, m.offset, m.line_no)
    t.checkpoints.write(t.checkpoints.snapshot() or b"")
    t.close()

    t2 = _tailer(tmp_path, tailers)
    t2.checkpoints.load()
    t2.discover()
    assert t2.files[0].pos == path.stat().st_size  # resumed where the checkpoint said
    # rewritten in place (same inode, as many bytes and more): only the first bytes tell
    with path.open("r+") as fh:
        fh.write(_lines("NEW", 30) + ILLEGAL + "\n" + AFTER)
    events, _, _ = t2.poll(1 << 20)
    assert t2.stats.truncations == 1
    assert [e.line_no for e in _matches(events)] == [31]


def test_reads_stop_at_the_size_seen_and_pick_up_the_rest(tmp_path: Path, tailers: list[Tailer]) -> None:
    path, t = _one_file(tmp_path, tailers, _lines("a", 10))
    t.poll(1 << 20)
    size = path.stat().st_size
    assert t.files[0].pos == size
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, (ILLEGAL + "\n" + AFTER).encode())
    finally:
        os.close(fd)
    events, marks, more = t.poll(1 << 20)
    assert not more and [e.line_no for e in _matches(events)] == [11]
    assert marks[-1].offset == path.stat().st_size


def test_a_traceback_split_across_reads_is_one_event_and_a_dead_writer_s_record_closes(
    tmp_path: Path, tailers: list[Tailer]
) -> None:
    """The header and the first frame in one read, a quiet spell longer than FOLD_IDLE_S, then
    the exception line: one event, as post-mortem. A record whose writer died open is taken as
    it is after the fold timeout, not before."""
    now = [1000.0]
    logs = tmp_path / "logs"
    logs.mkdir()
    path = logs / "rank0.log"
    path.write_text(_lines("x", 3))
    t = Tailer(
        (str(logs / "rank*.log"),), MATCHER, Checkpoints(tmp_path / "state", "a"), job="j", node="n",
        agent="a", progress_interval=0.0, fold_timeout=5.0, clock=lambda: now[0],
    )  # fmt: skip
    tailers.append(t)
    t.discover()
    t.poll(1 << 20)

    def write(text: str, wait: float) -> list[Event]:
        with path.open("a") as fh:
            fh.write(text)
        got = _matches(t.poll(1 << 20)[0])
        now[0] += wait
        return got + _matches(t.poll(1 << 20)[0])

    assert write('Traceback (most recent call last):\n  File "train.py", line 9, in <module>\n', 1.0) == []
    (ev,) = write("KeyError: 'shard-9'\n", 0.5)  # complete once the file is quiet after it
    assert ev.rule == "python-traceback" and ev.line_no == 4
    assert ev.text.startswith("Traceback") and ev.text.endswith("KeyError: 'shard-9'")
    assert write("Traceback (most recent call last):\n", 4.0) == []  # not yet: under the fold timeout
    now[0] += 1.5
    (dead,) = _matches(t.poll(1 << 20)[0])  # the writer died after the header: taken as it is
    assert dead.line_no == 7 and dead.text == "Traceback (most recent call last):"


def test_a_line_begun_a_moment_ago_counts_as_unread(tmp_path: Path, tailers: list[Tailer]) -> None:
    """Half of a line read (its writer paused mid-line) is still on its way: the agent says it is
    behind, so the daemon's alert waits for it; a line held for longer (a progress bar redrawn
    with carriage returns, a stalled writer) no longer counts."""
    path, t = _one_file(tmp_path, tailers, _lines("old", 3))
    now = [1000.0]
    t.clock = lambda: now[0]
    t.poll(1 << 20)
    assert t.behind == 0
    with path.open("a") as fh:
        fh.write("2026-11-29 12:00:09,000 WARNING [rank2] layers.0.attn_norm: fp16 var")
    now[0] += 0.1
    t.poll(1 << 20)
    held = t.behind
    assert held == len("2026-11-29 12:00:09,000 WARNING [rank2] layers.0.attn_norm: fp16 var")
    now[0] += 0.5
    t.poll(1 << 20)
    assert t.behind == held  # still fresh
    now[0] += 1.0
    t.poll(1 << 20)
    assert t.behind == 0  # held too long to count
    with path.open("a") as fh:  # the line an error-level rule matches waits for the next one (a C++ stack?)
        fh.write("iance overflowed (inf)\n2026-11-29 12:00:10,000 INFO old line 00003 of the log\n")
    now[0] += 0.1
    events, _, _ = t.poll(1 << 20)
    assert t.behind == 0 and any(e.rule == "layernorm-inf-variance" for e in _matches(events))
