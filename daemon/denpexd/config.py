"""`denpexd serve` configuration: one frozen dataclass parsed once, at the edge.

Sources, highest precedence first: command-line flags, environment (`DENPEX_<KEY>` upper case),
a TOML file (`--config`), the defaults below (README, "Live diagnosis"). Unknown keys in the
file, unknown flags and unknown `DENPEX_*` variables are errors naming them, so a typo never
silently falls back to a default; `denpex_agent.environ` holds the rule for the variables, which
the agent shares (`DENPEX_CONFIG`, `DENPEX_SERVER` are tolerated, `DENPEX_API_TOKEN` is a key).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from denpex_agent.environ import SHARED, config_variables
from denpex_agent.redact import redact_url
from denpexd.errors import ConfigError
from denpexd.nodehistory import MAX_JOBS as MAX_HISTORY_JOBS
from denpexd.podidentity import PodTokens, TokenKeysError

EVENT_LOOPS = ("auto", "uvloop", "asyncio")


@dataclass(frozen=True, slots=True)
class ServeConfig:
    mqtt_listen: str = "127.0.0.1:1883"  # the embedded broker's address (unused with `broker`)
    broker: str | None = None  # mqtt[s]://user:pass@host:port of an external broker
    http_listen: str = "127.0.0.1:8080"
    # where people reach the HTTP API (behind a proxy, say): the alerts' generatorURL points to
    # <external_url>/jobs/<job>; default http://<http_listen>
    external_url: str | None = None
    data_dir: str = "denpex-data"
    rules: str | None = None  # rule library folder; None = the bundled one
    client_id: str = "denpexd"
    shared_group: str | None = None  # replicas: subscribe as $share/<group>/... (external broker)
    session_expiry_s: int = 86_400
    job_idle_close_s: float = 900.0
    max_open_jobs: int = 10_000
    job_queue_batches: int = 64
    # received messages held for validation; when full, ingest stops reading from the broker
    ingest_backlog: int = 512
    dedup_ids_per_job: int = 200_000
    debounce_s: float = 0.2
    progress_debounce_s: float = 1.0  # re-diagnosis when only progress/heartbeats arrived
    retention_days: float = 14.0
    node_history_jobs: int = 200  # a live diagnosis's node history counts the last this many jobs
    alertmanager: str | None = None
    alert_repeat_s: float = 60.0
    # a new incident's first alert waits (bounded) for the evidence other agents may still hold:
    # agents that have sent nothing since the initiator's event arrived (alert_settle_s), agents
    # that say they are catching up on a backlog (alert_catchup_hold_s); 0 turns a wait off
    alert_settle_s: float = 0.5
    alert_catchup_hold_s: float = 10.0
    # the stall watch (denpexd.stall): a job none of whose ranks advanced for
    # max(stall_floor_s, stall_factor x its step interval), or stall_pause_s in an announced
    # pause (evaluation, checkpoint), is reported as a hang; stall_floor_s = 0 turns it off
    stall_factor: float = 10.0
    stall_floor_s: float = 30.0
    stall_pause_s: float = 1800.0
    api_token: str | None = None
    # the embedded broker's one secret, from which every agent's and reader's broker password is
    # derived (`denpexd credential`); without it, the embedded broker is for loopback only
    agent_secret: str | None = None
    # the weaker alternative: one broker password for every agent (dynamic pod names), see
    # brokeraccess; a holder may connect as any agent
    agent_password: str | None = None
    # Kubernetes: agents log in with their pod's service-account token (denpexd.podidentity),
    # checked against the cluster's public keys (a JWKS file), the audience and the issuer
    agent_token_keys: str | None = None
    agent_token_audience: str = "denpex"
    agent_token_issuer: str | None = None
    shutdown_timeout_s: float = 10.0
    log_level: str = "info"
    # the asyncio event loop: uvloop when it can be imported (`pip install 'denpexd[fast]'`),
    # else the standard one ("auto"); "uvloop" requires it, "asyncio" never uses it
    event_loop: str = "auto"

    @property
    def store_path(self) -> Path:
        return Path(self.data_dir) / "denpex.sqlite"

    def redacted(self) -> dict[str, Any]:
        """The configuration as logged: no token, no broker password."""
        out = dataclasses.asdict(self)
        for key in ("api_token", "agent_secret", "agent_password"):
            if out[key]:
                out[key] = "***"
        if out["broker"]:
            out["broker"] = redact_url(out["broker"])
        return out


_FIELDS = {f.name: f for f in dataclasses.fields(ServeConfig)}
_DEFAULTS = ServeConfig()
_TOLERATED = sorted(n for n in SHARED if n.removeprefix("DENPEX_").lower() not in _FIELDS)


def _coerce(key: str, value: Any, source: str) -> Any:
    default = getattr(_DEFAULTS, key)
    kind = type(default) if default is not None else str
    where = f"{key} (from {source})"
    if value is None:
        return None
    if isinstance(value, str) and kind is not str:
        try:
            return kind(value)
        except ValueError:
            raise ConfigError(where, f"expected {kind.__name__}, got {value!r}") from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ConfigError(where, f"expected {kind.__name__}, got {type(value).__name__}")
    return value


def _host_port(key: str, value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(key, f"expected HOST:PORT, got {value!r}")
    return host, int(port)


def split_listen(value: str) -> tuple[str, int]:
    return _host_port("listen", value)


MIN_SECRET_CHARS = 16


def is_loopback(host: str) -> bool:
    """Does listening on ``host`` keep the port on this machine?"""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost: whatever it resolves to, assume it is reachable


def pod_tokens(cfg: ServeConfig) -> PodTokens | None:
    """The verifier of agents' service-account tokens, when configured (`TokenKeysError`)."""
    if cfg.agent_token_keys is None:
        return None
    return PodTokens(cfg.agent_token_keys, cfg.agent_token_audience, cfg.agent_token_issuer)


def _validate(cfg: ServeConfig) -> ServeConfig:
    mqtt_host, _ = _host_port("mqtt_listen", cfg.mqtt_listen)
    http_host, _ = _host_port("http_listen", cfg.http_listen)
    for key in ("agent_secret", "agent_password"):
        value = getattr(cfg, key)
        if value is not None and len(value) < MIN_SECRET_CHARS:
            raise ConfigError(
                key, f"too short: use at least {MIN_SECRET_CHARS} characters (e.g. `openssl rand -hex 32`)"
            )
    if cfg.agent_token_keys is not None:
        if cfg.broker is not None:
            raise ConfigError("agent_token_keys", "is for the embedded broker (no --broker)")
        if not cfg.agent_token_audience:
            raise ConfigError("agent_token_audience", "must not be empty")
        try:
            pod_tokens(cfg)
        except TokenKeysError as exc:
            raise ConfigError("agent_token_keys", str(exc)) from None
    # Nothing listens beyond loopback without authentication.
    authenticated = any(v is not None for v in (cfg.agent_secret, cfg.agent_password, cfg.agent_token_keys))
    if cfg.broker is None and not authenticated and not is_loopback(mqtt_host):
        raise ConfigError(
            "mqtt_listen",
            f"the embedded broker would accept anyone on {cfg.mqtt_listen}: set agent_secret "
            "(DENPEX_AGENT_SECRET; agents then connect with `denpexd credential` passwords), or "
            "agent_token_keys (Kubernetes: agents log in with their pods' service-account tokens), "
            "or agent_password (DENPEX_AGENT_PASSWORD, one password for all agents), or listen on "
            "127.0.0.1",
        )
    if cfg.api_token is None and not is_loopback(http_host):
        raise ConfigError(
            "http_listen",
            f"the HTTP API would answer anyone on {cfg.http_listen}: set api_token "
            "(DENPEX_API_TOKEN) or listen on 127.0.0.1",
        )
    if cfg.broker is not None:
        u = urlsplit(cfg.broker)
        shown = redact_url(cfg.broker)
        if u.scheme not in ("mqtt", "mqtts") or not u.hostname:
            raise ConfigError("broker", f"expected mqtt[s]://[user:pass@]host[:port], got {shown!r}")
        try:
            u.port  # noqa: B018 - urlsplit checks the port only when asked
        except ValueError:
            raise ConfigError("broker", f"the port is not a number 0-65535 in {shown!r}") from None
    if cfg.shared_group is not None:
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", cfg.shared_group):
            raise ConfigError("shared_group", "use 1-64 of A-Z a-z 0-9 _ -")
        if cfg.broker is None:
            raise ConfigError("shared_group", "needs --broker: replicas share an external broker")
    if cfg.external_url is not None and (
        urlsplit(cfg.external_url).scheme not in ("http", "https") or not urlsplit(cfg.external_url).netloc
    ):
        raise ConfigError("external_url", f"expected an http(s) URL, got {cfg.external_url!r}")
    if cfg.alertmanager is not None and urlsplit(cfg.alertmanager).scheme not in ("http", "https"):
        raise ConfigError("alertmanager", f"expected an http(s) URL, got {cfg.alertmanager!r}")
    for key in (
        "max_open_jobs",
        "job_queue_batches",
        "ingest_backlog",
        "dedup_ids_per_job",
        "session_expiry_s",
    ):
        if getattr(cfg, key) < 1:
            raise ConfigError(key, "must be >= 1")
    for key in (
        "job_idle_close_s", "debounce_s", "progress_debounce_s", "retention_days", "alert_repeat_s",
        "shutdown_timeout_s",
    ):  # fmt: skip
        if getattr(cfg, key) <= 0:
            raise ConfigError(key, "must be > 0")
    for key in ("stall_factor", "stall_floor_s", "stall_pause_s"):
        if not 0 <= getattr(cfg, key) <= 86_400:
            raise ConfigError(key, "must be between 0 and 86400")
    if not 1 <= cfg.node_history_jobs <= MAX_HISTORY_JOBS:
        raise ConfigError("node_history_jobs", f"must be between 1 and {MAX_HISTORY_JOBS}")
    for key in ("alert_settle_s", "alert_catchup_hold_s"):
        if not 0 <= getattr(cfg, key) <= 600:
            raise ConfigError(key, "must be between 0 and 600 seconds")
    if cfg.event_loop not in EVENT_LOOPS:
        raise ConfigError("event_loop", f"must be one of {', '.join(EVENT_LOOPS)}")
    if cfg.log_level.lower() not in ("debug", "info", "warning", "error"):
        raise ConfigError("log_level", "must be debug, info, warning or error")
    return cfg


def read_file(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError("--config", f"cannot read {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("--config", f"{path} is not valid TOML: {exc}") from exc
    # accept either top-level keys or a [serve] table
    table = raw.pop("serve", {}) if isinstance(raw.get("serve"), dict) else {}
    return {**raw, **table}


def load_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> ServeConfig:
    """Merge defaults < file < environment < flags into one validated `ServeConfig`."""
    values: dict[str, Any] = {}
    for key, value in (read_file(path) if path is not None else {}).items():
        if key not in _FIELDS:
            raise ConfigError(key, f"unknown key in {path} (known: {', '.join(sorted(_FIELDS))})")
        values[key] = _coerce(key, value, str(path))
    variables, unknown = config_variables(env if env is not None else os.environ, _FIELDS)
    if unknown:
        raise ConfigError(
            unknown[0],
            "unknown environment variable: serve takes DENPEX_<KEY> for its keys "
            f"({', '.join(sorted(_FIELDS))}) and tolerates {', '.join(_TOLERATED)}",
        )
    for key, (name, value) in variables.items():
        values[key] = _coerce(key, value, name)
    for key, value in (flags or {}).items():
        if key not in _FIELDS:
            raise ConfigError(key, "unknown option")
        if value is not None:
            values[key] = _coerce(key, value, "command line")
    return _validate(ServeConfig(**values))
