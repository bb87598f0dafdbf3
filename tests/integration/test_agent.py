"""denpex-agent as a real subprocess against the real Mosquitto on 127.0.0.1:1883."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import orjson
import pytest

from tests.integration.agent_harness import (
    agent_cmd,
    broker_up,
    collector,
    eventually,
    free_port,
    start_agent,
    stop,
    unique_job,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not broker_up(), reason="no MQTT broker on 127.0.0.1:1883 (.ci/run starts one)"),
]

OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB"


def step(rank: int, n: int) -> str:
    return f"2026-11-29 12:00:{n % 60:02d},{n % 1000:03d} INFO [rank{rank}] step {n} | loss 2.0 | grad_norm 1.0\n"


@pytest.mark.asyncio
async def test_ships_matches_progress_heartbeats_and_status(tmp_path: Path) -> None:
    job = unique_job()
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank0.log").write_text("".join(step(0, i) for i in range(1, 20)))
    (logs / "rank1.log").write_text(step(1, 1) + "[rank1]: Traceback (most recent call last):\n"
                                     '[rank1]:   File "train.py", line 3, in <module>\n'
                                     f"[rank1]: {OOM}\n")  # fmt: skip
    async with collector(job) as got:
        proc = start_agent(
            agent_cmd(job, "n1", [str(logs / "rank*.log")], tmp_path / "state"), tmp_path / "agent.log"
        )
        try:
            await eventually(lambda: any(e.rule == "cuda-oom" for e in got.events("match")))
            with (logs / "rank0.log").open("a") as fh:  # appended after the start: followed
                fh.write("RuntimeError: CUDA error: an illegal memory access was encountered\n")
            (logs / "rank2.log").write_text("Killed\n")  # a file that appears later
            await eventually(lambda: len(got.events("match")) >= 3)
            await eventually(lambda: len(got.events("heartbeat")) >= 3)
            await eventually(lambda: got.clock_requests >= 1)
        finally:
            assert stop(proc) == 0
        await eventually(lambda: ("n1", "n1", "offline") in [(a, n, s) for a, n, s in got.statuses])
    matches = {e.rule: e for e in got.events("match")}
    oom = matches["cuda-oom"]
    assert oom.rank == 1 and oom.node == "n1" and oom.text.startswith("[rank1]: Traceback")
    assert matches["illegal-memory-access"].rank == 0
    assert any(e.rank == 2 for e in got.events("match"))
    prog = got.events("progress")
    assert any(e.rank == 0 and e.fields["step"] == 19 for e in prog)  # the newest step line of rank 0
    assert ("n1", "n1", "online") in got.statuses
    assert got.invalid == 0
    log = (tmp_path / "agent.log").read_text()
    assert "agent stopped" in log


@pytest.mark.asyncio
async def test_resumes_after_kill_9_without_loss_and_with_stable_ids(tmp_path: Path) -> None:
    job = unique_job()
    logs = tmp_path / "logs"
    logs.mkdir()
    f = logs / "rank0.log"
    cmd = agent_cmd(job, "n1", [str(logs / "rank*.log")], tmp_path / "state", "--checkpoint-interval", "0.2")
    async with collector(job) as got:
        proc = start_agent(cmd, tmp_path / "agent.log")
        with f.open("a") as fh:
            for i in range(200):
                fh.write(f"RuntimeError: CUDA error: an illegal memory access was encountered marker={i}\n")
                fh.flush()
                if i == 100:
                    await eventually(lambda: len(got.events("match")) >= 50)
                    proc.kill()  # SIGKILL: no flush, no goodbye
                    proc.wait()
                    # the broker publishes the agent's last will
                    await eventually(lambda: ("n1", "n1", "offline") in got.statuses, within=10)
                    proc = start_agent(cmd, tmp_path / "agent.log")
        await eventually(lambda: {_marker(e.text) for e in got.events("match")} >= set(range(200)), within=20)
        stop(proc)
    ids: dict[int, set[str]] = {}
    for e in got.events("match"):
        ids.setdefault(_marker(e.text), set()).add(e.id)
    assert set(ids) == set(range(200))
    assert all(len(v) == 1 for v in ids.values()), "a re-sent line must carry the same event id"


@pytest.mark.asyncio
async def test_an_impossible_checkpoint_position_is_reported_and_its_file_read_again(tmp_path: Path) -> None:
    """One position with offset -5 (hand-edited, or a bug): reported, that file read again from
    its start, the other file resumed where it was; nothing of either file is missed."""
    job = unique_job()
    logs = tmp_path / "logs"
    logs.mkdir()
    for r in (0, 1):
        (logs / f"rank{r}.log").write_text(
            "".join(f"RuntimeError: CUDA error: an illegal memory access was encountered marker={r * 100 + i}\n"
                    for i in range(20)) + "2026-11-29 12:00:00,000 INFO done\n"
        )  # fmt: skip
    cmd = agent_cmd(job, "n1", [str(logs / "rank*.log")], tmp_path / "state", "--checkpoint-interval", "0.2")
    async with collector(job) as got:
        proc = start_agent(cmd, tmp_path / "agent.log")
        await eventually(lambda: len(got.events("match")) >= 40)
        assert stop(proc) == 0
    state = tmp_path / "state" / "checkpoints.json"
    doc = json.loads(state.read_text())
    by_path = {p["path"]: ident for ident, p in doc["files"].items()}
    doc["files"][by_path[str(logs / "rank0.log")]]["offset"] = -5
    state.write_text(json.dumps(doc))
    with (logs / "rank1.log").open("a") as fh:
        fh.write("RuntimeError: CUDA error: an illegal memory access was encountered marker=199\n2026 x\n")
    async with collector(job) as again:
        proc = start_agent(cmd, tmp_path / "agent.log")
        await eventually(lambda: {_marker(e.text) for e in again.events("match")} >= set(range(20)) | {199})
        assert stop(proc) == 0
    resent = {_marker(e.text) for e in again.events("match")}
    assert not resent & set(range(100, 120)), "rank1.log resumed from its position"
    text = (tmp_path / "agent.log").read_text()
    assert "impossible position" in text and "read again from its start" in text


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return str(resp.read().decode())


def _marker(text: str) -> int:
    return int(text.rsplit("marker=", 1)[1].split()[0])


@pytest.mark.asyncio
async def test_rotation_by_rename_and_copytruncate(tmp_path: Path) -> None:
    job = unique_job()
    logs = tmp_path / "logs"
    logs.mkdir()
    f = logs / "rank0.log"
    f.write_text("")
    async with collector(job) as got:
        proc = start_agent(
            agent_cmd(job, "n1", [str(logs / "rank*.log")], tmp_path / "state"), tmp_path / "agent.log"
        )
        try:
            n = 0

            def write(k: int) -> None:
                nonlocal n
                with f.open("a") as fh:
                    for _ in range(k):
                        fh.write(
                            f"RuntimeError: CUDA error: an illegal memory access was encountered marker={n}\n"
                        )
                        n += 1

            write(20)
            await eventually(lambda: len(got.events("match")) >= 20)
            # rename rotation: the old file's tail is written after the rename, then a new file
            os.rename(f, logs / "rank0.log.1")
            with (logs / "rank0.log.1").open("a") as fh:
                fh.write("RuntimeError: CUDA error: an illegal memory access was encountered marker=late\n")
            write(20)
            await eventually(lambda: len(got.events("match")) >= 41)
            # copytruncate: copy away, truncate in place, keep writing
            (logs / "copy.bak").write_bytes(f.read_bytes())
            with f.open("r+") as fh:
                fh.truncate(0)
            write(20)
            await eventually(lambda: len(got.events("match")) >= 61)
        finally:
            stop(proc)
    texts = [e.text for e in got.events("match")]
    markers = sorted(_marker(t) for t in texts if "marker=late" not in t)
    assert markers == list(range(60))
    assert sum("marker=late" in t for t in texts) == 1
    log = (tmp_path / "agent.log").read_text()
    assert "rotated" in log and "truncated" in log


@pytest.mark.asyncio
async def test_hostile_files_are_warned_about_and_the_rest_is_served(tmp_path: Path) -> None:
    job = unique_job()
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank0.log").write_bytes(os.urandom(300_000))
    (logs / "rank1.log").write_bytes(b"\xc3\x28\xa0\xa1 garbled\n" * 1000)
    (logs / "rank2.log").mkdir()  # a directory where a file should be
    os.symlink(logs / "nowhere", logs / "rank3.log")  # a dangling link
    with (logs / "rank4.log").open("wb") as fh:  # a 100 MB line, then a failure
        chunk = b"B" * (1 << 20)
        for _ in range(100):
            fh.write(chunk)
        fh.write(f"\n{OOM}\n".encode())
    unreadable = logs / "rank5.log"
    unreadable.write_text(f"{OOM}\n")
    unreadable.chmod(0)
    port = free_port()
    cmd = agent_cmd(
        job, "n1", [str(logs / "rank*.log"), str(tmp_path / "absent" / "*.log")], tmp_path / "state"
    )
    cmd += ["--metrics-listen", f"127.0.0.1:{port}"]
    if os.geteuid() == 0:  # root reads anything: drop the capabilities that bypass file modes
        caps = "-dac_override,-dac_read_search"
        cmd = ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}", *cmd]
    async with collector(job) as got:
        proc = start_agent(cmd, tmp_path / "agent.log")
        try:
            await eventually(lambda: any(e.rule == "cuda-oom" for e in got.events("match")), within=60)
            with (logs / "rank1.log").open("ab") as fh:
                fh.write(b"Killed\n")
            await eventually(lambda: any(e.rank == 1 for e in got.events("match")))
            metrics = await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/metrics")
        finally:
            assert stop(proc) == 0
    oom = next(e for e in got.events("match") if e.rule == "cuda-oom")
    assert oom.rank == 4
    assert 'denpex_agent_warnings_total{reason="not-a-file"}' in metrics
    assert 'denpex_agent_warnings_total{reason="stat-failed"}' in metrics
    assert 'denpex_agent_warnings_total{reason="glob-empty"}' in metrics
    assert 'denpex_agent_warnings_total{reason="open-failed"}' in metrics
    assert not any(e.rank == 5 for e in got.events("match"))
    assert "denpex_agent_lines_truncated_total 1.0" in metrics
    assert "denpex_agent_batches_published_total" in metrics
    assert re.search(r"^denpex_agent_read_lag_bytes [0-9.e+]+$", metrics, re.M)
    log = (tmp_path / "agent.log").read_text()
    assert "rank2.log" in log and "rank3.log" in log and "absent" in log
    assert re.search(r"cannot open \(Permission denied\) path=\S*rank5\.log", log)


def test_configuration_precedence_and_errors(tmp_path: Path) -> None:
    conf = tmp_path / "agent.toml"
    conf.write_text('job = "from-file"\nlogs = ["/x/*.log"]\nbatch_max_delay = 0.5\n')
    run = [sys.executable, "-c", "from denpex_agent.cli import main; raise SystemExit(main())"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DENPEX_")}
    p = subprocess.run(
        [*run, "--config", str(conf), "--check"], capture_output=True, text=True, env=env, check=False
    )
    assert p.returncode == 0 and "job=from-file" in p.stdout
    p = subprocess.run(
        [*run, "--config", str(conf), "--check"],
        capture_output=True,
        text=True,
        check=False,
        env=env | {"DENPEX_JOB": "from-env"},
    )
    assert "job=from-env" in p.stdout
    p = subprocess.run(
        [*run, "--config", str(conf), "--check", "--job", "from-flag"],
        capture_output=True, text=True, check=False, env=env | {"DENPEX_JOB": "from-env"},
    )  # fmt: skip
    assert "job=from-flag" in p.stdout
    conf.write_text('job = "j"\nlogs = ["/x/*.log"]\nbatch_max_dealy = 0.5\n')
    p = subprocess.run(
        [*run, "--config", str(conf), "--check"], capture_output=True, text=True, env=env, check=False
    )
    assert p.returncode == 2 and "batch_max_dealy" in p.stderr
    p = subprocess.run(
        [*run, "--check", "--logs", "/x"],
        capture_output=True,
        text=True,
        env=env | {"DENPEX_JOBB": "x"},
        check=False,
    )
    assert p.returncode == 2 and "DENPEX_JOBB" in p.stderr
    p = subprocess.run(
        [*run, "--check", "--job", "a/b", "--logs", "/x"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert p.returncode == 2 and "job" in p.stderr
    p = subprocess.run(
        [*run, "--check", "--job", "j", "--logs", "/x", "--broker", "http://h"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert p.returncode == 2 and "mqtt://" in p.stderr


@pytest.mark.asyncio
async def test_broker_outage_pauses_reading_and_catches_up(tmp_path: Path) -> None:
    from tests.integration.agent_harness import PrivateBroker

    broker = PrivateBroker(tmp_path)
    broker.start()
    job = unique_job()
    logs = tmp_path / "logs"
    logs.mkdir()
    f = logs / "rank0.log"
    f.write_text("")
    cmd = agent_cmd(job, "n1", [str(logs / "rank*.log")], tmp_path / "state", port=broker.port)
    proc = start_agent(cmd, tmp_path / "agent.log")
    try:
        async with collector(job, broker.port, session=f"c-{job}") as got:
            with f.open("a") as fh:
                fh.write(
                    "".join(
                        f"RuntimeError: CUDA error: an illegal memory access was encountered marker={i}\n"
                        for i in range(50)
                    )
                )
            await eventually(lambda: len(got.events("match")) >= 50)
            broker.stop()
            with f.open("a") as fh:  # written while the broker is down
                fh.write(
                    "".join(
                        f"RuntimeError: CUDA error: an illegal memory access was encountered marker={i}\n"
                        for i in range(50, 100)
                    )
                )
            await asyncio.sleep(1.5)
            assert proc.poll() is None, "the agent must survive a broker outage"
            broker.start()
            await eventually(
                lambda: {_marker(e.text) for e in got.events("match")} >= set(range(100)), within=30
            )
    finally:
        stop(proc)
        broker.stop()
    assert proc.returncode == 0
    assert "reconnecting" in (tmp_path / "agent.log").read_text()


def test_sigterm_exits_within_the_shutdown_bound(tmp_path: Path) -> None:
    if not broker_up():
        pytest.skip("no broker")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank0.log").write_text("".join(step(0, i) for i in range(100)))
    proc = start_agent(
        agent_cmd(unique_job(), "n1", [str(logs / "*.log")], tmp_path / "state"), tmp_path / "agent.log"
    )
    time.sleep(2.0)
    t0 = time.monotonic()
    assert stop(proc, signal.SIGTERM) == 0
    assert time.monotonic() - t0 < 6.0
    state = orjson.loads((tmp_path / "state" / "checkpoints.json").read_bytes())
    (pos,) = state["files"].values()
    assert pos["offset"] == (logs / "rank0.log").stat().st_size


@pytest.mark.asyncio
async def test_sighup_reloads_rules_and_a_bad_library_keeps_the_old_one(tmp_path: Path) -> None:
    from denpex_agent.rules import default_rules_dir

    rules = tmp_path / "rules"
    shutil.copytree(default_rules_dir(), rules)
    job = unique_job()
    logs = tmp_path / "logs"
    logs.mkdir()
    f = logs / "rank0.log"
    f.write_text("")
    cmd = agent_cmd(job, "n1", [str(logs / "*.log")], tmp_path / "state", "--rules", str(rules))
    async with collector(job) as got:
        proc = start_agent(cmd, tmp_path / "agent.log")
        try:
            await eventually(lambda: ("n1", "n1", "online") in got.statuses)
            with f.open("a") as fh:
                fh.write("site-specific: ECC page retirement storm on gpu 3 (first)\n")
            await asyncio.sleep(1.0)
            assert not got.events("match")
            (rules / "site.toml").write_text(SITE_RULE)
            proc.send_signal(signal.SIGHUP)
            await eventually(lambda: "rules reloaded" in (tmp_path / "agent.log").read_text())
            with f.open("a") as fh:
                fh.write("site-specific: ECC page retirement storm on gpu 3 (second)\n")
            await eventually(lambda: any(e.rule == "site-ecc-storm" for e in got.events("match")))
            (rules / "broken.toml").write_text("schema = 1\n[[rule]]\nid = 'x'\n")
            proc.send_signal(signal.SIGHUP)
            await eventually(lambda: "rule reload failed" in (tmp_path / "agent.log").read_text())
            with f.open("a") as fh:
                fh.write("site-specific: ECC page retirement storm on gpu 3 (third)\n")
            await eventually(lambda: sum(e.rule == "site-ecc-storm" for e in got.events("match")) >= 2)
            assert proc.poll() is None
        finally:
            assert stop(proc) == 0
    texts = [e.text for e in got.events("match")]
    assert not any("(first)" in t for t in texts)


SITE_RULE = """schema = 1
[[rule]]
id = "site-ecc-storm"
title = "Site-specific ECC page retirement storm"
category = "hardware"
severity = "critical"
role = "root-cause"
patterns = ['ECC page retirement storm on gpu (?P<rank>\\d+)']
root_cause = "The GPU is retiring pages faster than the site threshold."
fix = "Drain the node and open a hardware ticket."
verify = "nvidia-smi -q -d PAGE_RETIREMENT shows no pending retirements after the swap."
examples = ["site-specific: ECC page retirement storm on gpu 3"]
"""


def _make_ca_and_certs(d: Path) -> dict[str, Path]:
    """A throw-away CA, a server certificate for 127.0.0.1 and a client certificate."""

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=denpex-test-ca",
        "-keyout", "ca.key", "-out", "ca.crt")  # fmt: skip
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    for name, extra in (("server", ["-extfile", "san.cnf"]), ("client", [])):
        run(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={name}",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
        )
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-out", f"{name}.crt", *extra)  # fmt: skip
    return {n: d / n for n in ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")}


def _start_mosquitto(conf: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["mosquitto", "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


@pytest.mark.asyncio
@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
async def test_mqtts_with_password_and_client_certificate(tmp_path: Path) -> None:
    certs = await asyncio.to_thread(_make_ca_and_certs, tmp_path)
    pwfile = tmp_path / "passwd"
    pwfile.write_text("")
    await asyncio.to_thread(
        subprocess.run, ["mosquitto_passwd", "-b", str(pwfile), "agent-n1", "s3cret"], check=True
    )
    plain, tls = free_port(), free_port()
    conf = tmp_path / "mosquitto.conf"
    conf.write_text(
        ("user root\n" if os.geteuid() == 0 else "")
        + f"per_listener_settings true\nlistener {plain} 127.0.0.1\nallow_anonymous true\n"
        f"listener {tls} 127.0.0.1\nallow_anonymous false\npassword_file {pwfile}\n"
        f"cafile {certs['ca.crt']}\ncertfile {certs['server.crt']}\nkeyfile {certs['server.key']}\n"
        "require_certificate true\n"
    )
    broker = _start_mosquitto(conf)
    try:
        await eventually(lambda: broker_up(tls) and broker_up(plain), within=10)
        job = unique_job()
        logs = tmp_path / "logs"
        logs.mkdir()
        (logs / "rank0.log").write_text(OOM + "\n")
        base = agent_cmd(job, "n1", [str(logs / "*.log")], tmp_path / "state")
        i = base.index("--broker")
        good = [*base[: i + 1], f"mqtts://agent-n1:s3cret@127.0.0.1:{tls}", *base[i + 2 :]]
        good += ["--ca-file", str(certs["ca.crt"]), "--cert-file", str(certs["client.crt"]),
                 "--key-file", str(certs["client.key"])]  # fmt: skip
        async with collector(job, plain) as got:
            proc = start_agent(good, tmp_path / "agent.log")
            try:
                await eventually(lambda: any(e.rule == "cuda-oom" for e in got.events("match")))
            finally:
                assert stop(proc) == 0
            bad = [a.replace("s3cret", "wrong") for a in good]
            proc = start_agent(bad, tmp_path / "agent-bad.log")
            await asyncio.sleep(3.0)
            stop(proc)
        assert "connected to broker" in (tmp_path / "agent.log").read_text()
        assert "connected to broker" not in (tmp_path / "agent-bad.log").read_text()
    finally:
        broker.terminate()
        broker.wait(10)
