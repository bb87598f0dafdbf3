"""The analyses that need no error line (trends, slow ranks, the end of training) raise no false
alarm: on every healthy recorded job, on the public corpus's healthy runs, and on the benchmark's
generated logs (failure events switched off) for several seeds, nothing is `degraded` by a trend
or a slow rank, and an fp16 loss scaler settling at the start is healthy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from denpex_agent.rules import RuleSet
from denpexd.diagnosecmd import diagnose_paths
from tests.integration.replay import JOBS

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
PUBLIC = ROOT / "tests" / "fixtures" / "public"


def _quiet(doc: dict[str, Any]) -> None:
    assert doc["trends"] == [], doc["trends"]
    assert doc["stragglers"] == [], doc["stragglers"]
    assert doc["verdict"] == "healthy", (doc["verdict"], doc["root_cause"])


def _cases(root: Path, truth: str, verdict: str) -> list[str]:
    return sorted(
        p.parent.name for p in root.glob(f"*/{truth}") if json.loads(p.read_text())["verdict"] == verdict
    )


@pytest.mark.parametrize("case", _cases(JOBS, "expected.json", "healthy"))
def test_healthy_recorded_jobs(case: str, library: RuleSet) -> None:
    doc = diagnose_paths([str(JOBS / case)], rules=library)
    _quiet(doc)
    assert doc["finished"] is True


@pytest.mark.parametrize("case", _cases(PUBLIC, "truth.json", "healthy"))
def test_healthy_public_runs(case: str, library: RuleSet) -> None:
    doc = diagnose_paths([str(PUBLIC / case / "logs")], rules=library)
    _quiet(doc)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_generated_benchmark_logs(seed: int, tmp_path: Path, library: RuleSet) -> None:
    out = tmp_path / "gen"
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gen_training_log.py"), str(out), "--size", "8M", "--seed", str(seed),
         "--failure-rate", "0"],
        check=True, capture_output=True,
    )  # fmt: skip
    doc = diagnose_paths([str(out)], rules=library)
    assert sum(r["last_step"] or 0 for r in doc["ranks"]) > 0  # the step lines were read
    _quiet(doc)
