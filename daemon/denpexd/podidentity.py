"""Kubernetes pods as broker identities: a service-account token names the pod and its node.

On Kubernetes an agent's name and node are known only once its pod exists, so no password can
be made for it in advance, and one password shared by every agent lets each connect under any
name. But the cluster already attests every pod: a projected service-account token (a JWT the
kubelet writes into the pod, for an audience the pod spec names) is signed by the cluster's
issuer and, since Kubernetes 1.30, carries the names of the pod and of the node it runs on
(`kubernetes.io.pod.name`, `kubernetes.io.node.name`). An agent presents it as its MQTT
password with its principal (``POD/NODE``, `wire.principal`) as user name; the embedded broker
checks the signature against the issuer's public keys (the cluster's JWKS, `kubectl get --raw
/openid/v1/jwks`), the audience, the expiry and the issuer, and grants the agent its own topics
only when the token's pod and node are the ones it claims. The daemon needs no access to the
Kubernetes API and holds no secret for this.

Any pod may ask for a token with this audience, but it is bound to that pod and its node: it
lets a pod speak for itself on its own node, nothing more.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jwt
import orjson

log = logging.getLogger(__name__)

# The issuer's signature algorithms Kubernetes uses (RSA by default, ECDSA when configured).
ALGORITHMS = ["RS256", "RS384", "RS512", "ES256", "ES384", "ES512", "PS256", "PS384", "PS512"]
LEEWAY_S = 30  # clock skew between the daemon and the cluster


class TokenKeysError(Exception):
    """The configured key set cannot be used (the daemon refuses to start)."""


def looks_like_jwt(password: str) -> bool:
    parts = password.split(".")
    return len(parts) == 3 and all(parts) and len(password) < 16_384


class PodTokens:
    """Verifies agents' service-account tokens against a cluster's public keys."""

    def __init__(self, keys_path: str, audience: str, issuer: str | None = None) -> None:
        self.keys_path, self.audience, self.issuer = keys_path, audience, issuer
        try:
            raw = Path(keys_path).read_bytes()
        except OSError as exc:
            raise TokenKeysError(f"cannot read {keys_path}: {exc.strerror or exc}") from exc
        try:
            doc = orjson.loads(raw)
            keys = jwt.PyJWKSet.from_dict(doc).keys
        except (ValueError, jwt.PyJWTError) as exc:
            raise TokenKeysError(
                f"{keys_path} is not a JSON Web Key Set (kubectl get --raw /openid/v1/jwks): {exc}"
            ) from exc
        usable = [k for k in keys if k.key_id]
        if not usable:
            raise TokenKeysError(f"{keys_path} holds no key with a key id (kid)")
        self._keys: dict[str, Any] = {str(k.key_id): k for k in usable}

    def verify(self, token: str, agent: str, node: str) -> str | None:
        """None when ``token`` is a valid token of pod ``agent`` on node ``node``; else why not."""
        try:
            kid = jwt.get_unverified_header(token).get("kid")
        except jwt.PyJWTError as exc:
            return f"not a token: {exc}"
        key = self._keys.get(kid) if isinstance(kid, str) else None
        if key is None:
            return f"signed with an unknown key (kid {str(kid)[:40]!r}; is {self.keys_path} the cluster's?)"
        try:
            claims = jwt.decode(
                token,
                key=key.key,
                algorithms=ALGORITHMS,
                audience=self.audience,
                issuer=self.issuer,
                leeway=LEEWAY_S,
                options={"require": ["exp", "aud", "sub"], "verify_iss": self.issuer is not None},
            )
        except jwt.PyJWTError as exc:
            return str(exc)
        k8s = claims.get("kubernetes.io")
        pod = k8s.get("pod") if isinstance(k8s, dict) else None
        pod_node = k8s.get("node") if isinstance(k8s, dict) else None
        if not isinstance(pod, dict) or not isinstance(pod.get("name"), str):
            return "the token is not bound to a pod (project it into the agent's pod)"
        if not isinstance(pod_node, dict) or not isinstance(pod_node.get("name"), str):
            return "the token names no node (Kubernetes 1.30 and later put it in pod-bound tokens)"
        if pod["name"] != agent or pod_node["name"] != node:
            return (
                f"the token is pod {pod['name'][:80]!r} on node {pod_node['name'][:80]!r}, "
                f"not {agent[:80]!r} on {node[:80]!r}"
            )
        return None
