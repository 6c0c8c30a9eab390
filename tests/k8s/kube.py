"""``FakeKube``: the fake control plane as a test drives it — the URL and kubeconfig the
agent gets, the official client for the test, and the things a cluster admin would set up
(namespaces, tokens, RBAC-like rules, runtime and priority classes).

Every method may be called from any thread except the apiserver's own; each runs on the
apiserver's loop and returns plain JSON-like dicts (the objects as the API serves them).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import kubernetes.client

from .apiserver.resources import (
    NAMESPACES,
    PODS,
    PRIORITY_CLASSES,
    RUNTIME_CLASSES,
    SERVICE_ACCOUNTS,
)
from .apiserver.reviews import (
    CREDENTIAL_ID_KEY,
    DEFAULT_AUDIENCES,
    POD_NAME_KEY,
    POD_UID_KEY,
    AccessRule,
    BoundPod,
    Token,
)
from .apiserver.server import ApiServer, Failure

AGENT_USER: Final = "system:serviceaccount:gpu-hotplug:gpu-hotplug-agent"
"""Who the kubeconfig's token authenticates as (when ``authorize_callers`` is on)."""
AGENT_AUDIENCE: Final = "gpu-hotplug"
"""The audience the agent's TokenReview asks for (DESIGN.md)."""
_REASONS: Final = {429: "TooManyRequests", 500: "InternalError", 504: "Timeout"}
WAIT_DEADLINE: Final = 60.0
"""Seconds ``wait_for_pod`` waits on a loaded machine; never asserted."""


class FakeKube:
    """A running fake apiserver; ``url``, ``kubeconfig_path`` and ``client()`` reach it."""

    def __init__(self, server: ApiServer, directory: Path) -> None:
        self.server = server
        self.directory = directory
        self.admin_token = "k8stier-admin-" + secrets.token_hex(8)
        """Token of ``client()``: user ``kubernetes-admin`` in group ``system:masters``."""
        self.agent_token = "k8stier-agent-" + secrets.token_hex(8)
        """The token in ``kubeconfig_path``: service account ``AGENT_USER``."""
        self.add_token(
            self.admin_token,
            username="kubernetes-admin",
            groups=("system:masters", "system:authenticated"),
        )
        self.add_token(
            self.agent_token,
            username=AGENT_USER,
            groups=(
                "system:serviceaccounts",
                "system:serviceaccounts:gpu-hotplug",
                "system:authenticated",
            ),
        )
        self.kubeconfig_path = directory / "kubeconfig"
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "k8stier", "cluster": {"server": server.url}}],
            "users": [{"name": "agent", "user": {"token": self.agent_token}}],
            "contexts": [{"name": "k8stier", "context": {"cluster": "k8stier", "user": "agent"}}],
            "current-context": "k8stier",
        }
        self.kubeconfig_path.write_text(json.dumps(config, indent=1))

    @property
    def url(self) -> str:
        return self.server.url

    def client(self, token: str | None = None) -> kubernetes.client.ApiClient:
        """The official client for this server, as cluster admin unless given another
        ``token`` (the caller closes it)."""
        configuration = kubernetes.client.Configuration()
        configuration.host = self.url
        configuration.api_key = {"authorization": f"Bearer {token or self.admin_token}"}
        return kubernetes.client.ApiClient(configuration)

    def authorize_callers(self, enabled: bool = True) -> None:
        """From now on every resource request must carry a known bearer token (else 401)
        and be allowed by the rules (``allow``, ``grant``; else 403 with the apiserver's
        message) — to prove the agent needs no more than its RBAC. Off by default."""
        self.server.authorize_callers = enabled

    def grant(
        self,
        role: dict[str, Any],
        *,
        users: tuple[str, ...] = (),
        groups: tuple[str, ...] = (),
        namespaces: tuple[str, ...] | None = None,
    ) -> list[AccessRule]:
        """Bind a Role or ClusterRole object (as rendered from ``k8s/``) to users/groups,
        cluster-wide or in ``namespaces``: each of its rules becomes an ``allow``."""
        rules = []
        for rule in role.get("rules") or []:
            names = rule.get("resourceNames")
            rules.append(
                self.allow(
                    verbs=tuple(rule.get("verbs") or ()),
                    resources=tuple(rule.get("resources") or ()),
                    users=users,
                    groups=groups,
                    namespaces=namespaces,
                    names=tuple(names) if names else None,
                    api_groups=tuple(rule.get("apiGroups") or ()),
                )
            )
        return rules

    def call(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``function`` on the apiserver's loop (for direct access to ``cluster``)."""
        return self.server.call(function, *args, **kwargs)

    @property
    def requests(self) -> list[tuple[str, str]]:
        """(method, uri) of every request the server answered, in order."""
        return list(self.server.requests)

    def pod_writes(self, namespace: str, *, since: int = 0) -> list[str]:
        """The methods of the writes to pods of ``namespace`` (create, PATCH, delete) among the
        requests answered after the first ``since``: what an operation cost the API server
        (the agent's Events are written beside its operations, never awaited, and are not
        pods)."""
        return [
            method
            for method, uri in self.requests[since:]
            if method in ("POST", "PATCH", "PUT", "DELETE")
            and f"/namespaces/{namespace}/pods" in uri
        ]

    # ----- objects ----------------------------------------------------------------------

    def create_namespace(self, name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
        body = {"metadata": {"name": name, "labels": labels or {}}}
        return self.call(self.server.cluster.create, NAMESPACES, "", body)  # type: ignore[no-any-return]

    def create(self, resource: Any, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.call(self.server.cluster.create, resource, namespace, body)  # type: ignore[no-any-return]

    def create_pod(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        """Create a pod through the apiserver's admission (defaults, validation...)."""
        return self.create(PODS, namespace, body)

    def pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The pod as stored now, or ``None``."""
        return self.call(self.server.cluster.store.find, PODS, namespace, name)  # type: ignore[no-any-return]

    def pods(self, namespace: str = "") -> list[dict[str, Any]]:
        return self.call(self.server.cluster.store.list, PODS, namespace)  # type: ignore[no-any-return]

    def delete_pod(self, namespace: str, name: str, grace: int | None = None) -> dict[str, Any]:
        options = {} if grace is None else {"gracePeriodSeconds": grace}
        return self.call(self.server.cluster.delete, PODS, namespace, name, options)  # type: ignore[no-any-return]

    def wait_for_pod(
        self,
        namespace: str,
        name: str,
        condition: Callable[[dict[str, Any] | None], bool],
        what: str,
    ) -> dict[str, Any] | None:
        """Poll until ``condition(pod or None)``; returns that pod (see ``wait_for``)."""
        found: list[dict[str, Any] | None] = []

        def holds() -> bool:
            found[:] = [self.pod(namespace, name)]
            return condition(found[0])

        self.wait_for(holds, f"pod {namespace}/{name}: {what}")
        return found[0]

    def wait_for(self, condition: Callable[[], bool], what: str) -> None:
        """Poll ``condition`` until true; ``AssertionError`` after ``WAIT_DEADLINE`` seconds
        (an upper bound for a loaded machine, never a measurement)."""
        deadline = time.monotonic() + WAIT_DEADLINE
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting until {what}")
            time.sleep(0.02)

    def namespace(self, name: str) -> dict[str, Any] | None:
        """The namespace as stored now, or ``None``."""
        return self.call(self.server.cluster.store.find, NAMESPACES, "", name)  # type: ignore[no-any-return]

    def create_runtime_class(self, name: str, handler: str) -> dict[str, Any]:
        return self.create(RUNTIME_CLASSES, "", {"metadata": {"name": name}, "handler": handler})

    def create_priority_class(self, name: str, value: int) -> dict[str, Any]:
        return self.create(PRIORITY_CLASSES, "", {"metadata": {"name": name}, "value": value})

    # ----- identities -------------------------------------------------------------------

    def add_token(
        self,
        token: str,
        *,
        username: str,
        uid: str = "",
        groups: tuple[str, ...] = ("system:authenticated",),
        extra: dict[str, list[str]] | None = None,
        audiences: tuple[str, ...] = DEFAULT_AUDIENCES,
        pod: BoundPod | None = None,
        expires: float | None = None,
    ) -> Token:
        """Make ``token`` review as this user (see ``apiserver/reviews.py``)."""
        entry = Token(username, uid, groups, extra or {}, audiences, pod, expires)

        def register() -> None:
            self.server.cluster.reviews.tokens[token] = entry

        self.call(register)
        return entry

    def pod_token(
        self, namespace: str, name: str, *, audiences: tuple[str, ...] = (AGENT_AUDIENCE,)
    ) -> str:
        """A projected service-account token bound to the pod as it exists now: it reviews
        as ``system:serviceaccount:<ns>:<sa>`` with the pod's name and uid in ``extra``,
        and stops being valid when the pod is deleted or replaced."""
        pod = self.pod(namespace, name)
        if pod is None:
            raise LookupError(f"no pod {namespace}/{name}")
        account = pod["spec"].get("serviceAccountName", "default")
        sa = self.call(self.server.cluster.store.find, SERVICE_ACCOUNTS, namespace, account)
        token = "k8stier-pod-" + secrets.token_hex(12)
        self.add_token(
            token,
            username=f"system:serviceaccount:{namespace}:{account}",
            uid=sa["metadata"]["uid"] if sa else "",
            groups=(
                "system:serviceaccounts",
                f"system:serviceaccounts:{namespace}",
                "system:authenticated",
            ),
            extra={
                POD_NAME_KEY: [name],
                POD_UID_KEY: [pod["metadata"]["uid"]],
                CREDENTIAL_ID_KEY: [f"JTI={secrets.token_hex(8)}"],
            },
            audiences=audiences,
            pod=BoundPod(namespace, name, pod["metadata"]["uid"]),
        )
        return token

    def allow(
        self,
        *,
        verbs: tuple[str, ...],
        resources: tuple[str, ...],
        users: tuple[str, ...] = (),
        groups: tuple[str, ...] = (),
        namespaces: tuple[str, ...] | None = None,
        names: tuple[str, ...] | None = None,
        api_groups: tuple[str, ...] = ("",),
        paths: tuple[str, ...] = (),
    ) -> AccessRule:
        """Let ``users``/``groups`` do ``verbs`` on ``resources`` (``"pods/gpus"``) in
        ``namespaces`` (``None``: cluster-wide), or on the non-resource URLs ``paths``
        (``"/metrics"``) — what SubjectAccessReview answers from."""
        rule = AccessRule(
            verbs,
            resources,
            users,
            groups,
            api_groups,
            namespaces,
            names,
            description=f"k8stier rule {len(self.server.cluster.reviews.rules) + 1}",
            paths=paths,
        )
        self.call(self.server.cluster.reviews.rules.append, rule)
        return rule

    @property
    def token_reviews(self) -> int:
        """TokenReviews answered so far."""
        return self.server.cluster.reviews.token_reviews

    @property
    def access_reviews(self) -> int:
        """SubjectAccessReviews answered so far."""
        return self.server.cluster.reviews.access_reviews

    def fail(
        self, method: str, uri_part: str, code: int = 503, *, times: int = 1, reason: str = ""
    ) -> Failure:
        """Answer the next ``times`` requests of ``method`` whose URI contains ``uri_part``
        with ``code`` (a Status body with the apiserver's reason for it) instead of
        serving them: an apiserver that is down, throttling (429) or failing (500)."""
        failure = Failure(method.upper(), uri_part, code, times)
        failure.reason = reason or _REASONS.get(code, failure.reason)
        self.call(self.server.failures.append, failure)
        return failure

    @property
    def open_watches(self) -> int:
        """Watch streams open now (e.g. to see that the agent watches instead of polling)."""
        return int(self.call(lambda: self.server.cluster.store.open_watches))

    def end_watches(self) -> None:
        """End every open watch stream now, as an apiserver restart or a load balancer
        does: clients must watch again from their last resourceVersion."""
        self.call(self.server.cluster.store.close_watches)

    def compact(self) -> None:
        """Drop the watch history: a watch from an older resourceVersion gets 410 Gone."""
        self.call(self.server.cluster.store.compact)
