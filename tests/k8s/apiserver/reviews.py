"""TokenReview and SubjectAccessReview answers from what the test registered.

Tokens: a test registers a token with the user it stands for and the audiences it is valid
for; a token bound to a pod (like a projected service account token) is valid only while that
pod exists with the same uid, and its user carries the pod's name and uid in ``extra`` under
the keys the real service account authenticator uses. An unknown, expired, wrong-audience or
orphaned token reviews as ``authenticated: false`` with an ``error``, never as an HTTP error.

Access rules work like RBAC rules bound to users or groups: verbs, API groups, resources
(``pods/gpus`` names a subresource), optional namespaces and resource names, or non-resource
URLs (``/metrics``); ``*`` matches anything. No rule allows → ``allowed: false``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from .errors import invalid

POD_NAME_KEY: Final = "authentication.kubernetes.io/pod-name"
POD_UID_KEY: Final = "authentication.kubernetes.io/pod-uid"
NODE_NAME_KEY: Final = "authentication.kubernetes.io/node-name"
CREDENTIAL_ID_KEY: Final = "authentication.kubernetes.io/credential-id"
DEFAULT_AUDIENCES: Final = ("https://kubernetes.default.svc.cluster.local",)
"""The apiserver's own audience: what a review without ``spec.audiences`` checks against."""


@dataclass(frozen=True)
class BoundPod:
    namespace: str
    name: str
    uid: str


@dataclass(frozen=True)
class Token:
    """What a token authenticates as."""

    username: str
    uid: str = ""
    groups: tuple[str, ...] = ("system:authenticated",)
    extra: dict[str, list[str]] = field(default_factory=dict)
    audiences: tuple[str, ...] = DEFAULT_AUDIENCES
    pod: BoundPod | None = None
    """Bound to this pod: invalid once the pod is gone or replaced (another uid)."""
    expires: float | None = None
    """``time.time()`` after which the token is rejected."""


@dataclass(frozen=True)
class AccessRule:
    """Allows ``verbs`` on ``resources`` to the listed users and groups."""

    verbs: tuple[str, ...]
    resources: tuple[str, ...]
    """``pods``, ``pods/gpus``, ``*``..."""
    users: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()
    api_groups: tuple[str, ...] = ("",)
    namespaces: tuple[str, ...] | None = None
    """``None``: every namespace (a ClusterRoleBinding); else a RoleBinding per namespace."""
    names: tuple[str, ...] | None = None
    """``None``: any object; else these resourceNames only."""
    description: str = "rule"
    paths: tuple[str, ...] = ()
    """Non-resource URLs (``/metrics``) the ``verbs`` are allowed on (a ClusterRole's
    ``nonResourceURLs``); they match ``nonResourceAttributes`` only."""

    def allows(self, spec: dict[str, Any]) -> bool:
        user, groups = spec.get("user", ""), set(spec.get("groups") or [])
        if user not in self.users and not groups & set(self.groups):
            return False
        url = spec.get("nonResourceAttributes")
        if url is not None:
            return _matches(self.verbs, url.get("verb", "")) and _matches(
                self.paths, url.get("path", "")
            )
        attrs = spec.get("resourceAttributes")
        if attrs is None:
            return False
        resource = attrs.get("resource", "")
        if attrs.get("subresource"):
            resource += "/" + attrs["subresource"]
        return (
            _matches(self.verbs, attrs.get("verb", ""))
            and _matches(self.resources, resource)
            and _matches(self.api_groups, attrs.get("group", ""))
            and (self.namespaces is None or attrs.get("namespace", "") in self.namespaces)
            and (self.names is None or attrs.get("name", "") in self.names)
        )


def _matches(allowed: Sequence[str], value: str) -> bool:
    return "*" in allowed or value in allowed


PodLookup = Callable[[str, str], dict[str, Any] | None]


class Reviews:
    def __init__(self) -> None:
        self.tokens: dict[str, Token] = {}
        self.rules: list[AccessRule] = [
            AccessRule(("*",), ("*",), groups=("system:masters",), api_groups=("*",),
                       description='ClusterRoleBinding "cluster-admin" of group system:masters'),
        ]  # fmt: skip
        self.token_reviews = 0
        self.access_reviews = 0
        """How many reviews were answered (a test of the agent's review cache reads them)."""

    def authenticate(
        self, presented: str, audiences: tuple[str, ...], find_pod: PodLookup
    ) -> tuple[Token | None, str]:
        """The token's user if it is valid for one of ``audiences``, else why not."""
        token = self.tokens.get(presented)
        if token is None:
            return None, "[invalid bearer token, token lookup failed]"
        if not set(token.audiences) & set(audiences):
            return None, "[invalid bearer token, token audiences is invalid]"
        if token.expires is not None and time.time() > token.expires:
            return None, "[invalid bearer token, service account token has expired]"
        if token.pod is not None and not _pod_alive(token.pod, find_pod):
            pod = f"{token.pod.namespace}/{token.pod.name}"
            return None, f"[invalid bearer token, pod {pod} not found or replaced]"
        return token, ""

    def token_review(self, body: dict[str, Any], find_pod: PodLookup) -> dict[str, Any]:
        self.token_reviews += 1
        spec = body.get("spec") or {}
        wanted = tuple(spec.get("audiences") or DEFAULT_AUDIENCES)
        token, error = self.authenticate(spec.get("token", ""), wanted, find_pod)
        if token is None:
            return _answer(body, {"authenticated": False, "user": {}, "error": error})
        user: dict[str, Any] = {"username": token.username, "groups": list(token.groups)}
        if token.uid:
            user["uid"] = token.uid
        if token.extra:
            user["extra"] = {k: list(v) for k, v in token.extra.items()}
        status = {
            "authenticated": True,
            "user": user,
            "audiences": [a for a in wanted if a in token.audiences],
        }
        return _answer(body, status)

    def allowed(self, token: Token, attributes: dict[str, str]) -> bool:
        """Whether the rules let ``token``'s user do what ``attributes`` describe (the
        ``resourceAttributes`` of a SubjectAccessReview)."""
        spec = {
            "user": token.username,
            "groups": list(token.groups),
            "resourceAttributes": attributes,
        }
        return any(rule.allows(spec) for rule in self.rules)

    def access_review(self, body: dict[str, Any]) -> dict[str, Any]:
        self.access_reviews += 1
        spec = body.get("spec") or {}
        if not spec.get("user") and not spec.get("groups"):
            raise invalid(
                "SubjectAccessReview",
                "",
                [
                    (
                        "spec.user",
                        'Invalid value: "": at least one of user or group must be specified',
                    )
                ],
            )
        if not spec.get("resourceAttributes") and not spec.get("nonResourceAttributes"):
            raise invalid(
                "SubjectAccessReview",
                "",
                [
                    (
                        "spec.resourceAttributes",
                        "Required value: exactly one of nonResourceAttributes or "
                        "resourceAttributes must be specified",
                    )
                ],
            )
        rule = next((r for r in self.rules if r.allows(spec)), None)
        status: dict[str, Any] = {"allowed": rule is not None}
        if rule is not None:
            status["reason"] = f"RBAC: allowed by {rule.description}"
        return _answer(body, status)


def _pod_alive(bound: BoundPod, find_pod: PodLookup) -> bool:
    pod = find_pod(bound.namespace, bound.name)
    return pod is not None and pod["metadata"]["uid"] == bound.uid


def _answer(body: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
    meta = dict(body.get("metadata") or {})
    meta["creationTimestamp"] = None
    return {
        "kind": body.get("kind"),
        "apiVersion": body.get("apiVersion"),
        "metadata": meta,
        "spec": body.get("spec") or {},
        "status": status,
    }
