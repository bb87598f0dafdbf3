"""`denpexd diagnose` and `denpexd rules` as a user runs them: real subprocesses, real files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
JOBS = REPO / "tests" / "fixtures" / "jobs"
CONTRACT = {
    "job",
    "verdict",
    "initiator",
    "root_cause",
    "candidates",
    "collateral",
    "clock",
    "fingerprints",
    "evidence",
}
CANDIDATE = {"node", "rank", "rule", "category", "time", "file", "line", "text", "confidence"}


def denpexd(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "denpexd", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
        check=False,
    )


def _any_failed_case() -> Path:
    for p in sorted(JOBS.glob("*/expected.json")):
        if json.loads(p.read_text())["verdict"] == "failed":
            return p.parent
    raise AssertionError("no failed case in the corpus")


def test_json_follows_the_contract() -> None:
    job = _any_failed_case()
    proc = denpexd("diagnose", str(job), "--format", "json", "--job", "job-4711")
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert set(d) >= CONTRACT
    assert d["job"] == "job-4711"
    assert set(d["initiator"]) >= CANDIDATE
    assert {"rule", "title", "category", "root_cause", "fix", "verify"} <= set(d["root_cause"])
    for c in d["collateral"]:
        assert {"node", "rank", "rule", "category", "first_time", "count"} <= set(c)
    for c in d["clock"].values():
        assert {"offset_s", "uncertainty_s", "method"} <= set(c)
    assert {"stage", "first_rank", "ranks"} <= set(d["fingerprints"]["nan"])
    assert {"file", "line", "before"} <= set(d["evidence"])
    assert 0 < len(d["evidence"]["before"]) <= 100


def test_text_report_puts_the_initiator_first() -> None:
    job = _any_failed_case()
    proc = denpexd("diagnose", str(job))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].endswith("FAILED")
    assert lines[2].startswith("FIRST FAILURE")
    for section in ("ROOT CAUSE", "fix", "verify", "COLLATERAL", "CLOCKS", "EVIDENCE"):
        assert section in proc.stdout


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    assert denpexd().returncode == 2
    p = denpexd("diagnose", str(tmp_path / "nope"))
    assert p.returncode == 2 and "no such file or directory" in p.stderr
    p = denpexd("diagnose", str(tmp_path), "--layout", "{node}/{what}.log")
    assert p.returncode == 2 and "unknown field" in p.stderr
    p = denpexd("diagnose", str(tmp_path), "--format", "yaml")
    assert p.returncode == 2
    p = denpexd("diagnose", str(tmp_path), "--rules", str(tmp_path / "none"))
    assert p.returncode == 2 and "invalid rules" in p.stderr


def test_nothing_to_read_and_a_layout_that_matches_nothing_are_errors(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    p = denpexd("diagnose", str(tmp_path / "empty"))
    assert (
        p.returncode == 2
        and f"no log files (*.log *.txt *.out *.err stdout stderr) found in {tmp_path / 'empty'}" in p.stderr
    )
    assert p.stdout == ""  # no "HEALTHY" for a directory with nothing in it
    example = REPO / "examples" / "job-4711"
    p = denpexd("diagnose", str(example), "--layout", "logs/{node}/{rank}.txt")
    assert p.returncode == 2 and "matches none of the 6 log file(s)" in p.stderr and p.stdout == ""


def _summary(doc: dict[str, object]) -> tuple[object, ...]:
    ini = doc["initiator"] or {}
    assert isinstance(ini, dict)
    return (doc["job"], doc["verdict"], ini.get("node"), ini.get("rank"), ini.get("rule"), ini.get("confidence"),
            doc["collateral_ranks"], doc["clock"])  # fmt: skip


def test_each_directory_argument_is_a_node() -> None:
    """`diagnose node1/ node2/` reads what `diagnose .` reads in their parent (the README's own
    example, with and without its --layout)."""
    example = REPO / "examples" / "job-4711"
    whole = json.loads(denpexd("diagnose", ".", "--format", "json", cwd=example).stdout)
    for extra in ([], ["--layout", "{node}/rank{rank}.log"], ["--job", "job-4711"]):
        p = denpexd("diagnose", "node1/", "node2/", "--format", "json", *extra, cwd=example)
        assert p.returncode == 0, p.stderr
        assert _summary(json.loads(p.stdout)) == _summary(whole), extra
    assert whole["initiator"]["node"] == "node2" and whole["initiator"]["rank"] == 3


def test_hostile_input_gives_warnings_not_crashes(tmp_path: Path) -> None:
    job = tmp_path / "job"
    n = job / "node1"
    n.mkdir(parents=True)
    (n / "rank0.log").write_bytes(os.urandom(200_000))
    (n / "rank1.log").write_bytes(b"\xc3\x28\xa0\xa1 invalid utf-8\n" * 100 + b"Killed\n")
    with (n / "rank2.log").open("wb") as fh:  # one 50 MB line, then a real failure
        fh.write(b"A" * (50 << 20))
        fh.write(
            b"\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB\n"
        )
    (n / "rank3.log").write_bytes(b"")
    (n / "rank4.log").mkdir()
    fifo = n / "rank5.log"
    os.mkfifo(fifo)
    proc = denpexd("diagnose", str(job), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    warnings = "\n".join(d["read"]["warnings"])
    assert "rank0.log" in warnings and "binary" in warnings
    assert "rank2.log" in warnings and "longer than" in warnings
    assert "rank4.log" in warnings and "rank5.log" in warnings  # a directory and a FIFO: skipped, named
    assert d["read"]["truncated_lines"] == 1
    assert d["verdict"] == "failed"
    assert d["initiator"]["rank"] == 2 and d["root_cause"]["category"] == "out-of-memory"


def test_rules_test_passes_on_the_library_and_names_a_bad_rule(tmp_path: Path) -> None:
    p = denpexd("rules", "test")
    assert p.returncode == 0, p.stdout
    assert "rules: ok" in p.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text(
        'schema = 1\n[[rule]]\nid = "broken-one"\ntitle = "t"\ncategory = "hang"\nseverity = "error"\n'
        'role = "root-cause"\npatterns = ["(unclosed"]\nroot_cause = "r"\nfix = "f"\nverify = "v"\nexamples = ["x"]\n'
    )
    p = denpexd("rules", "test", "--rules", str(bad))
    assert p.returncode == 1
    assert "bad.toml" in p.stdout and "broken-one" in p.stdout and "does not compile" in p.stdout
    bad.write_text(
        bad.read_text()
        .replace('"(unclosed"', '"stuck"')
        .replace('examples = ["x"]', 'examples = ["x"]\nsevrity = 1')
    )
    p = denpexd("rules", "test", "--rules", str(bad))
    assert p.returncode == 1 and "unknown key" in p.stdout and "sevrity" in p.stdout
    bad.write_text(
        bad.read_text().replace("\nsevrity = 1", "").replace('role = "root-cause"', 'role = "victim"')
    )
    p = denpexd("rules", "test", "--rules", str(bad))
    assert p.returncode == 1 and "role 'victim'" in p.stdout
    bad.write_text(bad.read_text().replace('role = "victim"', 'role = "root-cause"'))
    p = denpexd("rules", "test", "--rules", str(bad))
    assert p.returncode == 1 and "example does not match" in p.stdout


@pytest.mark.parametrize("example", ["examples/job-4711"])
def test_bundled_example_is_diagnosed(example: str) -> None:
    p = denpexd("diagnose", example)
    assert p.returncode == 0, p.stderr
    assert "FIRST FAILURE" in p.stdout


def test_progress_bar_on_request_and_never_in_the_output() -> None:
    job = _any_failed_case()
    p = denpexd("diagnose", str(job), "--format", "json", "--progress", "always")
    assert p.returncode == 0
    assert "reading [" in p.stderr and "MB/s" in p.stderr
    json.loads(p.stdout)  # stdout stays clean JSON
    p = denpexd("diagnose", str(job), "--progress", "auto")  # stderr is a pipe here: no bar
    assert "reading [" not in p.stderr
