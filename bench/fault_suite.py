#!/usr/bin/env python3
"""Every fault scenario of the project in one run, with its figures in one report.

The scenarios are tests (in CI) and two longer scripts (not in CI). This runs them all and
prints, per scenario: passed or failed, how long it took, and the figures it printed (written /
stored / lost / duplicated, refused, RSS, API latency, time to stop):

* poison messages, both broker modes (`test_serve_poison.py`);
* a full disk (`test_serve_disk_full.py`);
* hostile clients and forged senders (`test_serve_broker_access.py`, `test_serve_bad_input.py`);
* back-pressure (`test_ingest_backpressure.py`);
* kill -9 of the daemon and of Mosquitto, and a flooding publisher, with real agents
  (`test_fault_kill9.py`);
* a stop that cannot finish (`test_agent_liveness.py`, `test_watchdog.py`);
* one publisher at full speed (`fault_overload.py`), Mosquitto killed alone (`fault_broker_kill.py`).

    python3 bench/fault_suite.py                  # everything (about 6 minutes)
    python3 bench/fault_suite.py --tests-only     # the CI scenarios alone
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = [
    "tests/integration/test_serve_poison.py",
    "tests/integration/test_serve_disk_full.py",
    "tests/integration/test_serve_broker_access.py",
    "tests/integration/test_serve_bad_input.py",
    "tests/integration/test_ingest_backpressure.py",
    "tests/integration/test_fault_kill9.py",
    "tests/integration/test_agent_liveness.py",
    "tests/unit/test_watchdog.py",
    "tests/unit/test_serve_faults.py",
    "tests/unit/test_serve_store_damage.py",
]
# the lines a scenario prints with its figures (after pytest's progress marks, with -s)
FIGURES = re.compile(
    r"^[.FEsx]*((?:written \d|poison \(|disk full:|flood of|embedded:|mosquitto:|reading paused).*)$",
    re.MULTILINE,
)


def run_tests() -> tuple[list[tuple[str, str, float]], list[str], int]:
    """(test, outcome, seconds) per test, the figure lines, pytest's exit code."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", f"--junitxml={junit}", *TESTS],
            cwd=REPO, capture_output=True, text=True, check=False,
        )  # fmt: skip
        results = []
        if junit.exists():
            for case in ET.parse(junit).iter("testcase"):
                outcome = "passed"
                for child in case:
                    if child.tag in ("failure", "error"):
                        outcome = "FAILED"
                    elif child.tag == "skipped":
                        outcome = "skipped"
                name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
                results.append((name, outcome, float(case.get("time", 0.0))))
    figures = [m.group(1) for m in FIGURES.finditer(proc.stdout)]
    if proc.returncode not in (0, 1):
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", file=sys.stderr)
    return results, figures, proc.returncode


def run_script(args: list[str]) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, check=False)
    out = proc.stdout.strip()
    if proc.returncode != 0:
        out += f"\n(exit {proc.returncode}) " + proc.stderr.strip()[-1500:]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tests-only", action="store_true", help="skip the two long scripts")
    ap.add_argument("--seconds", type=float, default=30.0, help="length of each long script's load")
    args = ap.parse_args()
    t0 = time.monotonic()
    results, figures, code = run_tests()
    print("== fault scenarios (tests) ==")
    for name, outcome, seconds in results:
        print(f"  {outcome:8} {seconds:6.1f} s  {name}")
    print("== their figures ==")
    for line in figures:
        print(f"  {line}")
    failed = [r for r in results if r[1] == "FAILED"]
    if not args.tests_only:
        print("== one publisher at full speed (bench/fault_overload.py) ==")
        print(run_script(["bench/fault_overload.py", "--seconds", str(args.seconds)]))
        print("== Mosquitto killed alone (bench/fault_broker_kill.py) ==")
        print(run_script(["bench/fault_broker_kill.py", "--seconds", str(min(args.seconds, 20.0))]))
    print(
        f"== {len(results) - len(failed)} of {len(results)} scenarios passed, "
        f"{len(failed)} failed, in {time.monotonic() - t0:.0f} s =="
    )
    return 1 if failed or code not in (0, 5) else 0


if __name__ == "__main__":
    raise SystemExit(main())
