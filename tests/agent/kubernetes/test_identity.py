"""Kubernetes mode's identity against an in-memory stand-in for the kube adapter's two review
calls: who the caller is, what it may act on, and the short cache of review answers. (The same
rules run end to end against the fake API server in tests/k8s.)"""

from __future__ import annotations

from typing import Any

import pytest

from jupyter_gpu_hotplug._structs import PodTarget
from jupyter_gpu_hotplug.agent.core.errors import Forbidden, InvalidRequest, Unauthenticated
from jupyter_gpu_hotplug.agent.core.seams import (
    ContainerCgroups,
    ContainerKey,
    HostContainer,
    PodIdentity,
)
from jupyter_gpu_hotplug.agent.kubernetes.identity import TokenIdentity
from jupyter_gpu_hotplug.agent.kubernetes.kube import KubeUnavailable
from jupyter_gpu_hotplug.agent.kubernetes.resolver import is_vm_handler

UID = "5b0e1f22-0000-4000-8000-000000000001"
POD_USER = {
    "username": "system:serviceaccount:team:default",
    "uid": "sa-uid",
    "groups": ["system:serviceaccounts"],
    "extra": {
        "authentication.kubernetes.io/pod-name": ["nb"],
        "authentication.kubernetes.io/pod-uid": [UID],
    },
}


class Reviews:
    """What the API server would answer, and how often it was asked."""

    def __init__(self) -> None:
        self.tokens: dict[str, dict[str, Any]] = {}
        self.allowed: set[tuple[str, str, str, str]] = set()
        self.readable: set[tuple[str, str]] = set()
        """(username, non-resource path) pairs RBAC allows ``get`` on."""
        self.token_reviews = 0
        self.access_reviews = 0
        self.audiences: list[list[str]] = []
        self.down = False
        self.access_down = False
        """SubjectAccessReview fails (``down``: TokenReview does)."""

    async def review_token(self, token: str, *, audiences: list[str]) -> dict[str, Any]:
        self.token_reviews += 1
        self.audiences.append(audiences)
        if self.down:
            raise KubeUnavailable("TokenReview: 503 unavailable", status=503)
        return self.tokens.get(token, {"authenticated": False, "error": "invalid bearer token"})

    async def review_access(
        self, user: dict[str, Any], *, namespace: str, verb: str, name: str
    ) -> tuple[bool, str]:
        self.access_reviews += 1
        if self.access_down:
            raise KubeUnavailable("SubjectAccessReview: 503 unavailable", status=503)
        return (user.get("username"), verb, namespace, name) in self.allowed, ""

    async def review_read(self, user: dict[str, Any], *, path: str) -> tuple[bool, str]:
        self.access_reviews += 1
        if self.access_down:
            raise KubeUnavailable("SubjectAccessReview: 503 unavailable", status=503)
        return (user.get("username"), path) in self.readable, "no RBAC rule allows it"


def _identity(reviews: Reviews, pod_uids: dict[tuple[str, str], str]) -> TokenIdentity:
    async def pod_uid(namespace: str, name: str) -> str | None:
        return pod_uids.get((namespace, name))

    return TokenIdentity(reviews, pod_uid=pod_uid)  # type: ignore[arg-type]


def _container(namespace: str, name: str) -> HostContainer:
    return HostContainer(
        target=PodTarget(namespace, name, "notebook"),
        key=ContainerKey("containerd://" + "a" * 64),
        pid=10,
        start_time=1,
        cgroups=ContainerCgroups(None, "/k"),
        label=f"pod {namespace}/{name}",
    )


async def test_a_bound_pod_token_names_the_pod_and_may_act_on_itself_only() -> None:
    reviews = Reviews()
    reviews.tokens["t"] = {"authenticated": True, "user": POD_USER, "audiences": ["gpu-hotplug"]}
    identity = _identity(reviews, {("team", "nb"): UID, ("team", "other"): "x"})
    connection = identity.bind_connection(peer=None, pidfd=None)

    caller = await identity.authenticate(authorization="Bearer t", connection=connection)
    again = await identity.authenticate(authorization="bearer t", connection=connection)

    assert caller.pod == PodIdentity("team", "nb", UID) and again == caller
    assert reviews.token_reviews == 1  # cached
    assert identity.self_target(caller) == PodTarget("team", "nb")
    await identity.authorize(caller, "create", _container("team", "nb"))
    assert reviews.access_reviews == 0
    with pytest.raises(Forbidden, match="may not delete GPUs of pod team/other"):
        await identity.authorize(caller, "delete", _container("team", "other"))


async def test_a_pod_recreated_under_the_same_name_is_another_pod() -> None:
    reviews = Reviews()
    reviews.tokens["t"] = {"authenticated": True, "user": POD_USER}
    identity = _identity(reviews, {("team", "nb"): "a-new-uid"})
    caller = await identity.authenticate(
        authorization="Bearer t", connection=identity.bind_connection(peer=None, pidfd=None)
    )
    with pytest.raises(Forbidden):
        await identity.authorize(caller, "get", _container("team", "nb"))
    assert reviews.access_reviews == 1


async def test_others_need_rbac_on_pods_gpus_and_answers_are_cached() -> None:
    reviews = Reviews()
    reviews.tokens["op"] = {"authenticated": True, "user": {"username": "alice"}}
    reviews.allowed.add(("alice", "create", "team", "nb"))
    identity = _identity(reviews, {("team", "nb"): UID})
    caller = await identity.authenticate(
        authorization="Bearer op", connection=identity.bind_connection(peer=None, pidfd=None)
    )
    assert caller.pod is None
    await identity.authorize(caller, "create", _container("team", "nb"))
    await identity.authorize(caller, "create", _container("team", "nb"))
    assert reviews.access_reviews == 1
    with pytest.raises(Forbidden):
        await identity.authorize(caller, "delete", _container("team", "nb"))
    with pytest.raises(InvalidRequest, match="not a pod"):
        identity.self_target(caller)


@pytest.mark.parametrize(
    ("authorization", "answer"),
    [
        (None, None),
        ("Basic abc", None),
        ("Bearer ", None),
        ("Bearer t", {"authenticated": False, "error": "expired"}),
        ("Bearer t", {"authenticated": True, "user": POD_USER, "audiences": ["kubernetes"]}),
    ],
)
async def test_refused_tokens_are_401(authorization: str | None, answer: Any) -> None:
    reviews = Reviews()
    if answer is not None:
        reviews.tokens["t"] = answer
    identity = _identity(reviews, {})
    with pytest.raises(Unauthenticated):
        await identity.authenticate(
            authorization=authorization,
            connection=identity.bind_connection(peer=None, pidfd=None),
        )


async def test_an_unreachable_api_server_is_a_retryable_401_and_is_not_cached() -> None:
    reviews = Reviews()
    reviews.tokens["t"] = {"authenticated": True, "user": POD_USER}
    reviews.down = True
    identity = _identity(reviews, {})
    connection = identity.bind_connection(peer=None, pidfd=None)
    with pytest.raises(Unauthenticated) as caught:
        await identity.authenticate(authorization="Bearer t", connection=connection)
    assert caught.value.retryable
    reviews.down = False
    assert (await identity.authenticate(authorization="Bearer t", connection=connection)).pod


PROMETHEUS = {"username": "system:serviceaccount:monitoring:prometheus", "uid": "p"}


async def test_a_reader_shows_its_api_server_token_and_needs_rbac_on_the_path() -> None:
    """``/metrics`` and the OpenAPI document (issue 31): the token Prometheus mounts (reviewed
    for the API server's own audiences: none given) and ``get`` on the non-resource URL."""
    reviews = Reviews()
    reviews.tokens["prom"] = {"authenticated": True, "user": PROMETHEUS}
    reviews.readable.add((PROMETHEUS["username"], "/metrics"))
    identity = _identity(reviews, {})
    connection = identity.bind_connection(peer=None, pidfd=None)

    for _ in range(2):
        caller = await identity.authenticate_reader(
            authorization="Bearer prom", connection=connection, path="/metrics"
        )
    assert caller.pod is None
    assert (reviews.audiences, reviews.token_reviews, reviews.access_reviews) == ([[]], 1, 1)
    with pytest.raises(Forbidden) as caught:
        await identity.authenticate_reader(
            authorization="Bearer prom", connection=connection, path="/v1/openapi.json"
        )
    assert "may not get /v1/openapi.json (no RBAC rule allows it)" in caught.value.message
    with pytest.raises(Unauthenticated):
        await identity.authenticate_reader(
            authorization=None, connection=connection, path="/metrics"
        )


async def test_a_reader_whose_access_review_fails_is_refused_retryably_and_not_cached() -> None:
    reviews = Reviews()
    reviews.tokens["prom"] = {"authenticated": True, "user": PROMETHEUS}
    reviews.readable.add((PROMETHEUS["username"], "/metrics"))
    identity = _identity(reviews, {})
    connection = identity.bind_connection(peer=None, pidfd=None)
    reviews.access_down = True
    with pytest.raises(Forbidden) as caught:
        await identity.authenticate_reader(
            authorization="Bearer prom", connection=connection, path="/metrics"
        )
    assert caught.value.retryable
    reviews.access_down = False
    await identity.authenticate_reader(
        authorization="Bearer prom", connection=connection, path="/metrics"
    )


async def test_who_may_see_whose_gpu() -> None:
    """``/v1/gpus`` names a pod to that pod, and to a caller with ``get`` on ``pods/gpus`` in
    its namespace (an operator); to other tenants a GPU is taken by nobody named."""
    reviews = Reviews()
    reviews.tokens["nb"] = {"authenticated": True, "user": POD_USER}
    reviews.tokens["op"] = {"authenticated": True, "user": {"username": "alice"}}
    reviews.allowed.add(("alice", "get", "team", ""))
    identity = _identity(reviews, {("team", "nb"): UID})
    connection = identity.bind_connection(peer=None, pidfd=None)
    pod = await identity.authenticate(authorization="Bearer nb", connection=connection)
    operator = await identity.authenticate(authorization="Bearer op", connection=connection)

    assert await identity.may_see(pod, PodTarget("team", "nb", "notebook"))
    assert not await identity.may_see(pod, PodTarget("other", "nb", "notebook"))
    assert not await identity.may_see(pod, PodTarget("team", "sibling", "notebook"))
    assert await identity.may_see(operator, PodTarget("team", "sibling", "notebook"))
    assert not await identity.may_see(operator, PodTarget("other", "x", "notebook"))
    reviews.access_down = True
    assert not await identity.may_see(pod, PodTarget("elsewhere", "x", "notebook"))


@pytest.mark.parametrize(
    ("handler", "vm"),
    [
        ("kata", True),
        ("kata-qemu", True),
        ("kata-fc", True),
        ("runsc", True),
        ("gvisor", True),
        ("runc", False),
        ("nvidia", False),
        ("crun", False),
    ],
)
def test_vm_runtime_handlers(handler: str, vm: bool) -> None:
    assert is_vm_handler(handler) is vm
