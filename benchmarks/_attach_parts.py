"""Shared by the Kubernetes benchmarks: one attach taken apart, each step timed with the very
adapters the agent uses, called from the benchmark's process.

Not a benchmark itself. ``bench_k8s_attach.py`` (fake API server, kubelet simulator) and
``bench_realnode.py`` (the real node) run the same steps, so their rows compare: the
TokenReview, resolving the pod to its container (pod GET, CRI ``ContainerStatus`` verbose,
``/proc``), a holder pod from create to Running and from delete to gone, the PodResources
``Get``, one annotation written to the holder (what each of the agent's durable state changes
costs), and the grant of one GPU node by the engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from jupyter_gpu_hotplug._structs import NVIDIA_MAJOR, PodTarget, RequestId
from jupyter_gpu_hotplug.agent.core.injector import EngineInjector, gpu_node
from jupyter_gpu_hotplug.agent.kubernetes.cri import CriClient
from jupyter_gpu_hotplug.agent.kubernetes.holders import HolderSpec, holder_pod
from jupyter_gpu_hotplug.agent.kubernetes.kube import KubeApi
from jupyter_gpu_hotplug.agent.kubernetes.podresources import PodResourcesClient
from jupyter_gpu_hotplug.agent.kubernetes.resolver import PodResolver
from jupyter_gpu_hotplug.linux import cgroups
from jupyter_gpu_hotplug.linux.engine import HotplugEngine

PARTS = (
    "auth (TokenReview, uncached)",
    "resolve (pod GET + CRI + /proc)",
    "  of which CRI ContainerStatus",
    "holder create -> Running",
    "PodResources Get",
    "annotate the holder (one PATCH)",
    "grant (engine, one node)",
    "holder delete -> gone",
)


async def attach_parts(
    *,
    kube: KubeApi,
    podresources_socket: Path,
    cri_endpoint: str,
    spec: HolderSpec,
    namespace: str,
    notebook: dict[str, Any],
    token: str,
    minor_of: Callable[[list[str]], int],
    runs: int,
) -> dict[str, list[float]]:
    """``runs`` times each step of one attach to ``notebook``'s container ``notebook``;
    ``minor_of`` turns the holder's device ids (PodResources) into the GPU's minor. ``kube``
    is closed at the end."""
    podresources = PodResourcesClient(podresources_socket)
    cri = CriClient(cri_endpoint)
    hierarchies = cgroups.discover()
    resolver = PodResolver(
        kube=kube,
        cri=cri,
        node_name=spec.node_name,
        host_proc=Path("/proc"),
        hierarchies=hierarchies,
    )
    injector = EngineInjector(HotplugEngine(host_proc=Path("/proc"), hierarchies=hierarchies))
    parts: dict[str, list[float]] = {name: [] for name in PARTS}

    async def timed(name: str, call: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        start = time.perf_counter()
        result = await call(*args)
        parts[name].append(time.perf_counter() - start)
        return result

    pod = notebook["metadata"]["name"]
    try:
        target = PodTarget(namespace, pod, "notebook")
        container_id = notebook["status"]["containerStatuses"][0]["containerID"]
        for index in range(runs):
            await timed(
                "auth (TokenReview, uncached)",
                lambda: kube.review_token(token, audiences=["gpu-hotplug"]),
            )
            container = await timed(
                "resolve (pod GET + CRI + /proc)", asyncio.to_thread, resolver.resolve, target
            )
            await timed(
                "  of which CRI ContainerStatus",
                asyncio.to_thread,
                cri.container_status,
                container_id.partition("://")[2],
            )
            body = holder_pod(
                notebook,
                container="notebook",
                container_id=container_id,
                request_id=RequestId(f"bench-{index}"),
                index=0,
                spec=spec,
            )
            name = body["metadata"]["name"]
            start = time.perf_counter()
            await kube.create_pod(namespace, body)
            async for event in kube.watch_pods(namespace, deadline=time.monotonic() + 60):
                if event.object["metadata"]["name"] == name and (
                    event.object.get("status", {}).get("phase") == "Running"
                ):
                    break
            parts["holder create -> Running"].append(time.perf_counter() - start)
            devices = await timed(
                "PodResources Get", asyncio.to_thread, podresources.get, namespace, name
            )
            assert devices is not None
            await timed(
                "annotate the holder (one PATCH)",
                kube.annotate_pod,
                namespace,
                name,
                {"bench.gpu-hotplug.jupyter.org/run": str(index)},
            )
            node = gpu_node(minor_of(devices.device_ids(spec.resource_name)), major=NVIDIA_MAJOR)
            await timed(
                "grant (engine, one node)", asyncio.to_thread, injector.grant, container, [node]
            )
            await asyncio.to_thread(injector.revoke, container, [node], force=False)
            start = time.perf_counter()
            await kube.delete_pod(namespace, name)
            while await kube.get_pod(namespace, name) is not None:
                await asyncio.sleep(0.01)  # a benchmark's own wait, not product code
            parts["holder delete -> gone"].append(time.perf_counter() - start)
    finally:
        podresources.close()
        cri.close()
        kube.close()
    return parts
