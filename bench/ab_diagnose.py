#!/usr/bin/env python3
"""Two source trees' `denpexd diagnose` on one job directory, interleaved, with grep beside them.

    python bench/ab_diagnose.py --base /tmp/base --new . bench/out/job-1G-64f-s42 --jobs 1,2

Each round runs ``grep -E -c -f PATTERNS`` on the job's files, then for every ``-j`` value the
base tree's and the new tree's ``python -m denpexd diagnose DIR --format json -j N`` (the tree
chosen by ``PYTHONPATH``: a copy of an older commit, ``git archive COMMIT | tar -x -C DIR``, runs
against the working tree in the same minutes). Wall time and the CPU seconds of the process and
its workers (``os.wait4``) are printed per round; at the end, the best of each. The JSON of the
two trees must be byte-identical (with the same ``-j``) or the run stops.

Run ``bench_diagnose.py --keep`` first: it builds the job directories, the rule snapshot and the
grep pattern file this script reuses (``bench/out/rules-snapshot``, ``bench/out/patterns.ere``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def measured(
    cmd: list[str], env: dict[str, str] | None = None, out: Path | None = None
) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one command, its output to ``out`` (or discarded)."""
    with open(out or os.devnull, "wb") as sink:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.DEVNULL, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
    if status != 0:
        raise SystemExit(f"ab_diagnose: {' '.join(cmd)} failed (status {status})")
    return wall, usage.ru_utime + usage.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("dir", help="job directory")
    ap.add_argument("--base", required=True, help="source tree of the version to compare against")
    ap.add_argument("--new", default=str(HERE.parent), help="source tree to measure (default: this one)")
    ap.add_argument("--jobs", default="1,2", help="-j values, comma-separated (default 1,2)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rules", default=str(HERE / "out" / "rules-snapshot"))
    ap.add_argument("--patterns", default=str(HERE / "out" / "patterns.ere"))
    a = ap.parse_args()
    trees = {"base": Path(a.base).resolve(), "new": Path(a.new).resolve()}
    jobs = [int(j) for j in a.jobs.split(",")]
    files = sorted(str(p) for p in Path(a.dir).rglob("*.log"))
    results: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(a.rounds):
            grep = ["env", "LC_ALL=C", "grep", "-E", "-c", "-h", "-f", a.patterns, *files]
            results.setdefault("grep -E -c -f", []).append(measured(grep))
            for j in jobs:
                outs = {}
                for name, tree in trees.items():
                    env = dict(os.environ, PYTHONPATH=f"{tree}/agents:{tree}/daemon:{tree}")
                    cmd = [sys.executable, "-m", "denpexd", "diagnose", a.dir, "--format", "json"]
                    cmd += ["--progress", "never", "--rules", a.rules, "-j", str(j)]
                    outs[name] = Path(tmp) / f"{name}-j{j}.json"
                    results.setdefault(f"{name} -j {j}", []).append(measured(cmd, env, outs[name]))
                if outs["base"].read_bytes() != outs["new"].read_bytes():
                    raise SystemExit(f"ab_diagnose: the two trees' JSON differ with -j {j}")
            row = "  ".join(f"{k} {v[-1][0]:.2f}/{v[-1][1]:.2f}" for k, v in results.items())
            print(f"round {rnd + 1} (wall/CPU s): {row}", flush=True)
    print(f"best of {a.rounds} (load average now {os.getloadavg()[0]:.1f}):")
    for name, runs in results.items():
        walls = " ".join(f"{w:.2f}" for w, _ in runs)
        best_wall = min(w for w, _ in runs)
        best_cpu = min(c for _, c in runs)
        print(f"  {name:16s} wall {best_wall:6.2f} s  CPU {best_cpu:6.2f} s   walls {walls}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
