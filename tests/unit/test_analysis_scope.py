"""analysis.scope: a failure of the job rather than of the rank that logged it first."""

from __future__ import annotations

import pytest

from denpex_agent.rules import RuleSet
from denpexd.analysis.scope import JOB_SCOPE_WINDOW_S, job_wide
from denpexd.analysis.story import Candidate, rank_candidates
from denpexd.clock import ClockEstimate
from tests.conftest import rules_from_text
from tests.unit.test_engine import T0

SETUP_RULE = """
schema = 1

[[rule]]
id = "missing-file"
title = "A file the job needs is missing"
category = "configuration"
severity = "error"
role = "root-cause"
scope = "job"
patterns = ['No such file or directory']
root_cause = "path"
fix = "mount it"
verify = "ls"
examples = ["FileNotFoundError: [Errno 2] No such file or directory: 'data'"]
"""


@pytest.fixture(scope="module")
def rules(tmp_path_factory: pytest.TempPathFactory) -> RuleSet:
    return rules_from_text(tmp_path_factory, "scope", SETUP_RULE)


def _cand(node: str, rank: int, rule: str, at: float | None) -> Candidate:
    return Candidate(node, rank, rule, "x", at, at, None, "event")


def _check(pool: list[Candidate], rules: RuleSet, erring: int | None = None) -> Candidate | None:
    clocks = {n: ClockEstimate(0.0, 0.01, "progress", 10) for n in ("a", "b")}
    ranked = rank_candidates(pool, clocks)
    errs = {(c.node, c.rank) for c in pool if c.rank is not None}
    errs |= {("b", 100 + i) for i in range((erring or len(errs)) - len(errs))}
    return job_wide(ranked[0][0], pool, ranked, errs, clocks, rules)


def test_every_rank_failing_the_same_way_at_once_is_the_jobs_failure(rules: RuleSet) -> None:
    pool = [_cand("a" if r < 2 else "b", r, "cuda-oom", T0 + 0.1 * r) for r in range(4)]
    assert _check(pool, rules) is pool[0]
    assert _check(pool, rules, erring=6) is None  # 4 of 6 ranks that logged an error: not the job's


def test_ranks_failing_apart_in_time_are_not_the_jobs_failure(rules: RuleSet) -> None:
    pool = [_cand("a", r, "cuda-oom", T0 + r * (JOB_SCOPE_WINDOW_S + 0.1)) for r in range(3)]
    assert _check(pool, rules) is None
    untimed = [_cand("a", r, "cuda-oom", None) for r in range(3)]
    assert _check(untimed, rules) is untimed[0]  # nothing tells them apart
    assert _check([*pool[:1], *untimed[1:]], rules) is None  # some timed, some not


def test_a_setup_rule_among_the_first_ranks_events_is_the_jobs_failure(rules: RuleSet) -> None:
    first = _cand("a", 0, "cuda-oom", T0)
    setup = _cand("a", 0, "missing-file", T0 + 0.5)
    other = _cand("b", 1, "missing-file", T0 + 0.2)
    assert _check([first, setup, other], rules) is setup
    late = _cand("a", 0, "missing-file", T0 + JOB_SCOPE_WINDOW_S + 0.5)
    assert _check([first, late, _cand("b", 1, "gloo", T0 + 3)], rules) is None


def test_a_hang_suspect_is_never_the_jobs_failure(rules: RuleSet) -> None:
    pool = [Candidate("a", r, "hang", "hang", T0, T0, None, "hang") for r in range(3)]
    assert _check(pool, rules) is None
