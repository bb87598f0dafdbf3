"""Shared fixtures: the repository's paths and a small, self-contained rule library for unit tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from denpex_agent.matcher import Matcher
from denpex_agent.rules import RuleSet, load_rules

REPO = Path(__file__).resolve().parents[1]
JOBS = REPO / "tests" / "fixtures" / "jobs"

UNIT_RULES = """
schema = 1

[[rule]]
id = "python-traceback"
title = "Uncaught Python exception"
category = "user-code-exception"
severity = "error"
role = "root-cause"
fold = "python-traceback"
patterns = ['Traceback \\(most recent call last\\):']
root_cause = "user code raised"
fix = "fix the code"
verify = "rerun"
examples = ["Traceback (most recent call last):"]

[[rule]]
id = "cuda-oom"
title = "CUDA out of memory"
category = "out-of-memory"
severity = "error"
role = "root-cause"
patterns = ['CUDA out of memory\\. Tried to allocate']
root_cause = "allocator"
fix = "smaller batch"
verify = "rerun"
examples = ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"]

[[rule]]
id = "gloo-closed"
title = "gloo connection closed by peer"
category = "communication"
severity = "error"
role = "collateral"
patterns = ['Connection closed by peer \\[']
root_cause = "peer died"
fix = "find the peer"
verify = "rerun"
examples = ["RuntimeError: [pair.cc:1] Connection closed by peer [127.0.0.1]:5"]

[[rule]]
id = "elastic-child-failed"
title = "torchrun child failed"
category = "process-killed"
severity = "error"
role = "collateral"
fold = "elastic-failure"
patterns = ['ChildFailedError']
root_cause = "a worker failed"
fix = "see root cause"
verify = "rerun"
examples = ["torch.distributed.elastic.multiprocessing.errors.ChildFailedError: "]

[[rule]]
id = "grad-norm-nonfinite"
title = "Non-finite local grad norm"
category = "numerical-instability"
severity = "warning"
role = "symptom"
fingerprint = "nan"
patterns = ['non-finite grad norm']
root_cause = "overflow"
fix = "bf16"
verify = "rerun"
examples = ["WARNING [rank3] non-finite grad norm (nan) before all-reduce"]

[[rule]]
id = "loss-nan"
title = "Loss is NaN"
category = "numerical-instability"
severity = "error"
role = "symptom"
fingerprint = "nan"
patterns = ['\\bloss (?:is )?nan\\b']
root_cause = "nan"
fix = "bf16"
verify = "rerun"
examples = ["ERROR [rank0] loss is nan at step 4"]

[[rule]]
id = "killed-line"
title = "Killed"
category = "process-killed"
severity = "error"
role = "root-cause"
patterns = ['^Killed$']
root_cause = "oom killer"
fix = "memory"
verify = "dmesg"
examples = ["Killed"]
counterexamples = ["Killed process 12"]

[[rule]]
id = "scale-warmup"
title = "Loss scale settling at start-up"
category = "numerical-instability"
severity = "info"
role = "notice"
patterns = ['scaler warm-up overflow']
root_cause = "the scaler starts high and halves until it fits: harmless"
fix = "nothing to do"
verify = "the scale settles"
examples = ["INFO [rank1] scaler warm-up overflow, halving to 32768"]

[[rule]]
id = "step"
title = "step line"
category = "progress"
severity = "info"
role = "progress"
patterns = ['\\bstep (?P<step>\\d+)(?: \\| loss (?P<loss>\\S+))?(?: \\| data_time (?P<data_time>[0-9.]+))?']
examples = ["2026-11-29 12:00:00,000 INFO [rank0] step 3 | loss 2.0"]
"""


def rules_from_text(tmp_path_factory: pytest.TempPathFactory, name: str, text: str) -> RuleSet:
    """A rule library of one file holding ``text``, loaded as the daemon loads its library."""
    d = tmp_path_factory.mktemp(name)
    (d / f"{name}.toml").write_text(text)
    return load_rules(d)


@pytest.fixture(scope="session")
def unit_rules(tmp_path_factory: pytest.TempPathFactory) -> RuleSet:
    return rules_from_text(tmp_path_factory, "unit", UNIT_RULES)


@pytest.fixture(scope="session")
def unit_matcher(unit_rules: RuleSet) -> Matcher:
    return Matcher(unit_rules)


@pytest.fixture(scope="session")
def library() -> RuleSet:
    return load_rules()
