"""The agent package's error root. Errors carry data, not only prose."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


def divert_loop_errors(loop: asyncio.AbstractEventLoop, divert: Callable[[dict[str, Any]], bool]) -> None:
    """Give ``divert`` the first look at what asyncio would report as an unhandled error (a
    dependency's stray task or future): it handles what it knows and returns True; anything
    else goes on to the handler that was there before (asyncio's own by default)."""
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if divert(context):
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


class DenpexAgentError(Exception):
    """Root of every error this package raises on purpose."""


class RuleError(DenpexAgentError):
    """A rule file or a rule in it is invalid."""

    def __init__(self, file: str, rule_id: str | None, reason: str) -> None:
        self.file = file
        self.rule_id = rule_id
        self.reason = reason
        where = f"{file}: rule {rule_id!r}" if rule_id else file
        super().__init__(f"{where}: {reason}")


class ConfigError(DenpexAgentError):
    """Configuration is invalid; the message names the key or value."""


class LayoutError(DenpexAgentError):
    """A --layout template cannot be used."""


class PatternTimeout(DenpexAgentError):
    """A rule's pattern ran longer than its bound on one line (it backtracks badly on it)."""

    def __init__(self, rule_id: str, pattern: str) -> None:
        self.rule_id = rule_id
        self.pattern = pattern
        super().__init__(f"rule {rule_id!r}: pattern {pattern!r} timed out on a line")
