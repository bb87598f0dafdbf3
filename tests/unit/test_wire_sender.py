"""Sender identity on the wire: every topic an agent sends on names it (agent, and node when the
two differ), the topic round-trips, and a payload that claims someone else is refused."""

from __future__ import annotations

import itertools

import pytest

from denpex_agent import wire

IDS = ["node01", "pod-7", "gpu-node-3.example", "a", "x:y@z=1"]


@pytest.mark.parametrize(("agent", "node"), list(itertools.product(IDS, IDS)))
def test_every_sender_topic_parses_back_to_its_sender(agent: str, node: str) -> None:
    for kind in ("events", "clock", "status"):
        where = wire.parse_topic(wire.sender_topic("job-1", agent, node, kind))
        assert (where.kind, where.job, where.agent, where.node) == (kind, "job-1", agent, node)
        wire.check_sender(where, agent, node)
    assert wire.parse_principal(wire.principal(agent, node)) == (agent, node)
    reply = wire.clock_reply_topic(agent, node)
    assert reply == f"denpex/v1/agents/{wire.principal(agent, node)}/clock"


def test_a_payload_that_claims_another_sender_is_refused() -> None:
    where = wire.parse_topic(wire.sender_topic("job-1", "pod-7", "gpu-3", "events"))
    for agent, node in (("pod-8", "gpu-3"), ("pod-7", "gpu-4"), ("gpu-3", "gpu-3")):
        with pytest.raises(wire.WireError, match="does not match the topic"):
            wire.check_sender(where, agent, node)
    # the first revision's topics name no node (and events no agent): nothing to compare
    legacy = wire.parse_topic("denpex/v1/jobs/job-1/events")
    assert (legacy.agent, legacy.node) == (None, None)
    wire.check_sender(legacy, "anyone", "anywhere")


@pytest.mark.parametrize(
    "topic",
    [
        "denpex/v1/jobs/j/from/a/a/events",  # AGENT/NODE spelled out although they are equal
        "denpex/v1/jobs/j/from/a/b/c/events",  # three levels
        "denpex/v1/jobs/j/from/events",
        "denpex/v1/jobs/j/from/a/diagnosis",
        "denpex/v1/jobs/j/from/../events",
        "denpex/v1/jobs/j/from/+/events",
        "denpex/v1/jobs/j/diagnosis",
    ],
)
def test_malformed_sender_topics_are_refused(topic: str) -> None:
    with pytest.raises(wire.WireError):
        wire.parse_topic(topic)


def test_the_daemon_subscribes_to_every_sender_topic() -> None:
    from denpexd.ingest import subscriptions

    def matches(topic: str, flt: str) -> bool:
        t, f = topic.split("/"), flt.split("/")
        return len(t) == len(f) and all(b in ("+", a) for a, b in zip(t, f, strict=True))

    filters = subscriptions(None)
    for agent, node in (("n1", "n1"), ("pod", "n1")):
        for kind in ("events", "clock", "status"):
            topic = wire.sender_topic("job-1", agent, node, kind)
            assert any(matches(topic, f) for f in filters), topic
