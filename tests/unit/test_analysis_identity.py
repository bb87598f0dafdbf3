"""analysis.identity: two processes announcing the same global rank, and what is not that."""

from __future__ import annotations

import itertools
import random

from denpexd.analysis.identity import MAX_CLAIMANTS, Claims, add_claim, duplicate_ranks


def same(node: str, ts: float | None) -> float | None:
    return ts


def claims_of(rows: list[tuple[int, str, int | None, float | None]]) -> Claims:
    claims: Claims = {}
    for announced, node, stream_rank, ts in rows:
        add_claim(claims, announced, node, stream_rank, ts)
    return claims


def test_two_nodes_each_counting_from_zero_are_duplicates() -> None:
    rows = [(r, node, None, 10.0 + r) for node in ("n0", "n1") for r in range(4)]
    got = duplicate_ranks(claims_of(rows), same, None)
    assert [d["rank"] for d in got] == [0, 1, 2, 3]
    assert got[0]["claimed_by"] == [{"node": "n0", "rank": None}, {"node": "n1", "rank": None}]


def test_two_srun_tasks_of_one_node_are_duplicates() -> None:
    rows = [(1, "n0", 0, None), (1, "n0", 1, None), (2, "n0", 0, None)]
    assert [d["rank"] for d in duplicate_ranks(claims_of(rows), same, None)] == [1]


def test_one_stream_repeating_a_rank_is_one_process() -> None:
    # a worker's own file (rank known) and its launcher's echo or a restart in place: one stream
    rows = [(3, "n0", 3, 1.0), (3, "n0", 3, 50.0), (3, "n0", None, 1.0), (0, "n0", 0, 1.0)]
    assert duplicate_ranks(claims_of(rows), same, None) == []


def test_a_healthy_launch_has_no_duplicates() -> None:
    rows = [(node * 4 + r, f"n{node}", node * 4 + r, 5.0) for node in range(2) for r in range(4)]
    assert duplicate_ranks(claims_of(rows), same, None) == []


def test_claims_after_the_first_error_are_a_new_launch() -> None:
    # an elastic restart hands node n1 the ranks n0 had before the failure at t=100
    rows = [(0, "n0", None, 10.0), (0, "n1", None, 130.0)]
    assert duplicate_ranks(claims_of(rows), same, 100.0) == []
    assert [d["rank"] for d in duplicate_ranks(claims_of(rows), same, None)] == [0]


def test_the_answer_does_not_depend_on_the_order_of_arrival() -> None:
    rows = [(r % 3, f"n{i % 7}", i % 2 if i % 5 else None, float(i % 11)) for i, r in enumerate(range(60))]
    want = duplicate_ranks(claims_of(rows), same, 8.0)
    rng = random.Random(7)
    for _ in range(50):
        rng.shuffle(rows)
        claims = claims_of(rows)
        assert all(len(by) <= MAX_CLAIMANTS for by in claims.values())
        assert duplicate_ranks(claims, same, 8.0) == want
    assert want  # the rows do hold duplicates


def test_claimants_are_bounded_per_rank() -> None:
    claims: Claims = {}
    for node, r in itertools.product(range(50), range(8)):
        add_claim(claims, 0, f"n{node:02d}", r, None)
    assert len(claims[0]) == MAX_CLAIMANTS
