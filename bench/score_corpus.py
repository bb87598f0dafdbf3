#!/usr/bin/env python3
"""Score `denpexd diagnose` against the public-logs corpus (tests/fixtures/public/).

Each case is a failure posted in a public issue thread or training logbook: its log lines as
posted (`logs/`), and `truth.json`, judged from the whole thread: the rank that broke first (or
null: every rank failed the same way, `scope: job`, or the thread does not tell,
`rank_knowable: false`), the category and the verdict. The case is diagnosed with the same
engine as `denpexd diagnose`, and scored:

* initiator: right rank where the rank is knowable; no initiator where the scope is the job;
* category: the initiator's (or, without one, the root cause's; with neither, the most severe
  matched rule's) category;
* verdict;
* confident and wrong: a rank named with confidence >= 0.6 where the truth is "no single rank".

Every miss is listed with what was said and what the thread says. With `--floor FILE` the run
fails (exit 1) when an answer the floor holds as right is no longer right, or when more confident
wrong ranks are named than the floor allows. The floor is a ratchet on answers, not on
percentages: the corpus grows with cases the engine was not built on, and a new case it gets
wrong lowers the percentages without any answer getting worse. `--write-floor FILE` writes the
answers right now (run it when a change fixes a case; CI keeps the file, which only gains cases).

    python3 bench/score_corpus.py
    python3 bench/score_corpus.py --json scores.json --floor tests/fixtures/public/floor.json
    python3 bench/score_corpus.py --write-floor tests/fixtures/public/floor.json
"""

from __future__ import annotations

import argparse
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from denpex_agent.rules import load_rules
from denpexd.diagnosecmd import diagnose_paths

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "public"
CONFIDENT = 0.6


DIMENSIONS = ("initiator", "category", "verdict")


@dataclass
class Score:
    cases: int = 0
    initiator_scored: int = 0
    confident_wrong: int = 0
    misses: list[str] = field(default_factory=list)
    right: dict[str, list[str]] = field(default_factory=lambda: {d: [] for d in DIMENSIONS})  # cases

    def as_dict(self) -> dict[str, Any]:
        def pct(a: int, b: int) -> float:
            return round(100.0 * a / b, 1) if b else 100.0

        out: dict[str, Any] = {"cases": self.cases}
        for dim in DIMENSIONS:
            n, of = len(self.right[dim]), self.initiator_scored if dim == "initiator" else self.cases
            out[f"{dim}_pct"], out[dim] = pct(n, of), f"{n}/{of}"
        out["confident_wrong"] = self.confident_wrong
        return out


def said(doc: dict[str, Any]) -> tuple[int | None, float, str | None]:
    """The diagnosis's initiator rank, its confidence and the category it gives: the
    initiator's, else the root cause's, else (nothing to explain: a healthy job) the category of
    the most severe rule that matched, earliest first — what the engine recognised in the lines,
    which is what a healthy case's truth names ("the category if it were a failure")."""
    init = doc.get("initiator") or None
    cause = doc.get("root_cause") or {}
    if init is None:
        return None, 0.0, cause.get("category") or _recognised(doc)
    return (
        init.get("rank"),
        float(init.get("confidence") or 0.0),
        init.get("category") or cause.get("category"),
    )


SEVERITY_ORDER = {"critical": 0, "error": 1, "warning": 2, "info": 3}


def _recognised(doc: dict[str, Any]) -> str | None:
    seen = [m for m in doc.get("matches") or [] if m.get("category") not in (None, "progress")]
    if not seen:
        return None
    best = min(
        seen,
        key=lambda m: (
            SEVERITY_ORDER.get(m.get("severity") or "info", 3),
            (m.get("first") or {}).get("time") or "~",
        ),
    )
    return best.get("category")


def score(corpus: Path) -> tuple[Score, list[dict[str, Any]]]:
    rules = load_rules()
    total = Score()
    rows = []
    for case in sorted(p for p in corpus.iterdir() if (p / "truth.json").is_file()):
        truth = orjson.loads((case / "truth.json").read_bytes())
        doc = diagnose_paths([str(case / "logs")], job=case.name, rules=rules, context_lines=0)
        rank, confidence, category = said(doc)
        total.cases += 1
        why: list[str] = []
        knowable = truth.get("rank_knowable", True)
        job_scope = truth.get("scope") == "job"
        if job_scope or (knowable and truth["initiator_rank"] is not None):
            total.initiator_scored += 1
            want = None if job_scope else truth["initiator_rank"]
            if rank == want:
                total.right["initiator"].append(case.name)
            else:
                why.append(f"initiator {rank} (confidence {confidence:.2f}), truth {want}")
        if job_scope and rank is not None and confidence >= CONFIDENT:
            total.confident_wrong += 1
            why.append("a confident rank where no single rank broke")
        if category == truth["category"]:
            total.right["category"].append(case.name)
        else:
            why.append(f"category {category}, truth {truth['category']}")
        if doc.get("verdict") == truth["verdict"]:
            total.right["verdict"].append(case.name)
        else:
            why.append(f"verdict {doc.get('verdict')}, truth {truth['verdict']}")
        if why:
            total.misses.append(f"{case.name}: {'; '.join(why)}  [{truth['source']}]")
        rows.append({"case": case.name, "rank": rank, "confidence": confidence, "category": category,
                     "verdict": doc.get("verdict"), "truth": truth,
                     "scored": job_scope or (knowable and truth["initiator_rank"] is not None)})  # fmt: skip
    return total, rows


def main() -> int:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the run quietly
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=CORPUS)
    ap.add_argument("--json", type=Path, help="write the scores and every case's answer here")
    ap.add_argument("--floor", type=Path, help="exit 1 when an answer this file holds as right is wrong now")
    ap.add_argument("--write-floor", type=Path, help="write the answers right now as the floor")
    args = ap.parse_args()
    total, rows = score(args.corpus)
    s = total.as_dict()
    print(f"public corpus: {s['cases']} cases ({args.corpus})")
    print(
        f"  initiator   {s['initiator']:>7}  {s['initiator_pct']:5.1f} %  (where the rank is knowable, or no single rank)"
    )
    print(f"  category    {s['category']:>7}  {s['category_pct']:5.1f} %")
    print(f"  verdict     {s['verdict']:>7}  {s['verdict_pct']:5.1f} %")
    print(f"  confident (>= {CONFIDENT}) rank where no single rank broke: {s['confident_wrong']}")
    sure = [r for r in rows if r["truth"].get("confidence") == "certain"]
    if sure:
        names = {r["case"] for r in sure}
        scored = {r["case"] for r in sure if r["scored"]}
        parts = [
            f"{dim} {len(names.intersection(total.right[dim]) & (scored if dim == 'initiator' else names))}"
            f"/{len(scored) if dim == 'initiator' else len(names)}"
            for dim in DIMENSIONS
        ]
        print(f"  of the {len(names)} cases whose thread makes the truth certain: {', '.join(parts)}")
    if total.misses:
        print(f"misses ({len(total.misses)}):")
        for miss in total.misses:
            print(f"  {miss}")
    if args.json:
        args.json.write_bytes(orjson.dumps({"scores": s, "cases": rows}, option=orjson.OPT_INDENT_2))
    if args.write_floor:
        floor_doc = {"right": {d: sorted(total.right[d]) for d in DIMENSIONS}, "confident_wrong": s["confident_wrong"],
                     "scores": {k: s[k] for k in ("cases", "initiator", "category", "verdict")}}  # fmt: skip
        args.write_floor.write_bytes(orjson.dumps(floor_doc, option=orjson.OPT_INDENT_2) + b"\n")
    if args.floor:
        floor = orjson.loads(args.floor.read_bytes())
        below = [
            f"{dim} of {case} no longer right"
            for dim in DIMENSIONS
            for case in floor["right"][dim]
            if case not in total.right[dim]
        ]
        gained = sum(len(set(total.right[d]) - set(floor["right"][d])) for d in DIMENSIONS)
        if gained:
            print(f"{gained} answer(s) right that the floor does not hold yet: raise it with --write-floor")
        if s["confident_wrong"] > floor["confident_wrong"]:
            below.append(f"confident_wrong {s['confident_wrong']} > floor {floor['confident_wrong']}")
        if below:
            print("BELOW THE FLOOR: " + "; ".join(below), file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
