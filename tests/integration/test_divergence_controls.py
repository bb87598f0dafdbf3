"""`denpexd diagnose CASE --control CASE_control`: each recorded failure against the healthy run of the
same job (same nodes, processes, line format, layout, launcher options and steps, no fault).

The pairs are found at collection from the controls' expected.json (``"control_of": "<case>"``), so a
control recorded later is picked up. What must hold:

1. a control against itself logs nothing new;
2. a failed run logs something its control never did;
3. no stream (a (node, rank), or a node's launcher when the control has launcher lines) diverges later
   than its first error-or-worse match: in the file of that match, the first new line comes at or before
   the match's line, and in another file no later in the node's time. Every such stream diverges at all:
   a clean control never logs an error, so the error's own line is new;
4. when a line of the initiator's own names the cause (the diagnosis's initiator is an `event` and its
   line is no launcher's report about it), the first divergence is the initiator's.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from denpex_agent.attribution import has_prefix
from denpex_agent.events import Event
from denpex_agent.matcher import Matcher
from denpex_agent.reader import ReadReport, discover, read_files
from denpex_agent.rules import load_rules
from denpex_agent.timestamps import parse_iso
from denpexd.diagnosecmd import diagnose_paths

REPO = Path(__file__).resolve().parents[2]
JOBS = REPO / "tests" / "fixtures" / "jobs"
RULES = load_rules()
SLACK_S = 0.001  # timestamps have millisecond resolution


def _expected(case: str) -> dict[str, Any]:
    return json.loads((JOBS / case / "expected.json").read_text())


def _controls() -> list[tuple[str, str]]:
    """(base case, its control) for every recorded control."""
    pairs = []
    for p in sorted(JOBS.glob("*/expected.json")):
        base = json.loads(p.read_text()).get("control_of")
        if base:
            pairs.append((base, p.parent.name))
    return pairs


PAIRS = _controls()
IDS = [control for _base, control in PAIRS]
FAILED_PAIRS = [pair for pair in PAIRS if _expected(pair[0])["verdict"] == "failed"]


@cache
def _diagnose(case: str, control: str) -> dict[str, Any]:
    return diagnose_paths([str(JOBS / case)], control=[str(JOBS / control)], rules=RULES)


@cache
def _errors(case: str) -> tuple[Event, ...]:
    """Every error-or-worse rule match of the case (the diagnosis keeps only the first of each
    (node, rank, rule), and no file or line for collateral)."""
    report = ReadReport()
    files = discover([str(JOBS / case)], None, report)
    return tuple(
        ev
        for ev in read_files(files, Matcher(RULES), case, report)
        if ev.kind == "match" and ev.severity in ("error", "critical")
    )


def _launcher_files(case: str) -> set[str]:
    return {
        str(lf.path)
        for lf in discover([str(JOBS / case)], None, ReadReport())
        if lf.who.rank is None and lf.who.local_rank is None
    }


def _where(entry: dict[str, Any] | None) -> tuple[str, int | None] | None:
    return None if entry is None else (entry["node"], entry["rank"])


def _own_line(case: str, ini: dict[str, Any]) -> bool:
    """Whether the initiator's line is its own: not a line of the launcher's log without a worker's prefix
    (torchrun's `failed (exitcode: -9) local_rank: 0` about a worker that printed nothing)."""
    return ini["file"] not in _launcher_files(case) or has_prefix(ini["text"])


def test_every_control_is_found() -> None:
    assert PAIRS, "no recorded control (expected.json with control_of)"
    for base, control in PAIRS:
        exp = _expected(control)
        assert exp["verdict"] == "healthy" and exp["initiator"] is None and exp["category"] is None
        assert exp["collateral_ranks"] == [] and exp["fault"] is None
        same = ("nodes", "nproc_per_node", "layout", "torch")
        assert [exp[k] for k in same] == [_expected(base)[k] for k in same]


@pytest.mark.parametrize("control", IDS)
def test_a_control_against_itself_is_no_divergence(control: str) -> None:
    d = _diagnose(control, control)
    assert d["verdict"] == "healthy"
    assert d["divergence"]["first"] is None and d["divergence"]["per_rank"] == []
    assert d["divergence"]["control"]["lines"] > 0


@pytest.mark.parametrize(("base", "control"), PAIRS, ids=IDS)
def test_the_base_case_diverges_from_its_control(base: str, control: str) -> None:
    d = _diagnose(base, control)
    div = d["divergence"]
    if _expected(base)["verdict"] == "failed":
        assert div["first"] is not None and div["first"] == div["per_rank"][0]
    else:
        # diverge: only the numbers of its lines change (masked in templates), so no line is new; the
        # diagnosis tells it apart from its control by the loss curve instead
        print(
            f"\n{base}: no new line against {control} (first divergence {div['first']}); verdict {d['verdict']}"
        )
        assert d["verdict"] != "healthy" and d["trends"]


@pytest.mark.parametrize(("base", "control"), FAILED_PAIRS, ids=[c for _b, c in FAILED_PAIRS])
def test_no_stream_diverges_after_its_first_error(base: str, control: str) -> None:
    div = _diagnose(base, control)["divergence"]
    firsts = {(e["node"], e["rank"]): e for e in div["per_rank"]}
    launchers_compared = div["control"]["launcher_lines"] > 0
    events = _errors(base)
    # a tee'd worker line that names only its local rank ([default1]:{'loss': nan, ...}) is that
    # local rank's global rank on the node, as the node's other lines pair them
    global_of = {(ev.node, ev.local_rank): ev.rank for ev in events if ev.rank is not None}
    checked = 0
    for ev in events:
        rank = ev.rank
        if rank is None and ev.local_rank is not None:
            if (ev.node, ev.local_rank) not in global_of:
                continue
            rank = global_of[ev.node, ev.local_rank]
        if rank is None and not launchers_compared:
            continue  # the control has no launcher lines: a launcher's lines are not compared
        first = firsts.get((ev.node, rank))
        where = f"{ev.node} rank {rank}: {ev.rule} at {ev.file}:{ev.line_no}"
        assert first is not None, f"{where} is an error, yet its stream logged nothing new"
        if first["file"] == ev.file:
            assert first["line"] <= ev.line_no, (where, first)
        elif first["local_time"] is not None and ev.ts is not None:
            local = parse_iso(first["local_time"])
            assert local is not None and local <= ev.ts + SLACK_S, (where, first)
        else:
            continue  # another file and no time to compare them by
        checked += 1
    assert checked


NAMED = [pair for pair in FAILED_PAIRS if _expected(pair[0])["initiator"] is not None]


@pytest.mark.parametrize(("base", "control"), NAMED, ids=[c for _b, c in NAMED])
def test_the_first_divergence_and_the_initiator(base: str, control: str) -> None:
    d = _diagnose(base, control)
    exp = _expected(base)["initiator"]
    ini, div = d["initiator"], d["divergence"]
    assert (ini["node"], ini["rank"]) == (exp["node"], exp["rank"])
    mine = [e for e in div["per_rank"] if (e["node"], e["rank"]) == (exp["node"], exp["rank"])]
    if ini["kind"] == "event" and _own_line(base, ini):
        # its own line named the cause, before anything reached the other ranks
        assert _where(div["first"]) == (exp["node"], exp["rank"]), div["first"]
    elif ini["kind"] == "event":
        # only its launcher's report names it (a rank killed by SIGKILL prints nothing): that report is
        # its first new line, and it comes after the peers' errors
        assert [(e["file"], e["line"]) for e in mine] == [(ini["file"], ini["line"])]
        print(f"\n{base}: the initiator's first new line is its launcher's report {mine[0]['text'][:100]!r}")
    else:
        # a silent initiator (it stopped; the others timed out): nothing of its own is new
        assert ini["kind"] == "hang" and mine == []


def _initiator_rows() -> list[tuple[str, dict[str, Any], dict[str, Any] | None, str, bool]]:
    """(base, expected initiator, first divergence, the diagnosis's initiator kind, whether its line is its
    own) for every failed base whose expected.json names an initiator."""
    rows = []
    for base, control in NAMED:
        d = _diagnose(base, control)
        ini = d["initiator"]
        own = ini["kind"] == "event" and _own_line(base, ini)
        rows.append((base, _expected(base)["initiator"], d["divergence"]["first"], ini["kind"], own))
    return rows


def test_first_divergence_against_the_expected_initiator() -> None:
    """Prints every failed base with a named initiator, and which disagree. A silent initiator (kind
    `hang`) logged nothing new; a rank killed by SIGKILL has only its launcher's report, after its peers'
    connection errors. Most event initiators name the cause in a line of their own, and are first."""
    rows = _initiator_rows()
    assert rows
    print()
    for base, exp, first, kind, own in rows:
        got = _where(first)
        print(
            f"{'agree   ' if got == (exp['node'], exp['rank']) else 'DISAGREE'} {base:20s} initiator "
            f"{exp['node']}/{exp['rank']} ({kind}, {'own line' if own else 'no line of its own'}); "
            f"first divergence {'/'.join(map(str, got)) if got else None}: {first['text'][:110] if first else None}"
        )
    events = [row for row in rows if row[3] == "event"]
    agree = [row for row in events if _where(row[2]) == (row[1]["node"], row[1]["rank"])]
    disagree = [row[0] for row in rows if _where(row[2]) != (row[1]["node"], row[1]["rank"])]
    print(
        f"first divergence = initiator for {len(agree)} of {len(events)} event initiators; disagree: {disagree}"
    )
    assert 2 * len(agree) > len(events)
