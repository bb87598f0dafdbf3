"""`denpexd` command-line edges, as a user meets them: unknown DENPEX_* variables, a reader that
closes the pipe (`| head`), `query` without a scheme and against a daemon that never answers.
Real subprocesses, real pipes, real sockets."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
DENPEXD = [sys.executable, "-m", "denpexd"]
AGENT = [sys.executable, "-c", "from denpex_agent.cli import main; raise SystemExit(main())"]
EXIT_SIGPIPE = 141  # 128 + SIGPIPE, what a shell reports for `cat big | head`


def _env(**extra: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("DENPEX_")} | extra


def _run(
    argv: list[str], env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, env=env or _env(), cwd=REPO, timeout=timeout, check=False
    )


# -- unknown DENPEX_* variables --------------------------------------------------------------


@pytest.mark.parametrize("command", ["validate", "serve"])
@pytest.mark.parametrize("name", ["DENPEX_JOB", "DENPEX_MAX_OPEN_JOB", "DENPEX_LOGS"])
def test_unknown_variable_is_an_error(command: str, name: str, tmp_path: Path) -> None:
    extra = ["--data-dir", str(tmp_path), "--http-listen", "127.0.0.1:0"] if command == "serve" else []
    p = _run([*DENPEXD, command, *extra], env=_env(**{name: "x"}), timeout=30)
    assert p.returncode == 2, p.stdout + p.stderr
    assert name in p.stderr and "unknown environment variable" in p.stderr
    assert "Traceback" not in p.stderr


def test_shared_variables_are_tolerated_where_they_do_not_belong(tmp_path: Path) -> None:
    """DENPEX_SERVER and DENPEX_API_TOKEN (query's) and DENPEX_CONFIG pass `serve`/`validate`
    and the agent; keys of the program's own still apply."""
    shared = {"DENPEX_SERVER": "127.0.0.1:9", "DENPEX_API_TOKEN": "tok-1234", "DENPEX_CONFIG": ""}
    p = _run([*DENPEXD, "validate"], env=_env(**shared, DENPEX_BROKER="mqtt://h:1883"))
    assert p.returncode == 0 and "broker mqtt://h:1883" in p.stdout, p.stdout + p.stderr
    (tmp_path / "logs").mkdir()
    p = _run(
        [*AGENT, "--check", "--job", "j", "--logs", str(tmp_path / "logs" / "*.log")], env=_env(**shared)
    )
    assert p.returncode == 0, p.stdout + p.stderr
    # query reads DENPEX_SERVER (no scheme: http:// assumed) and is not configured otherwise
    p = _run([*DENPEXD, "query", "--jobs"], env=_env(**shared, DENPEX_JOB="agent-side"))
    assert p.returncode == 1 and "cannot reach denpexd at http://127.0.0.1:9" in p.stderr, p.stderr


def test_help_states_the_rule() -> None:
    for argv in ([*DENPEXD, "--help"], [*DENPEXD, "serve", "--help"]):
        text = " ".join(_run(argv).stdout.split())
        assert "any other DENPEX_* variable is an error" in text, argv


# -- a reader that goes away -----------------------------------------------------------------


@contextlib.contextmanager
def _stub_daemon(body: bytes) -> Iterator[int]:
    """An HTTP server answering every GET with ``body`` (the JSON a daemon would send)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def _into_closed_pipe(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run with stdout on a pipe whose reader is gone (`| head` that already exited)."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run(
            argv, stdout=w, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO, timeout=120, check=False
        )
    finally:
        os.close(w)


_MANY_JOBS = {"jobs": [{"job": f"job-{i}", "open": True, "verdict": "failed"} for i in range(5000)]}


def test_closed_pipe_ends_quietly() -> None:
    with _stub_daemon(json.dumps(_MANY_JOBS).encode()) as port:
        for argv in (
            ["rules", "list"],
            ["diagnose", "examples/job-4711"],
            ["diagnose", "examples/job-4711", "--format", "json"],
            ["query", "--jobs", "--server", f"127.0.0.1:{port}"],
            ["query", "--jobs", "--json", "--server", f"127.0.0.1:{port}"],
        ):
            p = _into_closed_pipe([*DENPEXD, *argv])
            assert p.returncode == EXIT_SIGPIPE, (argv, p.returncode, p.stderr)
            assert p.stderr == "", (argv, p.stderr)


def test_head_in_a_shell_pipeline() -> None:
    """The real thing in bash: `| head -n 0` is gone before denpexd writes (EPIPE for sure);
    `| head -n 3` reads a little of far more than a pipe holds (EPIPE when a write comes late)."""
    cli = " ".join(DENPEXD)
    with _stub_daemon(json.dumps(_MANY_JOBS).encode()) as port:
        for command, lines, statuses in (
            (f"{cli} rules list | head -n 0", 0, {EXIT_SIGPIPE}),
            (f"{cli} query --jobs --server 127.0.0.1:{port} | head -n 3", 3, {0, EXIT_SIGPIPE}),
        ):
            p = subprocess.run(
                ["bash", "-c", f"{command}; echo status=${{PIPESTATUS[0]}}"],
                capture_output=True, text=True, env=_env(), cwd=REPO, timeout=60, check=False,
            )  # fmt: skip
            out = p.stdout.splitlines()
            assert len(out) == lines + 1 and int(out[-1].removeprefix("status=")) in statuses, (
                command,
                p.stdout,
            )
            assert p.stderr == "", (command, p.stderr)


# -- query: scheme, timeout --------------------------------------------------------------------


def test_query_server_without_scheme() -> None:
    with _stub_daemon(b'{"jobs": [{"job": "job-1", "open": true, "verdict": "healthy"}]}') as port:
        p = _run([*DENPEXD, "query", "--jobs", "--server", f"127.0.0.1:{port}"])
    assert p.returncode == 0, p.stderr
    assert "job-1" in p.stdout and "healthy" in p.stdout


@contextlib.contextmanager
def _silent_server() -> Iterator[int]:
    """Accepts TCP connections and never says a word."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                held.append(srv.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield int(srv.getsockname()[1])
    finally:
        stop.set()
        thread.join()
        for c in held:
            c.close()
        srv.close()


def test_query_times_out_on_a_silent_server() -> None:
    with _silent_server() as port:
        t0 = time.monotonic()
        p = _run([*DENPEXD, "query", "--job", "job-1", "--server", f"127.0.0.1:{port}", "--timeout", "1"])
        elapsed = time.monotonic() - t0
        assert p.returncode == 1, p.stdout + p.stderr
        assert elapsed < 8, elapsed  # the interpreter's start plus the 1 s, not the default 10 s
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1, p.stderr
        assert f"http://127.0.0.1:{port}" in lines[0] and "within 1 s" in lines[0], lines[0]
        p = _run([*DENPEXD, "query", "--jobs", "--server", f"127.0.0.1:{port}", "--timeout", "0"])
        assert p.returncode == 2 and "--timeout" in p.stderr


def test_query_default_timeout_is_bounded() -> None:
    with _silent_server() as port:
        t0 = time.monotonic()
        p = _run([*DENPEXD, "query", "--jobs", "--server", f"http://127.0.0.1:{port}"], timeout=60)
        elapsed = time.monotonic() - t0
    assert p.returncode == 1 and "within 10 s" in p.stderr, p.stderr
    assert 9.5 < elapsed < 20, elapsed
