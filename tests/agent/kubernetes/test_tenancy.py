"""Kubernetes mode's tenant policy against an in-memory stand-in for the kube adapter's two reads
(the target pod, its Namespace's labels): which namespaces may get GPUs and the limit of a pod
without the ``max-gpus`` annotation, both failing closed. (On the real API server, with the
agent's own RBAC: tests/realnode/test_limits.py.)"""

from __future__ import annotations

from typing import Any

import pytest

from jupyter_gpu_hotplug._structs import PidTarget, PodTarget
from jupyter_gpu_hotplug.agent.core.errors import Forbidden, NotFound
from jupyter_gpu_hotplug.agent.core.seams import ContainerCgroups, ContainerKey, HostContainer
from jupyter_gpu_hotplug.agent.kubernetes.kube import KubeForbidden, KubeUnavailable
from jupyter_gpu_hotplug.agent.kubernetes.tenancy import TenantPolicy
from jupyter_gpu_hotplug.agent.settings import DEFAULT_NAMESPACE_SELECTOR, LabelSelector

MAX_GPUS = "gpu-hotplug.jupyter.org/max-gpus"


class Cluster:
    """What the API server would answer: pods and namespaces, and what it was asked."""

    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.namespaces: dict[str, dict[str, str]] = {}
        self.namespace_reads = 0
        self.failure: Exception | None = None

    def add(self, namespace: str, pod: str, annotations: dict[str, str] | None = None) -> None:
        self.pods[namespace, pod] = {"metadata": {"annotations": annotations or {}}}

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.pods.get((namespace, name))

    async def namespace_labels(self, name: str) -> dict[str, str] | None:
        self.namespace_reads += 1
        if self.failure is not None:
            raise self.failure
        return self.namespaces.get(name)


def _policy(
    cluster: Cluster,
    *,
    default: int = 1,
    names: tuple[str, ...] = (),
    selector: str = DEFAULT_NAMESPACE_SELECTOR,
) -> TenantPolicy:
    return TenantPolicy(
        cluster,  # type: ignore[arg-type]
        default_max_gpus=default,
        allowed_namespaces=names,
        selector=LabelSelector.parse(selector),
    )


def _container(namespace: str, pod: str, container: str = "notebook") -> HostContainer:
    return HostContainer(
        target=PodTarget(namespace, pod, container),
        key=ContainerKey("containerd://" + "a" * 64),
        pid=10,
        start_time=1,
        cgroups=ContainerCgroups(None, "/k"),
        label=f"pod {namespace}/{pod} (container {container})",
    )


@pytest.fixture
def cluster() -> Cluster:
    cluster = Cluster()
    cluster.namespaces = {
        "jhub": {"gpu-hotplug.jupyter.org/notebooks": "true"},
        "batch": {"team": "ml"},
        "plain": {},
    }
    for namespace in cluster.namespaces:
        cluster.add(namespace, "nb")
    return cluster


@pytest.mark.parametrize(
    ("namespace", "names", "selector", "allowed"),
    [
        ("jhub", (), DEFAULT_NAMESPACE_SELECTOR, True),
        ("plain", (), DEFAULT_NAMESPACE_SELECTOR, False),
        ("batch", (), DEFAULT_NAMESPACE_SELECTOR, False),
        ("batch", ("batch",), DEFAULT_NAMESPACE_SELECTOR, True),
        ("batch", (), "team=ml", True),
        ("batch", (), "team=ml,!legacy", True),
        ("batch", (), "team!=ml", False),
        ("plain", ("*",), "", True),
        # Unlike a Kubernetes selector, the empty one matches nothing: leaving the setting
        # empty never opens every namespace.
        ("jhub", (), "", False),
        ("gone", (), DEFAULT_NAMESPACE_SELECTOR, False),
    ],
)
async def test_the_namespace_allowlist(
    cluster: Cluster, namespace: str, names: tuple[str, ...], selector: str, allowed: bool
) -> None:
    cluster.add("gone", "nb")
    policy = _policy(cluster, names=names, selector=selector)
    if allowed:
        await policy.gpu_limit(_container(namespace, "nb"))
        return
    with pytest.raises(Forbidden) as caught:
        await policy.gpu_limit(_container(namespace, "nb"))
    message = caught.value.message
    assert f"namespace {namespace!r}" in message
    assert "--allowed-namespaces" in message and "--allowed-namespace-selector" in message
    if selector == DEFAULT_NAMESPACE_SELECTOR:
        expected = f"kubectl label namespace {namespace} gpu-hotplug.jupyter.org/notebooks=true"
        assert expected in message
    elif selector:
        assert f"labels that match {selector}" in message
    else:
        assert "--allowed-namespace-selector (none)" in message


async def test_a_namespace_allowed_by_name_is_not_read(cluster: Cluster) -> None:
    await _policy(cluster, names=("batch",)).gpu_limit(_container("batch", "nb"))
    await _policy(cluster, names=("*",)).gpu_limit(_container("plain", "nb"))
    assert cluster.namespace_reads == 0


@pytest.mark.parametrize(
    "failure",
    [KubeUnavailable("get namespace: 503", status=503), KubeForbidden("get namespace: 403")],
)
async def test_a_namespace_that_cannot_be_read_is_refused_retryably(
    cluster: Cluster, failure: Exception
) -> None:
    cluster.failure = failure
    with pytest.raises(Forbidden) as caught:
        await _policy(cluster).gpu_limit(_container("jhub", "nb"))
    assert caught.value.retryable
    assert "namespace jhub" in caught.value.message


@pytest.mark.parametrize(
    ("annotations", "default", "limit", "source"),
    [
        ({}, 1, 1, "--default-max-gpus"),
        ({}, 0, 0, "--default-max-gpus"),
        ({}, 4, 4, "--default-max-gpus"),
        ({MAX_GPUS: "3"}, 1, 3, MAX_GPUS),
        ({MAX_GPUS: "0"}, 4, 0, MAX_GPUS),
        # An annotation the agent cannot read allows nothing: fail closed.
        ({MAX_GPUS: "two"}, 4, 0, MAX_GPUS),
        ({MAX_GPUS: "-2"}, 4, 0, MAX_GPUS),
        ({MAX_GPUS: ""}, 4, 0, MAX_GPUS),
    ],
)
async def test_the_pods_limit(
    cluster: Cluster, annotations: dict[str, str], default: int, limit: int, source: str
) -> None:
    cluster.add("jhub", "nb", annotations)
    found = await _policy(cluster, default=default).gpu_limit(_container("jhub", "nb"))
    assert (found.count, source in found.source) == (limit, True)


async def test_the_limit_covers_every_container_of_the_pod_and_nothing_else(
    cluster: Cluster,
) -> None:
    cluster.add("jhub", "other")
    found = await _policy(cluster).gpu_limit(_container("jhub", "nb"))
    assert found.covers(PodTarget("jhub", "nb", "notebook"))
    assert found.covers(PodTarget("jhub", "nb", "sidecar"))
    assert not found.covers(PodTarget("jhub", "other", "notebook"))
    assert not found.covers(PodTarget("batch", "nb", "notebook"))
    assert not found.covers(PidTarget(10, 1))


async def test_a_pod_gone_since_it_was_resolved_is_not_found(cluster: Cluster) -> None:
    with pytest.raises(NotFound):
        await _policy(cluster).gpu_limit(_container("jhub", "vanished"))
