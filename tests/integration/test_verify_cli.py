"""`denpexd verify` on recorded jobs: real subprocesses, real files, and a real `denpexd serve`.

NEW runs that stop early or log no step lines are made from recorded files by keeping their
first lines or leaving lines out: every line is one a real run wrote.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from denpex_agent.rules import RuleSet
from tests.integration.replay import Daemon, load_case, replay
from tests.integration.test_diagnose_cli import denpexd

pytestmark = [pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
JOBS = REPO / "tests" / "fixtures" / "jobs"


def verify_json(*args: str) -> tuple[int, dict[str, Any]]:
    p = denpexd("verify", *args, "--format", "json")
    assert p.returncode in (0, 1), p.stderr
    return p.returncode, json.loads(p.stdout)


def reason(doc: dict[str, Any], check: str) -> dict[str, Any]:
    return next(r for r in doc["reasons"] if r["check"] == check)


def test_a_healthy_rerun_verifies_the_fix() -> None:
    p = denpexd("verify", str(JOBS / "healthy"), "--against-dir", str(JOBS / "nan_fp16"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.startswith("VERIFIED  nan_fp16's failure (megatron-nan-grad-norm) is gone from healthy")
    assert "NEW reached step 30, past step 12 where OLD failed" in p.stdout
    code, doc = verify_json(str(JOBS / "healthy"), "--against-dir", str(JOBS / "nan_fp16"))
    assert code == 0 and doc["verified"] is True
    assert doc["signature"]["rule"] == "megatron-nan-grad-norm"
    assert doc["signature"]["category"] == "numerical-instability"
    assert (doc["signature"]["node"], doc["signature"]["rank"]) == ("node2", 3)
    assert doc["old"]["failure_step"] == 12 and doc["new"]["furthest_step"] == 30
    assert [r["ok"] for r in doc["reasons"]] == [True, True, True]


def test_the_same_run_again_names_what_is_still_there() -> None:
    p = denpexd("verify", str(JOBS / "nan_fp16"), "--against-dir", str(JOBS / "nan_fp16"))
    assert p.returncode == 1, p.stderr
    assert p.stdout.startswith("NOT VERIFIED")
    assert (
        "megatron-nan-grad-norm is still there: 1 line(s) on 1 rank(s), first at node node2 rank 3"
        in p.stdout
    )
    assert "nan_fp16/node2/rank3.log:14" in p.stdout
    assert "found NaN in local grad norm" in p.stdout
    code, doc = verify_json(str(JOBS / "nan_fp16"), "--against-dir", str(JOBS / "nan_fp16"))
    assert code == 1 and doc["verified"] is False
    where = reason(doc, "signature")["where"]
    assert (where["node"], where["rank"], where["line"]) == ("node2", 3, 14)
    assert reason(doc, "progress")["ok"] is False


def test_another_failure_before_the_old_failure_step_is_not_verified() -> None:
    """exception dies at step 9, before nan_fp16's step 12: the NaN is absent, but NEW never got
    where it would have shown."""
    code, doc = verify_json(str(JOBS / "exception"), "--against-dir", str(JOBS / "nan_fp16"))
    assert code == 1
    assert reason(doc, "signature")["ok"] is True
    assert reason(doc, "category")["ok"] is True
    assert "NEW failed otherwise: python-traceback [user-code-exception]" in reason(doc, "category")["text"]
    assert reason(doc, "progress") == {
        "check": "progress",
        "ok": False,
        "text": "NEW did not progress past step 12 where OLD failed: it got to step 9",
    }


def test_another_failure_past_the_old_failure_step_is_verified() -> None:
    code, doc = verify_json(str(JOBS / "alloc_fail"), "--against-dir", str(JOBS / "exception"))
    assert code == 0
    assert doc["new"]["failure"]["rule"] == "cpu-alloc-failure"
    assert doc["old"]["failure_step"] == 9 and doc["new"]["furthest_step"] == 15


def test_the_same_category_under_another_rule_is_not_verified() -> None:
    """norm_overflow_ln fails with numerical-instability (layernorm-inf-variance) past step 12."""
    code, doc = verify_json(str(JOBS / "norm_overflow_ln"), "--against-dir", str(JOBS / "nan_fp16"))
    assert code == 1
    assert [r["ok"] for r in doc["reasons"]] == [True, False, True]
    category = reason(doc, "category")
    assert (
        "NEW failed with numerical-instability again, under another rule: layernorm-inf-variance"
        in category["text"]
    )
    assert category["where"]["rule"] == "layernorm-inf-variance"


def _truncated(src: Path, dest: Path, keep: int) -> Path:
    """A copy of ``src`` whose rank logs keep their first ``keep`` lines."""
    shutil.copytree(src, dest)
    for log in dest.glob("*/rank*.log"):
        lines = log.read_bytes().splitlines(keepends=True)
        log.write_bytes(b"".join(lines[:keep]))
    return dest


def test_a_run_that_stops_before_the_old_failure_step_is_not_verified(tmp_path: Path) -> None:
    short = _truncated(JOBS / "healthy", tmp_path / "short", keep=12)  # two set-up lines, steps 1-10
    p = denpexd("verify", str(short), "--against-dir", str(JOBS / "nan_fp16"))
    assert p.returncode == 1, p.stderr
    assert "progress check failed" in p.stdout.splitlines()[0]
    assert "NEW did not progress past step 12 where OLD failed: it got to step 10" in p.stdout


def test_without_old_step_lines_progress_is_not_checkable(tmp_path: Path) -> None:
    stepless = tmp_path / "stepless"
    shutil.copytree(JOBS / "nan_fp16", stepless)
    for log in stepless.glob("*/rank*.log"):
        kept = [
            ln
            for ln in log.read_text().splitlines(keepends=True)
            if "iteration " not in ln and "at step " not in ln
        ]
        log.write_text("".join(kept))
    p = denpexd("verify", str(JOBS / "healthy"), "--against-dir", str(stepless))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "n/a   progress   not checkable: OLD logged no step line" in p.stdout
    assert "verification rests on the signature and category checks" in p.stdout
    code, doc = verify_json(str(stepless), "--against-dir", str(stepless))
    assert code == 1 and reason(doc, "progress")["ok"] is None
    assert doc["old"]["failure_step"] is None


def test_a_degraded_run_is_verified_by_its_trend_or_slow_rank() -> None:
    """A loss divergence: its rule is looked for among NEW's trends and NEW must get past the
    step it started at; a slow rank: its rule among NEW's stragglers (no failure step)."""
    code, doc = verify_json(str(JOBS / "diverge"), "--against-dir", str(JOBS / "diverge"))
    assert code == 1 and doc["signature"]["rule"] == "loss-divergence" and doc["old"]["failure_step"] == 54
    assert reason(doc, "signature")["ok"] is False
    code, doc = verify_json(str(JOBS / "slow_pct_control"), "--against-dir", str(JOBS / "diverge"))
    assert code == 0 and [r["ok"] for r in doc["reasons"]] == [True, True, True]
    code, doc = verify_json(str(JOBS / "healthy"), "--against-dir", str(JOBS / "diverge"))
    assert code == 1 and reason(doc, "progress")["ok"] is False  # it stopped at step 30 < 54
    code, doc = verify_json(str(JOBS / "slow_pct"), "--against-dir", str(JOBS / "slow_pct"))
    assert code == 1 and doc["signature"]["rule"] == "slow-rank-compute"
    assert (doc["signature"]["node"], doc["signature"]["rank"]) == ("node1", 1)
    code, doc = verify_json(str(JOBS / "slow_pct_control"), "--against-dir", str(JOBS / "slow_pct"))
    assert code == 0 and reason(doc, "progress")["ok"] is None


def test_nothing_to_verify_and_usage_errors_exit_2(tmp_path: Path) -> None:
    p = denpexd("verify", str(JOBS / "nan_fp16"), "--against-dir", str(JOBS / "healthy"))
    assert p.returncode == 2 and "healthy did not fail (verdict healthy): nothing to verify" in p.stderr
    assert p.stdout == ""
    p = denpexd("verify", str(JOBS / "healthy"))
    assert p.returncode == 2 and "give OLD as --against-dir PATH or as --against ID" in p.stderr
    p = denpexd("verify", str(JOBS / "healthy"), "--job", "x", "--against-dir", str(JOBS / "hang"))
    assert p.returncode == 2 and "give NEW as log PATHs or as --job ID" in p.stderr
    p = denpexd("verify", str(tmp_path / "nope"), "--against-dir", str(JOBS / "hang"))
    assert p.returncode == 2 and "no such file or directory" in p.stderr
    (tmp_path / "empty").mkdir()
    p = denpexd("verify", str(tmp_path / "empty"), "--against-dir", str(JOBS / "hang"))
    assert p.returncode == 2 and "no log files" in p.stderr
    p = denpexd("verify", "--job", "a b", "--against", "x")
    assert p.returncode == 2 and "invalid job id 'a b'" in p.stderr


def test_an_unreachable_daemon_exits_2() -> None:
    from tests.integration.replay import free_port

    p = denpexd("verify", "--job", "a", "--against", "b", "--server", f"127.0.0.1:{free_port()}")
    assert p.returncode == 2 and "cannot reach denpexd" in p.stderr


@pytest.mark.asyncio
async def test_stored_jobs_through_a_running_serve(tmp_path: Path, library: RuleSet) -> None:
    tag = uuid.uuid4().hex[:8]
    jobs = {case: f"verify-{case}-{tag}" for case in ("healthy", "nan_fp16", "exception")}
    daemon = Daemon(tmp_path / "data", "--api-token", f"token-{tag}")
    await daemon.start()
    try:
        loaded = {case: load_case(case, job, library) for case, job in jobs.items()}
        await asyncio.gather(
            *(replay(loaded[c], jobs[c], port=daemon.mqtt_port, v5=False, speed=50.0) for c in jobs)
        )
        for case, job in jobs.items():
            await daemon.wait_events(job, len(loaded[case]), token=f"token-{tag}")
        server = ["--server", daemon.url, "--api-token", f"token-{tag}"]

        def run(*args: str) -> subprocess.CompletedProcess[str]:
            return denpexd("verify", *args, *server)

        p = await asyncio.to_thread(run, "--job", jobs["healthy"], "--against", jobs["nan_fp16"])
        assert p.returncode == 0, p.stdout + p.stderr
        assert "NEW is still open" in p.stdout
        p = await asyncio.to_thread(
            run, "--job", jobs["nan_fp16"], "--against", jobs["nan_fp16"], "--format", "json"
        )
        assert p.returncode == 1, p.stderr
        doc = json.loads(p.stdout)
        where = reason(doc, "signature")["where"]
        assert (where["node"], where["rank"], where["line"]) == ("node2", 3, 14)
        p = await asyncio.to_thread(run, "--job", jobs["exception"], "--against", jobs["nan_fp16"])
        assert p.returncode == 1 and "did not progress past step 12" in p.stdout
        # one side stored, the other read from files
        p = await asyncio.to_thread(run, str(JOBS / "healthy"), "--against", jobs["nan_fp16"])
        assert p.returncode == 0, p.stdout + p.stderr
        p = await asyncio.to_thread(run, "--job", jobs["healthy"], "--against", jobs["healthy"])
        assert p.returncode == 2 and "did not fail (verdict healthy): nothing to verify" in p.stderr
        p = await asyncio.to_thread(run, "--job", f"unknown-{tag}", "--against", jobs["nan_fp16"])
        assert p.returncode == 2 and f"unknown job unknown-{tag}" in p.stderr
        p = await asyncio.to_thread(denpexd, "verify", "--job", jobs["healthy"], "--against", jobs["nan_fp16"],
                                    "--server", daemon.url)  # fmt: skip
        assert p.returncode == 2 and "401 unauthorized" in p.stderr
        assert await daemon.stop() == 0
    finally:
        if daemon.proc is not None and daemon.proc.returncode is None:
            daemon.kill()
            await daemon.wait()
