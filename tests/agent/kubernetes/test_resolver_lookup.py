"""``PodResolver.lookup``: "gone" and "cannot tell now" are two answers, not one.

Why: a waiting request asks whether its target still runs at every recheck, the reconciler and
the lost-holder revoke ask before they release, and the suspension recovery before it forgets.
A CRI call or a pod read that times out on a loaded node (the production VM node under
side-by-side attaches) once read as "gone": the waiting request answered 404 "the target exited
while it waited for GPUs" for a notebook that was running. Here the runtime is a real gRPC
client on a socket nobody serves (``UNAVAILABLE``), the API server a ``KubeApi`` whose reads
fail as the client's do.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from jupyter_gpu_hotplug._structs import PodTarget
from jupyter_gpu_hotplug.agent.core.errors import LookupFailed
from jupyter_gpu_hotplug.agent.core.seams import ContainerKey
from jupyter_gpu_hotplug.agent.kubernetes.cri import CriClient
from jupyter_gpu_hotplug.agent.kubernetes.kube import KubeApi, KubeError, KubeObject
from jupyter_gpu_hotplug.agent.kubernetes.resolver import PodResolver
from jupyter_gpu_hotplug.linux.cgroups import CgroupHierarchies

NODE = "node-a"
TARGET = PodTarget("team", "notebook", "notebook")
KEY = ContainerKey("containerd://" + "4c" * 32)


class Pods(KubeApi):
    """The API server's pods; ``failing`` makes every read fail as a timed-out request does."""

    def __init__(self, *pods: KubeObject) -> None:  # no client: reads answer from here
        self.pods = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in pods}
        self.failing = False

    def read_pod(self, namespace: str, name: str) -> KubeObject | None:
        if self.failing:
            raise KubeError(f"get pod {namespace}/{name}: timed out after 10 s")
        return self.pods.get((namespace, name))


def notebook(*, node: str = NODE) -> KubeObject:
    return {
        "metadata": {"namespace": TARGET.namespace, "name": TARGET.name},
        "spec": {"nodeName": node, "containers": [{"name": "notebook"}]},
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {"name": "notebook", "containerID": KEY, "state": {"running": {}}}
            ],
        },
    }


@pytest.fixture
def unanswered_runtime() -> Iterator[CriClient]:
    """A real CRI client whose runtime does not answer (its socket is served by nobody)."""
    with tempfile.TemporaryDirectory(prefix="cri-", dir="/tmp") as directory:
        client = CriClient(f"unix://{Path(directory) / 'cri.sock'}", timeout=1)
        try:
            yield client
        finally:
            client.close()


def resolver(kube: KubeApi, cri: CriClient) -> PodResolver:
    return PodResolver(
        kube=kube,
        cri=cri,
        node_name=NODE,
        host_proc=Path("/proc"),
        hierarchies=CgroupHierarchies(devices_v1=None, unified=None),
    )


def test_a_runtime_that_does_not_answer_is_not_an_exit(unanswered_runtime: CriClient) -> None:
    pods = resolver(Pods(notebook()), unanswered_runtime)
    with pytest.raises(LookupFailed, match="UNAVAILABLE"):
        pods.lookup(TARGET, KEY)
    with pytest.raises(LookupFailed):
        pods.current(TARGET, KEY)


def test_an_api_server_that_does_not_answer_is_not_an_exit(
    unanswered_runtime: CriClient,
) -> None:
    kube = Pods(notebook())
    kube.failing = True
    pods = resolver(kube, unanswered_runtime)
    with pytest.raises(LookupFailed, match=r"could not read pod team/notebook: .*timed out"):
        pods.lookup(TARGET, KEY)
    # An attach gets the same refusal it always got: 422, worth retrying.
    with pytest.raises(LookupFailed) as refused:
        pods.resolve(TARGET)
    assert (refused.value.status, refused.value.code, refused.value.retryable) == (
        422,
        "target_not_ready",
        True,
    )


@pytest.mark.parametrize(
    "gone",
    [
        pytest.param(Pods(), id="pod_deleted"),
        pytest.param(Pods(notebook(node="node-b")), id="pod_on_another_node"),
    ],
)
def test_what_is_known_gone_is_gone(gone: Pods, unanswered_runtime: CriClient) -> None:
    # Known from the API server alone: the runtime is never asked.
    assert resolver(gone, unanswered_runtime).lookup(TARGET, KEY) is None


def test_a_container_that_no_longer_runs_is_gone(unanswered_runtime: CriClient) -> None:
    stopped = notebook()
    stopped["status"]["containerStatuses"][0]["state"] = {"terminated": {"exitCode": 0}}
    assert resolver(Pods(stopped), unanswered_runtime).lookup(TARGET, KEY) is None
