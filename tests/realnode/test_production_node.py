"""Kubernetes mode on the production node: a cgroup v2 + systemd worker (``vm_node.py``) joined
to the real cluster beside the host's cgroup v1 node — two nodes, one control plane.

What only this node shows: the kubelet's ``systemd`` cgroup driver (pods in
``kubepods*.slice``, containers in ``cri-containerd-<id>.scope``), the v2 device controller that
the agent drives through the unit's ``DeviceAllow=`` over D-Bus *from inside its pod* (the
DaemonSet's host-systemd mounts) as well as through eBPF, and a second node whose agent and
holders must never be confused with the first's. The agent is the shipped DaemonSet on both
nodes (``deployment.deployed_agent`` with the VM node as a worker).
"""

from __future__ import annotations

import concurrent.futures
import json
import shlex
import subprocess
from collections.abc import Callable, Iterator
from typing import Any, Final

import kubernetes.client as k8s
import pytest
from kubernetes.client.exceptions import ApiException

from jupyter_gpu_hotplug.agent.kubernetes.events import HOLDER_LOST, REVOKED
from jupyter_gpu_hotplug.nvml.sim import read_config

from ..fixtures.requirements import needs_root
from ..image.images import BUILD_TIMEOUT
from ..manifests.support import kubectl as kubectl_binary
from . import deployment
from .agent import AGENT_NAMESPACE, AgentAccount, api_as, holder_as_the_agent_builds_it
from .cluster import Cluster, eventually
from .node import GPU_RESOURCE
from .service_calls import (
    REQUEST_TIMEOUT,
    agent_call,
    attach_through_the_service,
    notebook_with_token,
)
from .vm_node import VM_GPUS, VmNode

pytestmark = [
    *needs_root,
    pytest.mark.realnode,
    pytest.mark.slow,
    # The first test's fixtures boot the VM node, build the agent's image and import it there
    # (under software emulation): minutes, not the suite's default five.
    pytest.mark.timeout(BUILD_TIMEOUT + 1800),
]

ENXIO: Final = "No such device or address"
HOLDER_WAIT: Final = 300
"""``wait_seconds`` of an attach on the VM node: a holder pod starts there in a minute or more
(one emulated vCPU), past the agent's default wait."""
EPERM: Final = "Operation not permitted"
LOSS_WAIT: Final = 300
"""How long a loss may take on the VM node: the DaemonSet's ``--lost-grace=30``, then the
revocation and the holder's end, each under emulation."""


@pytest.fixture(scope="module")
def agents(cluster: Cluster, vm_node: VmNode, agent_account: AgentAccount) -> Iterator[str]:
    """The agent's DaemonSet on both nodes; yields its Service's ClusterIP."""
    with deployment.deployed_agent(cluster, workers=[vm_node]) as service_ip:
        yield service_ip


def _notebook(cluster: Cluster, ns: str, name: str, node: str) -> dict[str, Any]:
    cluster.core.create_namespaced_pod(ns, notebook_with_token(name, node))
    return cluster.wait_running(ns, name)


def _scope(cluster: Cluster, ns: str, pod: str) -> str:
    """The systemd unit of the pod's notebook container on the VM node."""
    return f"cri-containerd-{cluster.container_id(ns, pod)}.scope"


def _device_allow_lines(vm: VmNode, unit: str) -> set[str]:
    """The unit's ``DeviceAllow=`` entries as systemd reports them, one per line."""
    shown = vm.run(f"systemctl show {shlex.quote(unit)} -p DeviceAllow")
    return {line for line in shown.splitlines() if line.startswith("DeviceAllow=")}


def _opens(cluster: Cluster, ns: str, pod: str, minor: int) -> str:
    """What opening a fresh node of the GPU in the container says: the cgroup alone decides
    (ENXIO: allowed, the simulated GPU has no driver; EPERM: denied)."""
    return cluster.open_fresh_node(ns, pod, minor)


def _attached_on_the_vm_node(
    cluster: Cluster, vm: VmNode, service_ip: str, prefix: str
) -> tuple[str, int]:
    """A notebook ``nb`` on the VM node, in a new namespace, with one GPU attached through
    the Service: the namespace and the GPU's minor."""
    ns = cluster.namespace(prefix)
    _notebook(cluster, ns, "nb", vm.name)
    answer = attach_through_the_service(cluster, ns, service_ip, wait_seconds=HOLDER_WAIT)
    (attachment,) = answer["attachments"]
    return ns, int(attachment["minor"])


def _detach(cluster: Cluster, ns: str, service_ip: str, pod: str = "nb") -> None:
    status, body = agent_call(cluster, ns, service_ip, "DELETE", pod=pod)
    assert status == 204, body


def test_two_nodes_ready_the_vm_node_runs_cgroup_v2_with_the_systemd_driver_and_fails_on_v1_by_default(  # noqa: E501
    cluster: Cluster, vm_node: VmNode
) -> None:
    nodes = json.loads(cluster.kubectl("get", "nodes", "-o", "json"))["items"]
    ready = {
        n["metadata"]["name"]: next(
            (c["status"] for c in n["status"].get("conditions", []) if c["type"] == "Ready"), None
        )
        for n in nodes
    }
    # (Other modules may leave a Node object without a kubelet: only these two are nodes.)
    assert (ready[cluster.node_name], ready[vm_node.name]) == ("True", "True"), ready
    config = vm_node.configz()
    assert config["cgroupDriver"] == "systemd"
    assert config["failCgroupV1"] is True  # the kubelet's default, not set by the tier
    assert vm_node.cgroup_fs() == "cgroup2fs"
    host_line, vm_line = vm_node.describe_nodes()
    built = cluster.node.components.versions
    containerd = built["CONTAINERD_VERSION"].lstrip("v")
    assert vm_line == (
        f"node {vm_node.name}: kubelet {built['KUBERNETES_VERSION']}, containerd {containerd}, "
        "cgroup v2, driver systemd"
    )
    assert host_line.endswith("cgroup v1, driver cgroupfs"), host_line
    # The VM's kubelet is system:node:<its name>: NodeRestriction lets it change its own Node
    # object only.
    as_vm_kubelet = vm_node.kubelet_kubeconfig_here()
    own = cluster.kubectl(f"--kubeconfig={as_vm_kubelet}", "label", "node", vm_node.name,
                          "jgh-test=own", "--overwrite", check=False)  # fmt: skip
    assert "labeled" in own, own
    other = cluster.kubectl(f"--kubeconfig={as_vm_kubelet}", "label", "node", cluster.node_name,
                            "jgh-test=other", "--overwrite", check=False)  # fmt: skip
    assert "forbidden" in other.lower(), other


def test_the_vm_nodes_gpus_are_its_own_and_a_gpu_pod_runs_in_a_systemd_scope(
    cluster: Cluster, vm_node: VmNode
) -> None:
    allocatable = cluster.node.kubectl_json("get", "node", vm_node.name)["status"]["allocatable"]
    assert allocatable[GPU_RESOURCE] == str(VM_GPUS)
    ns = cluster.namespace("vm-plugin")
    cluster.run_notebook_pod(
        ns, "gpu", resources={"limits": {GPU_RESOURCE: "1"}}, node=vm_node.name
    )
    env = cluster.exec(ns, "gpu", ["sh", "-c", "echo $NVIDIA_VISIBLE_DEVICES"]).stdout.strip()
    mine = {str(g.uuid) for g in vm_node.nvml_config.gpus}
    assert cluster.node.nvml_config_path is not None
    hosts = {str(g.uuid) for g in read_config(cluster.node.nvml_config_path).gpus}
    assert env in mine and env not in hosts, (env, mine)
    unit = _scope(cluster, ns, "gpu")
    group = vm_node.run(f"systemctl show {unit} -p ControlGroup --value").strip()
    assert group.startswith("/kubepods.slice/kubepods-besteffort.slice/"), group
    assert group.endswith(f"/{unit}")
    # The plugin's GPU back to the node: the tests after this one count the VM's free GPUs.
    cluster.delete_pod(ns, "gpu")
    eventually(lambda: cluster.gone(ns, "gpu"), "the plugin's GPU pod gone")


def test_production_node_attach_usable_in_the_notebook_eperm_elsewhere_detach_restores_device_allow(
    cluster: Cluster, vm_node: VmNode, agents: str
) -> None:
    ns = cluster.namespace("prod-attach")
    _notebook(cluster, ns, "nb", vm_node.name)
    _notebook(cluster, ns, "other", vm_node.name)
    unit = _scope(cluster, ns, "nb")
    before = _device_allow_lines(vm_node, unit)
    answer = attach_through_the_service(cluster, ns, agents, wait_seconds=HOLDER_WAIT)
    (attachment,) = answer["attachments"]
    minor = attachment["minor"]
    assert attachment["uuid"] in {str(g.uuid) for g in vm_node.nvml_config.gpus}
    (holder,) = cluster.holders(ns)
    assert holder["spec"]["nodeName"] == vm_node.name
    assert ENXIO in _opens(cluster, ns, "nb", minor)
    assert EPERM in _opens(cluster, ns, "other", minor)
    granted = _device_allow_lines(vm_node, unit) - before
    assert granted == {f"DeviceAllow=/dev/char/195:{minor} rw"}, granted
    _detach(cluster, ns, agents)
    assert EPERM in _opens(cluster, ns, "nb", minor)
    assert _device_allow_lines(vm_node, unit) == before
    eventually(lambda: cluster.holders(ns) == [], "the detach frees the GPU")


def test_production_node_daemon_reload_reexec_set_property_and_daemon_restarts_keep_the_gpu(
    cluster: Cluster, vm_node: VmNode, agents: str
) -> None:
    ns, minor = _attached_on_the_vm_node(cluster, vm_node, agents, "prod-systemd")
    (holder,) = cluster.holders(ns)
    unit = _scope(cluster, ns, "nb")
    pod_slice = vm_node.run(f"systemctl show {unit} -p Slice --value").strip()
    for step in (
        "systemctl daemon-reload && systemctl daemon-reload && systemctl daemon-reload",
        "systemctl daemon-reexec",
        f"systemctl set-property --runtime {pod_slice} CPUWeight=50",
        "systemctl restart jgh-containerd",
        "systemctl restart jgh-kubelet",
    ):
        vm_node.run(step)
        eventually(
            lambda: ENXIO in _opens(cluster, ns, "nb", minor), f"the GPU usable after `{step}`"
        )
    (still,) = cluster.holders(ns)
    assert still["metadata"]["uid"] == holder["metadata"]["uid"]
    _detach(cluster, ns, agents)
    assert EPERM in _opens(cluster, ns, "nb", minor)


def test_two_nodes_each_holder_lands_on_its_notebooks_node_and_a_full_node_refuses_or_queues(
    cluster: Cluster, vm_node: VmNode, agents: str
) -> None:
    """A notebook on a full node is refused (409) while the other node has free GPUs; asked to
    wait, it queues on its own node and gets the GPU a notebook there gives back."""
    ns = cluster.namespace("two-nodes")
    _notebook(cluster, ns, "on-host", cluster.node_name)
    for i in range(VM_GPUS):
        _notebook(cluster, ns, f"on-vm-{i}", vm_node.name)
    for pod in ("on-host", *(f"on-vm-{i}" for i in range(VM_GPUS))):
        attach_through_the_service(cluster, ns, agents, pod=pod, wait_seconds=HOLDER_WAIT)
    placed = {h["metadata"]["ownerReferences"][0]["name"]: h["spec"]["nodeName"]
              for h in cluster.holders(ns)}  # fmt: skip
    assert placed == {
        "on-host": cluster.node_name,
        **{f"on-vm-{i}": vm_node.name for i in range(VM_GPUS)},
    }
    # The VM node is full, the host has free GPUs: a fourth notebook there is refused, and
    # nothing of its is placed on the other node.
    _notebook(cluster, ns, "late", vm_node.name)
    refused = attach_through_the_service(cluster, ns, agents, pod="late", expect=409)
    assert (refused["error"], refused["free"], refused["requested"]) == ("insufficient_gpus", 0, 1)
    assert len(cluster.holders(ns)) == 1 + VM_GPUS

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(
            attach_through_the_service, cluster, ns, agents, pod="late", wait_seconds=HOLDER_WAIT
        )
        eventually(
            lambda: _queued(cluster, ns, agents, "late") == 1 or waiting.done(),
            "the late notebook's request in its node's queue",
        )
        assert not waiting.done(), waiting.result()  # it waits: the host's free GPUs not taken
        _detach(cluster, ns, agents, "on-vm-0")
        (attachment,) = waiting.result(timeout=REQUEST_TIMEOUT + HOLDER_WAIT)["attachments"]
    placed = {h["metadata"]["ownerReferences"][0]["name"]: h["spec"]["nodeName"]
              for h in cluster.holders(ns)}  # fmt: skip
    assert placed["late"] == vm_node.name and "on-vm-0" not in placed, placed
    assert ENXIO in _opens(cluster, ns, "late", int(attachment["minor"]))
    for pod in ("on-host", "late", *(f"on-vm-{i}" for i in range(1, VM_GPUS))):
        _detach(cluster, ns, agents, pod)
    eventually(lambda: cluster.holders(ns) == [], "every GPU freed")


def _queued(cluster: Cluster, ns: str, service_ip: str, pod: str) -> int:
    """How many attach requests of ``pod`` wait in its node's queue (``GET /v1/queue``)."""
    status, body = agent_call(cluster, ns, service_ip, "GET", pod=pod, path="/v1/queue")
    assert status in (0, 200), body
    return len(json.loads(body)["requests"]) if status == 200 else 0


def test_production_node_agent_killed_9_rebuilds_and_neither_nodes_sweeps_touch_the_others_grant(
    cluster: Cluster, vm_node: VmNode, agents: str
) -> None:
    """Each agent's start-up reconciliation and node sweeps (orphaned grants, stray access) see
    its own node only: a GPU granted on the other node is neither revoked nor adopted."""
    ns, vm_minor = _attached_on_the_vm_node(cluster, vm_node, agents, "prod-kill")
    _notebook(cluster, ns, "on-host", cluster.node_name)
    (host_attachment,) = attach_through_the_service(cluster, ns, agents, pod="on-host")[
        "attachments"
    ]
    host_minor = int(host_attachment["minor"])
    holders = {h["metadata"]["uid"] for h in cluster.holders(ns)}
    vm_grant = f"DeviceAllow=/dev/char/195:{vm_minor} rw"
    unit = _scope(cluster, ns, "nb")

    (vm_agent,) = _agent_pods(cluster, vm_node.name)
    container = cluster.container_id(AGENT_NAMESPACE, vm_agent, "agent")
    restarts = _restarts(cluster, vm_agent)
    vm_node.run(f"systemctl kill --signal=SIGKILL cri-containerd-{container}.scope")
    eventually(
        lambda: _restarts(cluster, vm_agent) > restarts and _agent_ready(cluster, vm_agent),
        "the VM node's agent restarted by the kubelet and ready",
        300,
    )
    assert ENXIO in _opens(cluster, ns, "nb", vm_minor)
    assert ENXIO in _opens(cluster, ns, "on-host", host_minor)

    # The host node's agent replaced (a new pod: its start-up sweeps) while the VM's grant stands.
    (host_agent,) = _agent_pods(cluster, cluster.node_name)
    cluster.delete_pod(AGENT_NAMESPACE, host_agent)
    eventually(
        lambda: [p for p in _agent_pods(cluster, cluster.node_name)
                 if p != host_agent and _agent_ready(cluster, p)],
        "the host node's new agent pod ready",
    )  # fmt: skip
    assert ENXIO in _opens(cluster, ns, "on-host", host_minor)
    assert ENXIO in _opens(cluster, ns, "nb", vm_minor)
    assert vm_grant in _device_allow_lines(vm_node, unit)
    assert {h["metadata"]["uid"] for h in cluster.holders(ns)} == holders
    _detach(cluster, ns, agents)
    _detach(cluster, ns, agents, "on-host")
    assert EPERM in _opens(cluster, ns, "nb", vm_minor)


def test_production_node_a_deleted_holder_is_revoked_and_a_deleted_notebook_frees_its_gpu(
    cluster: Cluster, vm_node: VmNode, agents: str
) -> None:
    ns, minor = _attached_on_the_vm_node(cluster, vm_node, agents, "prod-lost")
    _notebook(cluster, ns, "watcher", vm_node.name)
    unit = _scope(cluster, ns, "nb")
    grant = f"DeviceAllow=/dev/char/195:{minor} rw"
    assert grant in _device_allow_lines(vm_node, unit)
    (holder,) = cluster.holders(ns)

    cluster.delete_pod(ns, holder["metadata"]["name"])
    eventually(
        lambda: EPERM in _opens(cluster, ns, "nb", minor),
        "the lost holder's GPU revoked after the loss's grace period",
        LOSS_WAIT,
    )
    assert grant not in _device_allow_lines(vm_node, unit)
    eventually(
        lambda: {HOLDER_LOST, REVOKED} <= set(cluster.event_reasons(ns, "nb")),
        "the notebook told of the loss, then of the revocation",
    )

    # Attached again, then the notebook deleted: the garbage collector takes its holder.
    attach_through_the_service(cluster, ns, agents, wait_seconds=HOLDER_WAIT)
    cluster.delete_pod(ns, "nb")
    eventually(lambda: cluster.holders(ns) == [], "the notebook's holder collected", LOSS_WAIT)
    eventually(
        lambda: _free_gpus(cluster, ns, agents, "watcher") == VM_GPUS,
        "every GPU of the VM node free again",
        LOSS_WAIT,
    )


def test_two_nodes_each_agents_own_token_is_refused_the_other_nodes_pods_and_non_holders(
    cluster: Cluster, vm_node: VmNode, agents: str
) -> None:
    """The real DaemonSet pods' own tokens (node-bound by the kubelet that projected them):
    the admission policy holds each agent to holders on its own node."""
    ns = cluster.namespace("two-node-identity")
    _notebook(cluster, ns, "on-host", cluster.node_name)
    _notebook(cluster, ns, "on-vm", vm_node.name)
    attach_through_the_service(cluster, ns, agents, pod="on-host", wait_seconds=HOLDER_WAIT)
    (host_holder,) = cluster.holders(ns)
    # Typed as Any: plain dicts are the bodies, as the client serializes them.
    as_vm_agent: Any = k8s.CoreV1Api(api_as(_agent_pod_token(cluster, vm_node.name), cluster))

    def holder_for(pod: str, node: str, index: int) -> dict[str, Any]:
        return holder_as_the_agent_builds_it(cluster, cluster.pod(ns, pod), index, node)

    name = host_holder["metadata"]["name"]
    refusals: list[Callable[[], Any]] = [
        lambda: as_vm_agent.create_namespaced_pod(ns, holder_for("on-host", cluster.node_name, 5)),
        lambda: as_vm_agent.patch_namespaced_pod(
            name, ns, {"metadata": {"annotations": {"gpu-hotplug.jupyter.org/state": "granted"}}}
        ),
        lambda: as_vm_agent.delete_namespaced_pod(name, ns),
        lambda: as_vm_agent.create_namespaced_pod(
            ns,
            {
                "metadata": {"name": "not-a-holder"},
                "spec": notebook_with_token("x", vm_node.name)["spec"],
            },
        ),
    ]
    for refused in refusals:
        with pytest.raises(ApiException) as denied:
            refused()
        assert denied.value.status == 403, denied.value.body
    # Its own node's holder is admitted (then removed by it).
    own = holder_for("on-vm", vm_node.name, 0)
    as_vm_agent.create_namespaced_pod(ns, own)
    as_vm_agent.delete_namespaced_pod(own["metadata"]["name"], ns, grace_period_seconds=1)
    assert cluster.pod(ns, name)["metadata"]["uid"] == host_holder["metadata"]["uid"]
    _detach(cluster, ns, agents, "on-host")


def test_production_node_drain_tells_the_notebook_while_its_gpu_still_works_and_leaks_nothing(
    cluster: Cluster, vm_node: VmNode, agents: str
) -> None:
    """``kubectl drain`` of the VM node (last: the node is cordoned while it runs) with a GPU
    attached: the loss is announced while the notebook still runs with its GPU usable; after
    the drain no holder, grant or GPU is left taken."""
    ns = cluster.namespace("prod-drain")
    notebook = notebook_with_token("nb", vm_node.name)
    # Long enough to look at the notebook while it is being evicted (the tier's pods take 1 s).
    notebook["spec"]["terminationGracePeriodSeconds"] = 60
    cluster.core.create_namespaced_pod(ns, notebook)
    cluster.wait_running(ns, "nb")
    (attachment,) = attach_through_the_service(cluster, ns, agents, wait_seconds=HOLDER_WAIT)[
        "attachments"
    ]
    minor = int(attachment["minor"])
    scope = _scope(cluster, ns, "nb")
    drain = subprocess.Popen(
        [kubectl_binary(), f"--kubeconfig={cluster.node.admin_kubeconfig}", "drain",
         vm_node.name, "--ignore-daemonsets", "--force", "--delete-emptydir-data",
         f"--timeout={LOSS_WAIT}s"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        eventually(
            lambda: HOLDER_LOST in cluster.event_reasons(ns, "nb"),
            "the notebook told that its GPU's holder is going",
            LOSS_WAIT,
        )
        # Told first: nothing has ended yet. The notebook runs and its scope still grants the
        # GPU, read on the node: a `kubectl exec` into the pod being evicted took over 40 s on
        # the loaded CI machine, past the loss's 30 s grace (the other tests show that this
        # grant is what makes the node open: ENXIO with it, EPERM without).
        granted = f"DeviceAllow=/dev/char/195:{minor} rw"
        assert granted in _device_allow_lines(vm_node, scope)
        assert cluster.pod(ns, "nb")["status"]["phase"] == "Running"
        output, _ = drain.communicate(timeout=LOSS_WAIT + 60)
        assert drain.returncode == 0, output
    finally:
        if drain.poll() is None:
            drain.kill()
        cluster.kubectl("uncordon", vm_node.name)
    assert cluster.gone(ns, "nb") and cluster.holders(ns) == []
    left = vm_node.run(f"systemctl list-units --all --plain --no-legend {shlex.quote(scope)}")
    assert scope not in left, left
    _notebook(cluster, ns, "after", vm_node.name)
    eventually(
        lambda: _free_gpus(cluster, ns, agents, "after") == VM_GPUS,
        "every GPU of the drained node free",
        LOSS_WAIT,
    )


def _agent_pod_token(cluster: Cluster, node: str) -> str:
    """The service-account token the kubelet projected into the agent's DaemonSet pod on
    ``node`` (bound to that pod, naming its node)."""
    (agent,) = _agent_pods(cluster, node)
    read = cluster.exec(
        AGENT_NAMESPACE,
        agent,
        ["cat", "/var/run/secrets/kubernetes.io/serviceaccount/token"],
        container="agent",
    )
    assert read.exit_code == 0, read
    return read.stdout.strip()


def _agent_pods(cluster: Cluster, node: str) -> list[str]:
    """The names of the agent's DaemonSet pods on ``node`` that are not terminating."""
    pods = cluster.pods(AGENT_NAMESPACE, "app.kubernetes.io/name=gpu-hotplug-agent")
    return [p["metadata"]["name"] for p in pods if p["spec"].get("nodeName") == node
            and not p["metadata"].get("deletionTimestamp")]  # fmt: skip


def _agent_status(cluster: Cluster, pod: str) -> dict[str, Any]:
    statuses = cluster.pod(AGENT_NAMESPACE, pod)["status"].get("containerStatuses") or []
    return next((s for s in statuses if s["name"] == "agent"), {})


def _restarts(cluster: Cluster, pod: str) -> int:
    return int(_agent_status(cluster, pod).get("restartCount", 0))


def _agent_ready(cluster: Cluster, pod: str) -> bool:
    return bool(_agent_status(cluster, pod).get("ready"))


def _free_gpus(cluster: Cluster, ns: str, service_ip: str, pod: str) -> int:
    """How many of its node's GPUs the agent lists as free, asked from ``pod``."""
    status, body = agent_call(cluster, ns, service_ip, "GET", pod=pod, path="/v1/gpus")
    assert status == 200, body
    return sum(gpu["state"] == "free" for gpu in json.loads(body)["gpus"])
