from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from denpexd.clock import UNALIGNED_UNCERTAINTY_S, align


def _samples(offset: float, rng: random.Random, steps: range, jitter: float) -> list[tuple[int, float]]:
    t0 = 1_795_953_600.0
    return [(s, t0 + 0.1 * s + offset + rng.uniform(-jitter, jitter)) for s in steps]


@settings(max_examples=60, deadline=None)
@given(
    offsets=st.lists(st.floats(min_value=-5.0, max_value=5.0), min_size=1, max_size=6),
    jitter=st.floats(min_value=0.0, max_value=0.003),
    seed=st.integers(0, 1000),
)
def test_recovers_node_offsets_within_uncertainty(offsets: list[float], jitter: float, seed: int) -> None:
    rng = random.Random(seed)
    nodes = ["ref"] + [f"n{i}" for i in range(len(offsets))]
    true = {"ref": 0.0} | {f"n{i}": o for i, o in enumerate(offsets)}
    progress = {n: _samples(true[n], rng, range(1, 80), jitter) for n in nodes}
    est = align(progress, nodes, reference="ref")
    assert est["ref"].method == "reference"
    for n in nodes[1:]:
        assert est[n].method == "progress"
        err = abs(est[n].offset_s - true[n])
        assert err <= 2 * jitter + 0.001, (n, est[n], true[n])
        assert est[n].uncertainty_s >= 0.001


@settings(max_examples=30, deadline=None)
@given(offset=st.floats(min_value=-5.0, max_value=5.0), seed=st.integers(0, 1000))
def test_sparse_unaligned_samples_are_interpolated(offset: float, seed: int) -> None:
    rng = random.Random(seed)
    ref = _samples(0.0, rng, range(0, 400, 7), 0.0)  # the two nodes never sample the same step
    other = _samples(offset, rng, range(3, 400, 11), 0.0)
    est = align({"a": ref, "b": other}, ["a", "b"], reference="a")
    assert abs(est["b"].offset_s - offset) < 0.002


def test_outliers_do_not_move_the_median() -> None:
    rng = random.Random(1)
    a = _samples(0.0, rng, range(1, 60), 0.0)
    b = _samples(2.0, rng, range(1, 60), 0.0)
    b[10] = (b[10][0], b[10][1] + 30.0)  # one stalled step
    est = align({"a": a, "b": b}, ["a", "b"], reference="a")
    assert abs(est["b"].offset_s - 2.0) < 0.001


def test_node_without_progress_is_marked_unaligned_or_uses_agent_offset() -> None:
    rng = random.Random(2)
    a = _samples(0.0, rng, range(1, 20), 0.0)
    est = align({"a": a}, ["a", "quiet"], reference="a")
    assert est["quiet"].method == "none"
    assert est["quiet"].uncertainty_s == UNALIGNED_UNCERTAINTY_S
    est = align(
        {"a": a}, ["a", "quiet"], reference="a", agent_offsets={"a": (0.5, 0.01), "quiet": (1.5, 0.02)}
    )
    assert est["quiet"].method == "agent"
    assert abs(est["quiet"].offset_s - 1.0) < 1e-9
