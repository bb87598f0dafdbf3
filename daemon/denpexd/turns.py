"""Sharing the event loop: long-running loops give it a turn once their slice of time is used.

Ingest's validator and the job worker run CPU work back to back under load; yielding after a
fixed number of items lets one item-heavy turn hold the loop for a third of a second, and
everything else (the HTTP API, the diagnoser, PUBACKs) waits that long at each of its steps.
A time slice bounds the wait whatever an item costs.
"""

from __future__ import annotations

import asyncio
import time

SLICE_S = 0.01


class Turns:
    """``await turns.share()`` after each item: yields once ``slice_s`` has passed since the last."""

    __slots__ = ("_since", "slice_s")

    def __init__(self, slice_s: float = SLICE_S) -> None:
        self.slice_s = slice_s
        self._since = time.monotonic()

    async def share(self) -> None:
        if time.monotonic() - self._since >= self.slice_s:
            await asyncio.sleep(0)
            self._since = time.monotonic()
