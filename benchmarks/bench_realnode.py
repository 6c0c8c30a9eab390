"""The real node: bring-up time, attach on a real kubelet split into its parts, the holder's
memory floor, and many pods attaching at once.

Run as root, after ``bash tests/realnode/build.sh`` (see ``docs/testing.md``)::

    .venv/bin/python benchmarks/bench_realnode.py [--bringups 2] [--runs 20] [--pods 20]
        [--rounds 3] [--floor] [--cpu 10m,100m,250m,none]

Part 0 starts and stops the node ``--bringups`` times (the first after a build is the cold
one: nothing of it is in the page cache) and prints the seconds to each milestone
(etcd healthy, apiserver ready, node Ready, GPUs allocatable from NVIDIA's device plugin).

Part 1 times, for one notebook pod, ``POST /v1/attachments {"count": 1}`` and its ``DELETE``
with the pod's bound token (the whole path: click → usable), and the agent's own overhead:
each attach minus that attach's holder create → Running as the agent logged it, i.e. what the
agent adds to the kubelet's pod start. It also times each step of an attach with the agent's
own adapters (``_attach_parts.py``, as ``bench_k8s_attach.py`` does on the simulated node),
and a holder-shaped pod from create to Running and to PodResources from this process.

Part 2 starts ``--pods`` notebook pods and has each attach one GPU at the same moment, over
``--rounds`` rounds, and checks that no GPU was handed out twice, in the answers and in the
real kubelet's PodResources.

``--cpu 10m,100m,250m,none`` starts holder-shaped pods at each CPU limit in turn and times
create -> Running (the limit is the pod's CFS quota, under which runc's init starts).

``--floor`` runs holder-shaped pods (the agent's own spec) with shrinking memory limits and
reports the smallest that the pause container and runc's init survive on this node.
Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _agent import crowd_rounds, holder_waits, percentile, summary, time_attach_detach
from _attach_parts import attach_parts

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jupyter_gpu_hotplug.agent.kubernetes.holders import HolderSpec
from jupyter_gpu_hotplug.agent.kubernetes.kube import KubeApi
from jupyter_gpu_hotplug.agent.settings import DEFAULT_HOLDER_CPU, DEFAULT_HOLDER_MEMORY
from tests.k8s.image import PAUSE_IMAGE
from tests.realnode.agent import install_agent_account, running_node_agent
from tests.realnode.cluster import Cluster, eventually
from tests.realnode.node import GPU_RESOURCE, new_node


def ms(seconds: float) -> str:
    return f"{seconds * 1000:8.1f} ms"


def part_zero(bringups: int) -> None:
    print(f"\n--- bring-up, {bringups} times (first = coldest) ---------------------------")
    for i in range(bringups):
        node = new_node()
        try:
            node.start()
            print(f"bring-up {i + 1}: {node.timings}")
        finally:
            left = node.stop()
            if left:
                print(f"  teardown removed by force: {left}")


def holder_shaped(name: str, memory: str, cpu: str | None = DEFAULT_HOLDER_CPU) -> dict[str, Any]:
    """A pod like the agent's holders (pause image, restricted security context, one GPU);
    ``cpu=None``: a request of the default and no CPU limit (Burstable)."""
    requests = {"cpu": cpu or DEFAULT_HOLDER_CPU, "memory": memory, GPU_RESOURCE: "1"}
    limits = {"memory": memory, GPU_RESOURCE: "1"} | ({} if cpu is None else {"cpu": cpu})
    return {
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Always",
            "automountServiceAccountToken": False,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 65535,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": "hold",
                    "image": PAUSE_IMAGE,
                    "imagePullPolicy": "Never",
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]},
                    },
                    "resources": {"limits": limits, "requests": requests},
                }
            ],
        },
    }


def part_one(cluster: Cluster, runs: int) -> None:
    ns = cluster.namespace("bench")
    cluster.run_notebook_pod(ns, "solo")
    account = install_agent_account(cluster)
    with running_node_agent(cluster, account) as agent:
        api = agent.as_pod(ns, "solo")
        attach, detach = time_attach_detach(api, runs)
        waits = holder_waits(agent.log(), runs)
    config = cluster.node.nvml_config
    assert config is not None
    parts = asyncio.run(
        attach_parts(
            kube=KubeApi(cluster.node.api_client()),
            podresources_socket=cluster.node.pod_resources_socket,
            cri_endpoint=cluster.node.cri_endpoint,
            spec=HolderSpec(node_name=cluster.node_name, image=PAUSE_IMAGE, pull_policy="Never"),
            namespace=ns,
            notebook=cluster.pod(ns, "solo"),
            token=cluster.pod_token(ns, "solo"),
            minor_of=lambda ids: next(g.minor for g in config.gpus if g.uuid in ids),
            runs=runs,
        )
    )
    running: list[float] = []
    podresources: list[float] = []
    for i in range(min(runs, 10)):
        name = f"shape-{i}"
        start = time.perf_counter()
        cluster.core.create_namespaced_pod(ns, holder_shaped(name, "32Mi"))
        cluster.wait_running(ns, name)
        running.append(time.perf_counter() - start)
        eventually(lambda n=name: (ns, n) in cluster.assignments(ns), "PodResources lists it")  # type: ignore[misc]
        podresources.append(time.perf_counter() - start)
        cluster.delete_pod(ns, name)
        eventually(lambda n=name: cluster.gone(ns, n), "the pod is gone")  # type: ignore[misc]
    print(f"\n--- one pod, one GPU, {runs} runs on the real node ----------------------")
    print(f"attach (HTTP, whole path: click -> usable)  {summary(attach)}")
    print(f"  p50 {ms(percentile(attach, 0.5))}  p99 {ms(percentile(attach, 0.99))}")
    print(f"detach (HTTP, whole path)                   {summary(detach)}")
    for name, samples in parts.items():
        print(f"  {name:42} {summary(samples)}")
    print(f"holder create -> Running, as the agent saw it  {summary(waits)}")
    overhead = [total - wait for total, wait in zip(attach, waits, strict=True)]
    print(f"agent overhead (attach - its holder wait)     {summary(overhead)}")
    print(f"holder-shaped pod create -> Running (here)     {summary(running)}")
    print(f"holder-shaped pod create -> in PodResources    {summary(podresources)}")
    print(
        f"(medians: attach {ms(statistics.median(attach))}, holder {ms(statistics.median(waits))})"
    )


def part_two(cluster: Cluster, pods: int, rounds: int) -> None:
    ns = cluster.namespace("crowd")
    names = [f"nb-{i:02d}" for i in range(pods)]
    for name in names:
        cluster.run_notebook_pod(ns, name)
    account = install_agent_account(cluster)
    with running_node_agent(cluster, account) as agent:
        clients = {name: agent.as_pod(ns, name) for name in names}
        crowd = crowd_rounds(
            clients,
            rounds,
            lambda: [d for ids in cluster.assignments(ns).values() for d in ids],
        )
    latencies = crowd.latencies
    print(
        f"\n--- {pods} pods attach one GPU each at once, {cluster.node.gpu_count} GPUs, "
        f"{rounds} rounds ---"
    )
    print(crowd.answers())
    print(f"latency (all answers)            {summary(latencies)}")
    print(f"p50 {ms(percentile(latencies, 0.5))}   p99 {ms(percentile(latencies, 0.99))}")


def cpu_limits(cluster: Cluster, cpus: list[str], runs: int) -> None:
    """Holder-shaped pods at each CPU limit, alternating, create -> Running: the limit is the
    pod's CFS quota, and runc's init starts the sandbox and the container under it."""
    ns = cluster.namespace("cpu")
    times: dict[str, list[float]] = {cpu: [] for cpu in cpus}
    for i in range(runs):
        for cpu in cpus:
            name = f"cpu-{cpu.lower()}-{i}"
            start = time.perf_counter()
            pod = holder_shaped(name, DEFAULT_HOLDER_MEMORY, None if cpu == "none" else cpu)
            cluster.core.create_namespaced_pod(ns, pod)
            cluster.wait_running(ns, name)
            times[cpu].append(time.perf_counter() - start)
            cluster.delete_pod(ns, name)
            eventually(lambda n=name: cluster.gone(ns, n), "the pod is gone")  # type: ignore[misc]
    print(f"\n--- holder start by CPU limit, {runs} runs each, alternating -----------------")
    for cpu, samples in times.items():
        print(f"  cpu limit {cpu:>5}: create -> Running {summary(samples)}")


def memory_floor(cluster: Cluster) -> None:
    ns = cluster.namespace("floor")
    print("\n--- holder memory floor (pause + runc init) --------------------------------")
    for memory in ("32Mi", "16Mi", "12Mi", "8Mi", "6Mi", "5Mi", "4Mi", "3Mi"):
        name = f"floor-{memory.lower()}"
        cluster.core.create_namespaced_pod(ns, holder_shaped(name, memory))
        deadline = time.monotonic() + 60
        outcome = "pending"
        while time.monotonic() < deadline:
            pod = cluster.pod(ns, name)
            statuses = pod["status"].get("containerStatuses") or []
            if statuses and "running" in (statuses[0].get("state") or {}):
                outcome = "Running"
                break
            waiting = [
                e
                for e in cluster.core.list_namespaced_event(ns).items
                if e.involved_object.name == name
                and e.type == "Warning"
                # Harmless here: no cluster DNS on this node; the not-ready taint of a node
                # just brought up (the scheduler retries once it is gone).
                and e.reason not in ("MissingClusterDNS", "FailedScheduling")
            ]
            if waiting:
                outcome = f"{waiting[-1].reason}: {(waiting[-1].message or '')[:120]}"
                break
            time.sleep(0.5)
        print(f"  limit {memory:>5}: {outcome}")
        cluster.delete_pod(ns, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bringups", type=int, default=2)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--pods", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--floor", action="store_true")
    parser.add_argument(
        "--cpu", default="", help="comma-separated holder CPU limits to compare ('none': no limit)"
    )
    parser.add_argument("--cpu-runs", type=int, default=5)
    args = parser.parse_args()
    part_zero(args.bringups)
    node = new_node()
    node.start()
    cluster = Cluster(node)
    try:
        if args.floor:
            memory_floor(cluster)
        if args.cpu:
            cpu_limits(cluster, args.cpu.split(","), args.cpu_runs)
        if args.runs:
            part_one(cluster, args.runs)
        if args.pods:
            part_two(cluster, args.pods, args.rounds)
    finally:
        cluster.close()
        left = node.stop()
        print(f"teardown: {left or 'clean'}")


if __name__ == "__main__":
    main()
