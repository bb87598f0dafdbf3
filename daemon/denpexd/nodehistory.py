"""Which nodes keep starting hardware and communication failures, across jobs.

One job's diagnosis names the rank that broke first; a node that starts one failure after
another across jobs is more likely broken itself (a GPU, its memory, its NIC or cable) than the
jobs that ran on it. The store keeps every job's initiating node, rule and category; these
functions count, over the last N jobs, the failures of the categories a node can cause
(`CATEGORIES`) that each node initiated:

* `ranking`: every such node, most failures first (`GET /api/v1/nodes`, `denpexd query --nodes`);
* `history`: one node's record, for a live diagnosis that names it (its `node_history` field),
  with a note once the node initiated `SUSPECT_AT` or more of them and the current failure is of
  those categories too.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

CATEGORIES = ("communication", "hardware")
LABEL = "hardware/communication"
SUSPECT_AT = 2  # initiated failures (besides the current one) that make the node a suspect
DEFAULT_JOBS = 200
MAX_JOBS = 10_000
RECENT_JOBS_SHOWN = 10


@dataclass(frozen=True, slots=True)
class Failure:
    """A stored job's failure: the job, its initiating node and rule, the rule's category."""

    job: str
    node: str
    rule: str
    category: str


def counted(failures: list[Failure]) -> list[Failure]:
    return [f for f in failures if f.category in CATEGORIES]


def ranking(failures: list[Failure], jobs: int) -> dict[str, Any]:
    """Every node that initiated a counted failure in the window of ``jobs`` jobs (newest first
    in ``failures``), most first, then by name."""
    mine = counted(failures)
    by_node: dict[str, list[Failure]] = {}
    for f in mine:
        by_node.setdefault(f.node, []).append(f)
    rows = [_record(node, own, len(mine)) for node, own in by_node.items()]
    rows.sort(key=lambda r: (-r["initiated"], r["node"]))
    return {"jobs": jobs, "categories": list(CATEGORIES), "failures": len(mine), "nodes": rows}


def history(node: str, category: str, failures: list[Failure], jobs: int) -> dict[str, Any] | None:
    """``node``'s record in the window (other jobs only), or None when it initiated none of its
    counted failures. ``category`` is the current failure's: the note needs it to be counted."""
    mine = counted(failures)
    own = [f for f in mine if f.node == node]
    if not own:
        return None
    out = {**_record(node, own, len(mine)), "jobs": jobs}
    if len(own) >= SUSPECT_AT and category in CATEGORIES:
        out["note"] = note(out)
    return out


def _record(node: str, own: list[Failure], of: int) -> dict[str, Any]:
    rules = Counter(f.rule for f in own)
    return {
        "node": node,
        "initiated": len(own),
        "of": of,
        "categories": sorted({f.category for f in own}),
        "rules": dict(sorted(rules.items(), key=lambda kv: (-kv[1], kv[0]))),
        "recent_jobs": [f.job for f in own[:RECENT_JOBS_SHOWN]],
    }


def note(record: dict[str, Any]) -> str:
    """What an operator should conclude from a node's record."""
    cats = record["categories"]
    if cats == ["hardware"]:
        suspect = (
            "suspect its hardware (GPUs, memory, driver) rather than the job: drain it and run its checks"
        )
    elif cats == ["communication"]:
        suspect = (
            "suspect its network (NIC, cable, switch port) rather than the job: drain it and test its links"
        )
    else:
        suspect = "suspect the node itself rather than the job: drain it and run its hardware and link checks"
    return f"{summary(record)}: {suspect}"


def summary(record: dict[str, Any]) -> str:
    """``node7 initiated 3 of the last 5 hardware/communication failures (rule x2, other x1)``"""
    rules = ", ".join(f"{rule} x{n}" for rule, n in record["rules"].items())
    return (
        f"{record['node']} initiated {record['initiated']} of the last {record['of']} "
        f"{LABEL} failures ({rules})"
    )
