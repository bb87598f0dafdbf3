"""The embedded broker's grants, as a table: who may publish, subscribe and receive what."""

from __future__ import annotations

import pytest
from amqtt.contexts import Action

from denpex_agent import wire
from denpexd.brokeraccess import AGENT, DAEMON, LOCAL, READER, Grant, allowed, credential, grant_for
from denpexd.config import ServeConfig, _validate, is_loopback
from denpexd.errors import ConfigError

SECRET = "s" * 32
PUB, SUB, RECV = Action.PUBLISH, Action.SUBSCRIBE, Action.RECEIVE


def test_grants_follow_the_credential_and_nothing_else() -> None:
    d = "daemon-pw"
    assert grant_for(SECRET, d, "denpexd", d) == Grant(DAEMON)
    assert grant_for(SECRET, d, "denpexd", "x") is None
    assert grant_for(None, d, "denpexd", "x") is None  # the daemon's name is never free
    assert grant_for(SECRET, d, "n1", credential(SECRET, AGENT, "n1")) == Grant(AGENT, "n1", "n1")
    assert grant_for(SECRET, d, "p/n2", credential(SECRET, AGENT, "p/n2")) == Grant(AGENT, "p", "n2")
    assert grant_for(SECRET, d, "n2", credential(SECRET, AGENT, "n1")) is None
    assert grant_for(SECRET, d, "n1", credential(SECRET, READER, "n1")) == Grant(READER)
    assert grant_for(SECRET, d, "n1", None) is None and grant_for(SECRET, d, None, None) is None
    assert grant_for("t" * 32, d, "n1", credential(SECRET, AGENT, "n1")) is None  # another secret
    assert grant_for(None, d, None, None) == Grant(LOCAL)
    shared = "p" * 20
    assert grant_for(None, d, "n1", shared, shared) == Grant(AGENT, "n1", "n1")
    assert grant_for(None, d, None, None, shared) is None
    assert grant_for(None, d, "bad/name/x", shared, shared) is None
    assert grant_for(None, d, "n1", credential(SECRET, READER, "n1"), shared) is None


@pytest.mark.parametrize(
    ("grant", "topic", "action", "ok"),
    [
        (Grant(AGENT, "n1", "n1"), "denpex/v1/jobs/j/from/n1/events", PUB, True),
        (Grant(AGENT, "n1", "n1"), "denpex/v1/jobs/other/from/n1/status", PUB, True),
        (Grant(AGENT, "n1", "n1"), "denpex/v1/jobs/j/from/n2/events", PUB, False),
        (Grant(AGENT, "n1", "n1"), "denpex/v1/jobs/j/from/n1/n2/events", PUB, False),
        (Grant(AGENT, "p", "n2"), "denpex/v1/jobs/j/from/p/n2/clock", PUB, True),
        (Grant(AGENT, "p", "n2"), "denpex/v1/jobs/j/from/p/events", PUB, False),
        (Grant(AGENT, "n1", "n1"), "denpex/v1/jobs/j/events", PUB, False),
        (Grant(AGENT, "n1", "n1"), "denpex/v1/jobs/j/diagnosis", PUB, False),
        (Grant(AGENT, "n1", "n1"), "denpex/v1/alerts/j", PUB, False),
        (Grant(AGENT, "n1", "n1"), "denpex/v1/agents/n1/clock", PUB, False),
        (Grant(AGENT, "n1", "n1"), "denpex/v1/agents/n1/clock", SUB, True),
        (Grant(AGENT, "n1", "n1"), "denpex/v1/agents/n2/clock", SUB, False),
        (Grant(AGENT, "n1", "n1"), "#", SUB, False),
        (Grant(AGENT, "n1", "n1"), "denpex/v1/jobs/+/from/+/events", SUB, False),
        (Grant(AGENT, "p", "n2"), "denpex/v1/agents/p/n2/clock", RECV, True),
        (Grant(READER), "denpex/v1/#", SUB, True),
        (Grant(READER), "#", SUB, False),
        (Grant(READER), "denpex/v1/jobs/j/diagnosis", PUB, False),
        (Grant(READER), "denpex/v1/jobs/j/from/n1/events", PUB, False),
        (Grant(LOCAL), "denpex/v1/jobs/j/from/anyone/events", PUB, True),
        (Grant(LOCAL), "denpex/v1/jobs/j/events", PUB, True),
        (Grant(LOCAL), "denpex/v1/jobs/j/diagnosis", PUB, False),
        (Grant(LOCAL), "denpex/v1/alerts/j", PUB, False),
        (Grant(LOCAL), "denpex/v1/agents/n1/clock", PUB, False),
        (Grant(LOCAL), "#", SUB, True),
        (Grant(DAEMON), "denpex/v1/jobs/j/diagnosis", PUB, True),
    ],
)
def test_the_acl(grant: Grant, topic: str, action: Action, ok: bool) -> None:
    assert allowed(grant, topic, action) is ok


def test_an_agents_every_own_topic_is_allowed_and_no_one_elses() -> None:
    ids = ["n1", "n2", "pod-1"]
    for agent in ids:
        for node in ids:
            g = Grant(AGENT, agent, node)
            for a2 in ids:
                for n2 in ids:
                    for kind in ("events", "clock", "status"):
                        topic = wire.sender_topic("j", a2, n2, kind)
                        assert allowed(g, topic, PUB) is ((a2, n2) == (agent, node)), (g, topic)


def test_nothing_listens_beyond_loopback_without_authentication() -> None:
    assert (
        is_loopback("127.0.0.1")
        and is_loopback("::1")
        and is_loopback("localhost")
        and is_loopback("127.3.4.5")
    )
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("10.0.0.1")
    assert not is_loopback("denpexd.example.internal")
    with pytest.raises(ConfigError, match=r"mqtt_listen.*accept anyone"):
        _validate(ServeConfig(mqtt_listen="0.0.0.0:1883"))
    with pytest.raises(ConfigError, match=r"http_listen.*answer anyone"):
        _validate(ServeConfig(http_listen="0.0.0.0:8080", agent_secret=SECRET))
    with pytest.raises(ConfigError, match=r"agent_secret.*too short"):
        _validate(ServeConfig(agent_secret="short"))
    _validate(
        ServeConfig(
            mqtt_listen="0.0.0.0:1883", http_listen="0.0.0.0:8080", agent_secret=SECRET, api_token="t"
        )
    )
    _validate(ServeConfig(mqtt_listen="0.0.0.0:1883", agent_password="p" * 16))
    # with a site broker the daemon listens for no agent: only the API needs its token
    _validate(ServeConfig(mqtt_listen="0.0.0.0:1883", broker="mqtt://b:1883"))
    assert "agent_secret': '***'" in str(ServeConfig(agent_secret=SECRET).redacted())
