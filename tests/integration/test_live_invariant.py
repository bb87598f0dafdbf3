"""The live answer equals the post-mortem one, for every recorded job, however its logs arrive.

Every job directory under tests/fixtures/jobs with an expected.json (found at collection, so a
new recording is picked up by itself) is replayed into fresh files through real `denpex-agent`
processes (one per node directory) and a real `denpexd serve`, under four write patterns
(livereplay.py: ``paced``, ``split`` mid-line and mid-record with random pauses, ``catchup``
with the files complete before the agents start, ``kill9`` with every agent SIGKILLed halfway and
resumed from its checkpoints; a ``_skew`` copy of a job runs paced and split, a ``_control`` job,
a healthy run of a failure case's job, split) and two brokers (the embedded one, and Mosquitto on
127.0.0.1:1883 with a persistent session), each (job, variant) through one of the two, chosen
pairwise (`_brokers`; DENPEX_LIVE_BROKERS=all for both). Once the writers are done and the live
diagnosis has settled,
`denpexd query --json` must equal `denpexd diagnose <original dir> --format json` on verdict,
initiator node/rank/rule, root-cause category, collateral ranks and the NaN fingerprint (stage,
first rank, ranks); the first alert must name diagnose's initiator (else the time until it was
relabelled is reported) and at the end exactly that alert fires (none when diagnose names none).

All selected replays run in one go, several at once against one daemon per broker; the whole
table is printed (-s) and written to `<basetemp>/live-invariant*/live_invariant.txt` (and to
$DENPEX_LIVE_REPORT when set) before any case is judged. DENPEX_SPLIT_SEED changes the split
seeds (each printed), DENPEX_LIVE_CONCURRENCY the number of replays in flight (default 12).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.integration.agent_harness import broker_up
from tests.integration.livereplay import (
    SPEED,
    VARIANTS,
    Corpus,
    Result,
    Site,
    clear_retained,
    corpus_jobs,
    diagnose_json,
    load_corpus,
    log_trouble,
    replay_job,
    site,
    split_seed,
)
from tests.integration.replay import JOBS

pytestmark = [pytest.mark.integration]

BROKERS = ("embedded", "mosquitto")
# The replays mostly wait (pacing, settling, alerts): on 2 cores, 6 at once took 195 s (the cores 58 % busy),
# 10 took 148 s and 14 took 125 s (90 % busy), every replay right in each
CONCURRENCY = int(os.environ.get("DENPEX_LIVE_CONCURRENCY", "12"))
Case = tuple[str, str, str]  # (job, variant, broker)
# A `_skew` copy is its base job with shifted clocks: the read timing the catchup and kill9
# variants vary is the base job's, replayed in those; the copy runs paced and split.
SKEW_VARIANTS = ("paced", "split")
# A `_control` job is a healthy run of a failure case's own job (for --control): its lines are
# the base job's up to the failure, already replayed in every variant; it runs split, the
# variant that cuts reads at the most places.
CONTROL_VARIANTS = ("split",)


def _variants(job: str) -> tuple[str, ...]:
    if job.endswith("_skew"):
        return SKEW_VARIANTS
    return CONTROL_VARIANTS if job.endswith("_control") else VARIANTS


def _brokers(job_index: int, variant_index: int) -> tuple[str, ...]:
    """The brokers a (job, variant) replay runs through. Pairwise by default: each (job,
    variant) once, on the broker its place picks, alternating along both the jobs and the
    variants, so that every job runs through both brokers (when it has two variants or more) and
    every variant runs through both on half the jobs; the replays' cost is halved and no pair
    of the three factors goes untested. DENPEX_LIVE_BROKERS=all runs the whole product."""
    if BROKER_MODE == "all":
        return BROKERS
    return (BROKERS[(job_index + variant_index) % len(BROKERS)],)


BROKER_MODE = os.environ.get("DENPEX_LIVE_BROKERS", "pairwise")
if BROKER_MODE not in ("pairwise", "all"):
    raise pytest.UsageError(f"DENPEX_LIVE_BROKERS must be 'pairwise' or 'all', not {BROKER_MODE!r}")

CASES = [
    pytest.param(job, variant, broker, id=f"{job}-{variant}-{broker}")
    for j, job in enumerate(corpus_jobs())
    for v, variant in enumerate(_variants(job))
    for broker in _brokers(j, v)
]
PARAMS = ("job", "variant", "broker")


@dataclass(repr=False)
class Run:
    results: dict[Case, Result]
    skipped: dict[Case, str] = field(default_factory=dict)
    daemons: dict[str, list[str]] = field(default_factory=dict)  # broker → trouble in its log
    cpu: dict[str, float | None] = field(default_factory=dict)  # broker → its daemon's CPU seconds
    table: str = ""

    def __repr__(self) -> str:  # shown in every failure's traceback: the table says it all
        return f"<Run of {len(self.results)} replays>"


def _selected(session: pytest.Session) -> list[Case]:
    """The cases of this module that this session will run (after -k, deselection, ...)."""
    out: set[Case] = set()
    for item in session.items:
        callspec = getattr(item, "callspec", None)
        module = getattr(item, "module", None)
        if callspec is not None and module is not None and module.__name__ == __name__:
            params = callspec.params
            if all(p in params for p in PARAMS):
                out.add((params["job"], params["variant"], params["broker"]))
    return sorted(out)


def _expected_seconds(corpus: Corpus, variant: str) -> float:
    return 0.0 if variant == "catchup" else corpus.duration / SPEED + (3.0 if variant == "split" else 0.0)


async def _run_all(
    cases: Sequence[Case],
    workdir: Path,
    root: Path = JOBS,
    max_gap_s: float | None = None,
    concurrency: int = CONCURRENCY,
) -> Run:
    """Every case replayed and judged; ``root`` holds the job directories, ``max_gap_s`` cuts the
    pauses of jobs whose logs span hours (`Corpus.compressed`)."""
    run = Run({c: Result(*c) for c in cases})
    if not broker_up():
        for c in cases:
            if c[2] == "mosquitto":
                run.skipped[c] = "no MQTT broker on 127.0.0.1:1883 (.ci/run starts one)"
    todo = [c for c in cases if c not in run.skipped]
    jobs = sorted({c[0] for c in todo})
    corpora = {j: load_corpus(j, root) for j in jobs}
    if max_gap_s is not None:
        corpora = {j: c.compressed(max_gap_s) for j, c in corpora.items()}
    for j in jobs:
        if any(c[0] == j and c[1] == "split" for c in todo):
            print(f"[live-invariant] split seed {j}: {split_seed(j)}", flush=True)
    sem = asyncio.Semaphore(concurrency)
    want: dict[str, dict[str, Any]] = {}

    async def diagnose(job: str) -> None:
        async with sem:
            try:
                want[job] = await diagnose_json(root / job)
            except Exception as exc:  # every replay of this job reports it
                for c in todo:
                    if c[0] == job:
                        run.results[c].error = " ".join(f"post-mortem: {exc}".split())[:500]

    await asyncio.gather(*(diagnose(j) for j in jobs))
    todo = [c for c in todo if c[0] in want]
    # the longest replays first, the brokers interleaved
    todo.sort(key=lambda c: (-_expected_seconds(corpora[c[0]], c[1]), c[0], c[1], c[2]))
    brokers = sorted({c[2] for c in todo})
    sites: dict[str, Site] = {}
    async with contextlib.AsyncExitStack() as stack:
        for b in brokers:
            sites[b] = await stack.enter_async_context(site(b, workdir / b))

        async def one(c: Case) -> None:
            async with sem:
                r = await replay_job(corpora[c[0]], c[1], sites[c[2]], want[c[0]], run.results[c])
            print(f"[live-invariant] {r.line()}", flush=True)

        await asyncio.gather(*(one(c) for c in todo))
    for b in brokers:
        run.cpu[b] = sites[b].cpu_s
        run.daemons[b] = log_trouble(workdir / b / "data" / "denpexd.log", limit=20)
        if sites[b].exit_code != 0:
            run.daemons[b].append(f"denpexd serve: exit code {sites[b].exit_code} after SIGTERM")
    if "mosquitto" in brokers:
        done = [r for c, r in run.results.items() if c[2] == "mosquitto" and r.job_id]
        await clear_retained(
            [r.job_id for r in done], [(r.job_id, a, n) for r in done for a, n in r.agent_nodes]
        )
    return run


def _table(run: Run, seconds: float) -> str:
    rows = [r for c, r in sorted(run.results.items()) if c not in run.skipped]
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    lines = [
        f"live invariant: {len(rows)} replays in {seconds:.0f} s (speed x{SPEED:g}, {CONCURRENCY} at once; "
        f"CPU s: test {time.process_time():.0f}, subprocesses {usage.ru_utime + usage.ru_stime:.0f}, "
        + ", ".join(f"denpexd {b} {c:.0f}" for b, c in run.cpu.items() if c is not None)
        + ")"
    ]
    for b in BROKERS:
        mine = [r for r in rows if r.broker == b]
        if mine:
            agree = sum(r.agree for r in mine)
            first = sum(bool(r.alerts and r.alerts.first_ok) for r in mine)
            final = sum(bool(r.alerts and r.alerts.final_ok) for r in mine)
            lines.append(
                f"  {b}: diagnosis agrees {agree}/{len(mine)}, first alert right {first}/{len(mine)}, "
                f"alert right at the end {final}/{len(mine)}"
            )
    for v in VARIANTS:
        mine = [r for r in rows if r.variant == v]
        if mine:
            lines.append(f"  {v}: diagnosis agrees {sum(r.agree for r in mine)}/{len(mine)}")
    lines += [r.line() for r in rows if r.job_id or r.error]
    lines += [f"SKIPPED {c[0]} {c[1]} {c[2]}: {why}" for c, why in sorted(run.skipped.items())]
    for b, trouble in run.daemons.items():
        lines += [f"denpexd serve ({b}) log: {t}" for t in trouble]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Run:
    cases = _selected(request.session)
    workdir = tmp_path_factory.mktemp("live-invariant")
    t0 = time.monotonic()
    result = asyncio.run(_run_all(cases, workdir))
    result.table = _table(result, time.monotonic() - t0)
    report = workdir / "live_invariant.txt"
    report.write_text(result.table + "\n")
    if os.environ.get("DENPEX_LIVE_REPORT"):
        Path(os.environ["DENPEX_LIVE_REPORT"]).write_text(result.table + "\n")
    print(f"\n{result.table}\n(written to {report})", flush=True)
    return result


def _result(run: Run, job: str, variant: str, broker: str) -> Result:
    case = (job, variant, broker)
    if case in run.skipped:
        pytest.skip(run.skipped[case])
    return run.results[case]


@pytest.mark.parametrize(PARAMS, CASES)
def test_live_diagnosis_equals_postmortem(run: Run, job: str, variant: str, broker: str) -> None:
    r = _result(run, job, variant, broker)
    assert r.error is None, r.line()
    assert r.diffs == [], r.line()


@pytest.mark.parametrize(PARAMS, CASES)
def test_first_alert_names_the_initiator(run: Run, job: str, variant: str, broker: str) -> None:
    r = _result(run, job, variant, broker)
    assert r.error is None, r.line()
    assert r.alerts is not None and r.alerts.first_ok, r.line()
    assert r.alerts.final_ok, r.line()


@pytest.mark.parametrize(PARAMS, CASES)
def test_processes_ran_cleanly(run: Run, job: str, variant: str, broker: str) -> None:
    """Every agent stopped with 0 on SIGTERM, no error or traceback in any agent's log, and
    `denpexd query` answered the first time."""
    r = _result(run, job, variant, broker)
    assert r.notes == [], r.line()


@pytest.mark.parametrize("broker", BROKERS)
def test_daemon_ran_cleanly(run: Run, broker: str) -> None:
    if broker not in run.daemons:
        pytest.skip(f"no replay through {broker}")
    assert run.daemons[broker] == [], "\n".join(run.daemons[broker])
