"""inotify-driven reading: the watcher's wake-ups, the idle reader thread, network filesystems."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from denpex_agent import watcher as watcher_mod
from denpex_agent.agent import Agent
from denpex_agent.checkpoint import Checkpoints
from denpex_agent.config import AgentConfig
from denpex_agent.matcher import Matcher
from denpex_agent.rules import load_rules
from denpex_agent.tailer import Mark, Tailer
from denpex_agent.watcher import Watcher, fstype, is_network_fs, open_watcher, parse_mounts

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify is Linux's")


@pytest.fixture
def w() -> Watcher:
    watcher = open_watcher()
    assert watcher is not None
    yield watcher
    watcher.close()


def _wait_for(w: Watcher, want: str, timeout: float = 2.0) -> set[str]:
    seen: set[str] = set()
    end = time.monotonic() + timeout
    while want not in seen and time.monotonic() < end:
        seen |= w.wait(end - time.monotonic()).paths
    return seen


def test_watcher_wakes_on_append_create_rename_and_stop(tmp_path: Path, w: Watcher) -> None:
    d = str(tmp_path.resolve())
    log = tmp_path / "rank0.log"
    log.write_text("start\n")
    assert w.add(d)
    assert not w.wait(0.05)  # nothing happened: a timeout, no change

    with log.open("a") as fh:  # append
        fh.write("a line\n")
    assert os.path.join(d, "rank0.log") in _wait_for(w, os.path.join(d, "rank0.log"))

    (tmp_path / "rank1.log").write_text("")  # create
    ch = w.wait(2.0)
    assert ch.structure and os.path.join(d, "rank1.log") in ch.paths | _wait_for(
        w, os.path.join(d, "rank1.log")
    )
    w.read_events()

    log.rename(tmp_path / "rank0.log.1")  # rename (rotation)
    ch = w.wait(2.0)
    assert ch.structure
    assert {os.path.join(d, "rank0.log"), os.path.join(d, "rank0.log.1")} <= ch.paths | w.read_events().paths

    # stop: a wake from another thread ends a long wait at once
    threading.Timer(0.1, w.wake).start()
    t0 = time.monotonic()
    ch = w.wait(10.0)
    assert ch.woken and not ch
    assert time.monotonic() - t0 < 1.0


def test_mount_table_and_network_types() -> None:
    mounts = parse_mounts(
        "/dev/sda1 / ext4 rw 0 0\n"
        "srv:/scratch /scratch nfs4 rw 0 0\n"
        "lfs@tcp:/fs /lustre lustre rw 0 0\n"
        "sshfs#x /mnt/my\\040dir fuse.sshfs rw 0 0\n"
    )
    assert fstype("/scratch/job/rank0.log", mounts) == "nfs4"
    assert fstype("/scratchy/rank0.log", mounts) == "ext4"
    assert fstype("/mnt/my dir/a.log", mounts) == "fuse.sshfs"
    assert [is_network_fs(t) for t in ("nfs4", "lustre", "fuse.sshfs", "beegfs", "gpfs", "cifs", "ext4", "xfs")] == [
        True, True, True, True, True, True, False, False,
    ]  # fmt: skip


def _tailer(globs: tuple[str, ...], state: Path, **kw: object) -> Tailer:
    return Tailer(
        globs,
        Matcher(load_rules()),
        Checkpoints(str(state), "a1"),
        job="j",
        node="n",
        agent="a1",
        watch=True,
        **kw,  # type: ignore[arg-type]
    )


def test_only_files_inotify_named_are_looked_at(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    for r in range(4):
        (logs / f"rank{r}.log").write_text("")
    t = _tailer((str(logs / "rank*.log"),), tmp_path / "state", mounts=lambda: "/dev/sda1 / ext4 rw 0 0\n")
    t.discover()
    assert t.roots_watched and all(f.watched for f in t.files)
    t.poll(1 << 20)  # the first poll looks at every file
    looks = t.looks
    t.poll(1 << 20)
    assert t.looks == looks  # nothing written: no file looked at
    with (logs / "rank2.log").open("a") as fh:
        fh.write("RuntimeError: CUDA error: an illegal memory access was encountered\n")
    assert t.wait(2.0)
    t.poll(1 << 20)
    assert t.looks == looks + 1
    assert [f.pos > 0 for f in t.files] == [False, False, True, False]
    t.close()


def test_file_on_a_network_filesystem_is_polled(tmp_path: Path) -> None:
    logs = tmp_path / "nfs"
    logs.mkdir()
    log = logs / "rank0.log"
    log.write_text("")
    table = f"/dev/sda1 / ext4 rw 0 0\nsrv:/export {logs.resolve()} nfs4 rw 0 0\n"
    t = _tailer((str(logs / "*.log"),), tmp_path / "state", mounts=lambda: table)
    t.discover()
    assert [f.watched for f in t.files] == [False]
    assert not t.roots_watched  # new files there are found by periodic discovery
    t.poll(1 << 20)
    assert t.due_in(0.15) == pytest.approx(0.15)  # polled every poll_interval
    with log.open("a") as fh:
        fh.write("RuntimeError: CUDA error: an illegal memory access was encountered\n")
    # no event is waited for: the poll looks at the file anyway
    t.poll(1 << 20)
    assert t.files[0].pos == log.stat().st_size
    t.close()


def _reader(tmp_path: Path, mode: str) -> tuple[Agent, threading.Thread, asyncio.AbstractEventLoop]:
    logs = tmp_path / f"logs-{mode}"
    logs.mkdir()
    (logs / "rank0.log").write_text("step 1 loss 2.0\n")
    cfg = AgentConfig(
        job="j",
        node="n",
        logs=(str(logs / "*.log"),),
        state_dir=str(tmp_path / f"state-{mode}"),
        follow_mode=mode,
    )
    agent = Agent(cfg)
    loop = asyncio.new_event_loop()
    agent._loop = loop  # the reader thread hands its items to the loop; none is running here
    th = threading.Thread(target=agent._read_forever, daemon=True)
    th.start()
    return agent, th, loop


def test_idle_reader_thread_sleeps_and_stops_at_once(tmp_path: Path) -> None:
    agent, th, loop = _reader(tmp_path, "auto")
    try:
        assert agent.tailer.watching
        time.sleep(1.0)  # start-up: discovery, first polls, the progress tip
        polls = agent.tailer.polls
        time.sleep(3.0)
        assert agent.tailer.polls - polls <= 1  # today's polling would make 20
        with open(agent.tailer.files[0].path, "a") as fh:  # a write wakes it at once
            fh.write("step 2 loss 1.9\n")
        read = agent.tailer.stats.bytes_read
        end = time.monotonic() + 1.0
        while agent.tailer.stats.bytes_read == read and time.monotonic() < end:
            time.sleep(0.01)
        assert agent.tailer.stats.bytes_read > read
        assert time.monotonic() < end
    finally:
        t0 = time.monotonic()
        agent.request_stop()
        th.join(2.0)
        assert not th.is_alive() and time.monotonic() - t0 < 0.5
        agent.tailer.close()
        loop.close()


def test_follow_mode_poll_polls(tmp_path: Path) -> None:
    agent, th, loop = _reader(tmp_path, "poll")
    try:
        assert not agent.tailer.watching
        time.sleep(1.0)
        polls = agent.tailer.polls
        time.sleep(1.5)
        assert agent.tailer.polls - polls >= 5  # every poll_interval (0.15 s)
    finally:
        agent.request_stop()
        th.join(2.0)
        agent.tailer.close()
        loop.close()


def test_no_inotify_falls_back_to_polling(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(watcher_mod.sys, "platform", "darwin")
    monkeypatch.setattr(watcher_mod, "_said_no_inotify", False)
    with caplog.at_level("INFO"):
        assert open_watcher() is None
        assert open_watcher() is None
    assert sum("no inotify" in r.message for r in caplog.records) == 1


def _settle(t: Tailer) -> list[Mark]:
    """What the reader thread does after a wake: rediscover if a name moved, then look."""
    t.wait(0.5)
    if t.discover_wanted:
        t.discover()
    return t.poll(1 << 20)[1]


def test_rotation_and_copytruncate_with_inotify(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    log = logs / "rank0.log"
    writer = log.open("a", buffering=1)
    writer.write("step 1 loss 2.0\n")
    t = _tailer((str(logs / "rank*.log"),), tmp_path / "state", mounts=lambda: "/dev/sda1 / ext4 rw 0 0\n")
    try:
        t.discover()
        t.poll(1 << 20)
        assert t.files[0].pos == log.stat().st_size
        first = t.files[0].identity

        # rename rotation: the old file is read to its end (then drained: closed once quiet for
        # DRAIN_GRACE_S, which a slow machine may reach within these looks), the new one followed
        log.rename(logs / "rank0.log.1")
        writer.write("step 2 loss 1.9\n")  # still the old file
        writer.close()
        log.write_text("step 3 loss 1.8\n")
        marks: list[Mark] = []
        for _ in range(10):
            marks += _settle(t)
            by_path = {f.path: f for f in t.files if not f.draining}
            old_read = max((m.offset for m in marks if m.identity == first), default=-1)
            if str(log) in by_path and old_read == (logs / "rank0.log.1").stat().st_size:
                break
        assert old_read == (logs / "rank0.log.1").stat().st_size
        assert all(f.draining for f in t.files if f.identity == first)
        assert by_path[str(log)].pos == log.stat().st_size and by_path[str(log)].identity != first

        # copytruncate: emptied and refilled, read again from its start
        with log.open("r+") as fh:
            fh.truncate(0)
        with log.open("a") as fh:
            fh.write("x\n")
        _settle(t)
        assert t.stats.truncations == 1
        assert {f.path: f for f in t.files if not f.draining}[str(log)].pos == 2
    finally:
        t.close()


def test_a_moved_directory_is_watched_anew(tmp_path: Path, w: Watcher) -> None:
    d = tmp_path / "a"
    d.mkdir()
    assert w.add(str(d.resolve()))
    d.rename(tmp_path / "b")
    ch = w.wait(2.0)
    assert ch.structure
    assert not w.watching(str(d.resolve()))
    assert w.add(str((tmp_path / "b").resolve()))
    (tmp_path / "b" / "x.log").write_text("x\n")
    assert str((tmp_path / "b" / "x.log").resolve()) in _wait_for(
        w, str((tmp_path / "b" / "x.log").resolve())
    )


def test_a_file_written_without_pause_is_polled_without_write_events(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    log = logs / "rank0.log"
    log.write_text("")
    (logs / "rank1.log").write_text("")
    t = _tailer((str(logs / "rank*.log"),), tmp_path / "state", mounts=lambda: "/dev/sda1 / ext4 rw 0 0\n")
    t.discover()
    t.poll(1 << 20)
    assert t.watcher is not None
    with log.open("a", buffering=1) as fh:
        for step in range(2):  # written since each of two looks: writes are no longer reported
            fh.write(f"step {step} loss 2.0\n")
            assert t.wait(2.0)
            t.poll(1 << 20)
        assert t.muted and t.due_in(0.15) == 0.15
        for step in range(2, 40):  # no event per write; every file is looked at each poll
            fh.write(f"step {step} loss 2.0\n")
        assert not t.watcher.wait(0.05)
        looks = t.looks
        t.poll(1 << 20)
        assert t.looks == looks + 2 and t.files[0].pos == log.stat().st_size
        (logs / "rank2.log").write_text("")  # names are still reported while muted
        assert t.wait(2.0) and t.discover_wanted
        t.poll(1 << 20)  # nothing new: writes are reported again, and every file looked at
        assert not t.muted and t.due_in(0.15) == 0.0
        fh.write("step 40 loss 1.9\n")  # written between those two polls: not lost
    t.poll(1 << 20)
    assert t.files[0].pos == log.stat().st_size and t.due_in(0.15) > 0.0
    with log.open("a") as fh:
        fh.write("step 41 loss 1.9\n")
    assert t.wait(2.0)  # and inotify wakes the reader again
    t.close()


def test_muting_reports_a_directory_gone_meanwhile(tmp_path: Path, w: Watcher) -> None:
    kept, gone = tmp_path / "kept", tmp_path / "gone"
    kept.mkdir()
    gone.mkdir()
    assert w.add(str(kept.resolve())) and w.add(str(gone.resolve()))
    gone.rmdir()
    assert not w.mute(True)  # one could not be watched again: worth a discovery
    assert w.muted and w.directories == {str(kept.resolve())}
    (kept / "rank0.log").write_text("x\n")  # a new name is reported, its write is not
    ch = w.wait(2.0)
    assert ch.structure
    with (kept / "rank0.log").open("a") as fh:
        fh.write("y\n")
    assert not w.wait(0.1)
    assert w.mute(False) and not w.muted
    with (kept / "rank0.log").open("a") as fh:
        fh.write("z\n")
    assert w.wait(2.0)
