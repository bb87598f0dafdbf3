"""The broker password and the API token never appear in anything `denpex-agent` or `denpexd`
print: every log line (at debug level), the "connecting"/"connected" lines, the error of a broker
that refuses the credentials, of an unreachable one, of a malformed URL, `--check` and `validate`,
usage errors and the traceback of an unexpected failure. Real subprocesses against a private
Mosquitto that requires a password; all of stdout and stderr is searched for the secret."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.agent_harness import broker_up, free_port

pytestmark = [pytest.mark.integration]

SECRET = f"Pw{uuid.uuid4().hex}"  # user denpex's real password on the private broker
WRONG = f"Wr{uuid.uuid4().hex}"  # a password the broker refuses
TOKEN = f"Tk{uuid.uuid4().hex}"  # an API token
NUMERIC = str(10**11 + uuid.uuid4().int % 10**11)  # a password TOML gives as an integer
ALL = (SECRET, WRONG, TOKEN, NUMERIC)

AGENT = [sys.executable, "-c", "from denpex_agent.cli import main; raise SystemExit(main())"]
DENPEXD = [sys.executable, "-m", "denpexd"]


@pytest.fixture(scope="module")
def auth_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A Mosquitto with a password file and no anonymous access; user denpex, password SECRET."""
    mosquitto = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    passwd = shutil.which("mosquitto_passwd")
    if not Path(mosquitto).exists() or passwd is None:
        pytest.skip("mosquitto and mosquitto_passwd are needed (Debian package mosquitto)")
    workdir = tmp_path_factory.mktemp("auth-broker")
    subprocess.run([passwd, "-c", "-b", str(workdir / "passwd"), "denpex", SECRET], check=True)
    port = free_port()
    conf = workdir / "mosquitto.conf"
    conf.write_text(
        f"{'user root' + chr(10) if os.geteuid() == 0 else ''}"
        f"listener {port} 127.0.0.1\nallow_anonymous false\npassword_file {workdir / 'passwd'}\n"
    )
    proc = subprocess.Popen(
        [mosquitto, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 10
    while not broker_up(port):
        assert time.monotonic() < deadline, "private mosquitto did not start"
        time.sleep(0.05)
    yield port
    proc.terminate()
    proc.wait(timeout=10)


@dataclass(frozen=True)
class Case:
    argv: list[str]  # {broker} = the private broker's port, {free} = a port nobody listens on, {tmp}
    until: str  # regex the output must reach (proves the situation happened)
    env: tuple[tuple[str, str], ...] = ()
    files: tuple[tuple[str, str], ...] = ()  # (name under tmp, content)
    exit_code: int | None = None  # when the process ends by itself


_LOGS = ["--job", "j-secrets", "--logs", "{tmp}/logs/*.log", "--state-dir", "{tmp}/state", "--log-level", "debug",
         "--shutdown-timeout", "0.5"]  # fmt: skip
_SERVE = ["serve", "--data-dir", "{tmp}/data", "--http-listen", "127.0.0.1:{free2}", "--log-level", "debug"]

CASES = {
    # the agent
    "agent-connected": Case(
        [*AGENT, *_LOGS, "--broker", f"mqtt://denpex:{SECRET}@127.0.0.1:{{broker}}"], r"connected to broker"
    ),
    "agent-refused": Case(
        [*AGENT, *_LOGS, "--broker", f"mqtt://denpex:{WRONG}@127.0.0.1:{{broker}}"], r"Not authori[sz]ed"
    ),
    "agent-flags-unreachable": Case(
        [*AGENT, *_LOGS, "--broker", "mqtt://127.0.0.1:{free}", "--username", "denpex", "--password", WRONG],
        r"connect failed.*refused",
    ),
    "agent-env-refused": Case(
        [*AGENT, *_LOGS],
        r"Not authori[sz]ed",
        env=(
            ("DENPEX_BROKER", "mqtt://127.0.0.1:{broker}"),
            ("DENPEX_USERNAME", "denpex"),
            ("DENPEX_PASSWORD", WRONG),
        ),
    ),
    "agent-env-url": Case(
        [*AGENT, *_LOGS],
        r"connected to broker",
        env=(("DENPEX_BROKER", f"mqtt://denpex:{SECRET}@127.0.0.1:{{broker}}"),),
    ),
    "agent-malformed-url": Case(
        [*AGENT, *_LOGS, "--broker", f"mqtt://denpex:{SECRET}@127.0.0.1:99999"], r"bad port", exit_code=2
    ),
    "agent-toml-malformed": Case(
        [*AGENT, *_LOGS, "--config", "{tmp}/agent.toml"],
        r"configuration error",
        files=(("agent.toml", f'broker = "mqtt://denpex:{SECRET}@127.0.0.1:port"\n'),),
        exit_code=2,
    ),
    "agent-toml-numeric-password": Case(
        [*AGENT, *_LOGS, "--config", "{tmp}/agent.toml"],
        r"not a valid str",
        files=(("agent.toml", f"password = {NUMERIC}\n"),),
        exit_code=2,
    ),
    "agent-check": Case(
        [
            *AGENT,
            *_LOGS,
            "--check",
            "--broker",
            f"mqtt://denpex:{SECRET}@127.0.0.1:1883",
            "--password",
            WRONG,
        ],
        r"ok: job=j-secrets",
        exit_code=0,
    ),
    "agent-usage-error": Case(
        [*AGENT, *_LOGS, "--brokr", f"mqtt://denpex:{SECRET}@127.0.0.1:1883"], r"unrecognized", exit_code=2
    ),
    "agent-traceback": Case(  # an unexpected failure whose message holds the secret (a path here)
        [
            *AGENT,
            "--job",
            "j",
            "--logs",
            "{tmp}/logs/*.log",
            "--state-dir",
            f"{{tmp}}/{SECRET}/file",
            "--broker",
            f"mqtt://denpex:{SECRET}@127.0.0.1:{{broker}}",
        ],
        r"Traceback",
        files=((f"{SECRET}/file", ""),),
        exit_code=1,
    ),
    # the daemon
    "serve-connected": Case(
        [*DENPEXD, *_SERVE, "--broker", f"mqtt://denpex:{SECRET}@127.0.0.1:{{broker}}"], r"serve ready"
    ),
    "serve-refused": Case(
        [*DENPEXD, *_SERVE, "--broker", f"mqtt://denpex:{WRONG}@127.0.0.1:{{broker}}"],
        r"Not authori[sz]ed",
        exit_code=1,
    ),
    "serve-env-unreachable": Case(
        [*DENPEXD, *_SERVE],
        r"cannot connect",
        env=(("DENPEX_BROKER", f"mqtt://denpex:{SECRET}@127.0.0.1:{{free}}"), ("DENPEX_API_TOKEN", TOKEN)),
        exit_code=1,
    ),
    "serve-malformed-url": Case(
        [*DENPEXD, *_SERVE, "--broker", f"mqtt://denpex:{SECRET}@127.0.0.1:port"],
        r"port is not a number",
        exit_code=2,
    ),
    "serve-usage-error": Case(
        [*DENPEXD, "serve", "--password", SECRET, "--brokr", f"mqtt://u:{WRONG}@h:1"],
        r"unrecognized",
        exit_code=2,
    ),
    "validate-ok": Case(
        [*DENPEXD, "-v", "validate", "--config", "{tmp}/d.toml"],
        r"configuration ok",
        files=(("d.toml", f'broker = "mqtt://denpex:{SECRET}@h:1883"\napi_token = "{TOKEN}"\n'),),
        exit_code=0,
    ),
    "validate-malformed": Case(
        [*DENPEXD, "validate", "--config", "{tmp}/d.toml"],
        r"broker",
        files=(("d.toml", f'[serve]\nbroker = "mqtt://denpex:{SECRET}@:1883"\n'),),
        exit_code=2,
    ),
    "serve-internal-error": Case(  # the top-level handler: a data_dir Python cannot open, with -v
        [
            *DENPEXD,
            "-v",
            "serve",
            "--config",
            "{tmp}/d.toml",
            "--http-listen",
            "127.0.0.1:{free2}",
            "--mqtt-listen",
            "127.0.0.1:{free}",
        ],
        r"internal error",
        files=(("d.toml", f'api_token = "{TOKEN}"\ndata_dir = "{{tmp}}/\\u0000{TOKEN}"\n'),),
        exit_code=1,
    ),
}


def _run(case: Case, tmp: Path, broker: int, within: float = 15.0) -> tuple[int | None, str]:
    ports = {"broker": str(broker), "free": str(free_port()), "free2": str(free_port()), "tmp": str(tmp)}

    def fill(text: str) -> str:
        return re.sub(r"\{(broker|free2?|tmp)\}", lambda m: ports[m.group(1)], text)

    (tmp / "logs").mkdir(parents=True, exist_ok=True)
    (tmp / "logs" / "rank0.log").write_text("2026-11-29 12:00:00,000 INFO [rank0] step 1 | loss 2.0\n")
    for name, content in case.files:
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text(fill(content))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DENPEX_")}
    env.update({k: fill(v) for k, v in case.env})
    out_path = tmp / "output.txt"
    with out_path.open("wb") as out:
        proc = subprocess.Popen(
            [fill(a) for a in case.argv], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp
        )
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and proc.poll() is None:
        # a process expected to end is left to end; a running one is stopped once it got there
        if case.exit_code is None and re.search(case.until, out_path.read_text(errors="replace")):
            time.sleep(0.3)  # let it log what follows (retries, the next attempt)
            break
        time.sleep(0.05)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    return code, out_path.read_text(errors="replace")


@pytest.mark.parametrize("name", sorted(CASES))
def test_no_secret_in_any_output(name: str, auth_broker: int, tmp_path: Path) -> None:
    case = CASES[name]
    code, output = _run(case, tmp_path, auth_broker)
    assert re.search(case.until, output), f"{name}: the situation did not happen:\n{output[-3000:]}"
    if case.exit_code is not None:
        assert code == case.exit_code, f"{name}: exit {code}\n{output[-3000:]}"
    leaked = [s for s in ALL if s in output]
    assert not leaked, f"{name}: secret in the output:\n{output}"
    if re.search(r"://\w*:\w+@", " ".join(case.argv) + str(case.env) + str(case.files)):
        assert "***" in output, f"{name}: no masked URL in the output:\n{output[-3000:]}"
