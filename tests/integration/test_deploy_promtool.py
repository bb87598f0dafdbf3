"""deploy/prometheus and deploy/alertmanager checked by promtool and amtool (Debian packages
prometheus and prometheus-alertmanager), and every dashboard query parsed by promtool."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration]

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PROM = DEPLOY / "prometheus"


def _tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed (Debian package {package}; .ci/run installs it)")
    return path


def _run(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=cwd)


def test_promtool_check_rules() -> None:
    promtool = _tool("promtool", "prometheus")
    print(_run(promtool, "--version").stdout.splitlines()[0])
    run = _run(promtool, "check", "rules", str(PROM / "denpex.rules.yml"))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout


def test_promtool_test_rules() -> None:
    promtool = _tool("promtool", "prometheus")
    run = _run(promtool, "test", "rules", "denpex.rules.test.yml", cwd=PROM)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout


def test_every_rule_is_unit_tested_and_has_a_runbook() -> None:
    rules = (PROM / "denpex.rules.yml").read_text()
    tests = (PROM / "denpex.rules.test.yml").read_text()
    alerts = re.findall(r"^\s*- alert: (\S+)", rules, re.M)
    assert len(alerts) >= 5
    untested = [a for a in alerts if f"alertname: {a}" not in tests and a != "DenpexDown"]
    assert not untested, untested
    assert rules.count("runbook:") == len(alerts)
    assert "denpexd query --job {{ $labels.job }}" in rules


def test_promtool_check_config() -> None:
    """The file as shipped (its rule file is found next to it), checked from elsewhere."""
    promtool = _tool("promtool", "prometheus")
    text = (PROM / "prometheus.example.yml").read_text()
    assert "honor_labels: true" in text
    assert re.search(r"(?m)^rule_files:\n(?:#.*\n)*  - denpex\.rules\.yml$", text)
    run = _run(promtool, "check", "config", str(PROM / "prometheus.example.yml"), cwd=DEPLOY.parent)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout and "rule files found" in run.stdout


def test_dashboard_queries_parse(tmp_path: Path) -> None:
    """Every panel query, with the dashboard variables substituted, as a recording rule: promtool
    parses it with the real PromQL parser."""
    promtool = _tool("promtool", "prometheus")
    dash = json.loads((DEPLOY / "grafana" / "denpex-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert exprs
    lines = ["groups:", "  - name: dashboard", "    rules:"]
    for i, expr in enumerate(exprs):
        lines += [
            f"      - record: dashboard:query_{i}",
            f"        expr: {json.dumps(expr.replace('$job', '.*'))}",
        ]
    rules = tmp_path / "dashboard.rules.yml"
    rules.write_text("\n".join(lines) + "\n")
    run = _run(promtool, "check", "rules", str(rules))
    assert run.returncode == 0, run.stdout + run.stderr


def test_dashboard_structure() -> None:
    dash = json.loads((DEPLOY / "grafana" / "denpex-dashboard.json").read_text())
    panels = dash["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    titles = " | ".join(p["title"] for p in panels).lower()
    for want in (
        "jobs overview",
        "nan fingerprint",
        "events/s",
        "ingest lag",
        "clock offset",
        "agents connected",
    ):
        assert want in titles, want
    for p in panels:
        assert {"x", "y", "w", "h"} <= set(p["gridPos"])
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}" and t["expr"].strip()


def test_amtool_check_config() -> None:
    amtool = _tool("amtool", "prometheus-alertmanager")
    version = _run(amtool, "--version")
    print((version.stdout or version.stderr).strip().splitlines()[0])
    run = _run(amtool, "check-config", str(DEPLOY / "alertmanager" / "alertmanager.example.yml"))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout


@pytest.mark.parametrize(
    ("labels", "receiver"),
    [
        (["job=llm-pretrain-4711", "role=initiator", "severity=critical"], "team-llm"),
        (["job=vision-42", "role=collateral"], "ml-platform"),
        (["job=denpexd", "component=denpexd", "alertname=DenpexIngestLag"], "denpex-operators"),
    ],
)
def test_amtool_routes(labels: list[str], receiver: str) -> None:
    amtool = _tool("amtool", "prometheus-alertmanager")
    cfg = str(DEPLOY / "alertmanager" / "alertmanager.example.yml")
    run = _run(amtool, "config", "routes", "test", f"--config.file={cfg}", *labels)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip() == receiver


def test_inhibition_rule_for_collateral() -> None:
    text = (DEPLOY / "alertmanager" / "alertmanager.example.yml").read_text()
    assert re.search(
        r'- source_matchers:\s*\n\s*- role="initiator"\s*\n\s*target_matchers:\s*\n\s*- role="collateral"\s*\n'
        r'\s*equal: \["job"\]',
        text,
    )
