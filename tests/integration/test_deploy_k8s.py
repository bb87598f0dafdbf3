"""deploy/k8s: every manifest validated against the Kubernetes API schemas by the PyPI package
kubernetes-validate (strict: unknown fields are errors), plus the contract the issue asks for."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.integration]

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"

kv = pytest.importorskip(
    "kubernetes_validate",
    reason="kubernetes-validate not installed (pip install 'kubernetes-validate>=1.31'; see deploy/README.md)",
)
yaml = pytest.importorskip("yaml", reason="PyYAML not installed (a dependency of kubernetes-validate)")


def _docs() -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out[(doc["kind"], doc["metadata"]["name"] if "metadata" in doc else path.name)] = doc
    return out


def test_manifests_validate_strict() -> None:
    version = kv.latest_version()
    checked = 0
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            kv.validate(doc, version, strict=True)
            checked += 1
    print(f"kubernetes-validate {kv.__version__}: {checked} resources valid against Kubernetes {version}")
    assert checked >= 5
    # The validator is not a no-op: an unknown field in the same StatefulSet fails strictly.
    bad = yaml.safe_load((K8S / "denpexd-statefulset.yaml").read_text())
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, version, strict=True)


def test_kustomization_lists_existing_resources() -> None:
    # kustomize itself is not installed here; check what it would read.
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert k["kind"] == "Kustomization"
    for res in k["resources"]:
        assert (K8S / res).is_file(), res
    assert "training-job-example.yaml" not in k["resources"]


def _container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    for c in pod.get("containers", []) + pod.get("initContainers", []):
        if c["name"] == name:
            return dict(c)
    raise AssertionError(name)


def test_statefulset_service_and_probes() -> None:
    docs = _docs()
    sts = docs[("StatefulSet", "denpexd")]
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    pod = sts["spec"]["template"]["spec"]
    c = _container(pod, "denpexd")
    assert {"name": "data", "mountPath": "/var/lib/denpexd"} in c["volumeMounts"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/-/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/-/healthy"
    assert _container(pod, "validate")["command"][:2] == ["denpexd", "validate"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    svc = docs[("Service", "denpexd")]
    assert {p["port"] for p in svc["spec"]["ports"]} == {1883, 8080}
    cfg = docs[("ConfigMap", "denpexd-config")]["data"]["denpexd.toml"]
    assert 'data_dir = "/var/lib/denpexd"' in cfg


def test_training_job_sidecar() -> None:
    job = _docs()[("Job", "llm-pretrain-4711")]
    pod = job["spec"]["template"]["spec"]
    agent = _container(pod, "denpex-agent")
    assert agent["restartPolicy"] == "Always"  # native sidecar
    env = {e["name"]: e for e in agent["env"]}
    assert env["DENPEX_JOB"]["valueFrom"]["fieldRef"]["fieldPath"].startswith("metadata.labels[")
    assert env["DENPEX_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["DENPEX_AGENT_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    trainer = _container(pod, "trainer")
    logs = {m["name"] for m in trainer["volumeMounts"]} & {m["name"] for m in agent["volumeMounts"]}
    assert logs == {"train-logs"}
    assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == "train-logs")
    assert next(m for m in agent["volumeMounts"] if m["name"] == "train-logs")["readOnly"] is True
    res = agent["resources"]
    assert res["requests"] == {"cpu": "50m", "memory": "64Mi"}
    assert res["limits"]["memory"] == "256Mi"
    # The agent refuses unknown DENPEX_* variables: only agent keys here.
    from denpex_agent.config import KEYS

    assert {n.removeprefix("DENPEX_").lower() for n in env} <= KEYS


def test_the_daemon_config_needs_its_secrets_and_gets_them(tmp_path: Path) -> None:
    """The ConfigMap's listeners are reachable in the cluster: without denpexd-secrets the
    validate init container refuses it; both containers read that Secret (not optional), and the
    example agent reads its password from a Secret too."""
    import os
    import subprocess
    import sys

    docs = _docs()
    conf = tmp_path / "denpexd.toml"
    conf.write_text(docs[("ConfigMap", "denpexd-config")]["data"]["denpexd.toml"])

    def validate(extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DENPEX_")} | extra
        return subprocess.run(
            [sys.executable, "-m", "denpexd", "validate", "--config", str(conf)],
            capture_output=True, text=True, timeout=60, env=env,
        )  # fmt: skip

    # the cluster's keys are where the StatefulSet mounts the ConfigMap denpex-cluster-keys
    keys_path = tomllib.loads(conf.read_text())["agent_token_keys"]
    pod = docs[("StatefulSet", "denpexd")]["spec"]["template"]["spec"]
    for c in (_container(pod, "validate"), _container(pod, "denpexd")):
        assert c["envFrom"] == [{"secretRef": {"name": "denpexd-secrets"}}], c["name"]
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert keys_path == f"{mounts['cluster-keys']}/jwks.json", c["name"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["cluster-keys"]["configMap"]["name"] == "denpex-cluster-keys"

    missing = validate({"DENPEX_API_TOKEN": "t" * 32})  # no key set at that path here
    assert missing.returncode == 2 and "agent_token_keys" in missing.stderr, missing.stderr
    from tests.unit.test_pod_identity import Cluster

    jwks = {"DENPEX_AGENT_TOKEN_KEYS": Cluster().jwks(tmp_path)}
    refused = validate(jwks)
    assert refused.returncode == 2 and "http_listen" in refused.stderr, refused.stderr
    assert validate(jwks | {"DENPEX_API_TOKEN": "t" * 32}).returncode == 0
    # the example agent logs in with its pod's projected token, for the daemon's audience
    job = docs[("Job", "llm-pretrain-4711")]["spec"]["template"]["spec"]
    agent = _container(job, "denpex-agent")
    env = {e["name"]: e for e in agent["env"]}
    token_file = env["DENPEX_PASSWORD_FILE"]["value"]
    assert "DENPEX_PASSWORD" not in env
    mount = next(m for m in agent["volumeMounts"] if token_file.startswith(m["mountPath"] + "/"))
    source = next(v for v in job["volumes"] if v["name"] == mount["name"])["projected"]["sources"][0]
    token = source["serviceAccountToken"]
    assert token_file == f"{mount['mountPath']}/{token['path']}"
    assert token["audience"] == tomllib.loads(conf.read_text())["agent_token_audience"]
