"""Rules that match a family of messages, each proven by real lines from several public threads.

A family rule keeps at least three examples copied from public threads, pages or logbooks, from
at least three different sources (lines written for the project do not count), every example
matches with its fields, no counterexample (the same words, not the failure) matches, and the
compiled matcher attributes every real example line to the family rule itself, not to a neighbour.
No example may come from a thread that the public-logs corpus (tests/fixtures/public/) scores.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from denpex_agent.errors import RuleError
from denpex_agent.matcher import Matcher
from denpex_agent.rules import load_rules, self_test

REPO = Path(__file__).parents[2]
PUBLIC = REPO / "tests" / "fixtures" / "public"

FAMILY_RULES = (
    # numerical-instability
    "floating-point-error-loss",
    "deepspeed-loss-scale-minimum",
    "autograd-anomaly-nan",
    "deepspeed-loss-scale-overflow",
    "apex-gradient-overflow",
    "loss-non-finite",
    "grad-norm-non-finite",
    # hang
    "nccl-watchdog-timeout",
    "nccl-watchdog-status",
    "fr-dump-signal-from-rank",
    "fr-dump-signal-local",
    "gloo-timeout",
    "nccl-timeout-at-work",
    # communication
    "nccl-system-error",
    "nccl-remote-error",
    "nccl-internal-error",
    "horovod-shut-down",
    "nccl-ib-async-event-error",
    "gloo-connection-closed",
    "connection-reset-by-peer",
    "nccl-warn-connection-closed",
    "nccl-warn-socket-connect-failed",
    "store-timeout",
    "client-socket-connect-failed",
    # configuration
    "client-socket-timeout",
    "invalid-device-ordinal",
    "nccl-shm-ipc-setup-failed",
    "nccl-no-socket-interface",
    "launcher-ssh-unreachable",
    "gloo-address-lookup-failed",
    "slurmstepd-execve-failed",
    "address-in-use",
    "no-cuda-gpus",
    "driver-too-old",
    "file-not-found",
    "ddp-unfinished-reduction",
    # hardware
    "illegal-memory-access",
    "cublas-error",
    "cudnn-error",
    "ecc-uncorrectable",
    "cuda-error-device-fault",
    "cuda-launch-failure",
    "nccl-unhandled-cuda-error",
    # user-code-exception
    "device-side-assert",
    "device-mismatch",
    "backward-twice",
    "inplace-modified-for-grad",
    # out-of-memory
    "cuda-oom",
    "host-oom-killer",
    "slurm-oom-kill",
    "cuda-error-out-of-memory",
    "cpu-alloc-failure",
    "python-memory-error",
    # dataloader
    "dataloader-worker-killed",
    "dataloader-shm-bus-error",
    "dataloader-exited-unexpectedly",
    "shm-open-failed",
    "dataloader-worker-exception",
    # process-killed
    "elastic-worker-sigkill",
    "elastic-child-failed",
    "deepspeed-launcher-worker-exit",
    "deepspeed-launcher-killing-subprocess",
    "segfault-python",
    "slurm-time-limit",
    "terminate-without-active-exception",
    "elastic-worker-exit-nonzero",
    "elastic-closing-signal",
    "bus-error-shared-memory",
    "srun-task-exited",
    "mpirun-rank-exited-on-signal",
    "mpirun-nonzero-exit",
    "mpirun-job-aborted-notice",
    # checkpoint-io
    "no-space-left",
    "disk-quota-exceeded",
    "state-dict-mismatch",
    "safetensors-shared-tensors",
    "too-many-open-files",
    # proven by real lines from public threads, second round
    "nccl-ops-failed-teardown",
    "nccl-taking-process-down",
    "nccl-communicator-aborted",
    "dist-backend-error",
    "nccl-warn-ib-completion-error",
    "nccl-unique-id-store-error",
    "nccl-heartbeat-monitor-timeout",
    "nccl-watchdog-stuck",
    "collective-mismatch",
    "monitored-barrier-peer-error",
    "nccl-watchdog-cuda-error",
    "xid-other",
    "stream-writer-failed",
    "stream-reader-failed",
    "safetensors-header-error",
    "weights-only-load-failed",
    "stale-file-handle",
    "deepspeed-overflow-hysteresis",
    "fairseq-min-loss-scale",
    "input-contains-nan",
    "loss-scale-reported-below-one",
    "elastic-worker-crash-signal",
    "elastic-worker-sigabrt",
    "elastic-death-signal",
    "signal-exception",
    "segfault-shell",
    "bare-killed",
    "fatal-python-aborted",
    "slurm-step-cancelled",
    "cuda-oom-legacy",
    "cublas-alloc-failed",
    "cuda-kernel-assertion",
    "ddp-mark-ready-twice",
    "shape-mismatch-matmul",
    "nccl-duplicate-gpu",
    "nccl-invalid-usage",
    "process-group-not-initialized",
    # proven by real lines from public threads, third round
    "rendezvous-error",
    "unexpected-pos",
    "monitored-barrier-failed",
    "xid-63-64-row-remap",
    "xid-79-fallen-off-bus",
    "nvml-gpu-lost",
    "nccl-not-built-in",
    "torch-built-without-nccl",
    "python-traceback",
    "megatron-skipped-iterations",
    "elastic-forceful-exit",
    "slurm-preemption-node-failure",
    # new families from the grown public corpus
    "pg-not-destroyed-at-exit",
    "dataloader-pin-memory-thread-exited",
    "lightning-child-process-terminated",
    "horovod-stall-inspector",
    # fourth round
    "multiprocessing-semaphore-failed",
    "dataloader-timeout",
    "megatron-nan-grad-norm",
    # fifth round
    "hf-checkpoint-staging-rename-race",
    # sixth round: markers, progress lines and vocabulary fallbacks
    "dcp-checkpoint-exception",
    "marker-evaluation-start",
    "marker-checkpoint-save",
    "marker-training-finished",
    "marker-rank-identity",
    "progress-step-line",
    "progress-megatron-iteration",
    "progress-hf-trainer-dict",
    "progress-tqdm-bar",
    "vocab-numerical",
    "vocab-out-of-memory",
    "vocab-hang",
    # seventh round
    "argparse-usage-error",
    "mpspawn-worker-sigkill",
    "launcher-worker-died-on-signal",
    "rendezvous-host-not-found",
    "parallel-size-not-divisible",
    "ray-worker-died",
    "mpspawn-worker-exit",
    # rules that reached three sources
    "elastic-worker-sigterm",
    "mpspawn-worker-crash-signal",
    "nccl-warn-socket-io-failed",
    "srun-task-oom",
    "fr-missing-ranks",
    "layernorm-inf-variance",
    "elastic-failure-summary-headless",
    "slurm-node-failure",
    "nccl-ibverbs-call-failed",
    "checkpoint-move-failed",
    # notices: known harmless lines people ask about
    "deepspeed-backend-not-implemented",
    "deepspeed-zero3-trace-cache-invalidated",
    "torchrun-omp-num-threads-default",
    "ddp-find-unused-parameters-unneeded",
    "nccl-barrier-device-guessed",
    "nccl-net-plugin-absent",
    "nccl-libibverbs-absent",
)
MIN_SOURCES = 3
# The library's rules that do not (yet) have real lines from three sources, and why. Every other
# rule must; a rule listed here that has reached three sources must leave the list.
SHORT_OF_SOURCES = {
    # one more public thread shows the line (NVIDIA/nccl#1176), and the corpus scores it; the
    # others quote the message without NCCL's `WARN`, or are the transport's own wording
    "nccl-bootstrap-message-truncated": "one usable public source",
    # printed by no public software: only the benchmark's generator (bench/gen_training_log.py)
    "rank-heartbeat-missed": "the benchmark's own line",
    # a fallback for wording that no signature knows: two threads so far
    "vocab-communication": "two public sources",
    # its lines are a traceback's frames, whose exception line the fold classifies
    "python-traceback-headless": "frame lines, not a message",
}

RULES = load_rules()


@pytest.fixture(scope="module")
def matcher() -> Matcher:
    return Matcher(RULES)


def _scored_threads() -> set[str]:
    return {json.loads(p.read_text())["source"] for p in PUBLIC.glob("*/truth.json")}


@pytest.mark.parametrize("rule_id", FAMILY_RULES)
def test_family_has_real_examples_from_several_sources(rule_id: str) -> None:
    rule = RULES.get(rule_id)
    assert rule is not None, f"{rule_id} is not in the library"
    real = [ex for ex in rule.examples if ex.source is not None]
    assert len(real) >= MIN_SOURCES, f"{rule_id}: {len(real)} real examples"
    sources = _sources(rule_id)
    assert len(sources) >= MIN_SOURCES, f"{rule_id}: examples from only {sorted(sources)}"
    assert rule.counterexamples, f"{rule_id} has no counterexample"


@pytest.mark.parametrize("rule_id", FAMILY_RULES)
def test_family_examples_match_and_counterexamples_do_not(rule_id: str) -> None:
    rule = RULES.get(rule_id)
    assert rule is not None
    failures = self_test([rule])
    assert not failures, "\n".join(f.reason for f in failures)


@pytest.mark.parametrize("rule_id", FAMILY_RULES)
def test_family_wins_its_example_lines(matcher: Matcher, rule_id: str) -> None:
    rule = RULES.get(rule_id)
    assert rule is not None
    for ex in (e for e in rule.examples if e.source is not None):
        data = ex.text.encode()
        if rule.role == "progress":
            # progress lines are read by the progress scan (Matcher.progress), not by classify_line:
            # the first progress rule in library order that matches must be this one, and a line
            # that carries a step must come out of the scan as this rule's hit (one without a step
            # as nobody's)
            first = next((r.id for r in matcher.progress_rules if r.search(ex.text) is not None), None)
            assert first == rule_id, f"{ex.text!r} is first matched by {first}, not {rule_id}"
            fields = rule.search(ex.text) or {}
            hits = [h.rule.id for h in matcher.progress(data, 0, len(data))]
            assert hits == ([rule_id] if "step" in fields else []), f"{ex.text!r}: progress scan gives {hits}"
            continue
        hit = matcher.classify_line(data, 0, len(data))
        assert hit is not None and hit.rule.id == rule_id, (
            f"{ex.text!r} goes to {hit.rule.id if hit else None}, not {rule_id}"
        )


def test_no_example_comes_from_a_scored_thread() -> None:
    scored = _scored_threads()
    assert scored, "the public corpus has no truth.json files"
    used = {ex.source for r in RULES for ex in r.examples if ex.source is not None}
    assert not used & scored, f"examples taken from scored threads: {sorted(used & scored)}"


def _rule_file(tmp_path: Path, example: str) -> Path:
    path = tmp_path / "r.toml"
    path.write_text(
        "schema = 1\ncategory = 'hardware'\n[[rule]]\nid = 'x-rule'\ntitle = 't'\nseverity = 'error'\n"
        "role = 'root-cause'\npatterns = ['boom']\nroot_cause = 'r'\nfix = 'f'\nverify = 'v'\n"
        f"examples = [{example}]\ncounterexamples = ['calm']\n"
    )
    return path


def test_example_source_is_kept(tmp_path: Path) -> None:
    rules = load_rules(_rule_file(tmp_path, "{ text = 'boom', source = 'https://example.org/t/1' }"))
    (ex,) = rules.rules[0].examples
    assert ex.source == "https://example.org/t/1"


@pytest.mark.parametrize("bad", ["'github.com/o/r/issues/1'", "3", "''", "'https://a b'"])
def test_example_source_must_be_an_address(tmp_path: Path, bad: str) -> None:
    with pytest.raises(RuleError, match="source"):
        load_rules(_rule_file(tmp_path, f"{{ text = 'boom', source = {bad} }}"))


def _sources(rule_id: str) -> set[str]:
    rule = RULES.get(rule_id)
    assert rule is not None, f"{rule_id} is not in the library"
    return {ex.source for ex in rule.examples if ex.source is not None}


def test_every_library_rule_is_held_to_three_sources_or_says_why_not() -> None:
    # a family rule's sources are counted by test_family_has_real_examples_from_several_sources
    loose = sorted(r.id for r in RULES if r.id not in FAMILY_RULES and r.id not in SHORT_OF_SOURCES)
    assert not loose, f"rules neither in FAMILY_RULES nor in SHORT_OF_SOURCES: {loose}"


@pytest.mark.parametrize("rule_id", sorted(SHORT_OF_SOURCES))
def test_an_exemption_from_three_sources_is_still_needed(rule_id: str) -> None:
    assert len(_sources(rule_id)) < MIN_SOURCES, (
        f"{rule_id} has {MIN_SOURCES} sources now: take it off the list"
    )
