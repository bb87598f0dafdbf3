"""The live answer equals the post-mortem one on the public-logs corpus too (tests/fixtures/public/).

Those logs were written by other people's jobs, so they exercise what the recorded corpus does
not: other launchers' prefixes, half-posted tracebacks, logbook excerpts that span hours. Each
case's ``logs/`` is laid out as a job directory (``<node>/...``), replayed through real
`denpex-agent` processes and the embedded broker of a real `denpexd serve` (the ``split``
variant: reads cut mid-line and mid-record; pauses longer than `MAX_GAP_S` shortened, the
timestamps in the bytes unchanged), and `denpexd query --json` must equal
`denpexd diagnose --format json` of the same directory on verdict, initiator, root-cause
category, collateral ranks and the NaN fingerprint (see test_live_invariant.py).
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import pytest

from tests.integration.test_live_invariant import Run, _run_all, _table

pytestmark = [pytest.mark.integration]

PUBLIC = Path(__file__).resolve().parents[1] / "fixtures" / "public"
CASES = sorted(p.parent.name for p in PUBLIC.glob("*/truth.json"))
MAX_GAP_S = 0.5
CONCURRENCY = 16  # small logs: the replays mostly wait for their diagnosis to settle
VARIANT, BROKER = "split", "embedded"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    root = tmp_path_factory.mktemp("public-jobs")
    for case in CASES:  # <case>/logs/<node>/... -> <case>/<node>/... (+ the expected.json replays look for)
        shutil.copytree(PUBLIC / case / "logs", root / case)
        (root / case / "expected.json").write_text("{}\n")
    workdir = tmp_path_factory.mktemp("live-invariant-public")
    t0 = time.monotonic()
    cases = [(case, VARIANT, BROKER) for case in CASES]
    result = asyncio.run(_run_all(cases, workdir, root=root, max_gap_s=MAX_GAP_S, concurrency=CONCURRENCY))
    result.table = _table(result, time.monotonic() - t0)
    (workdir / "live_invariant.txt").write_text(result.table + "\n")
    print(f"\n{result.table}", flush=True)
    return result


def test_the_corpus_is_there() -> None:
    assert len(CASES) >= 40


@pytest.mark.parametrize("case", CASES)
def test_live_diagnosis_equals_postmortem(run: Run, case: str) -> None:
    r = run.results[(case, VARIANT, BROKER)]
    assert r.error is None, r.line()
    assert r.diffs == [], r.line()


@pytest.mark.parametrize("case", CASES)
def test_processes_ran_cleanly(run: Run, case: str) -> None:
    r = run.results[(case, VARIANT, BROKER)]
    assert r.notes == [], r.line()


def test_daemon_ran_cleanly(run: Run) -> None:
    assert run.daemons[BROKER] == [], "\n".join(run.daemons[BROKER])
