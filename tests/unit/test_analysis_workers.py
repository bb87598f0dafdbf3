"""A process id a line names is a worker's rank when its node's launcher listed that worker
(`analysis.workers`): DeepSpeed's teardown names every worker it spawned, local rank 0 first, and
the kernel's OOM killer names the process it killed. Real files, read as `diagnose` reads them."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from denpex_agent.matcher import Matcher
from denpex_agent.reader import ReadReport, discover, read_files
from denpex_agent.rules import RuleSet
from denpexd.analysis.workers import local_rank_of, note_worker
from denpexd.diagnosecmd import diagnose_paths
from denpexd.engine import Engine

# the launcher's teardown as DeepSpeed prints it (launch.py's sigkill_handler), three workers
TEARDOWN = (
    "[2025-06-02 20:51:24,182] [INFO] [launch.py:319:sigkill_handler] Killing subprocess 410126\n"
    "[2025-06-02 20:51:24,184] [INFO] [launch.py:319:sigkill_handler] Killing subprocess 410127\n"
    "[2025-06-02 20:51:26,612] [INFO] [launch.py:319:sigkill_handler] Killing subprocess 410128\n"
)


def _kernel(pid: int) -> str:
    return (
        f"[856341.770960] Out of memory: Killed process {pid} (python) total-vm:79905000kB, "
        "anon-rss:22957108kB, file-rss:72036kB, shmem-rss:15143164kB, UID:1000 pgtables:78032kB oom_score_adj:0\n"
    )


def _job(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "logs"
    for name, text in files.items():
        p = root / "node0" / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


@pytest.mark.parametrize("pid,rank", [(410126, 0), (410127, 1), (410128, 2)])
def test_the_killed_pid_is_the_worker_at_its_place_in_the_teardown(
    tmp_path: Path, pid: int, rank: int
) -> None:
    d = diagnose_paths([str(_job(tmp_path, {"console.log": TEARDOWN + _kernel(pid)}))])
    assert d["verdict"] == "failed" and d["root_cause"]["rule"] == "host-oom-killer"
    assert d["initiator"] is not None and d["initiator"]["rank"] == rank


def test_the_kernel_line_may_come_first_and_from_another_file(tmp_path: Path) -> None:
    before = diagnose_paths([str(_job(tmp_path / "a", {"console.log": _kernel(410127) + TEARDOWN}))])
    apart = diagnose_paths(
        [str(_job(tmp_path / "b", {"console.log": TEARDOWN, "dmesg.log": _kernel(410127)}))]
    )
    assert before["initiator"]["rank"] == 1
    assert apart["initiator"]["rank"] == 1


def test_a_process_the_launcher_did_not_list_names_no_rank(tmp_path: Path) -> None:
    # a DataLoader worker or another job's process: killed, but not one of the listed workers
    d = diagnose_paths([str(_job(tmp_path, {"console.log": TEARDOWN + _kernel(999)}))])
    assert d["verdict"] == "failed" and d["root_cause"]["rule"] == "host-oom-killer"
    assert (d["initiator"] or {}).get("rank") is None


def test_the_rank_does_not_depend_on_the_order_lines_arrive_in(tmp_path: Path, library: RuleSet) -> None:
    root = _job(tmp_path, {"console.log": TEARDOWN, "dmesg.log": _kernel(410128)})
    report = ReadReport()
    events = list(read_files(discover([str(root)], None, report), Matcher(library), "job", report))
    assert sum(ev.kind == "match" for ev in events) == 4  # three listed workers, one kill
    for seed in range(6):
        random.Random(seed).shuffle(events)
        engine = Engine("job", library)
        for ev in events:
            engine.add(ev)
        assert engine.diagnose()["initiator"]["rank"] == 2, seed


def test_lists_are_ordered_by_offset_and_must_agree() -> None:
    pids: dict[tuple[str, str], dict[int, int]] = {}
    for pid, offset in ((30, 300), (10, 100), (20, 200)):  # read out of order
        note_worker(pids, "n", "launcher.log", pid, offset)
    assert [local_rank_of(pids, "n", p) for p in (10, 20, 30, 40)] == [0, 1, 2, None]
    assert local_rank_of(pids, "other-node", 10) is None
    note_worker(pids, "n", "launcher.log", 30, 50)  # listed again, earlier in the file: its first place
    assert local_rank_of(pids, "n", 30) == 0
    note_worker(pids, "n", "second.log", 20, 0)  # another list puts 20 first: they disagree
    assert local_rank_of(pids, "n", 20) is None
