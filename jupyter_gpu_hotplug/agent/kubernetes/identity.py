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

Reviews cost an API round trip, so their answers are cached for a few seconds (keyed by a hash
of the token; a review that failed is never cached). The pod's own GPU limit and the
namespace's quota are the allocator's business (it reads the target pod and creates holders).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypeVar

from ..._structs import TOKEN_AUDIENCE, PodTarget, TargetRef
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
        if not authorization or not authorization.lower().startswith(_BEARER):
            raise Unauthenticated("no bearer token")
        token = authorization[len(_BEARER) :].strip()
        if not token:
            raise Unauthenticated("an empty bearer token")
        digest = hashlib.sha256(token.encode()).digest()
        cached = self._tokens.get(digest)
        if cached is not None:
            return cached
        try:
            status = await self._kube.review_token(token, audiences=[self._audience])
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
        if isinstance(audiences, list) and audiences and self._audience not in audiences:
            raise Unauthenticated(f"the token is not meant for audience {self._audience!r}")
        caller = self._caller(status.get("user") or {}, connection)
        self._tokens.put(digest, caller)
        return caller

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
        user = caller.user if isinstance(caller, KubeCaller) else {}
        key = (
            str(user.get("username")),
            str(user.get("uid")),
            verb,
            pod_target.namespace,
            pod_target.name,
        )
        verdict = self._access.get(key)
        if verdict is None:
            try:
                allowed, reason = await self._kube.review_access(
                    dict(user), namespace=pod_target.namespace, verb=verb, name=pod_target.name
                )
            except KubeError as e:
                raise Forbidden(
                    f"could not check whether {caller} may {verb} GPUs of pod "
                    f"{pod_target.namespace}/{pod_target.name}: {e}",
                    retryable=True,
                ) from e
            verdict = (allowed, reason)
            self._access.put(key, verdict)
        allowed, reason = verdict
        if not allowed:
            raise Forbidden(
                f"{caller} may not {verb} GPUs of pod {pod_target.namespace}/{pod_target.name}"
                + (f" ({reason})" if reason else ""),
                hint="a pod may act on itself only; other callers need RBAC for the verb on "
                "the pods/gpus subresource",
            )

    def self_target(self, caller: Caller) -> TargetRef:
        if caller.pod is None:
            raise InvalidRequest(
                f"{caller} is not a pod: give the target pod",
                field="target",
                hint='add "target": {"pod": {"namespace": ..., "name": ...}} (or ?pod=NS/NAME)',
            )
        return PodTarget(caller.pod.namespace, caller.pod.name)
