"""Holder pods: how a hot-attached GPU is reserved in Kubernetes, and how it is read back.

Why holder pods: the scheduler and the kubelet's device manager account for GPUs per pod. A GPU
injected into a running container behind their back would be handed to the next pod that asks.
So each hot-attached GPU is *held* by a small pod of its own that requests it; the kubelet's
device plugin picks the device, and PodResources tells us which (DESIGN §4). The holder pods
are also the agent's durable state: labels and annotations say whom each one serves and how
far its attach got, so an agent that restarts rebuilds everything from them (which write
records what, and the crash it is there for: ``allocator.py``).

The spec (``holder_pod``), and why each part is there:

- one GPU per holder, so one GPU can be released without touching the others;
- in the target's namespace with an ``ownerReference`` to the target pod (``controller:
  false``, ``blockOwnerDeletion``): the garbage collector deletes holders with their pod, and
  a same-namespace owner is never mistaken for a dangling cross-namespace reference (the
  prior art's holders in another namespace were collected at once on Kubernetes ≥ 1.20);
- ``nodeName`` pinned to this node (the GPU must be on the node of the container);
- a PriorityClass of its own (``gpu-hotplug-holder``, above notebooks; configurable, empty:
  the target's own class) and the target's tolerations: a higher-priority GPU pod preempts a
  notebook's holder only when nothing else can go, and a ``NoExecute`` taint its pod tolerates
  does not evict it; if a holder is lost all the same, the user is warned before the access
  goes (``core/lost.py``);
- Guaranteed QoS (equal small cpu/memory requests and limits): never evicted for pressure
  before its pod (BestEffort holders of the prior art were evicted and leaked); the memory
  limit is the floor measured for runc's init and the pause process plus a margin (runc's
  init runs in the holder's memory cgroup and is OOM-killed below it); the CPU limit is the
  pod's CFS quota, under which runc's init starts the sandbox and the container — at 10m a
  holder took 6-8 s to start on a real kubelet, at 100m 0.7 s, and every user's attach waits
  for it;
- PodSecurity ``restricted``: non-root as the pause image's own user 65535, seccomp
  ``RuntimeDefault``, every capability dropped, no privilege escalation, a read-only root —
  so holders are admitted in namespaces that enforce it;
- ``restartPolicy: Always``: a holder must never reach a terminal phase by itself; the
  kubelet frees a terminated pod's devices and would hand the GPU, still usable by our
  container, to another pod. If the pause process dies it is restarted and keeps its device;
- the pause image (``imagePullPolicy`` and ``imagePullSecrets`` configurable, for a private
  mirror), no service-account token, no privilege, ``NVIDIA_VISIBLE_DEVICES=none``: the holder
  itself never touches the GPU.

Everything here is pure (dicts in, dicts out) and unit-tested.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from ..._structs import GpuUuid, PodTarget, RequestId, parse_timestamp, target_from_key
from ..core.seams import ReservationState
from ..settings import (
    DEFAULT_HOLDER_CPU,
    DEFAULT_HOLDER_IMAGE,
    DEFAULT_HOLDER_MEMORY,
    DEFAULT_HOLDER_PRIORITY_CLASS,
    DEFAULT_RESOURCE_NAME,
)
from .kube import KubeObject

__all__ = [
    "ANNOTATION_CONTAINER_ID",
    "ANNOTATION_GRANTED_AT",
    "ANNOTATION_MINOR",
    "ANNOTATION_NODE_CREATED",
    "ANNOTATION_REQUEST_ID",
    "ANNOTATION_STATE",
    "ANNOTATION_TARGET",
    "ANNOTATION_UUID",
    "HOLDER_LABELS",
    "LABEL_CONTAINER",
    "LABEL_HOLDER",
    "LABEL_REQUEST",
    "LABEL_TARGET_UID",
    "Holder",
    "HolderSpec",
    "holder_pod",
    "read_holder",
    "request_label",
]

_PREFIX: Final = "gpu-hotplug.jupyter.org"
LABEL_HOLDER: Final = f"{_PREFIX}/holder"
LABEL_TARGET_UID: Final = f"{_PREFIX}/target-uid"
LABEL_CONTAINER: Final = f"{_PREFIX}/container"
LABEL_REQUEST: Final = f"{_PREFIX}/request"
HOLDER_LABELS: Final = {LABEL_HOLDER: "true"}
"""What every holder carries: the selector of the agent's lists and watches."""

ANNOTATION_STATE: Final = f"{_PREFIX}/state"
ANNOTATION_TARGET: Final = f"{_PREFIX}/target"
ANNOTATION_UUID: Final = f"{_PREFIX}/gpu-uuid"
ANNOTATION_MINOR: Final = f"{_PREFIX}/minor"
ANNOTATION_INDEX: Final = f"{_PREFIX}/index"
ANNOTATION_GPU_NAME: Final = f"{_PREFIX}/gpu-name"
ANNOTATION_CONTAINER_ID: Final = f"{_PREFIX}/container-id"
ANNOTATION_REQUEST_ID: Final = f"{_PREFIX}/request-id"
ANNOTATION_GRANTED_AT: Final = f"{_PREFIX}/granted-at"
ANNOTATION_NODE_CREATED: Final = f"{_PREFIX}/node-created"
"""``"true"`` when the agent created the GPU's device node in the container (so it may remove
it again); the agent never deletes a node it did not create."""

_HOLDER_CONTAINER: Final = "hold"
_NAME_STEM_MAX: Final = 40
_PAUSE_USER: Final = 65535


def request_label(target_uid: str, request_id: str) -> str:
    """A label-safe stand-in for a client's request id (any text) within one target pod."""
    return hashlib.sha256(f"{target_uid}\0{request_id}".encode()).hexdigest()[:32]


def _holder_name(pod_name: str, target_uid: str, request_id: str | None, index: int) -> str:
    """``<pod>-gpu-<10 hex>``: derived from the request id when there is one, so that a retry
    after a crash re-creates (and finds) the same holders instead of new ones."""
    if request_id is None:
        suffix = secrets.token_hex(5)
    else:
        seed = f"{target_uid}\0{request_id}\0{index}".encode()
        suffix = hashlib.sha256(seed).hexdigest()[:10]
    return f"{pod_name[:_NAME_STEM_MAX].rstrip('-.')}-gpu-{suffix}"


@dataclass(frozen=True)
class HolderSpec:
    """The node-wide settings of holder pods."""

    node_name: str
    resource_name: str = DEFAULT_RESOURCE_NAME
    """The extended resource one holder requests: ``nvidia.com/gpu`` or a MIG profile such as
    ``nvidia.com/mig-1g.10gb``."""
    image: str = DEFAULT_HOLDER_IMAGE
    cpu: str = DEFAULT_HOLDER_CPU
    memory: str = DEFAULT_HOLDER_MEMORY
    priority_class: str = DEFAULT_HOLDER_PRIORITY_CLASS
    """Empty: the target pod's own priority class."""
    pull_policy: str = "IfNotPresent"
    pull_secrets: tuple[str, ...] = ()


def holder_pod(
    target_pod: KubeObject,
    *,
    container: str,
    container_id: str,
    request_id: RequestId | None,
    index: int,
    spec: HolderSpec,
) -> KubeObject:
    """The holder of one GPU for ``container`` of ``target_pod`` (state ``reserving``)."""
    metadata = target_pod["metadata"]
    namespace, pod_name, uid = metadata["namespace"], metadata["name"], metadata["uid"]
    pod_spec = target_pod.get("spec") or {}
    resources = {"cpu": spec.cpu, "memory": spec.memory, spec.resource_name: "1"}
    labels = {**HOLDER_LABELS, LABEL_TARGET_UID: uid, LABEL_CONTAINER: container}
    annotations = {
        ANNOTATION_STATE: str(ReservationState.RESERVING),
        ANNOTATION_TARGET: PodTarget(namespace, pod_name, container).key,
        ANNOTATION_CONTAINER_ID: container_id,
    }
    if request_id is not None:
        labels[LABEL_REQUEST] = request_label(uid, request_id)
        annotations[ANNOTATION_REQUEST_ID] = request_id
    holder_spec: dict[str, Any] = {
        "nodeName": spec.node_name,
        "restartPolicy": "Always",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        # pause exits on SIGTERM at once; 0 would make a deletion forced (see KubeApi.delete_pod).
        "terminationGracePeriodSeconds": 1,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": _PAUSE_USER,
            "runAsGroup": _PAUSE_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [
            {
                "name": _HOLDER_CONTAINER,
                "image": spec.image,
                "imagePullPolicy": spec.pull_policy,
                "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}],
                "resources": {"requests": dict(resources), "limits": dict(resources)},
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "capabilities": {"drop": ["ALL"]},
                },
            }
        ],
    }
    if spec.pull_secrets:
        holder_spec["imagePullSecrets"] = [{"name": name} for name in spec.pull_secrets]
    priority_class = spec.priority_class or pod_spec.get("priorityClassName")
    if priority_class:
        holder_spec["priorityClassName"] = priority_class
    # The notebook's tolerations, but for a tolerate-everything (no key): a holder is pinned to
    # its node, and one that tolerates every NoExecute taint would outstay any drain or
    # eviction there; the admission policy refuses it (k8s/policy/admission-policy.yaml).
    tolerations = [t for t in pod_spec.get("tolerations") or [] if t.get("key")]
    if tolerations:
        holder_spec["tolerations"] = tolerations
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": _holder_name(pod_name, uid, request_id, index),
            "namespace": namespace,
            "labels": labels,
            "annotations": annotations,
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": pod_name,
                    "uid": uid,
                    "controller": False,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": holder_spec,
    }


def gpu_annotations(*, uuid: GpuUuid, index: int, minor: int, name: str) -> dict[str, str]:
    """What a holder records once PodResources named its GPU."""
    return {
        ANNOTATION_UUID: uuid,
        ANNOTATION_INDEX: str(index),
        ANNOTATION_MINOR: str(minor),
        ANNOTATION_GPU_NAME: name,
    }


@dataclass(frozen=True)
class Holder:
    """A holder pod as the agent reads it back (``read_holder``)."""

    namespace: str
    name: str
    uid: str
    target: PodTarget
    target_uid: str
    container_id: str
    state: ReservationState
    """As recorded on the pod: ``granted`` from the grant's intent on, while the agent that
    wrote it still holds the reservation ``reserving`` until the grant is done (``allocator``,
    "state changes")."""
    request_id: RequestId | None
    created_at: datetime
    granted_at: datetime | None
    uuid: GpuUuid | None
    """The GPU PodResources named (None until then)."""
    index: int | None
    minor: int | None
    gpu_name: str
    phase: str
    """``Pending``, ``Running``, ``Failed``, ... (``status.phase``)."""
    deleting: bool
    """The API server marked it for deletion."""
    unschedulable: str | None
    """Why it can never run here (admission refused it, or unschedulable), else None."""
    node_created: bool = False
    """The agent created the device node in the container."""

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


def _unschedulable(pod: KubeObject) -> str | None:
    status = pod.get("status") or {}
    if status.get("phase") == "Failed":
        return str(status.get("reason") or status.get("message") or "Failed")
    for condition in status.get("conditions") or []:
        if (
            condition.get("type") == "PodScheduled"
            and condition.get("status") == "False"
            and condition.get("reason") == "Unschedulable"
        ):
            return str(condition.get("message") or "Unschedulable")
    return None


def _int(text: str | None) -> int | None:
    try:
        return None if text is None else int(text)
    except ValueError:
        return None


def read_holder(pod: KubeObject, *, labelled: bool = True) -> Holder | None:
    """The holder ``pod`` is, or None when it is not one of ours (or damaged beyond reading).

    ``labelled=False`` reads a holder whose label someone removed (the agent's start-up looks
    for those too: ``trust.vet`` decides whether to believe them, not the label)."""
    metadata = pod.get("metadata") or {}
    labels = metadata.get("labels") or {}
    annotations = metadata.get("annotations") or {}
    if labelled and labels.get(LABEL_HOLDER) != "true":
        return None
    try:
        target = target_from_key(annotations[ANNOTATION_TARGET])
        if not isinstance(target, PodTarget) or target.container is None:
            return None
        state = ReservationState(annotations.get(ANNOTATION_STATE, ReservationState.RESERVING))
        created = metadata.get("creationTimestamp")
        granted = annotations.get(ANNOTATION_GRANTED_AT)
        return Holder(
            namespace=metadata["namespace"],
            name=metadata["name"],
            uid=str(metadata.get("uid") or ""),
            target=target,
            target_uid=str(labels.get(LABEL_TARGET_UID, "")),
            container_id=str(annotations.get(ANNOTATION_CONTAINER_ID, "")),
            state=state,
            request_id=RequestId(annotations[ANNOTATION_REQUEST_ID])
            if ANNOTATION_REQUEST_ID in annotations
            else None,
            created_at=parse_timestamp(created) if created else datetime.now(UTC),
            granted_at=parse_timestamp(granted) if granted else None,
            uuid=GpuUuid(annotations[ANNOTATION_UUID]) if ANNOTATION_UUID in annotations else None,
            index=_int(annotations.get(ANNOTATION_INDEX)),
            minor=_int(annotations.get(ANNOTATION_MINOR)),
            gpu_name=str(annotations.get(ANNOTATION_GPU_NAME, "")),
            phase=str((pod.get("status") or {}).get("phase") or "Pending"),
            deleting=bool(metadata.get("deletionTimestamp")),
            unschedulable=_unschedulable(pod),
            node_created=annotations.get(ANNOTATION_NODE_CREATED) == "true",
        )
    except (KeyError, ValueError):
        return None
