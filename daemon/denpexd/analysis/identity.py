"""Two processes that took the same global rank: a launch that cannot form its process group.

Frameworks announce the global rank each process initialised with (Lightning, Fabric and NeMo:
``Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/8``; rules with ``marker = "identity"``).
When two different processes announce the same rank, the launch is wrong: each node (or each
SLURM task) computed its ranks as if it were alone, typically because the scheduler's task
layout and the framework's idea of it disagree (``--ntasks-per-node`` against ``devices``, a
job not started through ``srun``). Such a job hangs at its first collective, fails on a
duplicate rendezvous, or trains copies of the model that never meet.

Different processes: announcements from different nodes, or from the same node under different
ranks of the stream they came in (``srun --label`` task ids, per-rank files). One stream
repeating a rank is not counted: a worker's own file and its launcher's echo of the same line
are one process, and so is a process restarted in place. A claim made after the job's first
error is not counted either: after an elastic restart the ranks are handed out anew.

Order does not matter: the claims are a set, the answer is a function of it.
"""

from __future__ import annotations

from typing import Any

from denpexd.analysis.tracks import Aligned

DUPLICATE_RULE = "duplicate-global-rank"
MAX_CLAIMANTS = 4  # processes remembered per announced rank (two make the duplicate)
MAX_CLAIMED_RANKS = 65_536  # announced ranks remembered per job

Claimant = tuple[str, int | None]  # the (node, rank of the stream) the announcement came in
Claims = dict[int, dict[Claimant, float | None]]  # announced rank -> claimant -> earliest time


def add_claim(claims: Claims, announced: int, node: str, stream_rank: int | None, ts: float | None) -> None:
    """Remember that ``(node, stream_rank)`` announced ``announced``, with its earliest time
    (untimed counts as earliest: it cannot be shown to come after anything)."""
    by = claims.get(announced)
    if by is None:
        if len(claims) >= MAX_CLAIMED_RANKS:
            return
        by = claims[announced] = {}
    key = (node, stream_rank)
    if key in by:
        old = by[key]
        if old is not None and (ts is None or ts < old):
            by[key] = ts
    else:
        by[key] = ts
        if len(by) > MAX_CLAIMANTS:
            # keep the least claimants: the evicted one is larger than MAX_CLAIMANTS kept ones,
            # which never leave, so it never comes back and the kept set ignores arrival order
            del by[max(by, key=_sortable)]


def _sortable(key: Claimant) -> tuple[str, int]:
    return key[0], -1 if key[1] is None else key[1]


def _distinct(a: Claimant, b: Claimant) -> bool:
    """Two announcements are two processes: other nodes, or other known stream ranks."""
    if a[0] != b[0]:
        return True
    return a[1] is not None and b[1] is not None and a[1] != b[1]


def duplicate_ranks(claims: Claims, aligned: Aligned, before: float | None) -> list[dict[str, Any]]:
    """Every global rank two processes announced (before the first error at aligned time
    ``before``, when there was one), lowest rank first, each with the processes that did."""
    out = []
    for announced in sorted(claims):
        by = claims[announced]
        keys = sorted(
            (k for k, ts in by.items() if before is None or _at_or_before(aligned(k[0], ts), before)),
            key=_sortable,
        )
        if any(_distinct(a, b) for i, a in enumerate(keys) for b in keys[i + 1 :]):
            out.append({"rank": announced, "claimed_by": [{"node": n, "rank": r} for n, r in keys]})
    return out


def _at_or_before(t: float | None, before: float) -> bool:
    return t is None or t <= before
