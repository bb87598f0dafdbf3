"""A hard bound on a stop: whatever holds it up (a stalled disk or mount, a peer that never
answers, a bug), past the bound every thread's stack goes to stderr and the process exits 1.

Both programs start it on their first stop signal (`denpex-agent`, `denpexd serve`); the work
not finished by then is what a crash leaves, which each is built to survive (the agent re-reads
from its last checkpoint, the daemon's broker or agents deliver again what it did not store).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import sys
import threading


def stop_watchdog(seconds: float, log: logging.Logger) -> threading.Timer:
    """Start the bound; the returned timer may be cancelled once the stop finished."""

    def overdue() -> None:
        log.error("stop overran its bound; exiting without finishing it bound_s=%.1f", seconds)
        with contextlib.suppress(Exception):
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        for handler in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        os._exit(1)

    timer = threading.Timer(seconds, overdue)
    timer.name = "stop-watchdog"
    timer.daemon = True
    timer.start()
    return timer
