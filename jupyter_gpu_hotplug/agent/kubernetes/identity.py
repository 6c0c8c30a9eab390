"""Who is calling, and what may they act on: Kubernetes mode's ``Identity``.

Why it exists: the agent serves every pod of its node over the network, so the network cannot
say who a caller is; a token must. A notebook pod presents its **projected service-account
token with audience** ``gpu-hotplug`` (short-lived, rotated by the kubelet, bound to the pod).
The agent asks the API server to review it (``TokenReview`` with that audience, so a token
minted for anything else is refused); a bound token's user info carries the pod's name and uid
(``extra["authentication.kubernetes.io/pod-name"|"pod-uid"]``) and its namespace (the service
account's, ``system:serviceaccount:<ns>:<sa>``). That pod is the caller, and:

- it may act on **itself only**: the target pod's namespace, name *and uid* must match the
  token's (a pod re-created under the same name is another pod);
- anything else — another pod, or a caller that is not a pod (an operator's or the hub's
  token) — needs RBAC on the virtual subresource ``pods/gpus`` for the verb (``get``,
  ``create``, ``delete``), checked with a ``SubjectAccessReview`` for the reviewed user.

Two reads answer other callers (issue 31). ``/metrics`` and the OpenAPI document describe the
node, not a pod: their reader shows its ServiceAccount's ordinary token (reviewed for the API
server's own audiences, as Prometheus sends it to the kubelet's ``/metrics``) and needs RBAC
``get`` on that non-resource URL (``authenticate_reader``). ``/v1/gpus`` names the pod holding
a GPU only to that pod and to callers with ``get`` on ``pods/gpus`` in its namespace
(``may_see``); to other tenants the GPU is taken, by nobody named.

Reviews cost an API round trip, so their answers are cached for a few seconds (keyed by a hash
of the token; a review that failed is never cached). The pod's own GPU limit and the
namespace's quota are the allocator's business (it reads the target pod and creates holders).
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypeVar

from ..._structs import TOKEN_AUDIENCE, PodTarget, Target, TargetRef
from ..core.errors import Forbidden, InvalidRequest, Unauthenticated
from ..core.seams import Caller, ConnectionInfo, HostContainer, PeerCredentials, PodIdentity, Verb
from .kube import KubeApi, KubeError

__all__ = ["KubeCaller", "TokenIdentity"]

_POD_NAME: Final = "authentication.kubernetes.io/pod-name"
_POD_UID: Final = "authentication.kubernetes.io/pod-uid"
_SERVICE_ACCOUNT: Final = "system:serviceaccount:"
_BEARER: Final = "bearer "
_CACHE_SECONDS: Final = 10.0
_CACHE_MAX: Final = 4096

_K = TypeVar("_K")
_V = TypeVar("_V")

PodUidOf = Callable[[str, str], Any]
"""``(namespace, name) → awaitable uid or None``: the target pod's uid now."""


@dataclass(frozen=True)
class KubeCaller(Caller):
    """A caller authenticated by TokenReview; ``user`` is the review's user info (for
    SubjectAccessReviews on its behalf)."""

    user: Mapping[str, Any] = field(default_factory=dict)


def _first(extra: Mapping[str, Any], key: str) -> str | None:
    values = extra.get(key)
    if isinstance(values, list) and values and isinstance(values[0], str):
        return values[0]
    return None


def _bearer(authorization: str | None) -> str:
    """The token of an ``Authorization: Bearer`` header; ``Unauthenticated`` without one."""
    if not authorization or not authorization.lower().startswith(_BEARER):
        raise Unauthenticated("no bearer token")
    token = authorization[len(_BEARER) :].strip()
    if not token:
        raise Unauthenticated("an empty bearer token")
    return token


class _TtlCache(Generic[_K, _V]):
    """Answers kept for ``seconds``; bounded (expired entries go first, then everything)."""

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        self._items: dict[_K, tuple[float, _V]] = {}

    def get(self, key: _K) -> _V | None:
        item = self._items.get(key)
        if item is None or item[0] < time.monotonic():
            self._items.pop(key, None)
            return None
        return item[1]

    def put(self, key: _K, value: _V) -> None:
        if len(self._items) >= _CACHE_MAX:
            now = time.monotonic()
            self._items = {k: v for k, v in self._items.items() if v[0] >= now}
            if len(self._items) >= _CACHE_MAX:
                self._items.clear()
        self._items[key] = (time.monotonic() + self._seconds, value)


class TokenIdentity:
    """``Identity`` by TokenReview and SubjectAccessReview (see the module docstring)."""

    def __init__(
        self,
        kube: KubeApi,
        *,
        pod_uid: PodUidOf,
        audience: str = TOKEN_AUDIENCE,
        cache_seconds: float = _CACHE_SECONDS,
    ) -> None:
        self._kube = kube
        self._pod_uid = pod_uid
        self._audience = audience
        self._tokens: _TtlCache[bytes, KubeCaller] = _TtlCache(cache_seconds)
        self._access: _TtlCache[tuple[str, ...], tuple[bool, str]] = _TtlCache(cache_seconds)

    def bind_connection(self, *, peer: PeerCredentials | None, pidfd: int | None) -> ConnectionInfo:
        """Nothing to bind: in Kubernetes mode identity is the token's, on every transport."""
        return ConnectionInfo(transport="tcp" if peer is None else "unix", peer=peer)

    async def authenticate(
        self, *, authorization: str | None, connection: ConnectionInfo
    ) -> Caller:
        return await self._review(_bearer(authorization), self._audience, connection)

    async def authenticate_reader(
        self, *, authorization: str | None, connection: ConnectionInfo, path: str
    ) -> Caller:
        """A reader of the agent's own ``path`` shows the token of its ServiceAccount as its
        pod mounts it (the API server's audience: what Prometheus sends, as to the kubelet's
        ``/metrics``), and needs RBAC ``get`` on that non-resource URL."""
        caller = await self._review(_bearer(authorization), None, connection)
        user = caller.user
        key = (str(user.get("username")), str(user.get("uid")), "get", path)
        allowed, reason = await self._verdict(
            caller,
            key,
            functools.partial(self._kube.review_read, dict(user), path=path),
            f"get {path}",
        )
        if not allowed:
            raise Forbidden(
                f"{caller} may not get {path}" + (f" ({reason})" if reason else ""),
                hint=f"bind the reader to a ClusterRole with nonResourceURLs [{path}] and "
                "verbs [get] (k8s/monitoring/metrics-reader.yaml for /metrics)",
            )
        return caller

    async def _review(
        self, token: str, audience: str | None, connection: ConnectionInfo
    ) -> KubeCaller:
        """The caller ``token`` stands for, reviewed for ``audience`` (None: the API server's
        own audiences), from the cache when it was reviewed lately."""
        digest = hashlib.sha256(f"{audience or ''}\0{token}".encode()).digest()
        cached = self._tokens.get(digest)
        if cached is not None:
            return cached
        try:
            status = await self._kube.review_token(
                token, audiences=[] if audience is None else [audience]
            )
        except KubeError as e:
            raise Unauthenticated(
                f"the token could not be reviewed: {e}",
                hint="the Kubernetes API server did not answer the agent; try again",
                retryable=True,
            ) from e
        if not status.get("authenticated"):
            raise Unauthenticated(
                f"the token was not accepted: {status.get('error') or 'TokenReview refused it'}"
            )
        audiences = status.get("audiences")
        if (
            audience is not None
            and isinstance(audiences, list)
            and audiences
            and audience not in audiences
        ):
            raise Unauthenticated(f"the token is not meant for audience {audience!r}")
        caller = self._caller(status.get("user") or {}, connection)
        self._tokens.put(digest, caller)
        return caller

    async def _verdict(
        self,
        caller: Caller,
        key: tuple[str, ...],
        review: Callable[[], Awaitable[tuple[bool, str]]],
        what: str,
    ) -> tuple[bool, str]:
        """A SubjectAccessReview's (allowed, reason), from the cache when asked lately (a
        review that failed is never cached: ``Forbidden``, retryable)."""
        verdict = self._access.get(key)
        if verdict is not None:
            return verdict
        try:
            verdict = await review()
        except KubeError as e:
            raise Forbidden(
                f"could not check whether {caller} may {what}: {e}", retryable=True
            ) from e
        self._access.put(key, verdict)
        return verdict

    @staticmethod
    def _caller(user: Mapping[str, Any], connection: ConnectionInfo) -> KubeCaller:
        username = str(user.get("username") or "")
        extra = user.get("extra") or {}
        name, uid = _first(extra, _POD_NAME), _first(extra, _POD_UID)
        pod = None
        if name and uid and username.startswith(_SERVICE_ACCOUNT):
            namespace = username.removeprefix(_SERVICE_ACCOUNT).partition(":")[0]
            if namespace:
                pod = PodIdentity(namespace=namespace, name=name, uid=uid)
        description = f"pod {pod.namespace}/{pod.name}" if pod else f"user {username or '?'}"
        return KubeCaller(description=description, pod=pod, connection=connection, user=dict(user))

    async def authorize(self, caller: Caller, verb: Verb, target: HostContainer) -> None:
        pod_target = target.target
        if not isinstance(pod_target, PodTarget):
            raise Forbidden(f"{caller} may act on pods only")
        me = caller.pod
        if (
            me is not None
            and (me.namespace, me.name) == (pod_target.namespace, pod_target.name)
            and await self._pod_uid(pod_target.namespace, pod_target.name) == me.uid
        ):
            return
        allowed, reason = await self._may(caller, verb, pod_target.namespace, pod_target.name)
        if not allowed:
            raise Forbidden(
                f"{caller} may not {verb} GPUs of pod {pod_target.namespace}/{pod_target.name}"
                + (f" ({reason})" if reason else ""),
                hint="a pod may act on itself only; other callers need RBAC for the verb on "
                "the pods/gpus subresource",
            )

    async def _may(self, caller: Caller, verb: Verb, namespace: str, name: str) -> tuple[bool, str]:
        """Whether RBAC gives ``caller`` ``verb`` on ``pods/gpus`` of pod ``namespace/name``
        (``name`` empty: of every pod of the namespace)."""
        user = caller.user if isinstance(caller, KubeCaller) else {}
        key = (str(user.get("username")), str(user.get("uid")), verb, namespace, name)
        review = functools.partial(
            self._kube.review_access, dict(user), namespace=namespace, verb=verb, name=name
        )
        what = f"{verb} GPUs of pod {namespace}/{name}" if name else f"{verb} GPUs in {namespace}"
        return await self._verdict(caller, key, review, what)

    async def may_see(self, caller: Caller, target: Target) -> bool:
        """A pod sees its own pod's attachments; anyone else needs ``get`` on ``pods/gpus`` of
        the target's namespace (an operator's or a hub's grant): other tenants learn that a
        GPU is taken, not by whom."""
        if not isinstance(target, PodTarget):
            return False
        me = caller.pod
        if me is not None and (me.namespace, me.name) == (target.namespace, target.name):
            return True
        try:
            allowed, _ = await self._may(caller, "get", target.namespace, "")
        except Forbidden:
            return False  # the review failed: name nobody
        return allowed

    def self_target(self, caller: Caller) -> TargetRef:
        if caller.pod is None:
            raise InvalidRequest(
                f"{caller} is not a pod: give the target pod",
                field="target",
                hint='add "target": {"pod": {"namespace": ..., "name": ...}} (or ?pod=NS/NAME)',
            )
        return PodTarget(caller.pod.namespace, caller.pod.name)
