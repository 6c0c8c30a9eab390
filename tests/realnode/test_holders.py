"""Issue 21 on the real node: holders that a real API server and kubelet accept, and a holder
lost while the agent is stopped.

- the holder runs Guaranteed at the agent's limits (the measured floor plus a margin,
  docs/performance.md) in the holders' PriorityClass that ``k8s/`` ships; the real PodSecurity
  admission of a ``restricted`` namespace takes today's holder spec and refuses the one before
  issue 21 (no seccomp profile);
- (the 3 MiB floor measured under containerd 1.6 does not carry over: on this node, containerd 2.4
  with runc 1.5.2, the floor is 5 MiB — ``bench_realnode.py --floor``, docs/performance.md —
  and the holder's 24Mi runs, above);
- a holder deleted while the agent is stopped: at start the notebook's grant is revoked and an
  Event on the notebook pod says why.
"""

from __future__ import annotations

import copy

import pytest
from kubernetes.client.exceptions import ApiException

from jupyter_gpu_hotplug.agent.kubernetes.holders import HolderSpec, holder_pod
from jupyter_gpu_hotplug.agent.settings import (
    DEFAULT_HOLDER_CPU,
    DEFAULT_HOLDER_MEMORY,
    DEFAULT_HOLDER_PRIORITY_CLASS,
)

from ..fixtures.device_messages import ENXIO, EPERM
from ..fixtures.requirements import needs_root
from ..k8s.image import PAUSE_IMAGE
from .agent import AgentAccount, NodeAgent, running_node_agent
from .cluster import Cluster, eventually

pytestmark = [*needs_root, pytest.mark.realnode, pytest.mark.slow]


def test_the_holder_runs_at_its_limits_and_restricted_admission_refuses_the_old_one(
    cluster: Cluster, node_agent: NodeAgent
) -> None:
    """The agent's holder runs Guaranteed at the agent's limits in the holders' class; the
    real PodSecurity admission of a ``restricted`` namespace takes today's holder spec and
    refuses the one before issue 21 (``test_attach.py`` runs a whole attach there)."""
    ns = cluster.namespace()
    notebook = cluster.run_notebook_pod(ns, "nb")
    api = node_agent.as_pod(ns, "nb")

    created = api.post("/v1/attachments", {"count": 1})

    assert created.status == 201, created.body
    (holder,) = cluster.holders(ns)
    assert holder["status"]["phase"] == "Running"
    assert holder["status"]["qosClass"] == "Guaranteed"
    (container,) = holder["spec"]["containers"]
    limits = container["resources"]["limits"]
    assert (limits["cpu"], limits["memory"]) == (DEFAULT_HOLDER_CPU, DEFAULT_HOLDER_MEMORY)
    assert holder["spec"]["priorityClassName"] == DEFAULT_HOLDER_PRIORITY_CLASS
    assert holder["spec"]["priority"] > 0, "above the notebook's (0)"
    (status,) = holder["status"]["containerStatuses"]
    assert status["restartCount"] == 0, status
    assert api.delete("/v1/attachments").status == 204

    strict = cluster.namespace("strict", pod_security="restricted")
    spec = HolderSpec(node_name=cluster.node_name, image=PAUSE_IMAGE)
    today = holder_pod(
        notebook, container="notebook", container_id="x", request_id=None, index=0, spec=spec
    )
    # Created by the admin, not as one of the agent's holders: no owner, no holder labels, no
    # holder annotations (only the agent may write those: test_forgery.py).
    today["metadata"] |= {
        "namespace": strict,
        "ownerReferences": [],
        "labels": {},
        "annotations": {},
    }
    old = copy.deepcopy(today)
    old["metadata"]["name"] += "-old"
    del old["spec"]["securityContext"]["seccompProfile"]
    with pytest.raises(ApiException) as refused:
        cluster.core.create_namespaced_pod(strict, old)
    assert refused.value.status == 403
    assert "violates PodSecurity" in str(refused.value.body)
    assert "seccompProfile" in str(refused.value.body)
    cluster.core.create_namespaced_pod(strict, today)
    cluster.wait_running(strict, today["metadata"]["name"])
    cluster.delete_pod(strict, today["metadata"]["name"])


def test_a_holder_deleted_while_the_agent_is_stopped_is_revoked_at_start(
    cluster: Cluster, agent_account: AgentAccount
) -> None:
    ns = cluster.namespace()
    cluster.run_notebook_pod(ns, "nb")
    with running_node_agent(cluster, agent_account, extra=("--lost-grace=0",)) as agent:
        (attachment,) = (
            agent.as_pod(ns, "nb").post("/v1/attachments", {"count": 1}).json()["attachments"]
        )
        agent.process.stop()
        cluster.delete_pod(ns, attachment["holder"].split("/")[1])
        eventually(lambda: cluster.holders(ns) == [], "the holder is gone")
        assert ENXIO in cluster.open_fresh_node(ns, "nb", attachment["minor"]), "orphaned"

        agent.process.start()

        eventually(
            lambda: EPERM in cluster.open_fresh_node(ns, "nb", attachment["minor"]),
            "the orphaned grant is revoked at start",
        )
        eventually(lambda: "GpuRevoked" in cluster.event_reasons(ns, "nb"), "a GpuRevoked Event")
        messages = [
            str(event.message)
            for event in cluster.core.list_namespaced_event(ns).items
            if event.involved_object.name == "nb" and event.reason == "GpuRevoked"
        ]
        assert any("no holder pod reserves it" in message for message in messages), messages
