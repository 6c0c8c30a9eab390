"""Which holder pods the agent believes: the checks a holder passes before its word counts.

Why it exists: holder pods are the agent's durable state (``holders.py``), and they are ordinary
pods. Anyone allowed to create or patch pods in a namespace — a hub, a CI tenant — can write
one that says "GPU X is granted to my container", or patch her own holder to name someone
else's GPU (issue 31 saw both succeed). The holder-protection admission policy
(``k8s/policy/holder-protection.yaml``) refuses such writes where it is installed; the agent
does not rely on it being installed. Before it grants, re-grants, revokes or releases anything
on a holder's word, it checks what a tenant cannot forge (``vet``):

- **the kubelet's PodResources names exactly the annotated GPU for that very pod**, of the
  configured resource. This is the authority on which device a pod has: the device manager
  hands a device only to a pod that requested it and was admitted with it, and never one
  device to two pods. A forged holder without a GPU request has no device; a holder whose
  annotation was patched to another GPU names one the kubelet did not give it;
- **its spec requests exactly one** of the configured resource (what ``holder_pod`` builds);
- **it serves a pod of its own namespace, which owns it**: the target annotation's namespace
  is the holder's, a Pod ownerReference's uid equals the ``target-uid`` label, and where the
  target pod is on this node its uid is that one too (a pod recreated under the same name is
  another pod); the ``container`` label agrees with the target annotation. So a holder in one
  namespace can never speak for (grant to, or "finish releasing" from) a container of another;
- **the annotated minor and index are NVML's for that GPU**: the minor is the device node the
  agent opens in the container, so a holder of GPU X that names GPU Y's minor would grant Y;
- **its container id is one the target pod's status names** for that container (the running
  one, or the one the kubelet last replaced): any other id is replaced by the pod's own
  (``trusted_container_id``) — the container is always re-resolved from the pod, never taken
  from the holder.

Not checked, on purpose: ``metadata.managedFields``. It records a *field manager* — a name the
client chooses (``fieldManager=``, by default its user agent) — not the authenticated user,
and a client may overwrite the whole list in an update. A forger can therefore make it read
exactly like the agent's own; it proves nothing that PodResources does not prove better, so
it is not consulted. Who created a pod is known for certain only to the API server's audit
log and to admission, which is why the admission policy is the first line and these checks
the second.

What the checks cannot rule out, and why that is acceptable: a tenant who creates a pod that
really requests one GPU (so the scheduler, quota and the kubelet charge it to her namespace)
and dresses it as a holder of her own notebook passes them; the agent then grants that GPU,
hers, to her own container, without the agent's ``max-gpus`` check. Nothing of anyone else's
is reachable that way; the admission policy refuses it where installed.

Everything here is pure: pods and PodResources' answer in, a verdict out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from ..._structs import GpuUuid
from ..core.inventory import GpuDevice
from .holders import LABEL_CONTAINER, Holder
from .kube import KubeObject
from .podresources import PodDevices, device_uuid

__all__ = ["Distrust", "Verdict", "trusted_container_id", "vet"]


class Distrust(StrEnum):
    """Why a holder is not believed (the ``reason`` of ``gpu_hotplug_untrusted_holders_total``)."""

    UNREADABLE = "unreadable"
    """Labelled as a holder (or carrying a holder's annotations), but not one the agent could
    have written (annotations missing or unreadable)."""
    NAMESPACE = "namespace"
    """It names a target in another namespace."""
    OWNER = "owner"
    """No Pod ownerReference with the ``target-uid``, or the target pod has another uid."""
    REQUEST = "request"
    """Its spec does not request exactly one of the configured resource."""
    DEVICE = "device"
    """PodResources does not name exactly the annotated GPU for it."""
    GPU = "gpu"
    """The annotated minor or index is not NVML's for the annotated GPU."""
    CONFLICT = "conflict"
    """Another trusted holder claims the same GPU first."""


@dataclass(frozen=True)
class Verdict:
    """Why one holder pod is not believed: the reason and what exactly was wrong."""

    reason: Distrust
    detail: str


_POD_OWNER: Final = ("v1", "Pod")


def vet(
    pod: KubeObject,
    holder: Holder | None,
    *,
    target_pod: KubeObject | None,
    devices: PodDevices | None,
    resource_name: str,
    gpus: Mapping[GpuUuid, GpuDevice],
    ended: bool = False,
) -> Verdict | None:
    """None when the holder ``pod`` (read as ``holder``) may be believed, else why not.

    ``target_pod`` is the pod its target annotation names, from the node's view (None when it
    is not on this node); ``devices`` what PodResources reports for the holder pod; ``gpus``
    the GPUs NVML knows by UUID. A holder that never learnt its GPU (``uuid`` None: its attach
    was cut short) is vetted for its ownership only: there is nothing granted to check.
    """
    if holder is None:
        return Verdict(Distrust.UNREADABLE, "a holder's label or annotations, but unreadable")
    ownership = _ownership(pod, holder, target_pod)
    if ownership is not None:
        return ownership
    requested = _requested(pod, resource_name)
    if requested != 1:
        return Verdict(Distrust.REQUEST, f"it requests {requested} {resource_name}, not 1")
    if holder.uuid is None:
        return None
    if not ended:
        ids = [] if devices is None else devices.device_ids(resource_name)
        if {device_uuid(device) for device in ids} != {holder.uuid}:
            return Verdict(
                Distrust.DEVICE,
                f"it names {holder.uuid}, the kubelet assigned it {sorted(ids) or 'no device'}",
            )
    gpu = gpus.get(holder.uuid)
    if gpu is not None and (holder.minor, holder.index) != (gpu.minor, gpu.index):
        return Verdict(
            Distrust.GPU,
            f"it names minor {holder.minor} and index {holder.index} for {holder.uuid}, "
            f"which NVML knows as minor {gpu.minor} and index {gpu.index}",
        )
    return None


def _ownership(pod: KubeObject, holder: Holder, target_pod: KubeObject | None) -> Verdict | None:
    target = holder.target
    if target.namespace != holder.namespace:
        return Verdict(
            Distrust.NAMESPACE, f"it is in {holder.namespace} and names {target.namespace}"
        )
    labels = (pod.get("metadata") or {}).get("labels") or {}
    if labels.get(LABEL_CONTAINER) != target.container:
        return Verdict(Distrust.OWNER, f"its container label is not {target.container}")
    owners = (pod.get("metadata") or {}).get("ownerReferences") or []
    owned = any(
        (owner.get("apiVersion"), owner.get("kind")) == _POD_OWNER
        and owner.get("name") == target.name
        and holder.target_uid
        and owner.get("uid") == holder.target_uid
        for owner in owners
    )
    if not owned:
        return Verdict(
            Distrust.OWNER, f"no Pod ownerReference to {target.name} with uid {holder.target_uid!r}"
        )
    if target_pod is not None:
        uid = (target_pod.get("metadata") or {}).get("uid")
        if uid != holder.target_uid:
            return Verdict(
                Distrust.OWNER, f"pod {target.namespace}/{target.name} is {uid}, not its owner"
            )
    return None


def _requested(pod: KubeObject, resource_name: str) -> int:
    """How many of ``resource_name`` the pod's containers ask for (limits: an extended
    resource's request equals its limit), init containers included."""
    spec = pod.get("spec") or {}
    total = 0
    for container in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
        resources = container.get("resources") or {}
        amount = (resources.get("limits") or {}).get(resource_name) or (
            resources.get("requests") or {}
        ).get(resource_name)
        try:
            total += int(amount or 0)
        except ValueError:
            return -1
    return total


def trusted_container_id(holder: Holder, target_pod: KubeObject | None) -> str:
    """The container id a reservation of ``holder`` may carry: the annotated one when the
    target pod's status names it for that container (running now, or the one the kubelet
    last replaced: the reconciler then re-injects into the new one), else the pod's running
    container's (the holder's own id is a hint, never an authority), else none. Without the
    target pod on this node the id stands: nothing can be granted to a pod that is not here
    (the reconciler releases such a holder)."""
    if target_pod is None:
        return holder.container_id
    statuses = (target_pod.get("status") or {}).get("containerStatuses") or []
    for status in statuses:
        if status.get("name") != holder.target.container:
            continue
        current = str(status.get("containerID") or "")
        terminated = (status.get("lastState") or {}).get("terminated") or {}
        last = str(terminated.get("containerID") or "")
        if holder.container_id and holder.container_id in (current, last):
            return holder.container_id
        return current
    return ""
