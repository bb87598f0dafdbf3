"""deploy/ against the real monitoring stack: Alertmanager, Prometheus and `denpexd serve`.

One module-wide stack on loopback ports, each process with its own tmp storage:
* a real Alertmanager running deploy/alertmanager/alertmanager.example.yml unchanged,
* `denpexd serve` (embedded broker) pushing to it, fed the corpus job nan_fp16 over MQTT,
* a real Prometheus running a copy of deploy/prometheus/prometheus.example.yml (targets and
  paths pointed at the stack) with deploy/prometheus/denpex.rules.yml, alerting to the same
  Alertmanager.
Each tool is skipped, with the reason, when its Debian package is not installed.
"""

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
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import aiomqtt
import pytest

from denpex_agent.rules import load_rules
from tests.integration.replay import free_port, load_case, replay

pytestmark = [pytest.mark.integration]

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
CASE = "nan_fp16"


def _which(*names: str) -> str | None:
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    return None


def _http_json(url: str, *, data: bytes | None = None, timeout: float = 5.0) -> Any:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _http_text(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return str(resp.read().decode())


def _wait(what: str, check: Callable[[], Any], timeout_s: float, logs: list[Path]) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
            last = exc
        time.sleep(0.2)
    tails = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs if p.exists())
    raise AssertionError(f"timed out waiting for {what}: {last!r}\n{tails}")


@dataclass
class Proc:
    name: str
    argv: list[str]
    log: Path
    env: dict[str, str] | None = None
    popen: subprocess.Popen[bytes] | None = None
    _fh: IO[bytes] | None = field(default=None, repr=False)

    def start(self) -> None:
        self._fh = open(self.log, "wb")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(self.argv, stdout=self._fh, stderr=subprocess.STDOUT, env=self.env)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self) -> int | None:
        rc = None
        if self.popen is not None:
            if self.popen.poll() is None:
                self.popen.send_signal(signal.SIGTERM)
                try:
                    self.popen.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    self.popen.kill()
                    self.popen.wait()
            rc = self.popen.returncode
        if self._fh is not None:
            self._fh.close()
        return rc


@dataclass
class Stack:
    tmp: Path
    job: str
    procs: dict[str, Proc] = field(default_factory=dict)
    am_url: str | None = None
    prom_url: str | None = None
    daemon_url: str = ""
    mqtt_port: int = 0
    events: int = 0

    @property
    def logs(self) -> list[Path]:
        return [p.log for p in self.procs.values()]

    def am_alerts(self, *matchers: str) -> list[dict[str, Any]]:
        """GET /api/v2/alerts with one `filter` parameter per matcher."""
        assert self.am_url is not None
        q = "?" + urllib.parse.urlencode([("filter", m) for m in matchers]) if matchers else ""
        return list(_http_json(f"{self.am_url}/api/v2/alerts{q}"))


def _start_alertmanager(stack: Stack) -> None:
    binary = _which("prometheus-alertmanager", "alertmanager")
    if binary is None:
        return
    port = free_port()
    storage = stack.tmp / "alertmanager"
    storage.mkdir()
    proc = Proc(
        "alertmanager",
        [binary, f"--config.file={DEPLOY / 'alertmanager' / 'alertmanager.example.yml'}",
         f"--storage.path={storage}", f"--web.listen-address=127.0.0.1:{port}",
         "--cluster.listen-address=", "--log.level=info"],
        stack.tmp / "alertmanager.log",
    )  # fmt: skip
    stack.procs["alertmanager"] = proc
    proc.start()
    stack.am_url = f"http://127.0.0.1:{port}"
    _wait("alertmanager ready", lambda: _http_text(f"{stack.am_url}/-/ready"), 20, stack.logs)


def _start_daemon(stack: Stack) -> None:
    http_port, stack.mqtt_port = free_port(), free_port()
    argv = [sys.executable, "-m", "denpexd", "serve", "--http-listen", f"127.0.0.1:{http_port}",
            "--mqtt-listen", f"127.0.0.1:{stack.mqtt_port}", "--data-dir", str(stack.tmp / "denpexd")]  # fmt: skip
    if stack.am_url:
        argv += ["--alertmanager", stack.am_url]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DENPEX_")}
    proc = Proc("denpexd", argv, stack.tmp / "denpexd.log", env=env)
    stack.procs["denpexd"] = proc
    proc.start()
    stack.daemon_url = f"http://127.0.0.1:{http_port}"
    _wait("denpexd ready", lambda: _http_text(f"{stack.daemon_url}/-/ready"), 30, stack.logs)


async def _publish_garbage(port: int, job: str) -> None:
    async with aiomqtt.Client("127.0.0.1", port, identifier=f"garbage-{job}"[:64]) as client:
        await client.publish(f"denpex/v1/jobs/{job}/events", b"not json", qos=1)


def _feed(stack: Stack) -> None:
    """The corpus job, one payload the daemon must reject, and a SIGHUP reload."""
    events = load_case(CASE, stack.job, load_rules())
    asyncio.run(replay(events, stack.job, port=stack.mqtt_port, v5=False, speed=20.0))
    asyncio.run(_publish_garbage(stack.mqtt_port, stack.job))
    stack.events = len(events)
    daemon = stack.procs["denpexd"].popen
    assert daemon is not None
    daemon.send_signal(signal.SIGHUP)

    def done() -> bool:
        doc = _http_json(f"{stack.daemon_url}/api/v1/jobs/{stack.job}")
        return bool(doc["stats"]["events"] >= stack.events and doc.get("verdict") == "failed")

    _wait(f"job {stack.job} diagnosed", done, 30, stack.logs)


def _start_prometheus(stack: Stack) -> None:
    binary = _which("prometheus")
    if binary is None:
        return
    port = free_port()
    text = (DEPLOY / "prometheus" / "prometheus.example.yml").read_text()
    daemon_target = stack.daemon_url.removeprefix("http://")
    subs = [
        (r"scrape_interval: 15s", "scrape_interval: 1s"),
        (r"evaluation_interval: 15s", "evaluation_interval: 1s"),
        (r"(?m)^  - denpex\.rules\.yml$", f"  - {DEPLOY / 'prometheus' / 'denpex.rules.yml'}"),
        (r'\["alertmanager\.example\.internal:9093"\]',
         json.dumps([stack.am_url.removeprefix("http://")] if stack.am_url else [])),
        (r'\["denpexd\.example\.internal:8080"\]', json.dumps([daemon_target])),
        (r'\["node01\.example\.internal:9101", "node02\.example\.internal:9101"\]', "[]"),
    ]  # fmt: skip
    for pattern, repl in subs:
        text, n = re.subn(pattern, lambda _m, r=repl: r, text)
        assert n >= 1, f"prometheus.example.yml no longer contains {pattern!r}"
    cfg = stack.tmp / "prometheus.yml"
    cfg.write_text(text)
    storage = stack.tmp / "prometheus-data"
    proc = Proc(
        "prometheus",
        [binary, f"--config.file={cfg}", f"--storage.tsdb.path={storage}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=info"],
        stack.tmp / "prometheus.log",
    )  # fmt: skip
    stack.procs["prometheus"] = proc
    proc.start()
    stack.prom_url = f"http://127.0.0.1:{port}"
    _wait("prometheus ready", lambda: _http_text(f"{stack.prom_url}/-/ready"), 30, stack.logs)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("deploy-stack"), job=f"llm-{CASE}-{uuid.uuid4().hex[:8]}")
    try:
        _start_alertmanager(s)
        _start_daemon(s)
        _feed(s)
        _start_prometheus(s)
        yield s
    finally:
        for proc in reversed(list(s.procs.values())):
            proc.stop()


def _need(url: str | None, tool: str, package: str) -> str:
    if url is None:
        pytest.skip(f"{tool} not installed (Debian package {package}; .ci/run installs it)")
    return url


def test_alertmanager_receives_denpexd_alert(stack: Stack) -> None:
    _need(stack.am_url, "alertmanager", "prometheus-alertmanager")

    def pushed() -> list[dict[str, Any]]:
        return [a for a in stack.am_alerts('alertname="DenpexJobFailed"') if a["labels"]["job"] == stack.job]

    alerts = _wait("DenpexJobFailed in Alertmanager", pushed, 20, stack.logs)
    assert len(alerts) == 1, alerts
    alert = alerts[0]
    labels = alert["labels"]
    assert {k: labels[k] for k in ("job", "rank", "node", "category", "role", "severity")} == {
        "job": stack.job,
        "rank": "3",
        "node": "node2",
        "category": "numerical-instability",
        "role": "initiator",
        "severity": "critical",
    }
    assert labels["rule"], labels
    assert alert["annotations"]["query"] == f"denpexd query --job {stack.job}"
    assert alert["status"]["state"] == "active"
    # Routed by job: the example routes llm-* jobs to the owning team.
    assert [r["name"] for r in alert["receivers"]] == ["team-llm"]


def test_alertmanager_inhibits_collateral_of_the_same_job(stack: Stack) -> None:
    am = _need(stack.am_url, "alertmanager", "prometheus-alertmanager")
    _wait(
        "initiator alert", lambda: stack.am_alerts(f'job="{stack.job}"', 'role="initiator"'), 20, stack.logs
    )
    other = f"llm-other-{uuid.uuid4().hex[:6]}"
    collateral = [
        {"labels": {"alertname": "TrainingRankError", "job": job, "rank": "1", "role": "collateral",
                    "severity": "critical"},
         "annotations": {"summary": "NCCL watchdog timeout on rank 1"}}
        for job in (stack.job, other)
    ]  # fmt: skip
    req = urllib.request.Request(
        f"{am}/api/v2/alerts",
        data=json.dumps(collateral).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 200

    def states() -> dict[str, dict[str, Any]] | None:
        got = {a["labels"]["job"]: a["status"] for a in stack.am_alerts('alertname="TrainingRankError"')}
        if got.get(stack.job, {}).get("state") == "suppressed" and other in got:
            return got
        return None

    got = _wait("collateral alert inhibited", states, 20, stack.logs)
    assert got[stack.job]["inhibitedBy"], got
    assert got[other]["state"] == "active", got  # no initiator for that job: not muted


def _referenced_metrics(dashboard: dict[str, Any]) -> dict[str, list[str]]:
    exprs: list[tuple[str, str]] = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            exprs.append((panel["title"], target["expr"]))
    for var in dashboard.get("templating", {}).get("list", []):
        q = var.get("query")
        if isinstance(q, dict):
            q = q.get("query")
        if isinstance(q, str) and var.get("type") == "query":
            exprs.append((f"variable {var['name']}", q))
    names: dict[str, list[str]] = {}
    for where, expr in exprs:
        for name in re.findall(r"\bdenpex_[A-Za-z0-9_:]+", expr):
            names.setdefault(name, []).append(where)
    return names


def _scraped_names(text: str) -> tuple[set[str], set[str]]:
    """(names with samples, names only declared by a `# TYPE` line: a labelled family whose
    label values have not occurred yet). A histogram's `_bucket/_sum/_count` count as its name."""
    sampled, declared = set(), set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            declared.add(name)
            if kind == "counter" and not name.endswith("_total"):
                declared.add(name + "_total")
        elif line and not line.startswith("#"):
            sampled.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    suffixes = ("_bucket", "_sum", "_count")
    sampled |= {n[: -len(s)] for n in sampled for s in suffixes if n.endswith(s)}
    return sampled, declared - sampled


def test_dashboard_queries_name_exported_metrics(stack: Stack) -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "denpex-dashboard.json").read_text())
    referenced = _referenced_metrics(dashboard)
    assert len(referenced) >= 15, sorted(referenced)
    sampled, declared = _scraped_names(_http_text(f"{stack.daemon_url}/metrics"))
    missing = {name: where for name, where in referenced.items() if name not in sampled | declared}
    assert not missing, f"dashboard queries name metrics denpexd does not export: {missing}"
    # Everything but a failed alert delivery and a slow rank (its gauge exists only for ranks
    # found slow) has occurred in this stack, so has real samples.
    unsampled = {name for name in referenced if name not in sampled}
    assert unsampled <= {"denpex_alerts_failed_total", "denpex_rank_slowness_ratio"}, unsampled
    # The panels the operators asked for are there.
    for needle in ("denpex_job_failed", "denpex_nan_fingerprint_stage", "denpex_ingest_events_total",
                   "denpex_ingest_lag_seconds_bucket", "denpex_clock_offset_seconds", "denpex_agents_connected"):  # fmt: skip
        assert needle in referenced, needle


def test_prometheus_scrapes_denpexd(stack: Stack) -> None:
    prom = _need(stack.prom_url, "prometheus", "prometheus")

    def query(q: str) -> list[dict[str, Any]]:
        doc = _http_json(f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": q}))
        assert doc["status"] == "success", doc
        return list(doc["data"]["result"])

    series = _wait("denpex_ series in Prometheus", lambda: query('{__name__=~"denpex_.+"}'), 30, stack.logs)
    names = {s["metric"]["__name__"] for s in series}
    assert {"denpex_jobs_open", "denpex_ingest_events_total", "denpex_agents_connected"} <= names, names
    # honor_labels keeps the training job's id in `job` (not exported_job).
    failed = _wait("denpex_job_failed of the job", lambda: query(f'denpex_job_failed{{job="{stack.job}"}}'), 15,
                   stack.logs)  # fmt: skip
    assert failed[0]["metric"]["initiator_rank"] == "3"
    assert failed[0]["value"][1] == "1"


def test_prometheus_rules_fire_and_alertmanager_inhibits_duplicates(stack: Stack) -> None:
    prom = _need(stack.prom_url, "prometheus", "prometheus")
    _need(stack.am_url, "alertmanager", "prometheus-alertmanager")

    def firing() -> dict[str, dict[str, Any]] | None:
        doc = _http_json(f"{prom}/api/v1/alerts")
        got = {a["labels"]["alertname"]: a for a in doc["data"]["alerts"]
               if a["labels"].get("job") == stack.job and a["state"] == "firing"}  # fmt: skip
        return got if {"DenpexNanFingerprintError", "DenpexJobDiagnosedFailed"} <= set(got) else None

    got = _wait("rule alerts firing in Prometheus", firing, 30, stack.logs)
    assert got["DenpexJobDiagnosedFailed"]["labels"]["rank"] == "3"
    assert got["DenpexJobDiagnosedFailed"]["labels"]["node"] == "node2"
    assert got["DenpexNanFingerprintError"]["annotations"]["runbook"] == f"denpexd query --job {stack.job}"

    def delivered() -> dict[str, dict[str, Any]] | None:
        alerts = {a["labels"]["alertname"]: a for a in stack.am_alerts(f'job="{stack.job}"')}
        want = {"DenpexNanFingerprintError", "DenpexJobDiagnosedFailed", "DenpexJobFailed"}
        return alerts if want <= set(alerts) else None

    alerts = _wait("rule alerts in Alertmanager", delivered, 30, stack.logs)
    # denpexd's own alert stays; the rule-based duplicate and the NaN symptom are muted.
    assert alerts["DenpexJobFailed"]["status"]["state"] == "active"
    assert alerts["DenpexJobDiagnosedFailed"]["status"]["state"] == "suppressed"
    assert alerts["DenpexNanFingerprintError"]["status"]["state"] == "suppressed"
