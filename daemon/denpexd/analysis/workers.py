"""Ranks for events that name only a process id, from the worker list a launcher printed.

Some launchers print one line per worker process, in the order they started them, which is
local-rank order: DeepSpeed's launcher, tearing the node down, logs ``Killing subprocess P`` for
every worker it spawned, local rank 0 first (the rules capture such a pid as ``worker_pid``). A
line that names only a pid and no rank, such as the kernel's ``Out of memory: Killed process P``,
then belongs to the worker at P's place in that list, when P is in it: a process that is not (a
DataLoader worker, the launcher itself, another job's process) is left without a rank.

The lists are kept per (node, file) with each pid's earliest offset in the file, so the order is
the file's, not the order in which the lines were read.
"""

from __future__ import annotations

from denpexd.analysis.ranks import global_rank
from denpexd.analysis.tracks import Aggregate, Tracks

MAX_WORKERS = 4096  # pids kept per (node, file): a launcher lists its node's workers, a few dozen

# (node, file) -> {pid: earliest offset of a line listing it}
WorkerPids = dict[tuple[str, str], dict[int, int]]
UnrankedKey = tuple[str, str, int | None, str]  # (node, file, local rank, rule)
Unranked = dict[UnrankedKey, Aggregate]


def note_worker(pids: WorkerPids, node: str, file: str, pid: int, offset: int) -> None:
    """A launcher's line listing worker ``pid`` at ``offset`` of ``file``."""
    listed = pids.get((node, file))
    if listed is None:
        listed = pids[(node, file)] = {}
    cur = listed.get(pid)
    if cur is None:
        if len(listed) < MAX_WORKERS:
            listed[pid] = offset
    elif offset < cur:
        listed[pid] = offset


def local_rank_of(pids: WorkerPids, node: str, pid: int) -> int | None:
    """The local rank of process ``pid`` on ``node``: its place in the lists of the node's files
    that name it, when they agree (None: no list names it, or they disagree)."""
    places = set()
    for (n, _file), listed in pids.items():
        if n != node or pid not in listed:
            continue
        offset = listed[pid]
        places.add(sum(1 for o in listed.values() if o < offset))
    return places.pop() if len(places) == 1 else None


def pid_ranks(
    unranked: Unranked, pids: WorkerPids, tracks: Tracks, nodes: list[str]
) -> dict[UnrankedKey, int]:
    """The global rank of each unranked aggregate (with no local rank) whose first event names a
    listed worker's pid: that worker's rank (`ranks.resolved` takes these before its votes)."""
    out: dict[UnrankedKey, int] = {}
    for key, agg in unranked.items():
        node, _file, local, _rule = key
        pid = agg.first.fields.get("pid")
        if local is not None or pid.__class__ is not int:
            continue
        lr = local_rank_of(pids, node, pid)
        rank = global_rank(node, lr, tracks, nodes) if lr is not None else None
        if rank is not None:
            out[key] = rank
    return out
