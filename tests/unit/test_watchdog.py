"""The stop bound of both programs: a process whose stop hangs exits 1 at the bound, with every
thread's stack on stderr (a real subprocess that hangs for good)."""

from __future__ import annotations

import subprocess
import sys
import time

HANGS = """
import logging, threading, time
from denpex_agent.watchdog import stop_watchdog
logging.basicConfig()
def stuck_in_a_write():
    threading.Event().wait()
threading.Thread(target=stuck_in_a_write, name="writer", daemon=False).start()
stop_watchdog(0.5, logging.getLogger("t"))
time.sleep(60)
"""


def test_a_hung_stop_ends_at_its_bound_with_the_stacks() -> None:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", HANGS], capture_output=True, text=True, timeout=30)
    took = time.monotonic() - t0
    assert out.returncode == 1
    assert took < 10, took  # the bound (0.5 s) plus interpreter start, not the 60 s sleep
    assert "stop overran its bound" in out.stderr
    assert "stuck_in_a_write" in out.stderr  # the stuck thread's stack, by its function
