"""The agent's view of its node's pods (``NodePods``) through the API faults that a real API
server does not produce on demand — every watch stream ended at once (an apiserver restart or a
load balancer), a watch answered 410 Gone, a list answered 503 — injected by the tier's fake API
server. Whatever changed meanwhile, the view catches up by listing again: a holder created,
deleted or left alone while the agent was blind is seen as it is now."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from jupyter_gpu_hotplug.agent.kubernetes.kube import KubeApi
from jupyter_gpu_hotplug.agent.kubernetes.node_pods import NodePods

from ...k8s.apiserver.server import Failure
from ...k8s.kube import FakeKube

NS = "team"
NODE = "node-a"
WAIT = 30.0
"""Upper bound, in seconds, for the view to catch up (never asserted as a time)."""
PODS_URI = "/api/v1/pods?"
"""The node-wide list and watch of pods (``spec.nodeName`` field selector)."""


def _pod(name: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": NS},
        "spec": {"nodeName": NODE, "containers": [{"name": "c", "image": "pause"}]},
    }


@pytest.fixture
async def view(kube: FakeKube) -> AsyncIterator[NodePods]:
    kube.create_namespace(NS)
    api = KubeApi(kube.client())
    pods = NodePods(api, NODE)
    await pods.start()
    await watching(kube)
    try:
        yield pods
    finally:
        await pods.stop()
        api.close()


async def shows(pods: NodePods, names: set[str]) -> bool:
    """Whether the view comes to hold exactly ``names`` (in ``NS``) within ``WAIT``."""

    def exactly() -> bool | None:
        held = {p["metadata"]["name"] for p in pods.pods() if p["metadata"]["namespace"] == NS}
        return True if held == names else None

    return await pods.wait_for(exactly, deadline=time.monotonic() + WAIT) is not None


async def watching(kube: FakeKube) -> None:
    """Wait until the view's watch is open (``start`` returns after its first list)."""
    deadline = time.monotonic() + WAIT
    while kube.open_watches < 1:
        assert time.monotonic() < deadline, f"not within {WAIT} s: the view watches"
        await asyncio.sleep(0.05)


async def served(failure: Failure) -> None:
    """Wait until the injected failure has answered its requests."""
    deadline = time.monotonic() + WAIT
    while failure.times:
        assert time.monotonic() < deadline, f"not within {WAIT} s: {failure} served"
        await asyncio.sleep(0.05)


def pod_requests(kube: FakeKube, since: int) -> list[str]:
    """The node's pod requests served from index ``since`` on: ``list`` or ``watch``."""
    return [
        "watch" if "watch=" in uri else "list"
        for _, uri in kube.requests[since:]
        if PODS_URI in uri
    ]


async def test_a_change_made_while_every_watch_is_down_and_the_list_fails_is_seen(
    kube: FakeKube, view: NodePods
) -> None:
    kube.create_pod(NS, _pod("kept"))
    kube.create_pod(NS, _pod("gone"))
    assert await shows(view, {"kept", "gone"})
    down = kube.fail("GET", PODS_URI, 503)  # the first list after the restart fails too
    since = len(kube.requests)

    kube.end_watches()
    kube.delete_pod(NS, "gone", grace=0)
    kube.create_pod(NS, _pod("new"))

    assert await shows(view, {"kept", "new"})
    await served(down)
    # The list answered 503 is retried: the view is rebuilt by a fresh list.
    assert pod_requests(kube, since)[:2] == ["list", "list"]


async def test_a_watch_answered_410_gone_is_followed_by_a_fresh_list(
    kube: FakeKube, view: NodePods
) -> None:
    assert await shows(view, set())
    gone = kube.fail("GET", "watch=", 410, reason="Expired")
    since = len(kube.requests)

    kube.end_watches()  # the view lists, then watches again: that watch is answered 410
    await served(gone)
    kube.create_pod(NS, _pod("late"))

    assert await shows(view, {"late"})
    assert pod_requests(kube, since)[:3] == ["list", "watch", "list"]


async def test_a_view_of_named_namespaces_lists_and_watches_only_those(kube: FakeKube) -> None:
    """An agent whose RBAC grants pods in named namespaces only (the chart's
    ``rbac.namespaced``) must never ask for the pods of every namespace: one list and one
    watch per namespace, and nothing of another namespace in the view."""
    kube.create_namespace(NS)
    kube.create_namespace("elsewhere")
    kube.create_pod(NS, _pod("mine"))
    kube.create_pod("elsewhere", {**_pod("theirs"), "metadata": {"name": "theirs"}})
    api = KubeApi(kube.client())
    pods = NodePods(api, NODE, namespaces=[NS])
    since = len(kube.requests)
    await pods.start()
    try:
        await watching(kube)
        kube.create_pod(NS, _pod("later"))
        assert await shows(pods, {"mine", "later"})
        assert [p["metadata"]["namespace"] for p in pods.pods()] == [NS, NS]
        uris = [uri for _, uri in kube.requests[since:]]
        assert not [uri for uri in uris if PODS_URI in uri], uris
        assert any(uri.startswith(f"/api/v1/namespaces/{NS}/pods?") for uri in uris), uris
    finally:
        await pods.stop()
        api.close()


def test_a_view_of_no_namespace_is_refused(kube: FakeKube) -> None:
    api = KubeApi(kube.client())
    try:
        with pytest.raises(ValueError, match="at least one namespace"):
            NodePods(api, NODE, namespaces=[])
    finally:
        api.close()
