"""Ranks that lines name or imply: the device a CUDA OOM names (a device other than 0 is the local
rank of the process that ran out of memory, one device per local rank; device 0 says nothing, as
a process that sees one device calls it 0 whatever its rank); the root a peer could not reach,
over the worker a launcher killed; the worker a launcher reports failed, for a first failure that
names no rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from denpexd.diagnosecmd import diagnose_paths

STEPS = "".join(
    f"2024-10-14 12:32:{40 + s:02d},000 INFO [rank{r}] step {s} | loss 2.1\n"
    for s in range(1, 6)
    for r in range(4)
)


def _job(tmp_path: Path, device: int, old_format: bool = False) -> Path:
    oom = (
        f"torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU {device}; 10.76 GiB "
        "total capacity; 9.72 GiB already allocated; 7.56 MiB free)"
        if old_format
        else f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.88 GiB. GPU {device} has a total "
        "capacity of 21.96 GiB of which 1.29 GiB is free."
    )
    log = tmp_path / "logs" / "node0" / "console.log"
    log.parent.mkdir(parents=True)
    log.write_text(STEPS + f"(Worker pid=2421) ERROR 10-14 12:32:47 worker.py:233] {oom}\n")
    return log.parent.parent


@pytest.mark.parametrize("old_format", [False, True])
def test_a_device_other_than_0_names_the_rank(tmp_path: Path, old_format: bool) -> None:
    d = diagnose_paths([str(_job(tmp_path, 3, old_format))])
    assert d["verdict"] == "failed" and d["root_cause"]["category"] == "out-of-memory"
    assert d["initiator"] is not None and d["initiator"]["rank"] == 3


def test_device_0_names_no_rank(tmp_path: Path) -> None:
    d = diagnose_paths([str(_job(tmp_path, 0))])
    assert d["verdict"] == "failed"
    assert (d["initiator"] or {}).get("rank") is None


def test_a_peer_naming_the_rank_it_lost_outweighs_the_launchers_kill_report(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "node0" / "console.log"
    log.parent.mkdir(parents=True)
    log.write_text(
        "RuntimeError: [6] is setting up NCCL communicator and retrieving ncclUniqueId from [0] via c10d key-value "
        "store by key '0', but store->get('0') got error: Broken pipe. This may indicate a possible application crash "
        "on rank 0 or a network set up issue.\n"
        "[2023-12-27 11:01:09,316] [ERROR] [launch.py:321:sigkill_handler] ['/usr/bin/python3', '-u', 'train.py', "
        "'--local_rank=7'] exits with return code = -9\n"
    )
    d = diagnose_paths([str(tmp_path / "logs")])
    assert d["verdict"] == "failed" and d["initiator"] is not None
    assert d["initiator"]["rank"] == 0  # the root rank 6 could not reach, not the worker the launcher reports
    # without the peer's report, the killed worker is all there is
    log.write_text(log.read_text().splitlines(keepends=True)[1])
    assert diagnose_paths([str(tmp_path / "logs")])["initiator"]["rank"] == 7


def _console(tmp_path: Path, *lines: str) -> str:
    log = tmp_path / "logs" / "node0" / "console.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("".join(line + "\n" for line in lines))
    return str(tmp_path / "logs")


TRACEBACK = (
    "Traceback (most recent call last):",
    '  File "train.py", line 9, in <module>',
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB",
)
FAILED = "E1129 12:00:05.000000 1 torch/distributed/elastic/multiprocessing/api.py:833] failed (exitcode: 1) local_rank: {} (pid: 42{}) of binary: /usr/bin/python3"


def test_an_unranked_first_failure_is_the_worker_its_launcher_reports(tmp_path: Path) -> None:
    d = diagnose_paths([_console(tmp_path, *TRACEBACK, FAILED.format(2, 2))])
    assert d["initiator"]["rule"] == "cuda-oom" and d["initiator"]["rank"] == 2


def test_another_nodes_launcher_names_no_rank_for_it(tmp_path: Path) -> None:
    root = _console(tmp_path, *TRACEBACK)
    other = tmp_path / "logs" / "node1" / "console.log"
    other.parent.mkdir(parents=True)
    other.write_text(FAILED.format(2, 2) + "\n")
    d = diagnose_paths([root])
    assert d["initiator"]["rule"] == "cuda-oom" and d["initiator"]["node"] == "node0"
    assert d["initiator"]["rank"] is None
