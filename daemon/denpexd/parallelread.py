"""`denpexd diagnose -j N`: the job's files read by N worker processes, the engine fed in the parent.

Files are cut into tasks in their discovery order: a file of at least ``BATCH_BYTES`` is a task of
its own, smaller ones are batched with their successors until a batch holds that many bytes, so a
job of 4,096 small files costs as few task round trips as one of 64 large files. Each worker
(forked, so the rules are not pickled) compiles its own `Matcher` once, reads a task's files with
`reader.read_files` exactly as ``-j 1`` does, and returns the task's events (plain tuples,
without the context the engine would drop: `engine.carried`), its `ReadReport`
counters and warnings, and its matcher's pattern timeouts. The parent feeds the engine task by
task in task order (a result that comes early waits for the ones before it), so the engine sees
the very sequence of events ``-j 1`` gives it, the counters sum up and the warnings come in the
same order. Bytes read are counted in a shared counter the parent polls for the progress bar.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any

import msgspec

from denpex_agent.events import Event
from denpex_agent.matcher import Matcher
from denpex_agent.reader import LogFile, ReadReport, read_files
from denpex_agent.rules import RuleSet
from denpexd.engine import carried, keeps_context

BATCH_BYTES = 16 << 20  # a task's bytes: 16 MiB, about 0.1 CPU second of reading
MIN_BATCH_BYTES = 1 << 20
START_METHOD = "fork"  # measured against forkserver in bench/bench_diagnose.py --jobs
POLL_S = 0.1


def default_jobs() -> int:
    """The CPUs this process may run on."""
    counter = getattr(os, "process_cpu_count", None)  # Python 3.13
    if counter is not None:
        n = counter()
        if n:
            return int(n)
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def plan_tasks(files: list[LogFile], jobs: int) -> list[list[LogFile]]:
    """Consecutive runs of files, each of at least the batch size (the last may be smaller).

    The batch size is ``BATCH_BYTES``, smaller for a small job (a quarter of each worker's share,
    at least 1 MiB) so that every worker gets several tasks."""
    total = sum(lf.size for lf in files)
    target = max(MIN_BATCH_BYTES, min(BATCH_BYTES, total // max(1, 4 * jobs)))
    tasks: list[list[LogFile]] = []
    batch: list[LogFile] = []
    size = 0
    for lf in files:
        batch.append(lf)
        size += lf.size
        if size >= target:
            tasks.append(batch)
            batch, size = [], 0
    if batch:
        tasks.append(batch)
    return tasks


class _QuietReport(ReadReport):
    """A worker's report: warnings are kept, not logged (the parent logs them, in order)."""

    __slots__ = ()

    def warn(self, message: str) -> None:
        self.warnings.append(message)


# one per worker process, set by _init_worker
_matcher: Matcher | None = None
_bytes_done: Any = None


def _init_worker(rules: RuleSet, bytes_done: Any) -> None:
    global _matcher, _bytes_done
    # Ctrl-C is the parent's to handle. The worker was forked with SIGINT blocked (see
    # `read_parallel`), so one that came before this line is pending: ignoring it discards it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _matcher = Matcher(rules, release_gil=False)
    _bytes_done = bytes_done


def _count_bytes(n: int) -> None:
    with _bytes_done.get_lock():
        _bytes_done.value += n


TaskResult = tuple[list[tuple[Any, ...]], ReadReport, dict[str, int]]
_as_tuple = msgspec.structs.astuple  # an event as a plain tuple: half the pickling cost


def _read_task(files: list[LogFile], job: str, context_lines: int) -> TaskResult:
    assert _matcher is not None
    report = _QuietReport()
    before = dict(_matcher.timeouts)
    events = [
        _as_tuple(carried(ev))
        for ev in read_files(
            files,
            _matcher,
            job,
            report,
            context_lines=context_lines,
            on_bytes=_count_bytes,
            wants_context=keeps_context,
        )
    ]
    timeouts = {r: n - before.get(r, 0) for r, n in _matcher.timeouts.items() if n != before.get(r, 0)}
    return events, report, timeouts


def read_parallel(
    files: list[LogFile],
    rules: RuleSet,
    job: str,
    report: ReadReport,
    timeouts: dict[str, int],
    *,
    jobs: int,
    context_lines: int = 100,
    on_bytes: Callable[[int], None] | None = None,
    start_method: str = START_METHOD,
) -> Iterator[Event]:
    """The events of ``files`` in ``-j 1`` order, read by ``jobs`` worker processes; ``report``
    gets the summed counters and the warnings in order, ``timeouts`` the summed pattern timeouts."""
    tasks = plan_tasks(files, jobs)
    ctx = multiprocessing.get_context(start_method)
    bytes_done = ctx.Value("q", 0)
    reported = 0
    others = set(multiprocessing.active_children())
    executor = ProcessPoolExecutor(
        max_workers=min(jobs, len(tasks)),
        mp_context=ctx,
        initializer=_init_worker,
        initargs=(rules, bytes_done),
    )
    try:
        todo = iter(tasks)
        window = 4 * jobs  # tasks in flight: bounds the memory held by results not yet consumed
        pending: deque[Future[TaskResult]] = deque()
        # The first submit forks every worker. A Ctrl-C that reached a worker between its fork and
        # `_init_worker` would be a KeyboardInterrupt (and a traceback) in its bootstrap, so they
        # are forked with SIGINT blocked; one that comes meanwhile stays pending here and is
        # raised in this process when the mask is restored.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            for task in todo:
                pending.append(executor.submit(_read_task, task, job, context_lines))
                if len(pending) >= window:
                    break
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        while pending:
            fut = pending.popleft()
            while not fut.done():
                wait([fut], timeout=POLL_S, return_when=FIRST_COMPLETED)
                if on_bytes is not None:
                    done = bytes_done.value
                    if done > reported:
                        on_bytes(done - reported)
                        reported = done
            events, part, part_timeouts = fut.result()
            del fut
            nxt = next(todo, None)
            if nxt is not None:
                pending.append(executor.submit(_read_task, nxt, job, context_lines))
            report.files += part.files
            report.add(part)
            for rule_id, n in part_timeouts.items():
                timeouts[rule_id] = timeouts.get(rule_id, 0) + n
            for values in events:
                yield Event(*values)
            del events
        if on_bytes is not None and bytes_done.value > reported:
            on_bytes(bytes_done.value - reported)
    except BaseException:
        _stop(executor, others)
        raise
    executor.shutdown(wait=True)


def _stop(executor: ProcessPoolExecutor, others: set[multiprocessing.process.BaseProcess]) -> None:
    """Cancel what has not started and end the workers now (Ctrl-C, or an error in the parent):
    this process's multiprocessing children but ``others`` (those it had before the pool), found
    through the public API rather than the pool's own table of them."""
    processes = [p for p in multiprocessing.active_children() if p not in others]
    executor.shutdown(wait=False, cancel_futures=True)
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(timeout=5)
