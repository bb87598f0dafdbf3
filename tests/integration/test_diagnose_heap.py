"""`denpexd diagnose` reads a big file without faulting in every chunk's memory again.

Each 1 MiB chunk, and the chunk joined to the partial line before it, are short-lived buffers of
the C heap; with glibc's default thresholds the freed heap top went back to the kernel after
nearly every chunk, so each chunk's pages were faulted in anew: about one minor page fault per
4 KiB read (`denpex_agent.heap`). The faults of a run are the kernel's count for that process
(``getrusage`` of the finished child), not a timing.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from denpex_agent.heap import keep_freed_memory

PAGE = os.sysconf("SC_PAGE_SIZE")
LINE = b"2026-11-29 12:00:01,000 INFO [rank0] step %d | loss 7.0 | lr 1e-05 | grad_norm 1.0 | tokens/s 5\n"


def _minor_faults(path: Path) -> int:
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
    subprocess.run(
        [sys.executable, "-m", "denpexd", "diagnose", str(path), "-j", "1", "--format", "json"],
        stdout=subprocess.DEVNULL,
        check=True,
        timeout=300,
    )
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - before


@pytest.mark.skipif(not keep_freed_memory(), reason="no glibc malloc to tune here")
def test_reading_a_big_file_does_not_fault_its_chunks_in_again(tmp_path: Path) -> None:
    small, big = tmp_path / "small" / "node0", tmp_path / "big" / "node0"
    small.mkdir(parents=True)
    big.mkdir(parents=True)
    (small / "rank0.log").write_bytes(LINE % 1)
    block = b"".join(LINE % i for i in range(10_000))
    data = block * ((96 << 20) // len(block))
    (big / "rank0.log").write_bytes(data)
    base = _minor_faults(small.parent)
    extra = _minor_faults(big.parent) - base
    pages = len(data) // PAGE
    # without the tuning: about one fault per page read (~24,000 here); with it, a few hundred
    assert extra < pages // 8, (extra, pages)
