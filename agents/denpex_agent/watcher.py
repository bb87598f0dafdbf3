"""Learn of writes from the kernel (inotify) instead of looking at every file on a timer.

`Watcher` watches *directories* (those of followed files and the roots of the globs) through
libc's public ``inotify_init1``/``inotify_add_watch``/``inotify_rm_watch`` (ctypes, no
dependency) and ``os.read`` on its descriptor; `Watcher.wait` blocks until something changed, the
timeout passed, or `Watcher.wake` was called (a pipe: a stop interrupts the wait at once).

inotify is silent for writes made on another machine, so files on network filesystems (NFS,
CIFS/SMB, Lustre, GPFS, BeeGFS, FUSE, ...) are still polled: `fstype` tells a path's filesystem
from the mount table (/proc/self/mounts). Where inotify is missing (not Linux) `open_watcher`
returns None and the tailer polls everything, as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import select
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000

DIR_MASK = (
    IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
    | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR
)  # fmt: skip
# a name appeared, went or moved: worth a discovery (a new file, a rotation)
STRUCTURE = IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF
# while the tailer polls a busy directory's files anyway (`Watcher.mute`): names only, no writes
MUTED_MASK = STRUCTURE | IN_ONLYDIR
_EVENT = struct.Struct("iIII")

# Filesystems where a write made on another node raises no inotify event on this one.
NETWORK_FS = frozenset(
    {
        "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs",
        "9p", "afs", "ocfs2", "gfs2", "pvfs2", "orangefs", "wekafs", "panfs",
    }
)  # fmt: skip


def is_network_fs(fstype: str) -> bool:
    return fstype in NETWORK_FS or fstype == "fuse" or fstype.startswith(("fuse.", "fuseblk"))


def _unescape(field: str) -> str:
    """/proc/self/mounts writes a space as \\040, a tab as \\011, a backslash as \\134."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mounts(text: str) -> list[tuple[str, str]]:
    """(mount point, filesystem type), longest mount point first."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3:
            out.append((_unescape(parts[1]), parts[2]))
    out.sort(key=lambda m: len(m[0]), reverse=True)
    return out


def read_mounts() -> str:
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


def fstype(path: str, mounts: list[tuple[str, str]]) -> str:
    """The filesystem type of the mount holding ``path`` (resolved), "" if unknown."""
    real = os.path.realpath(path)
    for point, kind in mounts:  # longest first: the innermost mount wins
        if real == point or real.startswith(point.rstrip("/") + "/"):
            return kind
    return ""


@dataclass(slots=True)
class Changes:
    """What one wait saw: the paths named by events (directory/name, or a watched directory
    itself), whether a name appeared/went/moved, and whether the kernel dropped events."""

    paths: set[str] = field(default_factory=set)
    structure: bool = False
    overflow: bool = False
    woken: bool = False

    def __bool__(self) -> bool:
        return bool(self.paths) or self.structure or self.overflow


class _Libc:
    def __init__(self) -> None:
        name = ctypes.util.find_library("c") or "libc.so.6"
        libc = ctypes.CDLL(name, use_errno=True)
        self.init1 = libc.inotify_init1
        self.init1.argtypes = [ctypes.c_int]
        self.init1.restype = ctypes.c_int
        self.add_watch = libc.inotify_add_watch
        self.add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self.add_watch.restype = ctypes.c_int
        self.rm_watch = libc.inotify_rm_watch
        self.rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
        self.rm_watch.restype = ctypes.c_int


class Watcher:
    """inotify on directories, plus a wake-up pipe. Not thread-safe except `wake`."""

    def __init__(self, libc: _Libc) -> None:
        self._libc = libc
        fd = libc.init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self.fd = fd
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._dirs: dict[str, int] = {}  # directory -> watch descriptor
        self._wds: dict[int, str] = {}
        self._seen: dict[bytes, tuple[str, bool]] = {}  # raw event -> its decoding
        self._poller = select.poll()
        self._poller.register(self.fd, select.POLLIN)
        self._poller.register(self._wake_r, select.POLLIN)
        self.wakeups = 0  # waits that returned because of an event or a wake (not a timeout)
        self.muted = False  # writes are not reported (see `mute`)
        self.closed = False

    # -- watches --------------------------------------------------------------------------------

    def watching(self, directory: str) -> bool:
        return directory in self._dirs

    def add(self, directory: str) -> bool:
        """Watch ``directory`` (a resolved path); False if it cannot be watched."""
        if directory in self._dirs:
            return True
        wd = self._libc.add_watch(self.fd, os.fsencode(directory), MUTED_MASK if self.muted else DIR_MASK)
        if wd < 0:
            err = ctypes.get_errno()
            if err == errno.ENOSPC:
                log.warning(
                    "inotify watch limit reached (fs.inotify.max_user_watches); polling instead dir=%s",
                    directory,
                )
            return False
        old = self._wds.get(wd)
        if old is not None and old != directory:  # the same directory under another name
            self._dirs.pop(old, None)
            self._seen.clear()
        self._dirs[directory] = wd
        self._wds[wd] = directory
        return True

    def remove(self, directory: str) -> None:
        wd = self._dirs.pop(directory, None)
        self._seen.clear()
        if wd is not None:
            self._wds.pop(wd, None)
            self._libc.rm_watch(self.fd, wd)

    @property
    def directories(self) -> set[str]:
        return set(self._dirs)

    def mute(self, muted: bool) -> bool:
        """Stop (True) or resume (False) reporting writes in the watched directories; names that
        appear, go or move are still reported. A busy file raises one event per write(2); while
        the tailer looks at every file every poll interval anyway, those events are only work.
        After resuming, the caller looks at every file once: a write made while muted raised no
        event. False if a directory could not be watched again (gone meanwhile: worth a
        discovery, which watches it anew if it is back)."""
        if muted == self.muted:
            return True
        self.muted = muted
        mask = MUTED_MASK if muted else DIR_MASK
        ok = True
        for directory, old in list(self._dirs.items()):
            wd = self._libc.add_watch(self.fd, os.fsencode(directory), mask)
            if wd < 0:
                self.remove(directory)
                ok = False
            elif wd != old:  # another directory under that name now: watch it, not the old one
                self._wds.pop(old, None)
                self._libc.rm_watch(self.fd, old)
                self._dirs[directory] = wd
                self._wds[wd] = directory
                self._seen.clear()
        return ok

    # -- waiting --------------------------------------------------------------------------------

    def wake(self) -> None:
        """Interrupt a `wait` (from any thread)."""
        with contextlib.suppress(OSError):  # the pipe is full (a wake is pending anyway) or closed
            os.write(self._wake_w, b"x")

    def wait(self, timeout: float | None) -> Changes:
        """Block up to ``timeout`` seconds (None: until something happens) for events or a wake."""
        ch = Changes()
        if self.closed:
            return ch
        ms = -1 if timeout is None else max(0, int(timeout * 1000 + 0.999))
        try:
            ready = self._poller.poll(ms)
        except InterruptedError:
            ready = []
        if not ready:
            return ch
        self.wakeups += 1
        self._drain_wake(ch)
        self.read_events(ch)
        return ch

    def _drain_wake(self, ch: Changes) -> None:
        try:
            while os.read(self._wake_r, 64):
                ch.woken = True
        except (BlockingIOError, OSError):
            pass

    def read_events(self, ch: Changes | None = None) -> Changes:
        """Take every queued event without blocking."""
        ch = ch if ch is not None else Changes()
        while True:
            try:
                buf = os.read(self.fd, 64 * 1024)
            except (BlockingIOError, InterruptedError):
                return ch
            if not buf:
                return ch
            self._parse(buf, ch)

    def _parse(self, buf: bytes, ch: Changes) -> None:
        # A busy file raises one IN_MODIFY per write(2): the same bytes again and again. Each
        # distinct event is decoded once (a small cache), the rest cost a slice and a lookup.
        i, n, size = 0, len(buf), _EVENT.size
        seen = self._seen
        while i + size <= n:
            length = _EVENT.unpack_from(buf, i)[3]
            raw = buf[i : i + size + length]
            i += size + length
            hit = seen.get(raw)
            if hit is None:
                hit = self._decode(raw, ch)
                if hit is None:
                    continue
                if len(seen) >= 4096:
                    seen.clear()
                seen[raw] = hit
            path, structure = hit
            ch.paths.add(path)
            if structure:
                ch.structure = True

    def _decode(self, raw: bytes, ch: Changes) -> tuple[str, bool] | None:
        """(path, a name appeared/went/moved) of one event; None for those that name no path."""
        wd, mask, _cookie, _length = _EVENT.unpack_from(raw, 0)
        if mask & IN_Q_OVERFLOW:
            ch.overflow = True
            return None
        directory = self._wds.get(wd)
        if directory is None:
            return None
        if mask & IN_IGNORED:  # the directory went (or was unmounted): watch it again later
            self._wds.pop(wd, None)
            if self._dirs.get(directory) == wd:
                del self._dirs[directory]
            self._seen.clear()  # the descriptor may be reused for another directory
            ch.structure = True
            return None
        if mask & IN_MOVE_SELF:  # the directory itself moved: its path is stale, watch it anew
            self.remove(directory)
            ch.structure = True
            return None
        name = raw[_EVENT.size :].split(b"\0", 1)[0]
        return (os.path.join(directory, os.fsdecode(name)) if name else directory), bool(mask & STRUCTURE)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for fd in (self.fd, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._dirs.clear()
        self._wds.clear()


_said_no_inotify = False


def open_watcher(libc_factory: Callable[[], _Libc] = _Libc) -> Watcher | None:
    """An inotify watcher, or None (one info line) where the platform has none."""
    global _said_no_inotify
    reason = ""
    if not sys.platform.startswith("linux"):
        reason = f"platform {sys.platform}"
    else:
        try:
            return Watcher(libc_factory())
        except (OSError, AttributeError) as exc:  # no such symbol, EMFILE, inotify disabled
            reason = str(exc) or type(exc).__name__
    if not _said_no_inotify:
        _said_no_inotify = True
        log.info("no inotify (%s); polling every followed file every poll_interval", reason)
    return None
