"""Agent configuration: defaults < TOML file < DENPEX_* environment < flags, parsed once.

Every key has the same name everywhere: ``batch_max_bytes`` in the file, ``DENPEX_BATCH_MAX_BYTES``
in the environment, ``--batch-max-bytes`` on the command line. Unknown keys in the file or in
``DENPEX_*`` variables are errors that name the key. The result is a frozen `AgentConfig` the
runtime trusts.
"""

from __future__ import annotations

import os
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from denpex_agent.errors import ConfigError
from denpex_agent.wire import valid_id

ENV_PREFIX = "DENPEX_"
# Variables the agent reads that are not configuration keys of its own.
_ENV_IGNORED = frozenset({"DENPEX_SERVER", "DENPEX_API_TOKEN", "DENPEX_CONFIG"})


@dataclass(frozen=True, slots=True)
class BrokerURL:
    scheme: str
    host: str
    port: int
    username: str | None
    password: str | None

    @property
    def tls(self) -> bool:
        return self.scheme == "mqtts"

    def redacted(self) -> str:
        auth = f"{self.username}:***@" if self.username else ""
        return f"{self.scheme}://{auth}{self.host}:{self.port}"


def parse_broker_url(url: str) -> BrokerURL:
    parts = urlsplit(url)
    if parts.scheme not in ("mqtt", "mqtts"):
        raise ConfigError(f"broker URL {url!r}: scheme must be mqtt:// or mqtts://")
    if not parts.hostname:
        raise ConfigError(f"broker URL {url!r}: no host")
    try:
        port = parts.port or (8883 if parts.scheme == "mqtts" else 1883)
    except ValueError as exc:
        raise ConfigError(f"broker URL {url!r}: bad port") from exc
    return BrokerURL(
        scheme=parts.scheme,
        host=parts.hostname,
        port=port,
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
    )


@dataclass(frozen=True, slots=True)
class AgentConfig:
    job: str
    node: str
    logs: tuple[str, ...]
    agent_id: str = ""
    broker: str = "mqtt://127.0.0.1:1883"
    username: str | None = None
    password: str | None = None
    password_file: str | None = None  # read at every connection (a token the platform renews)
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    mqtt_version: str = "auto"  # auto | 5 | 3.1.1
    topic_style: str = "sender"  # sender: topics name the agent | job: one topic per job (replicas)
    state_dir: str = "./denpex-agent-state"
    rules: str | None = None
    layout: str | None = None
    batch_max_bytes: int = 256 * 1024
    batch_max_delay: float = 0.0
    poll_interval: float = 0.15
    follow_mode: str = "auto"  # auto: inotify where the filesystem reports writes | poll: always poll
    discover_interval: float = 1.0
    heartbeat_interval: float = 5.0
    clock_interval: float = 30.0
    checkpoint_interval: float = 1.0
    max_line_bytes: int = 1 << 20
    context_lines: int = 100
    read_chunk: int = 1 << 20
    max_inflight_bytes: int = 8 << 20
    receipt_timeout: float = 10.0
    progress_interval: float = 0.25
    fold_timeout: float = 5.0
    slow_scan_warning: float = 2.0
    shutdown_timeout: float = 5.0
    metrics_listen: str | None = None
    log_level: str = "info"

    @property
    def broker_url(self) -> BrokerURL:
        return parse_broker_url(self.broker)

    @property
    def agent(self) -> str:
        return self.agent_id or f"{self.node}"


_FIELD_TYPES: dict[str, type] = {
    "job": str,
    "node": str,
    "logs": tuple,
    "agent_id": str,
    "broker": str,
    "username": str,
    "password": str,
    "password_file": str,
    "ca_file": str,
    "cert_file": str,
    "key_file": str,
    "mqtt_version": str,
    "topic_style": str,
    "state_dir": str,
    "rules": str,
    "layout": str,
    "batch_max_bytes": int,
    "batch_max_delay": float,
    "poll_interval": float,
    "follow_mode": str,
    "discover_interval": float,
    "heartbeat_interval": float,
    "clock_interval": float,
    "checkpoint_interval": float,
    "max_line_bytes": int,
    "context_lines": int,
    "read_chunk": int,
    "max_inflight_bytes": int,
    "receipt_timeout": float,
    "progress_interval": float,
    "fold_timeout": float,
    "slow_scan_warning": float,
    "shutdown_timeout": float,
    "metrics_listen": str,
    "log_level": str,
}
KEYS = frozenset(f.name for f in fields(AgentConfig))
assert set(_FIELD_TYPES) == KEYS


def _coerce(key: str, value: Any, origin: str) -> Any:
    want = _FIELD_TYPES[key]
    try:
        if want is tuple:
            if isinstance(value, str):
                items = [v for v in value.replace(os.pathsep, ",").split(",") if v.strip()]
                return tuple(v.strip() for v in items)
            if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
                return tuple(value)
            raise TypeError
        if want is int:
            if isinstance(value, bool):
                raise TypeError
            return int(value)
        if want is float:
            if isinstance(value, bool):
                raise TypeError
            return float(value)
        if not isinstance(value, str):
            raise TypeError
        return value
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{origin}: {key} = {value!r} is not a valid {want.__name__}") from exc


def load_config(
    flags: Mapping[str, Any],
    env: Mapping[str, str] | None = None,
    config_file: str | None = None,
) -> AgentConfig:
    """Merge defaults < file < environment < flags (None flags are unset) and validate."""
    env = os.environ if env is None else env
    merged: dict[str, Any] = {}
    if config_file:
        try:
            with open(config_file, "rb") as fh:
                doc = tomllib.load(fh)
        except OSError as exc:
            raise ConfigError(f"config file {config_file}: {exc.strerror or exc}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {config_file}: invalid TOML: {exc}") from exc
        section = doc.get("agent", doc) if isinstance(doc.get("agent"), dict) else doc
        for key, value in section.items():
            if key not in KEYS:
                raise ConfigError(f"config file {config_file}: unknown key {key!r}")
            merged[key] = _coerce(key, value, f"config file {config_file}")
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or name in _ENV_IGNORED:
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if key not in KEYS:
            raise ConfigError(f"environment: unknown variable {name}")
        merged[key] = _coerce(key, value, f"environment {name}")
    for key, value in flags.items():
        if value is None or key not in KEYS:
            continue
        merged[key] = _coerce(key, value, f"--{key.replace('_', '-')}")
    merged.setdefault("node", socket.gethostname().split(".")[0])
    return validate(merged)


def validate(values: Mapping[str, Any]) -> AgentConfig:
    for key in ("job", "logs"):
        if not values.get(key):
            raise ConfigError(f"{key} is required (--{key}, DENPEX_{key.upper()} or the config file)")
    for key in ("job", "node"):
        if not valid_id(values[key]):
            raise ConfigError(
                f"{key} {values[key]!r}: use 1-128 of A-Z a-z 0-9 . _ : @ = - (no '/', '+', '#')"
            )
    if values.get("agent_id") and not valid_id(values["agent_id"]):
        raise ConfigError(f"agent_id {values['agent_id']!r} is not a valid id")
    cfg = AgentConfig(**values)
    url = parse_broker_url(cfg.broker)
    if cfg.mqtt_version not in ("auto", "5", "3.1.1"):
        raise ConfigError("mqtt_version must be auto, 5 or 3.1.1")
    if cfg.follow_mode not in ("auto", "poll"):
        raise ConfigError("follow_mode must be auto or poll")
    if cfg.topic_style not in ("sender", "job"):
        raise ConfigError("topic_style must be sender or job")
    if cfg.password_file is not None and (cfg.password or url.password):
        raise ConfigError("password and password_file: give one of them")
    for key in ("ca_file", "cert_file", "key_file", "password_file"):
        path = getattr(cfg, key)
        if path and not Path(path).is_file():
            raise ConfigError(f"{key} {path}: no such file")
    if (cfg.cert_file is None) != (cfg.key_file is None):
        raise ConfigError("cert_file and key_file go together")
    if (cfg.ca_file or cfg.cert_file) and not url.tls:
        raise ConfigError("certificates given but the broker URL is not mqtts://")
    positive = (
        "batch_max_bytes", "poll_interval", "discover_interval", "heartbeat_interval",
        "clock_interval", "checkpoint_interval", "max_line_bytes", "read_chunk", "max_inflight_bytes",
        "shutdown_timeout", "progress_interval", "fold_timeout", "slow_scan_warning", "receipt_timeout",
    )  # fmt: skip
    for key in positive:
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"{key} must be > 0")
    if cfg.batch_max_delay < 0:
        raise ConfigError("batch_max_delay must be >= 0")
    if cfg.batch_max_bytes > 900 * 1024:
        raise ConfigError("batch_max_bytes must be at most 900 KiB (receivers refuse payloads over 1 MiB)")
    if cfg.context_lines < 0 or cfg.context_lines > 200:
        raise ConfigError("context_lines must be between 0 and 200")
    if cfg.metrics_listen is not None:
        parse_listen(cfg.metrics_listen)
    if cfg.log_level.lower() not in ("debug", "info", "warning", "error"):
        raise ConfigError("log_level must be debug, info, warning or error")
    return cfg


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"listen address {value!r}: use HOST:PORT, e.g. 127.0.0.1:9101")
    return host or "127.0.0.1", int(port)
