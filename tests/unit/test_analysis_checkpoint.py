"""analysis.checkpoint: a hang whose stuck collective began as a rank went to write a checkpoint."""

from __future__ import annotations

import random

from denpex_agent.rules import load_rules
from denpexd.engine import Engine
from tests.unit.test_engine import T0, ev

RULES = load_rules()
TIMEOUT_MS = 600_000


def job(
    save_at: float | None,
    step_after_save: bool = False,
    order_seed: int | None = None,
    all_save: bool = False,
) -> dict:
    events = []
    for s in range(1, 11):
        for r in range(4):
            events.append(ev("n0" if r < 2 else "n1", r, T0 + s, None, RULES, step=s))
    if save_at is not None:
        for r in range(4) if all_save else (0,):  # every rank may announce the same save
            events.append(
                ev("n0" if r < 2 else "n1", r, T0 + save_at + 0.001 * r, "marker-checkpoint-save", RULES)
            )
    if step_after_save:
        events.append(ev("n0", 0, T0 + (save_at or 0) + 5, None, RULES, step=11))
    fired = T0 + 10.2 + TIMEOUT_MS / 1000  # ranks 1-3 entered the step-11 all-reduce at ~T0 + 10.2
    for r in (1, 2, 3):
        node = "n0" if r < 2 else "n1"
        events.append(ev(node, r, fired + 0.01 * r, "nccl-watchdog-timeout", RULES, timeout_ms=TIMEOUT_MS))
    if order_seed is not None:
        random.Random(order_seed).shuffle(events)
    e = Engine("j", RULES)
    for x in events:
        e.add(x)
    return e.diagnose()


def test_a_timeout_that_began_at_a_save_is_a_checkpoint_stall() -> None:
    d = job(save_at=10.5)
    assert d["verdict"] == "failed"
    assert d["root_cause"]["rule"] == "hang-in-checkpoint-save"
    assert d["root_cause"]["category"] == "checkpoint-io"
    got = d["checkpoint_stall"]
    assert (got["node"], got["rank"], got["timeout_s"]) == ("n0", 0, 600.0)
    # the rank that stopped first is the writer: named, with the write's story
    assert (d["initiator"]["rank"], d["initiator"]["category"]) == (0, "checkpoint-io")


def test_the_writer_is_the_rank_that_never_came_back_not_one_that_timed_out() -> None:
    got = job(save_at=10.5, all_save=True)["checkpoint_stall"]
    assert (got["node"], got["rank"]) == ("n0", 0)


def test_a_save_long_before_the_collective_is_not_the_cause() -> None:
    d = job(save_at=10.2 - 400)
    assert d["checkpoint_stall"] is None and d["root_cause"]["category"] == "hang"


def test_a_writer_that_stepped_on_after_its_save_was_not_held_by_it() -> None:
    d = job(save_at=10.5, step_after_save=True)
    assert d["checkpoint_stall"] is None


def test_without_a_save_a_hang_stays_a_hang() -> None:
    d = job(save_at=None)
    assert d["checkpoint_stall"] is None and d["root_cause"]["category"] == "hang"


def test_the_answer_does_not_depend_on_the_order_of_events() -> None:
    want = job(save_at=10.5)["checkpoint_stall"]
    for seed in range(10):
        assert job(save_at=10.5, order_seed=seed)["checkpoint_stall"] == want
