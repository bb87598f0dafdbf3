"""`Engine.compact()` changes what the engine holds, never what it says: on every case of the
fixture corpus, compacting at any points while the events arrive (serve compacts after each
diagnosis) gives the diagnosis of an engine never compacted; the stall watch pointed at the
compacted step lines says what it said before."""

from __future__ import annotations

import random

import pytest

from denpex_agent.events import Event
from denpex_agent.rules import RuleSet
from denpexd.analysis.tracks import NO_CONTEXT, StepFields
from denpexd.engine import Engine
from denpexd.stall import StallWatch
from tests.unit.test_engine_order import CASES, _diagnose, _events


@pytest.mark.parametrize("case", CASES)
def test_compacting_at_any_point_gives_the_same_diagnosis(case: str, library: RuleSet) -> None:
    events = _events(case, library)
    reference = _diagnose(events, library)
    for seed in range(3):
        rng = random.Random(seed)
        shuffled = list(events)
        rng.shuffle(shuffled)
        engine = Engine("job", library)
        for ev in shuffled:
            engine.add(ev)
            if rng.random() < 0.05:
                engine.compact()
                engine.diagnose()
        engine.compact()
        assert engine.diagnose() == reference, f"seed {seed}"
        engine.compact()  # twice: nothing changes
        assert engine.diagnose() == reference


def _step(rank: int, step: int, **fields: object) -> Event:
    return Event(
        id=f"r{rank}-s{step}", kind="progress", job="job", node="n1", rank=rank, local_rank=rank,
        file=f"/logs/rank{rank}.log", offset=step * 100, line_no=step, ts=1.8e9 + step, ts_source="line",
        rule="megatron-iteration", severity="info", role="progress", category="progress",
        text=f"iteration {step}/10 | loss 2.0", fields={"step": step, "loss": 2.0, "lr": 1e-4, **fields},
    )  # fmt: skip


def test_a_compacted_step_line_keeps_what_is_read(library: RuleSet) -> None:
    engine = Engine("job", library)
    watch = StallWatch(factor=2, floor_s=1, pause_s=10)
    for rank in range(4):
        for step in range(3 if rank else 2):
            ev = _step(rank, step, total=10)
            engine.add(ev)
            watch.progress(ev, 100.0 + step)
    before = (engine.diagnose(), watch.check(200.0, 1.9e9))
    engine.compact()
    watch.compact(engine.kept_step, engine.track_keys())
    kept = engine.tracks[("n1", 1)].last_progress
    assert kept is not None and kept.fields == {"step": 2, "total": 10}
    assert kept.fields.__class__ is StepFields and kept.context is NO_CONTEXT
    assert kept.fields is engine.tracks[("n1", 2)].last_progress.fields  # type: ignore[union-attr]
    assert watch.ranks[("n1", 1)].event is kept  # one object for the engine and the watch
    # ... and one key tuple per rank
    assert {id(k) for k in watch.ranks} == {id(k) for k in engine.tracks}
    assert (engine.diagnose(), watch.check(200.0, 1.9e9)) == before
