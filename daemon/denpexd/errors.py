"""The daemon's one error root. Foreign errors are translated at the boundary and carry data."""

from __future__ import annotations


class DenpexdError(Exception):
    """Base of every error `denpexd` raises on purpose; the CLI maps it to a clear message."""


class ConfigError(DenpexdError):
    """An invalid configuration value or an unknown key; `key` names it."""

    def __init__(self, key: str, reason: str) -> None:
        self.key, self.reason = key, reason
        super().__init__(f"{key}: {reason}")


class BrokerError(DenpexdError):
    """The embedded broker could not start, or the external broker is unreachable."""

    def __init__(self, address: str, reason: str) -> None:
        self.address, self.reason = address, reason
        super().__init__(f"MQTT broker {address}: {reason}")


class StoreError(DenpexdError):
    """The SQLite store could not be opened or migrated."""

    def __init__(self, path: str, reason: str) -> None:
        self.path, self.reason = path, reason
        super().__init__(f"store {path}: {reason}")


class HttpError(DenpexdError):
    """The HTTP API could not bind its address."""

    def __init__(self, address: str, reason: str) -> None:
        self.address, self.reason = address, reason
        super().__init__(f"HTTP {address}: {reason}")


class QueryError(DenpexdError):
    """`denpexd query` could not get an answer from the daemon."""
