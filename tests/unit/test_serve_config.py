"""ServeConfig: defaults, precedence flags > env > file > defaults, unknown keys and unknown
DENPEX_* variables rejected."""

from __future__ import annotations

from pathlib import Path

import pytest

from denpex_agent import config as agent_config
from denpex_agent.environ import SHARED
from denpexd.config import ServeConfig, load_config
from denpexd.errors import ConfigError
from denpexd.metrics import invalid_reason


def test_defaults() -> None:
    cfg = load_config(env={})
    assert cfg == ServeConfig()
    assert (cfg.mqtt_listen, cfg.http_listen) == ("127.0.0.1:1883", "127.0.0.1:8080")
    assert str(cfg.store_path) == "denpex-data/denpex.sqlite"


def test_precedence(tmp_path: Path) -> None:
    f = tmp_path / "d.toml"
    f.write_text('http_listen = "127.0.0.1:1"\nmax_open_jobs = 7\ndebounce_s = 1\n[serve]\ndata_dir = "/x"\n')
    cfg = load_config(f, env={"DENPEX_HTTP_LISTEN": "127.0.0.1:2", "DENPEX_MAX_OPEN_JOBS": "8"},
                      flags={"http_listen": "127.0.0.1:3", "max_open_jobs": None})  # fmt: skip
    assert cfg.http_listen == "127.0.0.1:3"
    assert cfg.max_open_jobs == 8
    assert cfg.debounce_s == 1.0 and cfg.data_dir == "/x"


def test_unknown_and_invalid(tmp_path: Path) -> None:
    f = tmp_path / "d.toml"
    f.write_text("max_open_job = 3\n")
    with pytest.raises(ConfigError, match="max_open_job"):
        load_config(f, env={})
    with pytest.raises(ConfigError, match="broker"):
        load_config(env={"DENPEX_BROKER": "http://x"})
    with pytest.raises(ConfigError, match="max_open_jobs"):
        load_config(env={"DENPEX_MAX_OPEN_JOBS": "many"})


def test_unknown_environment_variables() -> None:
    for name in ("DENPEX_JOB", "DENPEX_MAX_OPEN_JOB", "DENPEX_PASSWORD"):  # agent keys, typos
        with pytest.raises(ConfigError, match=name) as err:
            load_config(env={name: "x", "PATH": "/bin"})
        assert err.value.key == name
    tolerated = {"DENPEX_SERVER": "http://h:8080", "DENPEX_CONFIG": "", "DENPEX_API_TOKEN": "tok"}
    assert load_config(env=tolerated) == ServeConfig(api_token="tok")  # DENPEX_API_TOKEN is a key


def test_agent_and_daemon_tolerate_the_same_variables() -> None:
    assert agent_config._ENV_IGNORED == SHARED


def test_redacted() -> None:
    cfg = load_config(env={"DENPEX_API_TOKEN": "t", "DENPEX_BROKER": "mqtt://u:pw@h:1883"})
    shown = cfg.redacted()
    assert shown["api_token"] == "***" and "pw" not in shown["broker"]


@pytest.mark.parametrize(
    ("message", "reason"),
    [("payload of 9 bytes exceeds 1", "too_large"), ("not JSON: x", "not_json"),
     ("unsupported version 2 (expected 1)", "version"), ("invalid job id '..'", "bad_id"),
     ("event 0: kind must be", "schema")],
)  # fmt: skip
def test_invalid_reason(message: str, reason: str) -> None:
    assert invalid_reason(message) == reason
