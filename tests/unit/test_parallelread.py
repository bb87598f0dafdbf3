"""`denpexd diagnose -j N`'s workers (denpexd.parallelread), in process."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from denpex_agent.matcher import Matcher
from denpex_agent.reader import ReadReport, discover, read_files
from denpex_agent.rules import load_rules
from denpexd import parallelread

LINES = (
    b"2026-11-29 12:00:01,000 INFO [rank{r}] step 1 | loss 7.0 | lr 1e-05 | grad_norm 1.0\n"
    b"2026-11-29 12:00:02,000 ERROR [rank{r}] torch.OutOfMemoryError: CUDA out of memory. "
    b"Tried to allocate 2.00 GiB\n"
)


def _job(tmp_path: Path) -> Path:
    (tmp_path / "node0").mkdir()
    for r in range(4):
        (tmp_path / "node0" / f"rank{r}.log").write_bytes(LINES.replace(b"{r}", str(r).encode()) * 50)
    return tmp_path


def test_a_ctrl_c_that_reaches_a_worker_before_it_is_set_up_is_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """A terminal's Ctrl-C goes to the whole process group, workers included; one that arrives
    between a worker's fork and its initializer must not kill it with a KeyboardInterrupt (the
    parent alone handles Ctrl-C). The signal is sent by the worker to itself at the earliest
    point the pool lets code run in it, before the real initializer."""
    rules = load_rules()
    job = _job(tmp_path)
    real = parallelread._init_worker

    def interrupted_first(*args: object) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(parallelread, "_init_worker", interrupted_first)
    # the workers are forked with this process's handler: KeyboardInterrupt, as under a terminal,
    # even when the tests were started with SIGINT ignored (in the background)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
    monkeypatch.setattr(parallelread, "MIN_BATCH_BYTES", 1)  # a task per file: both workers busy
    files = discover([job], None, ReadReport())
    assert len(parallelread.plan_tasks(files, 2)) == 4
    timeouts: dict[str, int] = {}
    got = list(parallelread.read_parallel(files, rules, "j", ReadReport(), timeouts, jobs=2))
    want = list(read_files(files, Matcher(rules, release_gil=False), "j", ReadReport()))
    assert len(got) == len(want) > 0
    assert [(e.rank, e.rule) for e in got] == [(e.rank, e.rule) for e in want]
