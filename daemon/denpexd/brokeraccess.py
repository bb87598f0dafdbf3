"""Who may do what on the embedded broker: credentials derived from one secret, and a topic ACL.

The daemon holds one secret (`agent_secret`). Every agent's broker password is derived from it
and from the agent's principal (``AGENT`` or ``AGENT/NODE``, `wire.principal`), which is also its
user name: `denpexd credential --agent ID --node NODE` prints both. An agent therefore holds a
password that is good for itself only, and the ACL below lets it publish only on its own
topics (``denpex/v1/jobs/<any job>/from/<its principal>/{events,clock,status}``) and read only
its own clock replies and receipts; the daemon then checks each payload against its topic, so nothing an
agent sends can speak for another agent or another node. Readers (dashboards, chat bots) get a
password derived for ``reader`` and their name: they may read everything under ``denpex/v1``
and publish nothing. The daemon's own ingest connects with a random password made at start.

Where agents' names and nodes are only known once they run (Kubernetes pods), each agent logs
in with its pod's service-account token (`agent_token_keys`, `podidentity`): the cluster's
signature binds it to the pod and its node, so the agent is held to that principal's topics.
`agent_password` is the weaker alternative for clusters whose tokens do not name the node: one password for every agent. It keeps out whoever does not hold it,
and each agent is still held to the topics of the principal it connects as, but a holder may
connect as any principal.

Without either the broker is in local-development mode (the configuration refuses that
unless it listens on loopback only): anyone may connect without credentials and publish agent
topics as anyone, but diagnoses, alerts and clock replies still come only from the daemon.

While the daemon's ingest is full (it has stopped reading its connection), the broker refuses
agents' event batches (`Intake`) instead of queueing them in memory without bound: an agent
checkpoints a batch only once the daemon's receipt says it is stored, so a refused batch is sent
again (`receipt_timeout`), and nothing is lost.

Both classes are amqtt plugins (its documented extension points, `BaseAuthPlugin` and
`BaseTopicPlugin`), named in the broker's configuration; each check is a few string
comparisons and one HMAC per new session, cached.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from amqtt.contexts import Action
from amqtt.plugins.base import BaseAuthPlugin, BaseTopicPlugin

from denpex_agent import wire
from denpexd.podidentity import PodTokens, looks_like_jwt

log = logging.getLogger(__name__)

DAEMON_USER = "denpexd"
AGENT, READER, DAEMON, LOCAL = "agent", "reader", "daemon", "local"


def credential(secret: str, role: str, name: str) -> str:
    """The broker password of ``name`` (a principal, or a reader's name) in ``role``."""
    assert role in (AGENT, READER), role
    msg = f"denpex-broker-credential/v1\0{role}\0{name}".encode()
    return hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()


@dataclass(frozen=True, slots=True)
class Grant:
    role: str
    agent: str | None = None  # for AGENT: whose topics
    node: str | None = None


def grant_for(
    secret: str | None,
    daemon_password: str,
    username: str | None,
    password: str | None,
    shared_password: str | None = None,
    *,
    tokens: PodTokens | None = None,
) -> Grant | None:
    """The grant of a connecting client, or None (refused)."""
    if username == DAEMON_USER:
        ok = password is not None and hmac.compare_digest(password.encode(), daemon_password.encode())
        return Grant(DAEMON) if ok else None
    if secret is None and shared_password is None and tokens is None:
        return Grant(LOCAL)  # local-development mode: loopback only (see ServeConfig)
    if not username or password is None:
        return None
    given = password.encode()
    sender: tuple[str, str] | None
    try:
        sender = wire.parse_principal(username)
    except wire.WireError:
        sender = None
    if sender is not None:
        agent, node = sender
        if tokens is not None and looks_like_jwt(password):
            why = tokens.verify(password, agent, node)
            if why is None:
                return Grant(AGENT, agent, node)
            log.warning(
                "broker client refused: its token does not hold user=%r reason=%s", username[:160], why
            )
            return None
        if secret is not None and hmac.compare_digest(given, credential(secret, AGENT, username).encode()):
            return Grant(AGENT, agent, node)
        if shared_password is not None and hmac.compare_digest(given, shared_password.encode()):
            return Grant(AGENT, agent, node)
    if (
        secret is not None
        and wire.valid_id(username)
        and hmac.compare_digest(given, credential(secret, READER, username).encode())
    ):
        return Grant(READER)
    return None


def _agent_topic(topic: str) -> wire.Topic | None:
    try:
        return wire.parse_topic(topic)
    except wire.WireError:
        return None


def allowed(grant: Grant, topic: str, action: Action) -> bool:
    """May the holder of ``grant`` do ``action`` on ``topic`` (a topic, or a filter to subscribe)?"""
    if grant.role == DAEMON:
        return True
    reading = action in (Action.SUBSCRIBE, Action.RECEIVE)
    if grant.role == READER:
        return reading and (topic == wire.PREFIX or topic.startswith(wire.PREFIX + "/"))
    if grant.role == LOCAL:
        # reading is free on loopback; writing only what an agent writes (any agent)
        return reading or _agent_topic(topic) is not None
    # AGENT: its own topics only
    assert grant.agent is not None and grant.node is not None
    if reading:
        return topic in (
            wire.clock_reply_topic(grant.agent, grant.node),
            wire.receipt_topic(grant.agent, grant.node),
        )
    where = _agent_topic(topic)
    return where is not None and where.agent == grant.agent and where.node == grant.node


class Intake:
    """Whether the daemon's ingest takes agents' event batches now (set by ingest, read by
    `Authorize` for every publish)."""

    __slots__ = ("_on_refused", "open")

    def __init__(self, on_refused: Callable[[], None] | None = None) -> None:
        self.open = True
        self._on_refused = on_refused

    def refused(self) -> None:
        if self._on_refused is not None:
            self._on_refused()


@dataclass
class Access:
    """Both plugins' configuration (amqtt fills it from the broker's `plugins` section)."""

    secret: str | None = None
    daemon_password: str = ""
    shared_password: str | None = None
    intake: Intake | None = None
    tokens: PodTokens | None = None

    def grant(self, username: str | None, password: str | None) -> Grant | None:
        return grant_for(
            self.secret, self.daemon_password, username, password, self.shared_password, tokens=self.tokens
        )


class Authenticate(BaseAuthPlugin):  # type: ignore[misc]  # amqtt has no type hints
    """amqtt authentication: a client connects with a grant, or not at all."""

    Config = Access

    async def authenticate(self, *, session: Any) -> bool | None:
        grant = self.context.config.grant(session.username, session.password)
        will_topic = session.will_topic or ""
        if grant is not None and session.will_flag and not allowed(grant, will_topic, Action.PUBLISH):
            # a last will is published (and retained) by the broker on the client's behalf: it
            # must be a topic the client may publish itself (an agent's own `offline` status)
            log.warning(
                "broker client refused: last will on a topic it may not publish user=%r topic=%r",
                str(session.username)[:80], will_topic[:120],
            )  # fmt: skip
            return False
        if grant is None:
            log.warning(
                "broker client refused: unknown user or wrong password user=%r client_id=%r",
                str(session.username)[:80], str(session.client_id)[:80],
            )  # fmt: skip
            return False
        return True


class Authorize(BaseTopicPlugin):  # type: ignore[misc]
    """amqtt topic filtering: publish, subscribe and receive against the client's grant."""

    Config = Access

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self._cache: dict[tuple[str | None, str | None], Grant | None] = {}

    async def topic_filtering(
        self, *, session: Any = None, topic: str | None = None, action: Action | None = None
    ) -> bool | None:
        if session is None or topic is None or action is None:
            return False
        key = (session.username, session.password)
        if key not in self._cache:
            if len(self._cache) > 65_536:
                self._cache.clear()
            self._cache[key] = self.context.config.grant(*key)
        grant = self._cache[key]
        intake = self.context.config.intake
        if (
            intake is not None
            and not intake.open
            and action == Action.PUBLISH
            and grant is not None
            and grant.role != DAEMON
            and topic.endswith("/events")
        ):
            intake.refused()  # sent again by its agent, unconfirmed (see the module docstring)
            return False
        if grant is None or not allowed(grant, topic, action):
            if action != Action.RECEIVE:
                log.info(
                    "broker refused %s user=%r topic=%r",
                    action.value,
                    str(session.username)[:80],
                    topic[:160],
                )
            return False
        return True
