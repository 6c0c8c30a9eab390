"""The production node beside the host's node, in one run: the VM worker's join (boot → Ready
with its GPUs), then click → usable and detach through each node's own deployed agent,
alternating between the nodes.

Run as root, after ``bash tests/realnode/build.sh`` and with the VM tier's tools
(``bash .ci/setup --with-vm``)::

    .venv/bin/python benchmarks/bench_production_node.py [--runs 20]

The agent is the shipped DaemonSet on both nodes (``deployment.deployed_agent``). Each attach
is ``POST /v1/attachments {"count": 1}`` with the notebook pod's bound token, sent from this
process to that node's agent pod (the VM's pod subnet is routed over the tier's link), and its
``DELETE``: the same client path for both nodes, so the two columns differ only by the node.
The agent's own overhead is each attach minus its holder's create → Running as that agent
logged it. The VM node runs under qemu's software emulation (TCG), so its absolute times are
not a machine's: the ratio to the host node is the figure to read. Figures are printed, never
asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from _agent import holder_waits, percentile, summary, time_attach_detach

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jupyter_gpu_hotplug.agent.settings import TcpAddress
from tests.agent.api_harness import ApiClient
from tests.realnode.agent import AGENT_NAMESPACE, install_agent_account
from tests.realnode.cluster import Cluster
from tests.realnode.deployment import deployed_agent
from tests.realnode.node import new_node
from tests.realnode.vm_node import running_vm_node

AGENT_PORT = 8477
AGENT_SELECTOR = "app.kubernetes.io/name=gpu-hotplug-agent"


def _agent_on(cluster: Cluster, node: str) -> tuple[str, str]:
    """The agent pod on ``node``: its name and its pod IP."""
    (pod,) = [p for p in cluster.pods(AGENT_NAMESPACE, AGENT_SELECTOR)
              if p["spec"]["nodeName"] == node]  # fmt: skip
    return pod["metadata"]["name"], pod["status"]["podIP"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=20, help="attach/detach cycles per node")
    args = parser.parse_args()
    host = new_node()
    host.start()
    try:
        with running_vm_node(host) as vm, contextlib.closing(Cluster(host)) as cluster:
            print("--- the VM node's join: seconds from the start to each milestone ---")
            print(vm.timings)
            for line in vm.describe_nodes():
                print(line)
            install_agent_account(cluster)
            with deployed_agent(cluster, workers=[vm]):
                ns = cluster.namespace("bench-prod")
                clients = {}
                for node in (host.node_name, vm.name):
                    pod = f"nb-{'vm' if node == vm.name else 'host'}"
                    cluster.run_notebook_pod(ns, pod, node=node)
                    _, ip = _agent_on(cluster, node)
                    address = TcpAddress(ip, AGENT_PORT)
                    clients[node] = ApiClient(address, cluster.pod_token(ns, pod), timeout=120)
                times: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in clients}
                for _ in range(args.runs):  # alternating, one cycle on each node in turn
                    for node, client in clients.items():
                        attach, detach = time_attach_detach(client, 1)
                        times[node][0].extend(attach)
                        times[node][1].extend(detach)
                print(f"\n--- click -> usable and detach, {args.runs} cycles per node ---")
                for node, (attach, detach) in times.items():
                    name, _ = _agent_on(cluster, node)
                    log = cluster.kubectl("logs", "-n", AGENT_NAMESPACE, name, "-c", "agent")
                    waits = holder_waits(log, len(attach))
                    print(f"{node}: attach  {summary(attach)}")
                    print(f"{node}: detach  {summary(detach)}")
                    if len(waits) == len(attach):
                        overhead = [a - w for a, w in zip(attach, waits, strict=True)]
                        print(f"{node}: agent overhead (attach - holder wait)  {summary(overhead)}")
                    else:
                        print(f"{node}: {len(waits)} holder waits in the agent's log, no overhead")
                (h_attach, _), (v_attach, _) = times[host.node_name], times[vm.name]
                for q in (0.5, 0.99):
                    ratio = percentile(v_attach, q) / percentile(h_attach, q)
                    print(f"attach p{round(q * 100)}: VM node / host node = {ratio:.2f}x")
    finally:
        left = host.stop()
        if left:
            print(f"teardown removed by force: {left}")


if __name__ == "__main__":
    main()
