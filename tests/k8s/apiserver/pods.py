"""What the apiserver does to a pod on the way in: defaults, validation, QoS class.

Only the rules a GPU agent's pods meet, each as the real server phrases it:

* defaults: restartPolicy, dnsPolicy, schedulerName, terminationGracePeriodSeconds,
  serviceAccountName, priority (from priorityClassName), enableServiceLinks, per container
  imagePullPolicy/terminationMessagePath/Policy, requests copied from limits where absent;
  ``status.phase=Pending`` and ``status.qosClass``;
* validation (422): containers present and named uniquely, an extended resource (a name with a
  domain, such as ``nvidia.com/gpu``) has a limit, and requests equal limits;
* updates: a pod's spec is immutable except container images, ``activeDeadlineSeconds`` and
  added tolerations.

ResourceQuota is not simulated: the real node's API server enforces it
(``tests/realnode/test_attach.py``).
"""

from __future__ import annotations

import copy
import re
from decimal import Decimal
from typing import Any, Final

from .errors import invalid

_STANDARD: Final = frozenset({"cpu", "memory", "ephemeral-storage", "storage", "pods"})
_SUFFIXES: Final = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    **{suffix: Decimal(1000) ** (i + 1) for i, suffix in enumerate("kMGTPE")},
    **{suffix + "i": Decimal(1024) ** (i + 1) for i, suffix in enumerate("KMGTPE")},
}
_QUANTITY: Final = re.compile(r"^([+-]?[0-9.]+)([eE][+-]?[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?$")
TERMINAL: Final = frozenset({"Succeeded", "Failed"})


def quantity(value: Any) -> Decimal:
    """A Kubernetes quantity (``"500m"``, ``"1Gi"``, ``2``) as a number."""
    match = _QUANTITY.match(str(value).strip())
    if not match:
        raise ValueError(f"quantities must match the regular expression: {value!r}")
    number, exponent, suffix = match.groups()
    result = Decimal(number + (exponent or ""))
    return result * _SUFFIXES[suffix or ""]


def is_extended(resource: str) -> bool:
    """``nvidia.com/gpu`` is; ``cpu`` and ``kubernetes.io/...`` names are not."""
    return "/" in resource and not resource.split("/")[0].endswith("kubernetes.io")


def containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return list(pod.get("spec", {}).get("containers") or [])


def pod_requests(pod: dict[str, Any], kind: str = "requests") -> dict[str, Decimal]:
    """Sum of ``kind`` (requests or limits) over the pod's containers, by resource."""
    total: dict[str, Decimal] = {}
    for container in containers(pod):
        for name, value in (container.get("resources", {}).get(kind) or {}).items():
            total[name] = total.get(name, Decimal(0)) + quantity(value)
    return total


def qos_class(pod: dict[str, Any]) -> str:
    """Guaranteed, Burstable or BestEffort, from the containers' cpu and memory."""
    requests, limits, guaranteed = False, False, True
    for container in containers(pod):
        resources = container.get("resources") or {}
        req = {k: v for k, v in (resources.get("requests") or {}).items() if k in _STANDARD}
        lim = {k: v for k, v in (resources.get("limits") or {}).items() if k in _STANDARD}
        requests = requests or bool(req)
        limits = limits or bool(lim)
        for name in ("cpu", "memory"):
            if name not in lim or quantity(lim[name]) != quantity(req.get(name, lim[name])):
                guaranteed = False
    if not requests and not limits:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"


def default_pod(pod: dict[str, Any], priorities: dict[str, int]) -> None:
    """Fill the defaults the apiserver fills (in place)."""
    spec = pod.setdefault("spec", {})
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("serviceAccountName", "default")
    spec.setdefault("serviceAccount", spec["serviceAccountName"])
    spec.setdefault("securityContext", {})
    spec.setdefault("enableServiceLinks", True)
    spec.setdefault("preemptionPolicy", "PreemptLowerPriority")
    spec.setdefault("tolerations", [])
    if "priorityClassName" in spec:
        spec.setdefault("priority", priorities.get(spec["priorityClassName"], 0))
    else:
        spec.setdefault("priority", 0)
    for container in containers(pod):
        image = str(container.get("image", ""))
        latest = ":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest")
        container.setdefault("imagePullPolicy", "Always" if latest else "IfNotPresent")
        container.setdefault("terminationMessagePath", "/dev/termination-log")
        container.setdefault("terminationMessagePolicy", "File")
        resources = container.setdefault("resources", {})
        limits = resources.get("limits") or {}
        requests = resources.get("requests") or {}
        for name, value in limits.items():
            requests.setdefault(name, value)
        if requests:
            resources["requests"] = requests
    status = pod.setdefault("status", {})
    status["phase"] = "Pending"
    status["qosClass"] = qos_class(pod)


def validate_pod(pod: dict[str, Any]) -> None:
    """422 for a pod the real server would refuse (the rules of the module docstring)."""
    name = pod["metadata"]["name"]
    causes: list[tuple[str, str]] = []
    listed = containers(pod)
    if not listed:
        causes.append(("spec.containers", "Required value"))
    seen: set[str] = set()
    for i, container in enumerate(listed):
        where = f"spec.containers[{i}]"
        if not container.get("name"):
            causes.append((f"{where}.name", "Required value"))
        elif container["name"] in seen:
            causes.append((f"{where}.name", f'Duplicate value: "{container["name"]}"'))
        seen.add(container.get("name", ""))
        if not container.get("image"):
            causes.append((f"{where}.image", "Required value"))
        resources = container.get("resources") or {}
        requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
        try:
            for value in (requests | limits).values():
                quantity(value)
        except ValueError as error:
            causes.append((f"{where}.resources", str(error)))
            continue
        for resource, value in requests.items():
            if not is_extended(resource):
                continue
            field = f"{where}.resources.requests[{resource}]"
            if resource not in limits:
                causes.append(
                    (field, "Forbidden: Limit must be set for non overcommitable resources")
                )
            elif quantity(limits[resource]) != quantity(value):
                causes.append(
                    (
                        field,
                        f'Invalid value: "{value}": must be equal to {resource} limit of '
                        f"{limits[resource]}",
                    )
                )
    if causes:
        raise invalid("Pod", name, causes)


_MUTABLE_SPEC: Final = frozenset({"activeDeadlineSeconds", "tolerations"})


def validate_pod_update(old: dict[str, Any], new: dict[str, Any]) -> None:
    """Only container images, activeDeadlineSeconds and added tolerations may change."""
    before, after = copy.deepcopy(old.get("spec", {})), copy.deepcopy(new.get("spec", {}))
    for spec in (before, after):
        for key in _MUTABLE_SPEC:
            spec.pop(key, None)
        for container in spec.get("containers") or []:
            container.pop("image", None)
    if before != after:
        raise invalid(
            "Pod",
            old["metadata"]["name"],
            [
                (
                    "spec",
                    "Forbidden: pod updates may not change fields other than "
                    "`spec.containers[*].image`, `spec.initContainers[*].image`, "
                    "`spec.activeDeadlineSeconds`, `spec.tolerations` (only additions to "
                    "existing tolerations), `spec.terminationGracePeriodSeconds` (allow it to be "
                    "set to 1 if it was previously negative)",
                )
            ],
        )
