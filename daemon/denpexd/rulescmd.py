"""`denpexd rules test|list`: self-test and list the signature library."""

from __future__ import annotations

import sys
from typing import TextIO

from denpex_agent.errors import RuleError
from denpex_agent.rules import RuleSet, load_rules, self_test


def run_test(rules_dir: str | None, out: TextIO = sys.stdout) -> int:
    """Load (validating) and self-test the library. 0 when every example behaves, 1 otherwise."""
    try:
        rules = load_rules(rules_dir)
    except RuleError as exc:
        print(f"rules: INVALID {exc}", file=out)
        return 1
    failures = self_test(rules)
    for f in failures:
        print(f"rules: FAIL {f.source}: rule {f.rule_id!r}: {f.reason}", file=out)
    n_ex = sum(len(r.examples) for r in rules)
    n_cx = sum(len(r.counterexamples) for r in rules)
    verdict = "FAILED" if failures else "ok"
    print(
        f"rules: {verdict}: {len(rules)} rules in {len(rules.files)} files, "
        f"{n_ex} examples, {n_cx} counterexamples, {len(failures)} failures",
        file=out,
    )
    return 1 if failures else 0


def run_list(rules_dir: str | None, out: TextIO = sys.stdout) -> int:
    try:
        rules: RuleSet = load_rules(rules_dir)
    except RuleError as exc:
        print(f"rules: INVALID {exc}", file=out)
        return 1
    for r in rules:
        print(f"{r.id:40} {r.category:22} {r.role:11} {r.severity:8} {r.title}", file=out)
    return 0
