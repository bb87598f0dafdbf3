"""`denpexd diagnose --control`: the recorded failures against a healthy run, and as a user runs it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from denpex_agent.timestamps import parse_iso
from denpexd.diagnosecmd import diagnose_paths
from denpexd.templates import template
from tests.integration.test_diagnose_cli import denpexd

REPO = Path(__file__).resolve().parents[2]
JOBS = REPO / "tests" / "fixtures" / "jobs"
HEALTHY = JOBS / "healthy"
# failed jobs whose files show the failure (a silent stall's do not: its expected.json says what
# the files alone tell, under "post_mortem")
FAILED = sorted(
    p.parent.name
    for p in JOBS.glob("*/expected.json")
    if json.loads(p.read_text())["verdict"] == "failed" and "post_mortem" not in json.loads(p.read_text())
)
# The jobs whose records have the healthy run's shape (its step lines, its start-up lines):
# against it, only their failure is new.
SAME_SHAPE = [
    j
    for j in FAILED
    if j.removesuffix("_skew") in ("alloc_fail", "barrier_timeout", "dataloader", "exception", "hang")
] + ["exception_rdzv_info"]
ENTRY = {"node", "rank", "time", "file", "line", "text"}


def _t(iso: str | None) -> float:
    assert iso is not None
    t = parse_iso(iso)
    assert t is not None
    return t


def _first_errors(d: dict[str, Any]) -> dict[int, float]:
    """Each rank's earliest cause, symptom or consequence the diagnosis lists, aligned."""
    out: dict[int, float] = {}
    timed = [(c["rank"], c.get("time")) for c in d["candidates"] if c.get("kind") == "event"]
    timed += [(c["rank"], c.get("first_time")) for c in d["collateral"]]
    for rank, iso in timed:
        if rank is not None and iso is not None:
            out[rank] = min(out.get(rank, float("inf")), _t(iso))
    return out


@pytest.mark.parametrize("job", FAILED)
def test_no_rank_diverges_after_its_first_error(job: str) -> None:
    d = diagnose_paths([str(JOBS / job)], control=[str(HEALTHY)])
    div = d["divergence"]
    assert div["first"] is not None and div["first"] == div["per_rank"][0]
    errors = _first_errors(d)
    slack = max(c["uncertainty_s"] for c in d["clock"].values()) + 0.001
    times = [_t(e["time"]) for e in div["per_rank"]]
    assert times == sorted(times)
    checked = 0
    for e in div["per_rank"]:
        assert set(e) >= ENTRY
        if e["rank"] in errors:
            assert _t(e["time"]) <= errors[e["rank"]] + slack, (e, errors[e["rank"]])
            checked += 1
    assert checked


@pytest.mark.parametrize("job", SAME_SHAPE)
def test_against_a_run_of_the_same_shape_only_the_failure_is_new(job: str) -> None:
    d = diagnose_paths([str(JOBS / job)], control=[str(HEALTHY)])
    div, ini = d["divergence"], d["initiator"]
    errors = _first_errors(d)
    slack = max(c["uncertainty_s"] for c in d["clock"].values()) + 0.001
    for e in div["per_rank"]:
        assert str(template(e["text"])).startswith("ERROR ")
        assert abs(_t(e["time"]) - errors[e["rank"]]) <= slack  # its first error, not a line before it
    if ini["kind"] == "event":  # a line named the cause: it is also the first new line
        assert (div["first"]["node"], div["first"]["rank"]) == (ini["node"], ini["rank"])
    else:  # a silent rank: it logged nothing new, the others' timeouts are
        assert ini["rank"] not in {e["rank"] for e in div["per_rank"]}


def test_healthy_against_healthy_is_no_divergence() -> None:
    div = diagnose_paths([str(HEALTHY)], control=[str(HEALTHY)])["divergence"]
    assert div["first"] is None and div["per_rank"] == []


def test_a_control_of_another_world_size() -> None:
    """One node of the three (world size 3, one rank) against a 2 x 2 job on other hosts."""
    whole = diagnose_paths([str(JOBS / "alloc_fail")], control=[str(HEALTHY)])["divergence"]
    one = diagnose_paths([str(JOBS / "alloc_fail")], control=[str(HEALTHY / "node1")])["divergence"]
    assert one["control"]["files"] == 2
    assert one["per_rank"] == whole["per_rank"]
    assert [e["rank"] for e in one["per_rank"]] == [2, 1, 3, 0]


def test_aligned_time_names_the_rank_whose_clock_is_behind(tmp_path: Path) -> None:
    """nan_fp16_skew's node2 clock runs 7 s ahead. The control is the same job's node1 up to step 11
    (two ranks of four). Every rank's step-12 line is new, and rank 3 warned of its NaN before them:
    first in aligned time, last in local time."""
    control = tmp_path / "control" / "node1"
    control.mkdir(parents=True)
    for name in ("rank0.log", "rank1.log"):
        lines = (JOBS / "nan_fp16" / "node1" / name).read_bytes().split(b"\n")
        (control / name).write_bytes(b"\n".join(lines[:13]) + b"\n")
    d = diagnose_paths([str(JOBS / "nan_fp16_skew")], control=[str(control.parent)])
    first = d["divergence"]["first"]
    assert (first["node"], first["rank"], first["line"]) == ("node2", 3, 14)
    assert "found NaN in local grad norm" in first["text"]
    others = d["divergence"]["per_rank"][1:]
    assert {e["rank"] for e in others} == {0, 1, 2}
    assert all(e["line"] == 14 and "lm loss: NAN" in e["text"] for e in others)
    node1 = [e for e in others if e["node"] == "node1"]
    assert all(_t(e["local_time"]) < _t(first["local_time"]) for e in node1)


def test_json_and_text_output() -> None:
    p = denpexd("diagnose", str(JOBS / "exception_skew"), "--control", str(HEALTHY), "--format", "json")
    assert p.returncode == 0, p.stderr
    div = json.loads(p.stdout)["divergence"]
    assert set(div) >= {"first", "per_rank", "control"}
    assert set(div["first"]) >= ENTRY
    assert (div["first"]["node"], div["first"]["rank"]) == ("node3", 2)
    assert div["first"]["time"] == "2026-11-29T20:18:50.232Z"
    assert div["control"]["files"] == 6 and div["control"]["lines"] == 99 and div["control"]["templates"] == 4
    p = denpexd("diagnose", str(JOBS / "exception_skew"), "--control", str(HEALTHY))
    assert p.returncode == 0, p.stderr
    section = p.stdout.split("FIRST DIVERGENCE FROM THE HEALTHY RUN")[1].split("\n\n")[0]
    assert "first      node node3 rank 2  at 2026-11-29T20:18:50.232Z" in section
    assert "KeyError: 'shard-00009'" in section
    assert "per rank   3 stream(s), earliest first" in section
    plain = denpexd("diagnose", str(JOBS / "exception_skew"), "--format", "json")
    assert "divergence" not in json.loads(plain.stdout)
    assert "FIRST DIVERGENCE" not in denpexd("diagnose", str(JOBS / "exception_skew")).stdout


def test_control_may_be_repeated() -> None:
    p = denpexd(
        "diagnose", str(JOBS / "dataloader"), "--control", str(HEALTHY / "node1"), "--control", str(HEALTHY / "node3"),
        "--format", "json",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    div = json.loads(p.stdout)["divergence"]
    assert div["control"]["files"] == 4
    assert (div["first"]["node"], div["first"]["rank"]) == ("node2", 1)


def test_a_control_that_cannot_be_read_is_a_usage_error(tmp_path: Path) -> None:
    p = denpexd("diagnose", str(JOBS / "hang"), "--control", str(tmp_path / "nope"))
    assert p.returncode == 2
    assert "--control: no such file or directory" in p.stderr and "nope" in p.stderr
    p = denpexd("diagnose", str(JOBS / "hang"), "--control", str(tmp_path))
    assert p.returncode == 2 and "--control: no log files" in p.stderr
    assert p.stdout == ""


def test_hostile_input_on_both_sides(tmp_path: Path) -> None:
    for side in ("control", "failed"):
        n = tmp_path / side / "node1"
        n.mkdir(parents=True)
        (n / "rank0.log").write_bytes(os.urandom(100_000))
        (n / "rank1.log").write_bytes(b"\xc3\x28\xa0\xa1 invalid utf-8 step 3\n" * 50)
        with (n / "rank2.log").open("wb") as fh:
            fh.write(b"B" * (20 << 20))
            fh.write(b"\nINFO step 4 | loss 2.0\n")
        (n / "rank3.log").write_bytes(b"")
        os.mkfifo(n / "rank4.log")
    with (tmp_path / "failed" / "node1" / "rank2.log").open("ab") as fh:
        fh.write(b"ERROR something new on rank 2\n")
    p = denpexd(
        "diagnose", str(tmp_path / "failed"), "--control", str(tmp_path / "control"), "--format", "json"
    )
    assert p.returncode == 0, p.stderr
    div = json.loads(p.stdout)["divergence"]
    assert any("rank2.log" in w and "longer than" in w for w in div["warnings"])
    rank2 = [e for e in div["per_rank"] if e["rank"] == 2]
    assert [(e["line"], e["text"]) for e in rank2] == [(3, "ERROR something new on rank 2")]
    assert 1 not in {e["rank"] for e in div["per_rank"]}  # the same undecodable lines: nothing new
