"""The public-logs corpus (tests/fixtures/public/): the scores stay at or above their floor.

The cases are failures posted in public threads; the truth is judged from each thread. The
floor only rises (tests/fixtures/public/README.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "tests" / "fixtures" / "public"


def test_every_case_is_complete() -> None:
    cases = [p for p in CORPUS.iterdir() if p.is_dir()]
    assert len(cases) >= 40
    for case in cases:
        truth = orjson.loads((case / "truth.json").read_bytes())
        assert truth["source"].startswith("https://"), case.name
        assert truth["verdict"] in ("failed", "degraded", "healthy"), case.name
        assert truth["scope"] in ("rank", "job"), case.name
        assert truth["initiator_rank"] is None or truth["scope"] == "rank", case.name
        assert any(p.is_file() for p in (case / "logs").rglob("*")), case.name


def test_no_answer_the_floor_holds_as_right_gets_worse(tmp_path: Path) -> None:
    out = tmp_path / "scores.json"
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "score_corpus.py"), "--json", str(out),
         "--floor", str(CORPUS / "floor.json")],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    scores = orjson.loads(out.read_bytes())["scores"]
    assert scores["cases"] == len([p for p in CORPUS.iterdir() if p.is_dir()])
    floor = orjson.loads((CORPUS / "floor.json").read_bytes())
    cases = {p.name for p in CORPUS.iterdir() if p.is_dir()}
    for dim, right in floor["right"].items():
        assert set(right) <= cases, f"the floor's {dim} names cases that are not in the corpus"


def test_the_floor_fails_a_run_that_lost_a_right_answer(tmp_path: Path) -> None:
    floor = orjson.loads((CORPUS / "floor.json").read_bytes())
    scores = tmp_path / "scores.json"
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "score_corpus.py"), "--json", str(scores)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    wrong = next(
        r["case"] for r in orjson.loads(scores.read_bytes())["cases"] if r["verdict"] != r["truth"]["verdict"]
    )
    floor["right"]["verdict"].append(wrong)  # a floor that holds a miss as right
    strict = tmp_path / "floor.json"
    strict.write_bytes(orjson.dumps(floor))
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "score_corpus.py"), "--floor", str(strict)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert run.returncode == 1 and f"verdict of {wrong} no longer right" in run.stderr
