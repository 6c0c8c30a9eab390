"""Holder pods: the spec (one GPU, owner reference, Guaranteed QoS, pinned, self-describing)
and reading it back as durable state."""

from __future__ import annotations

import copy
from typing import Any

from jupyter_gpu_hotplug._structs import PodTarget, RequestId
from jupyter_gpu_hotplug.agent.core.seams import ReservationState
from jupyter_gpu_hotplug.agent.kubernetes.holders import (
    ANNOTATION_STATE,
    LABEL_REQUEST,
    HolderSpec,
    gpu_annotations,
    holder_pod,
    read_holder,
    request_label,
)

UID = "7d1f0c2a-3b4c-4d5e-8f90-a1b2c3d4e5f6"
CID = "containerd://" + "ab" * 32
NOTEBOOK: Any = {
    "metadata": {"namespace": "team-a", "name": "jupyter-alice", "uid": UID},
    "spec": {
        "nodeName": "gpu-node-1",
        "priorityClassName": "notebooks",
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "containers": [{"name": "notebook", "image": "jupyter/base"}],
    },
}
SPEC = HolderSpec(node_name="gpu-node-1", resource_name="nvidia.com/mig-1g.10gb")


def _holder(request_id: str | None = "r-1", index: int = 0) -> Any:
    return holder_pod(
        NOTEBOOK,
        container="notebook",
        container_id=CID,
        request_id=None if request_id is None else RequestId(request_id),
        index=index,
        spec=SPEC,
    )


def test_one_gpu_guaranteed_qos_pinned_and_unprivileged() -> None:
    pod = _holder()
    spec = pod["spec"]
    (container,) = spec["containers"]
    resources = container["resources"]
    assert resources["requests"] == resources["limits"]
    assert resources["limits"]["nvidia.com/mig-1g.10gb"] == "1"
    assert {"cpu", "memory"} <= set(resources["limits"])
    assert spec["nodeName"] == "gpu-node-1"
    assert spec["restartPolicy"] == "Always"
    assert spec["priorityClassName"] == "gpu-hotplug-holder"
    assert spec["tolerations"] == NOTEBOOK["spec"]["tolerations"]
    assert spec["automountServiceAccountToken"] is False
    assert container["image"] == "registry.k8s.io/pause:3.9"
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"} in container["env"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_a_tolerate_everything_of_the_notebook_is_not_copied() -> None:
    """A toleration without a key tolerates every taint: a holder never carries one (the
    admission policy would refuse the holder, and the attach with it)."""
    keyed = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    notebook = {
        **NOTEBOOK,
        "spec": {**NOTEBOOK["spec"], "tolerations": [{"operator": "Exists"}, keyed]},
    }
    holder = holder_pod(
        notebook, container="notebook", container_id=CID, request_id=None, index=0, spec=SPEC
    )
    assert holder["spec"]["tolerations"] == [keyed]
    everything = {**NOTEBOOK, "spec": {**NOTEBOOK["spec"], "tolerations": [{"operator": "Exists"}]}}
    holder = holder_pod(
        everything, container="notebook", container_id=CID, request_id=None, index=0, spec=SPEC
    )
    assert "tolerations" not in holder["spec"]


def test_restricted_pod_security_is_met() -> None:
    """Every control of PodSecurity ``restricted`` (Kubernetes 1.34's list) that a pod can
    fail, checked on the spec as the admission plugin checks it."""
    spec = _holder()["spec"]
    (container,) = spec["containers"]
    pod_ctx, ctx = spec["securityContext"], container["securityContext"]
    assert pod_ctx["runAsNonRoot"] is True and pod_ctx["runAsUser"] != 0
    assert pod_ctx["runAsUser"] == pod_ctx["runAsGroup"] == 65535, "the pause image's user"
    assert pod_ctx["seccompProfile"] == {"type": "RuntimeDefault"}
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"] == {"drop": ["ALL"]}
    assert not ctx.get("privileged") and "add" not in ctx["capabilities"]
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        assert not spec.get(host)
    assert "volumes" not in spec and "ports" not in container
    assert "procMount" not in ctx and "sysctls" not in pod_ctx


def test_limits_pull_settings_and_priority_are_configurable() -> None:
    spec = HolderSpec(
        node_name="n",
        cpu="20m",
        memory="32Mi",
        priority_class="",
        pull_policy="Always",
        pull_secrets=("mirror", "backup"),
    )
    pod = holder_pod(
        NOTEBOOK, container="notebook", container_id=CID, request_id=None, index=0, spec=spec
    )
    (container,) = pod["spec"]["containers"]
    assert container["resources"]["limits"] | {"nvidia.com/gpu": "1"} == {
        "cpu": "20m",
        "memory": "32Mi",
        "nvidia.com/gpu": "1",
    }
    assert container["imagePullPolicy"] == "Always"
    assert pod["spec"]["imagePullSecrets"] == [{"name": "mirror"}, {"name": "backup"}]
    assert pod["spec"]["priorityClassName"] == "notebooks", "empty: the notebook's own class"


def test_owned_by_the_target_pod_in_its_namespace() -> None:
    metadata = _holder()["metadata"]
    assert metadata["namespace"] == "team-a"
    assert metadata["ownerReferences"] == [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": "jupyter-alice",
            "uid": UID,
            "controller": False,
            "blockOwnerDeletion": True,
        }
    ]


def test_names_are_stable_per_request_and_unique_without_one() -> None:
    assert _holder("r-1", 0)["metadata"]["name"] == _holder("r-1", 0)["metadata"]["name"]
    assert _holder("r-1", 0)["metadata"]["name"] != _holder("r-1", 1)["metadata"]["name"]
    assert _holder(None)["metadata"]["name"] != _holder(None)["metadata"]["name"]
    name = _holder()["metadata"]["name"]
    assert name.startswith("jupyter-alice-gpu-") and len(name) <= 63


def test_request_ids_of_any_text_become_label_values() -> None:
    labels = _holder("retry: 3 / ü")["metadata"]["labels"]
    assert labels[LABEL_REQUEST] == request_label(UID, "retry: 3 / ü")
    assert labels[LABEL_REQUEST].isalnum() and len(labels[LABEL_REQUEST]) <= 63


def test_read_back_as_state() -> None:
    pod = copy.deepcopy(_holder())
    pod["metadata"]["uid"] = "holder-uid"
    pod["metadata"]["creationTimestamp"] = "2026-01-02T03:04:05Z"
    holder = read_holder(pod)
    assert holder is not None
    assert holder.target == PodTarget("team-a", "jupyter-alice", "notebook")
    assert (holder.state, holder.uuid, holder.request_id) == (
        ReservationState.RESERVING,
        None,
        "r-1",
    )
    assert holder.phase == "Pending" and holder.unschedulable is None
    pod["metadata"]["annotations"].update(
        gpu_annotations(uuid="GPU-1", index=2, minor=5, name="A100")  # type: ignore[arg-type]
    )
    pod["metadata"]["annotations"][ANNOTATION_STATE] = "granted"
    pod["status"] = {"phase": "Failed", "reason": "OutOfnvidia.com/gpu"}
    holder = read_holder(pod)
    assert holder is not None
    assert (holder.uuid, holder.index, holder.minor, holder.state) == (
        "GPU-1",
        2,
        5,
        ReservationState.GRANTED,
    )
    assert holder.unschedulable == "OutOfnvidia.com/gpu"


def test_unschedulable_condition_and_foreign_pods() -> None:
    pod = copy.deepcopy(_holder())
    pod["status"] = {
        "phase": "Pending",
        "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/1"}
        ],
    }
    holder = read_holder(pod)
    assert holder is not None and holder.unschedulable == "0/1"
    assert read_holder(NOTEBOOK) is None
    del pod["metadata"]["annotations"]["gpu-hotplug.jupyter.org/target"]
    assert read_holder(pod) is None
