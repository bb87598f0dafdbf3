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


def test_the_agents_stop_margin_covers_the_waits_its_close_may_take() -> None:
    """A stop that only waits out its own bounds (the offline status, the connection task's
    disconnect, that task's disconnect once cancelled) plus a checkpoint write and a loaded
    loop's lag must end before the watchdog does: at 3 s for 3 x 1 s of waits, a loaded machine
    ended stops that were merely slow."""
    from denpex_agent.cli import STOP_MARGIN_S
    from denpex_agent.publisher import CLOSE_TIMEOUT_S

    assert STOP_MARGIN_S >= 3 * CLOSE_TIMEOUT_S + 2.0
