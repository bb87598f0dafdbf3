"""`denpexd diagnose -j N`: files read by worker processes give the very diagnosis of `-j 1`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from denpex_agent.reader import LogFile, ReadReport
from denpex_agent.rules import RuleSet
from denpexd import diagnosecmd, parallelread
from denpexd.diagnosecmd import diagnose_paths

REPO = Path(__file__).resolve().parents[2]
JOBS = REPO / "tests" / "fixtures" / "jobs"
CASES = sorted(p.parent.name for p in JOBS.glob("*/expected.json"))
TIMING = {"elapsed_s", "elapsed_ms", "took_s"}  # none today; a timing field would differ run to run


def _canon(doc: dict[str, Any]) -> bytes:
    return orjson.dumps({k: v for k, v in doc.items() if k not in TIMING}, option=orjson.OPT_NON_STR_KEYS)


@pytest.fixture
def one_file_per_task(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file its own task, so that even the small recorded jobs go through the pool."""
    monkeypatch.setattr(parallelread, "BATCH_BYTES", 1)
    monkeypatch.setattr(parallelread, "MIN_BATCH_BYTES", 1)


def denpexd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "denpexd", *args], capture_output=True, text=True, timeout=300, check=False
    )


@pytest.mark.usefixtures("one_file_per_task")
def test_every_recorded_job_is_diagnosed_the_same_with_two_workers(library: RuleSet) -> None:
    assert len(CASES) >= 12
    for case in CASES:
        one = diagnose_paths([str(JOBS / case)], rules=library)
        two = diagnose_paths([str(JOBS / case)], rules=library, jobs=2)
        assert _canon(two) == _canon(one), case


def test_the_command_line_gives_the_same_json_with_j1_and_j2() -> None:
    case = str(JOBS / CASES[0])
    one = denpexd("diagnose", case, "--format", "json", "-j", "1")
    two = denpexd("diagnose", case, "--format", "json", "--jobs", "2")
    assert one.returncode == two.returncode == 0, two.stderr
    assert _canon(orjson.loads(two.stdout)) == _canon(orjson.loads(one.stdout))


@pytest.mark.parametrize("bad", ["0", "-1"])
def test_zero_or_negative_jobs_is_a_usage_error(bad: str) -> None:
    p = denpexd("diagnose", str(JOBS / CASES[0]), f"-j{bad}")
    assert p.returncode == 2 and "-j/--jobs must be >= 1" in p.stderr and p.stdout == ""


def _small_files_job(root: Path, files: int) -> Path:
    """``files`` small rank logs over 8 nodes: steps on every rank, an out-of-memory on one."""
    for r in range(files):
        node = root / f"node{r % 8}"
        node.mkdir(parents=True, exist_ok=True)
        lines = [
            f"2026-11-29 12:00:{s:02d},{r % 1000:03d} INFO [rank{r}] step {s} | loss 7.{s:02d} | lr 1e-05\n"
            for s in range(20)
        ]
        if r == 1234:
            lines.append(
                "2026-11-29 12:00:20,500 ERROR [rank1234] torch.OutOfMemoryError: CUDA out of memory. "
                "Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB\n"
            )
        (node / f"rank{r}.log").write_text("".join(lines))
    return root


def test_four_thousand_small_files_are_batched_and_diagnosed_the_same(
    tmp_path: Path, library: RuleSet
) -> None:
    job = _small_files_job(tmp_path / "job", 4096)
    one = diagnose_paths([str(job)], rules=library)
    two = diagnose_paths([str(job)], rules=library, jobs=2)
    assert _canon(two) == _canon(one)
    assert one["read"]["files"] == 4096 and one["verdict"] == "failed"
    files = diagnosecmd.discover([str(job)], None, ReadReport())
    tasks = parallelread.plan_tasks(files, 2)
    assert 4 <= len(tasks) <= 64  # batched: a few hundred files a task, not one
    assert [lf for t in tasks for lf in t] == files  # in order, each once
    # and through the command line, with the progress bar fed by the workers
    p = denpexd("diagnose", str(job), "--format", "json", "-j", "2", "--progress", "always")
    assert p.returncode == 0, p.stderr
    assert "reading [" in p.stderr and "100.0%" in p.stderr
    assert _canon(orjson.loads(p.stdout)) == _canon(one)


def test_big_files_are_a_task_each() -> None:
    files = [_fake(f"rank{i}.log", 16 << 20) for i in range(64)]
    assert [len(t) for t in parallelread.plan_tasks(files, 2)] == [1] * 64
    small = [_fake(f"rank{i}.log", 256 << 10) for i in range(4096)]
    assert [len(t) for t in parallelread.plan_tasks(small, 2)] == [64] * 64


def _fake(name: str, size: int) -> LogFile:
    from denpex_agent.attribution import attribute_path

    return LogFile(path=Path(name), rel=name, who=attribute_path(name), size=size, mtime=0.0, identity=name)


@pytest.mark.usefixtures("one_file_per_task")
def test_a_file_that_vanishes_or_cannot_be_read_gives_the_same_warnings(
    tmp_path: Path, library: RuleSet, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = _small_files_job(tmp_path / "job", 24)
    gone = job / "node3" / "rank11.log"
    unreadable = job / "node5" / "rank13.log"
    discover = diagnosecmd.discover

    def discover_then_break(*args: Any) -> list[LogFile]:
        found = discover(*args)
        if gone.exists():
            gone.unlink()  # vanishes between discovery and reading
        if unreadable.is_file():
            unreadable.unlink()
            unreadable.mkdir()  # reading it fails (EISDIR), even as root
        return found

    monkeypatch.setattr(diagnosecmd, "discover", discover_then_break)
    one = diagnose_paths([str(job)], rules=library)
    gone.write_text("x\n")
    unreadable.rmdir()
    unreadable.write_text("x\n")
    two = diagnose_paths([str(job)], rules=library, jobs=2)
    assert _canon(two) == _canon(one)
    warnings = two["read"]["warnings"]
    assert len(warnings) == 2, warnings
    assert str(gone) in warnings[0] and "read failed" in warnings[0]
    assert str(unreadable) in warnings[1] and "read failed" in warnings[1]
    assert two["read"]["files"] == 24


def test_a_file_without_read_permission_gives_the_same_warnings(tmp_path: Path) -> None:
    """Three files of 17 MiB (one task each, so -j 2 really uses the pool), one without read
    permission: the same diagnosis and the same warning naming it with -j 1 and -j 2. Run as a
    subprocess that cannot bypass file modes (as root: without CAP_DAC_OVERRIDE/READ_SEARCH)."""
    line = b"2026-11-29 12:00:01,000 INFO [rank0] step 1 | loss 7.0 | grad_norm 1.0\n"
    for r in range(3):
        (tmp_path / "node0").mkdir(exist_ok=True)
        (tmp_path / "node0" / f"rank{r}.log").write_bytes(line * ((17 << 20) // len(line) + 1))
    locked = tmp_path / "node0" / "rank1.log"
    locked.chmod(0)
    prefix: list[str] = []
    if os.geteuid() == 0:
        caps = "-dac_override,-dac_read_search"
        prefix = ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}"]

    def run(jobs: str) -> dict[str, Any]:
        p = subprocess.run(
            [
                *prefix,
                sys.executable,
                "-m",
                "denpexd",
                "diagnose",
                str(tmp_path),
                "-j",
                jobs,
                "--format",
                "json",
            ],
            capture_output=True,
            check=False,
            timeout=300,
        )
        assert p.returncode == 0, p.stderr
        return dict(orjson.loads(p.stdout))

    try:
        one, two = run("1"), run("2")
    finally:
        locked.chmod(0o644)
    assert _canon(two) == _canon(one)
    assert any(str(locked) in w for w in two["read"]["warnings"]), two["read"]["warnings"]


def test_ctrl_c_stops_the_workers(tmp_path: Path) -> None:
    """SIGINT to the foreground group (a terminal's Ctrl-C): exit 130, one line, no worker left."""
    import signal
    import time

    line = b"2026-11-29 12:00:01,000 INFO [rank0] step 1 | loss 7.0 | lr 1e-05 | grad_norm 1.0 | tokens/s 5\n"
    for r in range(4):
        (tmp_path / "node0").mkdir(exist_ok=True)
        (tmp_path / "node0" / f"rank{r}.log").write_bytes(line * ((64 << 20) // len(line)))
    p = subprocess.Popen(
        [sys.executable, "-m", "denpexd", "diagnose", str(tmp_path), "-j", "2", "--format", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # a shell that starts the tests in the background hands them SIGINT ignored, and Python
        # then installs no KeyboardInterrupt handler: the command gets the disposition a terminal gives
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    workers: list[str] = []
    deadline = time.monotonic() + 30
    while len(workers) < 2 and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
        workers = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
    if p.poll() is not None:
        pytest.skip("the read finished before the workers were seen")
    os.killpg(p.pid, signal.SIGINT)
    _out, err = p.communicate(timeout=30)
    assert p.returncode == 130 and err.strip().endswith("denpexd: interrupted"), err
    assert "Traceback" not in err
    time.sleep(0.2)
    assert not [w for w in workers if Path(f"/proc/{w}").exists()]
