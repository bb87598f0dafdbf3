"""deploy/systemd: the unit files, checked by `systemd-analyze verify` and `security --offline`.

systemd need not be PID 1: `verify` loads the units offline. It also checks that every
ExecStart/ExecStartPre/ExecReload binary exists, so the check runs on a copy whose install
prefix (/opt/denpex/bin) points at this environment's entry points; nothing else is changed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration]

SYSTEMD = Path(__file__).resolve().parents[2] / "deploy" / "systemd"
UNITS = ("denpexd.service", "denpex-agent.service")
PREFIX = "/opt/denpex/bin/"


def _systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        pytest.skip("systemd-analyze not installed (Debian package systemd; .ci/run installs it)")
    return path


def _bin_dir() -> str:
    for name in ("denpexd", "denpex-agent"):
        if not os.access(Path(sys.executable).parent / name, os.X_OK):
            pytest.skip(f"{name} is not installed next to {sys.executable}")
    return str(Path(sys.executable).parent) + "/"


def _copies(tmp_path: Path) -> list[Path]:
    out = []
    for unit in UNITS:
        text = (SYSTEMD / unit).read_text()
        assert PREFIX in text, unit
        (tmp_path / unit).write_text(text.replace(PREFIX, _bin_dir()))
        out.append(tmp_path / unit)
    return out


def _directives(unit: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in (SYSTEMD / unit).read_text().splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    tool = _systemd_analyze()
    units = _copies(tmp_path)
    run = subprocess.run([tool, "verify", *map(str, units)], capture_output=True, text=True, timeout=60)
    print(subprocess.run([tool, "--version"], capture_output=True, text=True).stdout.splitlines()[0])
    # verify exits 0 on unknown keys and bad values too, but prints them: demand silence.
    assert run.returncode == 0 and not run.stdout.strip() and not run.stderr.strip(), run.stdout + run.stderr


def test_systemd_security_exposure(tmp_path: Path) -> None:
    tool = _systemd_analyze()
    for unit in _copies(tmp_path):
        run = subprocess.run(
            [tool, "security", "--offline=yes", "--threshold=25", "--no-pager", str(unit)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        overall = re.search(r"Overall exposure level for \S+: ([0-9.]+)", run.stdout)
        assert overall is not None, run.stdout + run.stderr
        assert run.returncode == 0, f"{unit.name}: exposure {overall.group(1)} above 2.5\n{run.stdout}"


@pytest.mark.parametrize("unit", UNITS)
def test_unit_contract(unit: str) -> None:
    d = _directives(unit)
    assert d["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert d["Restart"] == ["on-failure"]
    assert d["NoNewPrivileges"] == ["yes"] and d["ProtectSystem"] == ["strict"]
    assert d["DynamicUser"] == ["yes"]
    assert d["StateDirectory"] and d["ReadWritePaths"] == [f"/var/lib/{d['StateDirectory'][0]}"]
    assert d["ExecStartPre"]
    if unit == "denpexd.service":
        assert d["ExecStartPre"] == [f"{PREFIX}denpexd validate --config /etc/denpex/denpexd.toml"]
    else:
        assert d["ExecStartPre"] == [f"{PREFIX}denpex-agent --check"]
        assert d["EnvironmentFile"] == ["/etc/denpex/agent.env"]
        assert d["ProtectHome"] == ["read-only"] and d["ReadOnlyPaths"]


def _validate_shipped(env_lines: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DENPEX_")}
    env.update(env_lines)
    return subprocess.run(
        [sys.executable, "-m", "denpexd", "validate", "--config", str(SYSTEMD / "denpexd.toml")],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip


def _env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key] = value
    return out


def test_the_shipped_daemon_config_is_refused_until_its_secrets_are_set() -> None:
    """denpexd.toml listens beyond loopback: as shipped (no secrets, or denpexd.env.example's
    empty ones) ExecStartPre refuses it, naming what is missing; with the secrets it passes."""
    bare = _validate_shipped({})
    assert bare.returncode == 2 and "mqtt_listen" in bare.stderr and "DENPEX_AGENT_SECRET" in bare.stderr
    shipped = _env_file(SYSTEMD / "denpexd.env.example")
    assert set(shipped) == {"DENPEX_AGENT_SECRET", "DENPEX_API_TOKEN"}
    as_shipped = _validate_shipped(shipped)
    assert as_shipped.returncode == 2 and "too short" in as_shipped.stderr, as_shipped.stderr
    no_token = _validate_shipped({"DENPEX_AGENT_SECRET": "a" * 64})
    assert no_token.returncode == 2 and "http_listen" in no_token.stderr
    filled = _validate_shipped({"DENPEX_AGENT_SECRET": "a" * 64, "DENPEX_API_TOKEN": "b" * 64})
    assert filled.returncode == 0, filled.stderr
    assert "a" * 64 not in filled.stdout + filled.stderr


def test_example_configs_pass_their_own_checks(tmp_path: Path) -> None:
    """What ExecStartPre runs, run on the shipped examples (the daemon's with its secrets set)."""
    denpexd = _validate_shipped({"DENPEX_AGENT_SECRET": "a" * 64, "DENPEX_API_TOKEN": "b" * 64})
    assert denpexd.returncode == 0, denpexd.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("DENPEX_")}
    for line in (SYSTEMD / "denpex-agent.env.example").read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    env["DENPEX_STATE_DIR"] = str(tmp_path / "state")  # as denpex-agent.service sets it
    agent = subprocess.run(
        [str(Path(_bin_dir()) / "denpex-agent"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert agent.returncode == 0, agent.stdout + agent.stderr
