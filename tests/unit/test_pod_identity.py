"""Service-account tokens as broker identities (`podidentity`, `brokeraccess.grant_for`).

The "cluster" here is a key pair made by the test, published as a JSON Web Key Set exactly as
`kubectl get --raw /openid/v1/jwks` prints it; tokens carry the claims kube-apiserver puts in a
projected, pod-bound token (Kubernetes 1.30 and later). Real signatures, real verification.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from pathlib import Path
from typing import Any

import jwt
import orjson
import pytest
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from denpexd.brokeraccess import AGENT, grant_for
from denpexd.podidentity import PodTokens, TokenKeysError

ISSUER = "https://kubernetes.default.svc.cluster.local"
AUDIENCE = "denpex"


def _seg(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _b64(n: int) -> str:
    raw = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


class Cluster:
    def __init__(self, kid: str = "k1") -> None:
        self.kid = kid
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        pub = self.key.public_key().public_numbers()
        self.jwk = {
            "use": "sig",
            "kty": "RSA",
            "kid": kid,
            "alg": "RS256",
            "n": _b64(pub.n),
            "e": _b64(pub.e),
        }

    def jwks(self, tmp_path: Path) -> str:
        path = tmp_path / f"jwks-{self.kid}.json"
        path.write_bytes(orjson.dumps({"keys": [self.jwk]}))
        return str(path)

    def token(self, pod: str, node: str | None, **over: Any) -> str:
        now = int(time.time())
        k8s: dict[str, Any] = {
            "namespace": "training",
            "pod": {"name": pod, "uid": "0b6a9c3e-0000-4000-8000-000000000001"},
            "serviceaccount": {"name": "default", "uid": "0b6a9c3e-0000-4000-8000-000000000002"},
        }
        if node is not None:
            k8s["node"] = {"name": node, "uid": "0b6a9c3e-0000-4000-8000-000000000003"}
        claims: dict[str, Any] = {
            "aud": [AUDIENCE], "exp": now + 3600, "iat": now, "nbf": now, "iss": ISSUER,
            "sub": "system:serviceaccount:training:default", "kubernetes.io": k8s,
        }  # fmt: skip
        claims.update(over)
        return jwt.encode(claims, self.key, algorithm="RS256", headers={"kid": self.kid})


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    return Cluster()


def _tokens(cluster: Cluster, tmp_path: Path, issuer: str | None = ISSUER) -> PodTokens:
    return PodTokens(cluster.jwks(tmp_path), AUDIENCE, issuer)


def test_a_pod_bound_token_grants_its_pod_on_its_node_only(cluster: Cluster, tmp_path: Path) -> None:
    tokens = _tokens(cluster, tmp_path)
    token = cluster.token("job-7-worker-0", "gpu-node-3")
    assert tokens.verify(token, "job-7-worker-0", "gpu-node-3") is None
    grant = grant_for(None, "x", "job-7-worker-0/gpu-node-3", token, tokens=tokens)
    assert grant is not None and (grant.role, grant.agent, grant.node) == (
        AGENT,
        "job-7-worker-0",
        "gpu-node-3",
    )
    # the same token under another node's or another pod's name is refused
    assert "not 'job-7-worker-0' on 'gpu-node-4'" in str(tokens.verify(token, "job-7-worker-0", "gpu-node-4"))
    assert grant_for(None, "x", "job-7-worker-0/gpu-node-4", token, tokens=tokens) is None
    assert grant_for(None, "x", "job-7-worker-1/gpu-node-3", token, tokens=tokens) is None


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"exp": int(time.time()) - 120}, "expired"),
        ({"aud": ["kubernetes"]}, "audience"),
        ({"iss": "https://elsewhere.example"}, "issuer"),
    ],
)
def test_expired_foreign_audience_or_issuer_is_refused(
    cluster: Cluster, tmp_path: Path, change: dict[str, Any], why: str
) -> None:
    tokens = _tokens(cluster, tmp_path)
    token = cluster.token("p", "n", **change)
    reason = tokens.verify(token, "p", "n")
    assert reason is not None and why in reason.lower()
    assert grant_for(None, "x", "p/n", token, tokens=tokens) is None


def test_a_token_without_a_node_claim_is_refused(cluster: Cluster, tmp_path: Path) -> None:
    reason = _tokens(cluster, tmp_path).verify(cluster.token("p", None), "p", "n")
    assert reason is not None and "names no node" in reason


def test_forged_signatures_are_refused(cluster: Cluster, tmp_path: Path) -> None:
    tokens = _tokens(cluster, tmp_path)
    other = Cluster(kid=cluster.kid)  # same key id, another key: a forger's
    assert "signature" in str(tokens.verify(other.token("p", "n"), "p", "n")).lower()
    stranger = Cluster(kid="k-unknown")
    assert "unknown key" in str(tokens.verify(stranger.token("p", "n"), "p", "n"))
    # alg=none, and HS256 keyed with the public key's text: never accepted
    claims = jwt.decode(cluster.token("p", "n"), options={"verify_signature": False})
    none = jwt.encode(claims, None, algorithm="none", headers={"kid": cluster.kid})
    assert tokens.verify(none, "p", "n") is not None
    head = _seg(orjson.dumps({"alg": "HS256", "typ": "JWT", "kid": cluster.kid}))
    body = _seg(orjson.dumps(claims))
    mac = hmac.new(orjson.dumps(cluster.jwk), f"{head}.{body}".encode(), hashlib.sha256).digest()
    assert tokens.verify(f"{head}.{body}.{_seg(mac)}", "p", "n") is not None
    # a tampered payload
    head, body, sig = cluster.token("p", "n").split(".")
    forged = orjson.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    forged["kubernetes.io"]["node"]["name"] = "other"
    body2 = base64.urlsafe_b64encode(orjson.dumps(forged)).rstrip(b"=").decode()
    assert tokens.verify(f"{head}.{body2}.{sig}", "p", "other") is not None


def test_ecdsa_clusters_work_too(tmp_path: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    jwk = orjson.loads(jwt.algorithms.ECAlgorithm.to_jwk(key.public_key()))
    jwk.update(kid="e1", use="sig", alg="ES256")
    path = tmp_path / "jwks.json"
    path.write_bytes(orjson.dumps({"keys": [jwk]}))
    now = int(time.time())
    token = jwt.encode(
        {"aud": AUDIENCE, "exp": now + 600, "sub": "s", "kubernetes.io": {"pod": {"name": "p"}, "node": {"name": "n"}}},
        key, algorithm="ES256", headers={"kid": "e1"},
    )  # fmt: skip
    assert PodTokens(str(path), AUDIENCE).verify(token, "p", "n") is None


def test_an_unusable_key_set_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TokenKeysError, match="cannot read"):
        PodTokens(str(tmp_path / "missing.json"), AUDIENCE)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TokenKeysError, match="not a JSON Web Key Set"):
        PodTokens(str(bad), AUDIENCE)
    nokid = tmp_path / "nokid.json"
    jwk = dict(Cluster().jwk)
    del jwk["kid"]
    nokid.write_bytes(orjson.dumps({"keys": [jwk]}))
    with pytest.raises(TokenKeysError, match="no key with a key id"):
        PodTokens(str(nokid), AUDIENCE)


def test_passwords_and_tokens_coexist(cluster: Cluster, tmp_path: Path) -> None:
    """With tokens configured, a secret-derived password still works, and a token is no
    password for the shared-password mode (nor the reverse)."""
    tokens = _tokens(cluster, tmp_path)
    from denpexd.brokeraccess import credential

    good = credential("s3cret", AGENT, "a1/n1")
    assert grant_for("s3cret", "x", "a1/n1", good, tokens=tokens) is not None
    assert grant_for(None, "x", "a1/n1", "shared", "shared", tokens=tokens) is not None
    assert grant_for(None, "x", "a1/n1", "not.a.token", tokens=tokens) is None
    assert grant_for(None, "x", "a1/n1", None, tokens=tokens) is None
