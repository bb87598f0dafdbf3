"""The signature library against the benchmark log generator and its own examples.

Every failure line the generator marks as expected-to-match must be matched by at least one
non-progress rule, every line it marks as not expected (traceback frames, NCCL INFO follow-ups,
blank lines) and every benign line must be matched by none, and training step lines must be
recognised as progress with the right step.
"""

from __future__ import annotations

import importlib.util
import random
import re
import sys
from pathlib import Path

import pytest

from denpex_agent.rules import CATEGORIES, Rule, load_rules, self_test

REPO = Path(__file__).parents[2]
GEN_PATH = REPO / "bench" / "gen_training_log.py"
RULES_DIR = REPO / "rules"


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_training_log", GEN_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_training_log", module)
    spec.loader.exec_module(module)
    return module


gen = _load_generator()
RULES = load_rules()
# A frame line matches `python-traceback-headless`, but starts a record only where no header did,
# and is an event only if the frames end in an exception (the scanner decides: test_scanner.py):
# line by line, frames are no failure.
FRAME_RULES = {r.id for r in RULES if r.fold == "python-traceback" and r.id != "python-traceback"}
# Notices are the library's known harmless lines: a benign line may match one.
FAILURE_RULES: list[Rule] = [
    r for r in RULES if r.role not in ("progress", "marker", "notice") and r.id not in FRAME_RULES
]
PROGRESS_RULES: list[Rule] = [r for r in RULES if r.role == "progress"]


def _matching(rules: list[Rule], line: str) -> list[str]:
    # Rule.search returns {} for a match without fields, so compare with None explicitly.
    return [r.id for r in rules if r.search(line) is not None]


@pytest.mark.parametrize("event", gen.EVENTS, ids=lambda ev: ev.__name__)
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_generator_event_lines(event, seed: int) -> None:
    rng = random.Random(seed)
    st = gen.State(rng)
    lines = event(st, rng)
    assert lines, f"{event.__name__} produced no lines"
    for line, expected in lines:
        hits = _matching(FAILURE_RULES, line)
        if expected:
            assert hits, f"{event.__name__}: expected a rule to match {line!r}"
        else:
            assert not hits, f"{event.__name__}: {line!r} must not match, matched by {hits}"


def _benign_lines(n: int, seed: int):
    """(maker name, line, step after the call) for n benign lines, mixed roughly like the generator."""
    rng = random.Random(seed)
    st = gen.State(rng)
    makers = [gen.step_line] * 6 + [gen.nccl_info_line, gen.warning_line, gen.other_info_line, gen.tqdm_line]
    for _ in range(n):
        st.clock.tick(rng)
        maker = makers[rng.randrange(len(makers))]
        line = maker(st)
        yield maker.__name__, line, st.step


def test_benign_lines_match_no_failure_rule() -> None:
    seen = 0
    for maker, line, _step in _benign_lines(5000, seed=42):
        hits = _matching(FAILURE_RULES, line)
        assert not hits, f"benign {maker} line {line!r} matched by {hits}"
        seen += 1
    assert seen == 5000


def test_each_benign_maker_is_clean() -> None:
    # every maker on its own, so rare variants of each are exercised too
    for maker in (gen.step_line, gen.nccl_info_line, gen.warning_line, gen.other_info_line, gen.tqdm_line):
        rng = random.Random(7)
        st = gen.State(rng)
        for _ in range(800):
            st.clock.tick(rng)
            line = maker(st)
            hits = _matching(FAILURE_RULES, line)
            assert not hits, f"benign {maker.__name__} line {line!r} matched by {hits}"


def test_step_lines_are_progress_with_the_right_step() -> None:
    n = 0
    for maker, line, step in _benign_lines(4000, seed=3):
        if maker != "step_line":
            continue
        n += 1
        got = [f for f in (r.search(line) for r in PROGRESS_RULES) if f is not None]
        assert got, f"step line not matched by a progress rule: {line!r}"
        assert got[0].get("step") == step, f"{line!r}: step {got[0].get('step')} != {step}"
        assert isinstance(got[0].get("loss"), float), f"{line!r}: loss not extracted"
        assert isinstance(got[0].get("grad_norm"), float), f"{line!r}: grad_norm not extracted"
    assert n > 1000


def test_library_size_and_category_coverage() -> None:
    assert len(FAILURE_RULES) >= 60
    assert {r.category for r in FAILURE_RULES} == set(CATEGORIES)
    for r in FAILURE_RULES:
        assert r.examples, r.id
        assert r.counterexamples, f"{r.id} has no counterexample"


def test_folds_are_where_the_reader_expects_them() -> None:
    tb = RULES.get("python-traceback")
    assert tb is not None and tb.fold == "python-traceback" and tb.role == "root-cause"
    assert tb.category == "user-code-exception" and tb.severity == "error"
    assert tb.search("Traceback (most recent call last):") is not None
    child = RULES.get("elastic-child-failed")
    assert child is not None and child.fold == "elastic-failure" and child.role == "collateral"


RULE_FILES = sorted(RULES_DIR.glob("*.toml"))


@pytest.mark.parametrize("rule_file", RULE_FILES, ids=lambda p: p.name)
def test_rule_file_self_test(rule_file: Path) -> None:
    # Load the whole library (related ids may point into other files) and self-test this file's rules.
    mine = [r for r in RULES if Path(r.source).name == rule_file.name]
    explained = [e for e in RULES.explanations if Path(e.source).name == rule_file.name]
    assert mine or explained, f"{rule_file.name} contributed no rules"
    failures = self_test(mine)
    assert not failures, "\n".join(f"{f.rule_id}: {f.reason}" for f in failures)


def test_every_inferred_diagnosis_is_explained() -> None:
    """Hang, killed and straggler diagnoses carry why / fix / verify like every matched rule."""
    from denpexd.analysis.story import ABSENT_RULE
    from denpexd.engine import HANG_RULE, KILLED_RULE, STRAGGLER_RULE

    for rid in (HANG_RULE, ABSENT_RULE, KILLED_RULE, STRAGGLER_RULE):
        found = RULES.explanation(rid)
        assert found is not None, rid
        assert found.root_cause and found.fix and found.verify, rid


def test_category_files_are_present() -> None:
    categories_by_file: dict[str, set[str]] = {}
    for r in RULES:
        categories_by_file.setdefault(Path(r.source).name, set()).add(r.category)
    covered = set().union(*categories_by_file.values())
    assert set(CATEGORIES) <= covered


def test_patterns_do_not_pin_source_line_numbers_or_exact_spacing() -> None:
    """Upstream line numbers (pair.cc:598) move between releases; double spaces vary."""
    pinned = re.compile(r"\.(?:cc|cpp|hpp|h|py|cu)\\?:\d")
    for rule in load_rules():
        for p in rule.patterns:
            assert not pinned.search(p), (rule.id, p)
            assert "  " not in p, (rule.id, p)
