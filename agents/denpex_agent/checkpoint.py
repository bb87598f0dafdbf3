"""Crash-safe read positions, keyed by file identity (device, inode, hash of the first bytes).

A position only moves forward after the broker acknowledged (PUBACK) the batch holding every
event read before it, so after ``kill -9`` the agent resumes where acknowledgements stopped:
nothing is lost, and what is read twice produces the same event ids. The file is versioned and
written tmp → fsync → rename → fsync(dir).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import orjson

log = logging.getLogger(__name__)

VERSION = 1
FILENAME = "checkpoints.json"
FORGET_AFTER_S = 7 * 86400


@dataclass(slots=True)
class Position:
    path: str
    offset: int
    line_no: int
    updated: float
    sampling: tuple[int, int] | None = None  # the scanner's progress-sampling state at offset


def _position(p: object) -> Position | None:
    """A stored position, or None when it cannot be one."""
    if not isinstance(p, dict):
        return None
    try:
        sampling = p.get("sampling")
        pos = Position(
            str(p["path"]),
            int(p["offset"]),
            int(p["line_no"]),
            float(p["updated"]),
            (int(sampling[0]), int(sampling[1])) if sampling is not None else None,
        )
    except (KeyError, TypeError, ValueError, IndexError):
        return None
    if pos.offset < 0 or pos.line_no < 1 or (pos.sampling is not None and min(pos.sampling) < -1):
        return None
    return pos


class Checkpoints:
    """The positions of one agent, persisted in ``state_dir``."""

    def __init__(self, state_dir: str | os.PathLike[str], agent: str) -> None:
        self.dir = Path(state_dir)
        self.path = self.dir / FILENAME
        self.agent = agent
        self.positions: dict[str, Position] = {}
        self.dirty = False
        self.writes = 0

    def load(self) -> list[str]:
        """Read the file if present; return warnings (a corrupt file is kept aside, not fatal)."""
        warnings: list[str] = []
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return warnings
        try:
            doc = orjson.loads(raw)
            if doc.get("version") != VERSION:
                raise ValueError(f"version {doc.get('version')!r}")
            if doc.get("agent") not in (None, self.agent):
                warnings.append(f"{self.path}: written by agent {doc.get('agent')!r}; positions reused")
            files = doc["files"]
            if not isinstance(files, dict):
                raise TypeError("files is not an object")
            for ident, p in files.items():
                pos = _position(p)
                if pos is None:
                    # one impossible position (a negative offset, say): that file is read again
                    # from its start (what was sent before has the same ids: dropped as duplicates)
                    warnings.append(
                        f"{self.path}: impossible position for {str(p.get('path') if isinstance(p, dict) else '?')!r} "
                        f"({str(p)[:120]}); that file is read again from its start"
                    )
                    continue
                self.positions[ident] = pos
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            aside = self.path.with_suffix(f".corrupt-{int(time.time())}")
            os.replace(self.path, aside)
            warnings.append(
                f"{self.path}: unreadable checkpoint ({exc}); moved to {aside.name}, starting over"
            )
            self.positions.clear()
        return warnings

    def get(self, identity: str) -> Position | None:
        return self.positions.get(identity)

    def advance(
        self, identity: str, path: str, offset: int, line_no: int, sampling: tuple[int, int] | None = None
    ) -> None:
        cur = self.positions.get(identity)
        if cur is not None and offset <= cur.offset:
            return
        self.positions[identity] = Position(path, offset, line_no, time.time(), sampling)
        self.dirty = True

    def snapshot(self) -> bytes | None:
        """The file's next content (None when nothing changed); marks the positions clean."""
        if not self.dirty:
            return None
        now = time.time()
        files = {
            ident: {
                "path": p.path,
                "offset": p.offset,
                "line_no": p.line_no,
                "updated": p.updated,
                "sampling": p.sampling,
            }
            for ident, p in self.positions.items()
            if now - p.updated < FORGET_AFTER_S
        }
        self.dirty = False
        return orjson.dumps(
            {"version": VERSION, "agent": self.agent, "files": files}, option=orjson.OPT_INDENT_2
        )

    def write(self, data: bytes) -> None:
        """Write atomically; blocking (run it in a worker thread from async code)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        self.writes += 1
