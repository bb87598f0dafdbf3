"""Which node and rank wrote a file, or a line: from the path, a --layout template, line prefixes.

Built-in path layouts (relative to the directory the user pointed at):

* ``<node>/rank<R>.log``, ``<node>/<R>.log``, ``<node>/rank_<R>.out``, ``<node>-rank<R>.log``
* torchrun ``--log-dir``: ``<node>/.../<run_id>/attempt_<n>/<local_rank>/{stdout,stderr}.log``
  (only the local rank is in the path; the global rank comes from the lines)
* a file directly under the root belongs to node ``local`` unless its name says otherwise.

Line prefixes, strongest first: ``[rank3]:`` (PyTorch's per-rank prefix), ``[default3]:``
(torchrun ``--tee``: local rank 3), then ``[rank3]``/``[Rank 3]``/``rank=3`` near the start.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath

from denpex_agent.errors import LayoutError


@dataclass(frozen=True, slots=True)
class Attribution:
    node: str
    rank: int | None
    local_rank: int | None


_RANK_NAME = re.compile(r"(?i)(?:^|[._-])(?:rank|r)[_-]?(?P<rank>\d{1,6})(?=[._-]|$)")
_NODE_RANK_NAME = re.compile(r"(?i)^(?P<node>.+?)[._-](?:rank|r)[_-]?(?P<rank>\d{1,6})(?=[._-]|$)")
_BARE_NUMBER = re.compile(r"^(?P<rank>\d{1,6})(?:\.[A-Za-z]+)+$")
_ATTEMPT = re.compile(r"^attempt_\d+$")
_LOCAL_DIR = re.compile(r"^\d{1,4}$")
_STD_NAME = re.compile(r"^(?:stdout|stderr)(?:\.log)?$")

DEFAULT_NODE = "local"


def attribute_path(rel: str) -> Attribution:
    """Node and rank of a file from its path relative to the root the user gave."""
    parts = PurePosixPath(rel).parts
    name = parts[-1]
    dirs = parts[:-1]
    node = dirs[0] if dirs else DEFAULT_NODE

    # torchrun --log-dir: .../attempt_N/<local_rank>/stdout.log
    if (
        len(parts) >= 3
        and _STD_NAME.match(name)
        and _LOCAL_DIR.match(parts[-2])
        and _ATTEMPT.match(parts[-3])
    ):
        return Attribution(node=node, rank=None, local_rank=int(parts[-2]))

    stem_name = _strip_rotation(name)
    m = _BARE_NUMBER.match(stem_name)
    if m:
        return Attribution(node=node, rank=int(m.group("rank")), local_rank=None)
    if not dirs:
        m2 = _NODE_RANK_NAME.match(stem_name)
        if m2:
            return Attribution(node=m2.group("node"), rank=int(m2.group("rank")), local_rank=None)
    m = _RANK_NAME.search(stem_name)
    if m:
        return Attribution(node=node, rank=int(m.group("rank")), local_rank=None)
    return Attribution(node=node, rank=None, local_rank=None)


def _strip_rotation(name: str) -> str:
    """``rank3.log.1`` → ``rank3.log``."""
    base, dot, suffix = name.rpartition(".")
    if dot and suffix.isdigit() and base:
        return base
    return name


class Layout:
    """A user template such as ``{node}/rank{rank}.log`` or ``logs/{node}-{local_rank}.txt``.

    Fields: ``{node}``, ``{rank}``, ``{local_rank}``, ``{any}`` (any text, ``/`` included).
    The template must match the whole relative path (a trailing rotation suffix ``.N`` allowed).
    """

    _FIELD = re.compile(r"\{(node|rank|local_rank|any)\}")

    def __init__(self, template: str) -> None:
        if not template or template.startswith("/"):
            raise LayoutError(f"layout {template!r}: give a path relative to the log directory")
        unknown = set(re.findall(r"\{([^}]*)\}", template)) - {"node", "rank", "local_rank", "any"}
        if unknown:
            raise LayoutError(
                f"layout {template!r}: unknown field(s) {sorted(unknown)}; use node, rank, local_rank, any"
            )
        out: list[str] = []
        pos = 0
        seen: set[str] = set()
        for m in self._FIELD.finditer(template):
            out.append(re.escape(template[pos : m.start()]))
            name = m.group(1)
            if name in seen and name != "any":
                raise LayoutError(f"layout {template!r}: {{{name}}} appears twice")
            seen.add(name)
            out.append(
                {
                    "node": r"(?P<node>[^/]+?)",
                    "rank": r"(?P<rank>\d+)",
                    "local_rank": r"(?P<local_rank>\d+)",
                    "any": r".*?",
                }[name]
            )
            pos = m.end()
        out.append(re.escape(template[pos:]))
        self.template = template
        self._rx = re.compile("".join(out) + r"(?:\.\d+)?")

    def match(self, rel: str) -> Attribution | None:
        m = self._rx.fullmatch(rel)
        if m is None:
            return None
        g = m.groupdict()
        return Attribution(
            node=g.get("node") or DEFAULT_NODE,
            rank=int(g["rank"]) if g.get("rank") else None,
            local_rank=int(g["local_rank"]) if g.get("local_rank") else None,
        )


# Line-level attribution ------------------------------------------------------------------------
#
# The prefixes launchers and log collectors put before a worker's own text, outermost first:
#
#   2026-11-29T12:00:00.123Z            a collector's timestamp, a pod or job-step tag (``i.pretrain/0``):
#   i.pretrain/0                        up to three such tokens before a bracket tag below
#   ` 12: `                             ``srun --label``: the task id (one task per rank: the rank;
#                                       before a ``[defaultN]:`` tag it is the node's task, not a rank)
#   `[1,12]<stderr>:`                   OpenMPI ``--tag-output``: job id, rank (PRRTE's detailed
#   `[ns,12][host:pid]<stderr>:`        form adds the host and process id)
#   `[12]<stderr>:`                     horovodrun: rank
#   `[gpu-node-3:12]`                   ``[host:rank]`` tags of MPI-style launchers (not OpenMPI's
#                                       ``[host:01234]``, a zero-padded process id)
#   `[default3]:`                       torchrun ``--tee``: the local rank on that node
#   `[rank12]:`                         PyTorch's own per-rank prefix: the global rank
#   `[rank: 12] `                       Lightning's (`rank_prefixed_message`): the rank the line is about
#
# A rank a prefix names is the line's rank (it beats the file's); failing that, a rank the start
# of the text names (``[Rank 3]``, ``[RANK 3]``, ``[rank: 3]``, ``rank=3``) is used when the file names none.

_LEAD = r"(?:[^\s\[\]]{1,48}\s+){0,3}"
_SRUN = r"\s{0,6}(?P<srun>\d{1,6}): "
_MPI = r"\[(?:[^\]\s,]{1,64},)?(?P<mpi>\d{1,6})\](?:\[[^\]\s]{1,80}\])?<std(?:out|err|diag)>:"
_HOST = r"\[(?P<host>[A-Za-z][\w.-]{0,62}):(?P<hostrank>0|[1-9]\d{0,3})\]:? "
_LIGHTNING = r"\[rank: \d{1,6}\] "  # Lightning's `[rank: N] message`
_TAGS = rf"(?P<tags>(?:\[(?:rank|default)\d{{1,6}}\]: ?|{_LIGHTNING})+)"
_PREFIX_RE = re.compile(
    rf"^(?:{_LEAD}(?=\[(?:rank|default)\d{{1,6}}\]:|{_LIGHTNING}|\[(?:[^\]\s,]{{1,64}},)?\d{{1,6}}\][<\[]))?"
    rf"(?:{_MPI}|{_HOST})?(?:{_SRUN})?{_TAGS}?"
)
_PREFIX_PART = re.compile(r"\[(?P<kind>rank|default)(?P<n>\d{1,6})\]:|\[(?P<kind2>rank): (?P<n2>\d{1,6})\] ")
_INLINE_RANK_RE = re.compile(r"\[(?i:rank):? ?(?P<n>\d{1,6})\]|\brank[= ](?P<m>\d{1,6})\b")
FILE_RANK_TAG = re.compile(rb"\[rank(\d{1,6})\]")


def _prefix(line: str) -> re.Match[str] | None:
    m = _PREFIX_RE.match(line)
    if m is None or m.end() == 0:
        return None
    if m.group("host") is not None and m.group("host").endswith(".py"):
        return None  # ``[train.py:42] ...``: a logger's file and line, not a host and rank
    return m


def has_prefix(line: str) -> bool:
    """Whether a launcher or PyTorch prefix names the line's rank or local rank, so strongly that
    it beats the rank of the file (a bare ``srun --label`` number does not: ``3: ...`` may be
    anybody's text)."""
    m = _prefix(line)
    return m is not None and (m.group("tags") or m.group("mpi") or m.group("hostrank")) is not None


def line_rank(line: str) -> tuple[int | None, int | None]:
    """(rank, local_rank) named by a line's prefix, strongest signal first; (None, None) if none.

    ``[default0]:[rank2]: ...`` (torchrun --tee around PyTorch's own prefix) gives (2, 0);
    `` 3: [rank2]: ...`` (srun --label around it) gives (2, None); `` 3: Traceback`` gives (3, None).
    """
    rank, local, _prefixed = line_rank_prefixed(line)
    return rank, local


def line_rank_prefixed(line: str) -> tuple[int | None, int | None, bool]:
    """`line_rank` and `has_prefix` of one line, its prefix parsed once."""
    m = _prefix(line)
    prefixed = m is not None and (m.group("tags") or m.group("mpi") or m.group("hostrank")) is not None
    rank: int | None = None
    local: int | None = None
    if m:
        tags = m.group("tags")
        if tags:
            for part in _PREFIX_PART.finditer(tags):
                if part.group("kind2"):
                    rank = int(part.group("n2"))
                elif part.group("kind") == "rank":
                    rank = int(part.group("n"))
                else:
                    local = int(part.group("n"))
        if rank is None:
            outer = m.group("mpi") or m.group("hostrank")
            if outer is not None:
                rank = int(outer)
            elif m.group("srun") is not None and local is None:
                rank = int(m.group("srun"))
        rest = line[m.end() :]
    else:
        rest = line
    if rank is None:
        m2 = _INLINE_RANK_RE.search(rest, 0, 120)
        if m2:
            rank = int(m2.group("n") or m2.group("m"))
    return rank, local, prefixed


def stream_key(line: str) -> str:
    """Which interleaved stream of a merged log the line belongs to: its launcher and rank
    prefixes without a timestamp before them ("" for a line without any). The lines of one
    worker's traceback share it while other workers' lines interleave with them."""
    m = _prefix(line)
    if m is None:
        return ""
    tags = m.group("tags")
    return f"{m.group('mpi') or ''}|{m.group('hostrank') or ''}|{m.group('srun') or ''}|" + (
        tags.replace(" ", "") if tags else ""
    )


def tee_echo(line: str) -> bool:
    """Whether the line is a launcher's copy of a worker's line: torchrun ``--tee``'s
    ``[defaultN]:`` tag in its prefix (after a collector's timestamp or task label too)."""
    m = _prefix(line)
    return m is not None and "[default" in (m.group("tags") or "")


def strip_prefix(line: str) -> str:
    """The line without its launcher and rank prefixes (and one space after)."""
    m = _prefix(line)
    return line[m.end() :] if m else line


def dominant_rank(sample: bytes) -> int | None:
    """The rank a file's head names in ≥ 90 % of its ``[rankN]`` tags, if any."""
    counts: dict[int, int] = {}
    for m in FILE_RANK_TAG.finditer(sample):
        r = int(m.group(1))
        counts[r] = counts.get(r, 0) + 1
    if not counts:
        return None
    total = sum(counts.values())
    rank, n = max(counts.items(), key=lambda kv: kv[1])
    return rank if n * 10 >= total * 9 else None
