"""Kubernetes-mode attach latency, split into its parts, and 20 pods attaching at once.

Run as root on a host with cgroups and Debian's containerd/runc/busybox-static:

    .venv/bin/python benchmarks/bench_k8s_attach.py [--runs 30] [--pods 20] [--rounds 3]

There is no cluster here, so the control plane is the Kubernetes test tier's (``tests/k8s``):
a fake API server reached by the official client over HTTP, a kubelet simulator with 8 GPUs
that runs holder and notebook pods as real containerd/runc containers and serves PodResources
over gRPC, and the fake NVML with the same GPUs. The agent is the real one, a subprocess in
Kubernetes mode.

Part 1 times, for one notebook pod, ``POST /v1/attachments {"count": 1}`` and its ``DELETE``
with the pod's bound token (the whole path), and separately each part of an attach with the
very adapters the agent uses, called from this process: the TokenReview (what an uncached
token costs; the agent caches answers for 10 s), resolving the pod to its container (pod GET,
CRI ``ContainerStatus`` verbose, ``/proc``), a holder pod from create to Running (simulated
kubelet admission, real containerd sandbox and container) and its deletion, the PodResources
``Get``, one annotation written to the holder, and the grant of one GPU node by the engine
(``_attach_parts.py``, shared with ``bench_realnode.py``). It counts the writes to pods one
more attach and its detach make (each a round trip to etcd on a real cluster). The agent's
own overhead is each attach minus that attach's own holder create→Running (the agent logs
it): what the agent adds to the cluster's work.

The agent runs as ``python -m`` from the working directory: run this script from another
checkout, with ``PYTHONPATH`` set to it, to measure that commit's agent with this harness.

Part 2 starts ``--pods`` notebook pods (``--pods 0``: no part 2) and has each attach one GPU at
the same moment, over ``--rounds`` rounds (detaching everything between rounds): 8 succeed,
the others get 409 ``insufficient_gpus``; it checks that no GPU was handed out twice (in the
answers and in PodResources) and prints the latency distribution. Figures are printed, never
asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

from _agent import crowd_rounds, holder_waits, percentile, summary, time_attach_detach
from _attach_parts import attach_parts

# The tier's fixtures stand in for the cluster; they live with the tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jupyter_gpu_hotplug.agent.kubernetes.holders import HolderSpec
from jupyter_gpu_hotplug.agent.kubernetes.kube import KubeApi
from jupyter_gpu_hotplug.nvml.sim import write_config
from jupyter_gpu_hotplug.nvml.sim.build import ensure_fake_nvml
from jupyter_gpu_hotplug.nvml.sim.runtime import fake_nvml_environ
from tests.agent.agent_process import AgentProcess
from tests.agent.api_harness import ApiClient
from tests.k8s.agent import ensure_holder_priority_class, kubernetes_argv
from tests.k8s.apiserver.server import ApiServer
from tests.k8s.containerd import Containerd, start_containerd
from tests.k8s.inventory import nvml_config, whole_gpus
from tests.k8s.kube import FakeKube
from tests.k8s.kubelet import KubeletSimulator

NODE = "bench-node"
GPUS = 8
NS = "bench"


class Cluster:
    """containerd, the fake API server, the kubelet simulator and the agent, started in order."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.containerd: Containerd = start_containerd()
        self.server: ApiServer | None = None
        self.kubelet: KubeletSimulator | None = None
        self.agent: AgentProcess | None = None
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        directory = self.directory
        self.server = ApiServer()
        self.server.start()
        self.kube = FakeKube(self.server, directory)
        ensure_holder_priority_class(self.kube)
        gpus = whole_gpus(GPUS, NODE)
        kubelet = KubeletSimulator(
            self.kube,
            self.containerd,
            node_name=NODE,
            gpus=gpus,
            pod_resources_socket=directory / "kubelet.sock",
        )
        self.kubelet = kubelet
        kubelet.start()
        config_path = directory / "nvml.conf"
        write_config(config_path, nvml_config(gpus, NODE))
        library = ensure_fake_nvml(directory / "nvml-cache")
        agent = AgentProcess(
            state_dir=directory / "state",
            simulate=0,
            env=fake_nvml_environ(library, config_path),
        )
        agent.argv = kubernetes_argv(
            kube=self.kube,
            kubelet=kubelet,
            containerd=self.containerd,
            state_dir=agent.state_dir,
            socket_path=agent.socket_path,
            reconcile_interval=10,
        )
        self.agent = agent
        agent.start()

    def as_pod(self, name: str) -> ApiClient:
        assert self.agent is not None and self.agent.tcp is not None
        return self.agent.tcp.with_token(self.kube.pod_token(NS, name))

    @property
    def node(self) -> KubeletSimulator:
        assert self.kubelet is not None
        return self.kubelet

    def close(self) -> None:
        """Stop what was started, in reverse (also after a failed start)."""
        if self.agent is not None:
            self.agent.stop()
        if self.kubelet is not None:
            self.kubelet.stop()
        if self.server is not None:
            self.server.stop()
        left = self.containerd.stop()
        if left:
            print(f"containerd left behind: {left}")


def ms(seconds: float) -> str:
    return f"{seconds * 1000:8.2f} ms"


def part_one(cluster: Cluster, runs: int) -> None:
    kubelet = cluster.node
    notebook = kubelet.run_notebook_pod(NS, "solo")
    api = cluster.as_pod("solo")
    attach, detach = time_attach_detach(api, runs)
    assert cluster.agent is not None
    waits = holder_waits(cluster.agent.log(), runs)
    writes = holder_writes(cluster, api)
    gpus = kubelet.gpus
    parts = asyncio.run(
        attach_parts(
            kube=KubeApi(cluster.kube.client()),
            podresources_socket=kubelet.pod_resources_socket,
            cri_endpoint=cluster.containerd.endpoint,
            spec=HolderSpec(node_name=NODE),
            namespace=NS,
            notebook=notebook,
            token=cluster.kube.pod_token(NS, "solo"),
            minor_of=lambda ids: next(g.minor for g in gpus if g.id in ids),
            runs=runs,
        )
    )
    print(f"\n--- one pod, one GPU, {runs} runs ---------------------------------------------")
    print(f"holder writes: attach {writes[0]}, detach {writes[1]}")
    print(f"attach (HTTP, whole path)        {summary(attach)}")
    print(f"detach (HTTP, whole path)        {summary(detach)}")
    for name, samples in parts.items():
        print(f"  {name:30} {summary(samples)}")
    overhead = [total - wait for total, wait in zip(attach, waits, strict=True)]
    print(f"holder create -> Running, as the agent saw it  {summary(waits)}")
    print(f"agent overhead (attach - its holder wait)     {summary(overhead)}")
    running = statistics.median(parts["holder create -> Running"])
    print(f"(medians subtracted instead: {ms(statistics.median(attach) - running)}; noisier)")


def holder_writes(cluster: Cluster, api: ApiClient) -> tuple[str, str]:
    """The writes to pods (create, PATCH, delete) of one more attach and its detach, as the
    API server answered them: each is a round trip to etcd on a real cluster."""
    start = len(cluster.kube.requests)
    created = api.post("/v1/attachments", {"count": 1})
    assert created.status == 201, created.body
    attach = cluster.kube.pod_writes(NS, since=start)
    middle = len(cluster.kube.requests)
    assert api.delete(f"/v1/attachments/{created.json()['attachments'][0]['uuid']}").status == 204
    return " + ".join(attach), " + ".join(cluster.kube.pod_writes(NS, since=middle))


def part_two(cluster: Cluster, pods: int, rounds: int) -> None:
    names = [f"nb-{i:02d}" for i in range(pods)]
    for name in names:
        cluster.node.run_notebook_pod(NS, name)
    clients = {name: cluster.as_pod(name) for name in names}

    def assigned() -> list[str]:
        return [
            device
            for containers in cluster.node.assignments().values()
            for devices in containers.values()
            for device in devices
        ]

    crowd = crowd_rounds(clients, rounds, assigned)
    latencies = crowd.latencies
    print(f"\n--- {pods} pods attach one GPU each at once, {GPUS} GPUs, {rounds} rounds ----------")
    print(crowd.answers())
    print(f"latency (all answers)            {summary(latencies)}")
    print(
        f"p50 {ms(percentile(latencies, 0.5))}   p90 {ms(percentile(latencies, 0.9))}   "
        f"p99 {ms(percentile(latencies, 0.99))}   max {ms(max(latencies))}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--pods", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-k8s-", dir="/tmp") as tmp:
        cluster = Cluster(Path(tmp))
        try:
            part_one(cluster, args.runs)
            if args.pods:
                part_two(cluster, args.pods, args.rounds)
        finally:
            cluster.close()


if __name__ == "__main__":
    main()
