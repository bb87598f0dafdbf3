"""Global ranks for events that name none.

An event whose line and path name no global rank is kept apart with its file and local rank,
and given a rank when the diagnosis is made: the global rank that events of the same node and
local rank name (torchrun's ``[defaultN]:`` echo, its ``attempt_0/N/`` directories), else the
rank that ≥ 90 % of the ranked events of its file name. Deciding this at the end, from all
events, keeps it independent of which lines happened to be read first.
"""

from __future__ import annotations

import re

from denpexd.analysis.tracks import Aggregate, Aggregates, RankTrack, TrackKey, Tracks

DOMINANT_SHARE = 0.9  # a file "is" rank r when this share of its ranked events name r


def most_named(counts: dict[int, int]) -> int | None:
    """The rank named most often (the lowest of equals), or None when none is."""
    if not counts:
        return None
    return min(counts, key=lambda r: (-counts[r], r))


def dominant(counts: dict[int, int]) -> int | None:
    """The rank that at least DOMINANT_SHARE of the votes name, if any."""
    rank = most_named(counts)
    if rank is None:
        return None
    return rank if counts[rank] >= DOMINANT_SHARE * sum(counts.values()) else None


def by_local(node: str, local_rank: int, tracks: Tracks) -> int | None:
    """The global rank the node's events name most often under this local rank."""
    counts = {
        r: votes
        for (n, r), t in tracks.items()
        if n == node and r is not None and (votes := t.votes_for_local(local_rank))
    }
    return most_named(counts)


def resolve_rank(node: str, file: str, local_rank: int | None, tracks: Tracks) -> int | None:
    """The global rank of an event of ``file`` on ``node`` that named none (see above)."""
    if local_rank is not None:
        rank = by_local(node, local_rank, tracks)
        if rank is not None:
            return rank
    by_file = {
        r: votes
        for (n, r), t in tracks.items()
        if n == node and r is not None and (votes := t.votes_for_file(file))
    }
    return dominant(by_file)


def global_rank(node: str, local_rank: int, tracks: Tracks, nodes: list[str]) -> int | None:
    """The global rank of a local rank a candidate names: by the node's votes, else by position
    among the node's known ranks, else (a single-node job) the local rank itself."""
    rank = by_local(node, local_rank, tracks)
    if rank is not None:
        return rank
    ranks = sorted(r for (n, r) in tracks if n == node and r is not None)
    if local_rank < len(ranks):
        return ranks[local_rank]
    if not ranks and nodes == [node]:
        return local_rank  # a single-node job: its local ranks are its global ranks
    return None


# Rules whose lines only a per-node launcher prints (torchrun's elastic agent, the DeepSpeed
# launcher, torch.multiprocessing.spawn): where one ran, an srun task is a node, not a rank.
PER_NODE_LAUNCHER_RULE = re.compile(r"^(?:elastic|deepspeed-launcher|mpspawn)-")


def tasks_are_ranks(aggs: Aggregates, tracks: Tracks) -> bool:
    """Whether srun's task numbers (``task``, its SLURM_PROCID) are the job's global ranks: yes
    when srun started the training processes itself, which the logs show as the absence of any
    per-node launcher (no local rank echoed by one, none of its reports)."""
    if any(t.local_votes for t in tracks.values()):
        return False
    return not any(PER_NODE_LAUNCHER_RULE.match(rule or "") for (_n, _r, rule) in aggs)


def resolved(
    aggs: Aggregates,
    unranked: dict[tuple[str, str, int | None, str], Aggregate],
    tracks: Tracks,
    unranked_tracks: dict[tuple[str, str, int | None], RankTrack],
    given: dict[tuple[str, str, int | None, str], int] | None = None,
    nodes: list[str] | None = None,
) -> tuple[Aggregates, Tracks]:
    """Aggregates and tracks with the unranked ones given their rank (new objects where
    anything merges; the inputs are never changed). ``given``: ranks already known for some
    unranked aggregates (a worker's pid, `analysis.workers`), taken before the votes. In a
    single-node job (``nodes``) whose logs name no global rank at all, a local rank is the
    global one."""
    if unranked:
        aggs = dict(aggs)
        alone = nodes is not None and len(nodes) == 1 and not any(r is not None for (_n, r) in tracks)
        for ukey, ua in sorted(
            unranked.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or -1, kv[0][3])
        ):
            node, file, local, rule = ukey
            rank = given.get(ukey) if given else None
            if rank is None:
                rank = resolve_rank(node, file, local, tracks)
            if rank is None and local is not None and alone:
                rank = local
            key = (node, rank, rule)
            cur = aggs.get(key)
            aggs[key] = ua if cur is None else cur.merged(ua)
    if unranked_tracks:
        ranked = tracks
        tracks = dict(tracks)
        copied: set[TrackKey] = set()
        for (node, file, local), ut in sorted(
            unranked_tracks.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or -1)
        ):
            nr = (node, resolve_rank(node, file, local, ranked))
            t = tracks.get(nr)
            if nr not in copied:
                t = tracks[nr] = t.copy() if t is not None else RankTrack(node, nr[1], ut.progress)
                copied.add(nr)
            assert t is not None
            t.merge(ut)
    return aggs, tracks
