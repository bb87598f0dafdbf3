"""analysis.trends: loss spikes and divergence, gradient-norm spikes, loss-scale collapse, judged
against the job's own history."""

from __future__ import annotations

import math
import random

import pytest

from denpexd.analysis.tracks import StepMax
from denpexd.analysis.trends import episode, scale_fall, step_at, trends


def _curve(values: list[float], first: int = 0) -> StepMax:
    c = StepMax()
    for i, v in enumerate(values):
        c.add(first + i, v)
    return c


def _training_loss(rng: random.Random, n: int) -> list[float]:
    """A healthy loss: decays from ~10 toward ~2 with a few percent of batch noise."""
    return [(2.0 + 8.0 * math.exp(-i / 60)) * rng.gauss(1.0, 0.04) for i in range(n)]


def test_a_spike_that_recovers_names_its_start_peak_and_recovery() -> None:
    rng = random.Random(1)
    values = _training_loss(rng, 300)
    for i, k in zip(range(200, 206), (1.4, 2.5, 4.0, 3.0, 1.2, 1.05), strict=True):
        values[i] *= k
    got = episode(_curve(values).curve(), "loss")
    assert got is not None and got["kind"] == "spike"
    assert got["start_step"] == 200 and got["detected_step"] in (201, 202) and got["peak_step"] == 202
    assert got["recovered_step"] is not None and 203 <= got["recovered_step"] <= 206


def test_a_divergence_stays_above_its_baseline_to_the_end() -> None:
    rng = random.Random(2)
    values = _training_loss(rng, 120) + [2.3 * 1.3**k for k in range(1, 40)]
    got = episode(_curve(values).curve(), "loss")
    assert got is not None and got["kind"] == "divergence" and got["recovered_step"] is None
    assert 119 <= got["start_step"] <= got["detected_step"] <= 123


@pytest.mark.parametrize("seed", range(30))
def test_healthy_curves_have_no_episode(seed: int) -> None:
    rng = random.Random(seed)
    assert trends({"loss": _curve(_training_loss(rng, 400))}, None) == []
    norms = [abs(rng.gauss(1.0, 0.3)) + 0.05 for _ in range(400)]
    assert trends({"grad_norm": _curve(norms)}, None) == []


def test_a_grad_norm_explosion_is_a_spike_of_its_own() -> None:
    norms = [0.24, 0.95, 0.3, 0.28, 0.25, 0.27, 0.31, 0.29, 15.9, 145.0, 960.0, 0.3, 0.26]
    (got,) = trends({"grad_norm": _curve(norms, 100)}, None)
    assert got["rule"] == "grad-norm-spike" and got["start_step"] == 108 and got["recovered_step"] == 111


def test_the_loss_scale_collapses_below_one_not_while_it_settles() -> None:
    assert trends({}, 2.0**20) == []  # halvings from 2^32 that settled: healthy
    (got,) = trends({}, 3.7e-09)
    assert got["rule"] == "loss-scale-collapse" and got["kind"] == "collapse"


def test_an_overflow_at_the_floor_is_a_collapse_a_logged_scale_of_one_is_not() -> None:
    """`Attempted loss scale: 1, reducing to 1`: the scaler is at DeepSpeed's floor and the step still
    overflowed. A logged value of 1 (bf16 runs log `loss scale: 1.0`) is no drop, and a drop that
    leaves the scale above 1 is the scaler at work."""
    assert [t["kind"] for t in trends({}, 1.0, 1.0)] == ["collapse"]
    assert trends({}, 1.0, None) == []
    assert trends({}, 1.0, 2.0) == []
    assert trends({}, 65536.0, 65536.0) == []


def test_the_curve_keeps_the_largest_value_per_step_whatever_the_order() -> None:
    a, b = StepMax(), StepMax()
    points = [(s, float(r)) for s in range(2000) for r in range(3)]
    for s, v in points:
        a.add(s, v)
    for s, v in reversed(points):
        b.add(s, v)
    assert a.curve() == b.curve() and len(a.curve()) <= 1024
    assert all(v == 2.0 for _, v in a.curve())


def test_the_settling_descent_is_healthy_and_a_fall_after_it_is_not() -> None:
    settle = [(float(i), i, 2.0 ** (32 - i)) for i in range(1, 8)]  # one halving per step from 2^32
    assert scale_fall(settle) is None
    # then it comes back to 2^25 and 2^26 now and then (no new low): still healthy
    again = [*settle, (500.0, 900, 2.0**26), (900.0, 1600, 2.0**25)]
    assert scale_fall(again) is None
    # new lows at steps 3000, 3120 and 3300: a fall
    fall = [*settle, (3000.0, 3000, 2.0**24), (3120.0, 3120, 2.0**23), (3300.0, 3300, 2.0**22)]
    got = scale_fall(fall)
    assert got is not None and got["kind"] == "falling" and got["baseline"] == 2.0**25
    assert (got["start_step"], got["detected_step"], got["value"]) == (3000, 3300, 2.0**22)
    # the same new lows spread over thousands of steps: a slow drift, not a fall
    drift = [*settle, (3000.0, 3000, 2.0**24), (6000.0, 6000, 2.0**23), (9000.0, 9000, 2.0**22)]
    assert scale_fall(drift) is None


def test_without_steps_a_descent_cannot_be_judged() -> None:
    assert scale_fall([(float(i), None, 2.0 ** (16 - i)) for i in range(10)]) is None


def test_step_at_reads_the_node_curve() -> None:
    curve = [(1, 10.0), (2, 11.0), (5, 14.0)]
    assert (step_at(curve, 9.0), step_at(curve, 11.5), step_at(curve, 99.0)) == (None, 2, 5)
