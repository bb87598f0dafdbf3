"""A private Mosquitto for the bench scripts: a free loopback port, a configuration of the
script's own, start (waiting until it listens), SIGKILL, stop. Scripts under bench/ import it
as `_mosquitto` (their folder is on the path when run as `python3 bench/NAME.py`)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivateMosquitto:
    """Anonymous, unlimited queues; ``settings`` adds configuration lines (persistence, windows)."""

    def __init__(self, workdir: Path, settings: str = "") -> None:
        self.exe = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        self.port = free_port()
        self.conf = workdir / "mosquitto.conf"
        root = "user root\n" if os.geteuid() == 0 else ""  # as root it would drop to its own user
        self.conf.write_text(
            f"{root}listener {self.port} 127.0.0.1\nallow_anonymous true\nmax_queued_messages 0\n{settings}\n"
        )
        self.log = workdir / "mosquitto.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def version(self) -> str:
        out = subprocess.run([self.exe, "-h"], capture_output=True, text=True).stdout.splitlines()
        return out[0] if out else self.exe

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen([self.exe, "-c", str(self.conf)], stdout=out, stderr=out)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.02)
        raise RuntimeError(f"mosquitto did not start: {self.log.read_text()[-1000:]}")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None
