"""The documentation matches the code: README's sample report is the real output, every field the
diagnosis carries is described in docs/diagnosis-json.md, and references stay inside the
repository."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
CONTRACT = REPO / "docs" / "diagnosis-json.md"
# one job of each shape: an event, a hang, a SIGKILL, NaN, a healthy and a degraded job
JOBS = [
    "examples/job-4711",
    *(f"tests/fixtures/jobs/{j}" for j in ("hang", "sigkill", "healthy", "slow_rank")),
]
DOCS = [
    REPO / "README.md",
    REPO / "ARCHITECTURE.md",
    REPO / "agents" / "README.md",
    REPO / "bench" / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    *sorted(p for p in (REPO / "deploy").rglob("*") if p.is_file()),
]


def test_readme_report_is_the_real_output() -> None:
    """README shows `denpexd diagnose examples/job-4711` verbatim up to its EVIDENCE line."""
    run = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "update-readme-report"), "--check"],
        capture_output=True, text=True, cwd=REPO, timeout=120, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr


def _field_names(node: Any, parent: str = "") -> set[str]:
    """Every key in a document, except the keys of maps keyed by data (node names, ranks)."""
    names: set[str] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            if parent not in ("clock", "per_rank"):
                names.add(key)
            names |= _field_names(value, key)
    elif isinstance(node, list):
        for value in node:
            names |= _field_names(value, parent)
    return names


def test_every_diagnosis_field_is_documented() -> None:
    names: set[str] = set()
    with_control = ["tests/fixtures/jobs/hang", "--control", "tests/fixtures/jobs/slow_rank"]
    for args in [[job] for job in JOBS] + [with_control]:
        run = subprocess.run(
            [sys.executable, "-m", "denpexd", "diagnose", *args, "--format", "json"],
            capture_output=True, text=True, cwd=REPO, timeout=300, check=False,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        names |= _field_names(json.loads(run.stdout))
    # what `serve` adds to the engine's document (daemon/denpexd/jobs.py)
    jobs_py = (REPO / "daemon" / "denpexd" / "jobs.py").read_text()
    served = set(re.findall(r'\b(?:doc|short)\["(\w+)"\]\s*=', jobs_py))
    agent_entry = re.search(r"per_job\[agent\] = \{([^}]*)\}", jobs_py)
    assert served >= {"agents", "open", "truncated"} and agent_entry, (
        "jobs.py changed shape: update this test"
    )
    served |= set(re.findall(r'"(\w+)":', agent_entry.group(1)))
    truncated = re.search(r'short\["truncated"\] = \{([^}]*)\}', jobs_py)
    assert truncated
    served |= set(re.findall(r'"(\w+)":', truncated.group(1)))
    text = CONTRACT.read_text()
    undocumented = sorted(n for n in names | served if f"`{n}`" not in text)
    assert not undocumented, f"fields missing from docs/diagnosis-json.md: {undocumented}"


def test_documents_point_inside_the_repository() -> None:
    """No reference to design notes kept elsewhere; every docs/… file named exists."""
    named: set[str] = set()
    for doc in DOCS:
        text = doc.read_text(errors="replace")
        assert not re.search(r"\bDESIGN\b|§\s*\d", text), f"{doc.relative_to(REPO)} cites an outside document"
        named |= set(re.findall(r"\bdocs/[\w.-]+\.md\b", text))
    for path in (REPO / "daemon", REPO / "agents"):
        for py in path.rglob("*.py"):
            named |= set(re.findall(r"\bdocs/[\w.-]+\.md\b", py.read_text()))
    assert "docs/diagnosis-json.md" in named
    missing = sorted(n for n in named if not (REPO / n).is_file())
    assert not missing, missing
