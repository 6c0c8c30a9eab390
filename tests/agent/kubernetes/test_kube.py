"""The Kubernetes adapter over the real ``kubernetes`` client against the tier's fake API
server on a real HTTP port: plain-dict objects, client-side filtering, watch with a deadline,
reviews, runtime classes, events, and the error mapping."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from jupyter_gpu_hotplug.agent.kubernetes.kube import (
    KubeApi,
    KubeConflict,
    KubeForbidden,
    KubeInvalid,
    KubeNotFound,
    KubeUnavailable,
    api_error,
)

from ...k8s.kube import FakeKube


def _pod(name: str, *, node: str | None = "node-a", labels: dict[str, str] | None = None) -> Any:
    """A pod; with no node it is unscheduled, and a deletion removes it at once (a bound pod
    waits for its kubelet, which these tests do not run)."""
    spec: dict[str, Any] = {"containers": [{"name": "c", "image": "pause"}]}
    if node is not None:
        spec["nodeName"] = node
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "team", "labels": labels or {}},
        "spec": spec,
    }


@pytest.fixture
def api(kube: FakeKube) -> Iterator[KubeApi]:
    kube.create_namespace("team")
    client = KubeApi(kube.client())
    yield client
    client.close()


async def test_pods_round_trip_and_lists_filter_client_side(api: KubeApi) -> None:
    await api.create_pod("team", _pod("mine", labels={"holder": "true"}))
    await api.create_pod("team", _pod("elsewhere", node="node-b", labels={"holder": "true"}))
    await api.create_pod("team", _pod("unlabelled", node=None))
    pod = await api.get_pod("team", "mine")
    assert pod is not None
    assert pod["spec"]["nodeName"] == "node-a"
    pods, _ = await api.list_pods("team", labels={"holder": "true"}, node_name="node-a")
    assert [p["metadata"]["name"] for p in pods] == ["mine"]
    assert await api.get_pod("team", "nope") is None
    with pytest.raises(KubeConflict):
        await api.create_pod("team", _pod("mine"))
    assert await api.delete_pod("team", "unlabelled") is True
    assert await api.delete_pod("team", "unlabelled") is False


async def test_watch_streams_matching_events_and_ends_by_its_deadline(api: KubeApi) -> None:
    seen: list[tuple[str, str]] = []

    async def watch() -> None:
        async for event in api.watch_pods(
            "team", labels={"holder": "true"}, deadline=time.monotonic() + 1.5
        ):
            seen.append((event.type, event.object["metadata"]["name"]))

    task = asyncio.create_task(watch())
    await asyncio.sleep(0.3)
    await api.create_pod("team", _pod("other"))
    await api.create_pod("team", _pod("h1", node=None, labels={"holder": "true"}))
    await api.delete_pod("team", "h1")
    started = time.monotonic()
    await asyncio.wait_for(task, 10)
    assert time.monotonic() - started < 10  # ended by the deadline, not by the server
    assert seen == [("ADDED", "h1"), ("DELETED", "h1")]


async def test_reviews_runtime_classes_and_events(api: KubeApi, kube: FakeKube) -> None:
    pod = await api.create_pod("team", _pod("nb"))
    token = kube.pod_token("team", "nb")
    status = await api.review_token(token, audiences=["gpu-hotplug"])
    assert status["authenticated"] is True
    extra = status["user"]["extra"]
    assert extra["authentication.kubernetes.io/pod-name"] == ["nb"]
    refused = await api.review_token(token, audiences=["elsewhere"])
    assert not refused.get("authenticated")
    user = {"username": "operator", "groups": ["ops"]}
    assert (await api.review_access(user, namespace="team", verb="create", name="nb"))[0] is False
    kube.allow(verbs=("create",), resources=("pods/gpus",), groups=("ops",))
    assert (await api.review_access(user, namespace="team", verb="create", name="nb"))[0] is True
    kube.create_runtime_class("kata", "kata-qemu")
    assert await asyncio.to_thread(api.read_runtime_class_handler, "kata") == "kata-qemu"
    assert await asyncio.to_thread(api.read_runtime_class_handler, "none") is None
    await api.create_event(pod, reason="GpuAttached", message="attached GPU-1")
    annotated = await api.annotate_pod("team", "nb", {"a/b": "c"})
    assert annotated["metadata"]["annotations"]["a/b"] == "c"


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (404, KubeNotFound),
        (409, KubeConflict),
        (403, KubeForbidden),
        (422, KubeInvalid),
        (500, KubeUnavailable),
        (429, KubeUnavailable),
    ],
)
def test_api_exceptions_map_onto_our_hierarchy(status: int, kind: type[Exception]) -> None:
    error = ApiException(status=status, reason="Reason")
    error.body = json.dumps({"message": "exceeded quota: gpus", "reason": "Forbidden"})
    mapped = api_error(error, "create pod")
    assert type(mapped) is kind
    assert "exceeded quota: gpus" in str(mapped)


def test_transport_failures_are_unavailable() -> None:
    assert isinstance(api_error(ConnectionRefusedError(111, "refused"), "get"), KubeUnavailable)
