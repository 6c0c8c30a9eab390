"""The Kubernetes resolver: from ``{"pod": {namespace, name, container}}`` to the running
container the injector acts on.

Why it exists: a request names a pod; the injector needs a live host process of one of its
containers, with its device cgroups. The chain is the one a node component can trust:

1. the pod from the API server (never from the request): on this node, not in a VM sandbox;
2. the container: the one the request names, else the one the pod's
   ``gpu-hotplug.jupyter.org/container`` annotation names, else the pod's only container;
3. its runtime id from the pod's status (``containerd://…``, ``cri-o://…``) — that id is the
   ``ContainerKey``: it changes when the kubelet restarts the container;
4. the runtime's own answer for that id (CRI ``ContainerStatus``, verbose): running, and its
   init pid in the host's pid namespace (a ``/proc/*/cgroup`` scan when the runtime names none);
5. that pid's cgroups, read from ``/proc/<pid>/cgroup`` and accepted only if they are that
   container's cgroup (cgroupfs or systemd naming; see ``container_cgroups``), and its mount
   namespace, which must not be the agent's.

VM sandboxes (RuntimeClass handlers such as Kata Containers or gVisor) are refused with 422:
their containers' devices live in a guest kernel that host cgroups and ``/dev`` do not reach.
Calls block (API server, CRI, ``/proc``): the core runs them in its worker pool.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Final

from ..._structs import CONTAINER_ANNOTATION, PodTarget, Target, TargetRef
from ...linux import cgroups, procfs
from ..core.errors import Forbidden, InvalidRequest, LookupFailed, NotFound, TargetNotReady
from ..core.seams import ContainerCgroups, ContainerKey, HostContainer
from .container_cgroups import belongs_to, expected_cgroup, find_container_pid, fold_inner
from .cri import ContainerRuntimeStatus, CriClient, CriError, split_container_id
from .kube import KubeApi, KubeError, KubeObject

__all__ = ["PodResolver", "is_vm_handler"]

_VM_HANDLER: Final = re.compile(r"(^|[-_.])(kata|gvisor|runsc|firecracker|fc)([-_.]|$)|^kata")


def is_vm_handler(handler: str) -> bool:
    """Whether a RuntimeClass handler runs pods in a VM or user-space kernel."""
    return _VM_HANDLER.search(handler.lower()) is not None


class PodResolver:
    """``Resolver`` for pods on this node (see the module docstring)."""

    def __init__(
        self,
        *,
        kube: KubeApi,
        cri: CriClient,
        node_name: str,
        host_proc: Path,
        hierarchies: cgroups.CgroupHierarchies,
        agent_pid: int | None = None,
    ) -> None:
        self._kube = kube
        self._cri = cri
        self._node = node_name
        self._proc = host_proc
        self._hierarchies = hierarchies
        agent = os.getpid() if agent_pid is None else agent_pid
        self._agent_mount_ns = self._mount_ns(agent)
        self._last: dict[ContainerKey, HostContainer] = {}
        """Every container resolved, by key (for ``current`` during a restart); bounded by
        forgetting the keys of containers that are gone (``_restarting`` False)."""

    # --- the seam ------------------------------------------------------------------------------

    def resolve(self, ref: TargetRef) -> HostContainer:
        if not isinstance(ref, PodTarget):
            # Well formed, but the Kubernetes backend knows no bare processes: not found (404).
            raise NotFound(
                "process",
                str(ref.pid),
                hint="this agent serves Kubernetes pods: give the target as "
                '{"pod": {"namespace": ..., "name": ..., "container": ...}}',
            )
        pod = self._pod(ref)
        if pod is None:
            raise NotFound("pod", f"{ref.namespace}/{ref.name}")
        node = (pod.get("spec") or {}).get("nodeName")
        if node != self._node:
            raise NotFound(
                "pod",
                f"{ref.namespace}/{ref.name}",
                hint=f"it runs on node {node or '(none yet)'}, not {self._node}: ask that "
                "node's agent",
            )
        self._refuse_vm(pod, ref)
        container = self._container_name(pod, ref)
        target = PodTarget(ref.namespace, ref.name, container)
        return self._running(pod, target)

    def lookup(self, target: Target, key: ContainerKey) -> HostContainer | None:
        found = self._current(target)
        return found if found is not None and found.key == key else None

    def current(self, target: Target, key: ContainerKey) -> HostContainer | None:
        """The running container of ``target``; while the kubelet restarts it (the pod is
        still there, the container is not running yet), the container as last resolved: the
        reservations must survive the gap, and the injector, finding its process gone, makes
        the reconciler wait for the next pass instead of releasing them."""
        found = self._current(target)
        if found is not None or not self._restarting(target):
            return found
        last = self._last.get(key)
        # The key is a holder's word: it stands for this target's own last container only.
        return last if last is not None and last.target == target else None

    def running(self, pod: KubeObject, target: PodTarget) -> HostContainer:
        """The running container ``target`` of ``pod``, an object the caller already has
        (the node sweep's, from the watch): resolved through CRI as any target is. No
        RuntimeClass is read (an API call per pod and pass): the sweep only inspects the
        device cgroup of the host process that CRI names for the container, whatever
        sandbox it runs in."""
        return self._running(pod, target)

    def remains(self, key: ContainerKey) -> ContainerCgroups | None:
        """The runtime removes a container's cgroups with it: nothing remains."""
        return None

    # --- steps ---------------------------------------------------------------------------------

    def _pod(self, ref: PodTarget) -> KubeObject | None:
        try:
            return self._kube.read_pod(ref.namespace, ref.name)
        except KubeError as e:
            raise LookupFailed(f"could not read pod {ref.namespace}/{ref.name}: {e}") from e

    def _current(self, target: Target) -> HostContainer | None:
        """The running container ``target`` names now, or None when there is none.
        ``LookupFailed`` (the API server or the runtime did not answer) is not "none": it
        goes to the caller, which must not take the target for gone."""
        if not isinstance(target, PodTarget) or target.container is None:
            return None
        pod = self._pod(target)
        if pod is None or (pod.get("spec") or {}).get("nodeName") != self._node:
            return None
        try:
            return self._running(pod, target)
        except LookupFailed:
            raise
        except (TargetNotReady, NotFound, Forbidden):
            return None

    def _restarting(self, target: Target) -> bool:
        """The pod of ``target`` is still on this node, not being deleted, and still has the
        container: the kubelet will start it again."""
        if not isinstance(target, PodTarget) or target.container is None:
            return False
        pod = self._pod(target)
        spec = (pod or {}).get("spec") or {}
        restarting = (
            pod is not None
            and spec.get("nodeName") == self._node
            and not (pod.get("metadata") or {}).get("deletionTimestamp")
            and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
            and any(c.get("name") == target.container for c in spec.get("containers") or [])
        )
        if not restarting:
            for key, container in list(self._last.items()):
                if container.target == target:
                    del self._last[key]
        return restarting

    def _refuse_vm(self, pod: KubeObject, ref: PodTarget) -> None:
        runtime_class = (pod.get("spec") or {}).get("runtimeClassName")
        if not runtime_class:
            return
        try:
            handler = self._kube.read_runtime_class_handler(runtime_class) or runtime_class
        except KubeError as e:
            raise TargetNotReady(f"could not read RuntimeClass {runtime_class}: {e}") from e
        if is_vm_handler(handler) or is_vm_handler(runtime_class):
            raise TargetNotReady(
                f"pod {ref.namespace}/{ref.name} runs in a virtual-machine sandbox "
                f"(RuntimeClass {runtime_class}, handler {handler}): its devices live in a "
                "guest kernel that the node's cgroups and /dev cannot reach",
                hint="GPUs can be hot-plugged only into containers of runc-like runtimes; "
                "start the notebook without a VM RuntimeClass",
                retryable=False,
            )

    @staticmethod
    def _container_name(pod: KubeObject, ref: PodTarget) -> str:
        names = [c.get("name") for c in (pod.get("spec") or {}).get("containers") or []]
        annotations = (pod.get("metadata") or {}).get("annotations") or {}
        wanted = ref.container or annotations.get(CONTAINER_ANNOTATION)
        if wanted is None:
            if len(names) != 1:
                raise InvalidRequest(
                    f"pod {ref.namespace}/{ref.name} has {len(names)} containers "
                    f"({', '.join(map(str, names))}): name one",
                    field="target",
                    hint=f"give target.pod.container, or annotate the pod with "
                    f"{CONTAINER_ANNOTATION}",
                )
            wanted = names[0]
        if wanted not in names:
            raise NotFound("container", f"{ref.namespace}/{ref.name}/{wanted}")
        return str(wanted)

    def _running(self, pod: KubeObject, target: PodTarget) -> HostContainer:
        assert target.container is not None
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        status = next((s for s in statuses if s.get("name") == target.container), None)
        container_id = (status or {}).get("containerID") or ""
        if status is None or "running" not in (status.get("state") or {}) or not container_id:
            raise TargetNotReady(f"container {target.container} of {target} is not running")
        try:
            _, runtime_id = split_container_id(container_id)
        except ValueError as e:
            raise TargetNotReady(f"{target}: {e}", retryable=False) from e
        try:
            runtime = self._cri.container_status(runtime_id)
        except CriError as e:
            raise LookupFailed(f"{target}: {e}") from e
        if runtime is None or not runtime.running:
            raise TargetNotReady(
                f"the container runtime does not run container {target.container} of {target} "
                f"({'unknown id' if runtime is None else runtime.state})"
            )
        return self._host_container(target, ContainerKey(container_id), runtime_id, runtime)

    def _host_container(
        self,
        target: PodTarget,
        key: ContainerKey,
        runtime_id: str,
        runtime: ContainerRuntimeStatus,
    ) -> HostContainer:
        pid = runtime.pid or find_container_pid(runtime_id, proc=self._proc)
        if pid is None:
            raise TargetNotReady(f"no process of {target} found on this host")
        who = procfs.identity(pid, proc=self._proc)
        try:
            text = (self._proc / str(pid) / "cgroup").read_text()
        except OSError as e:
            if not procfs.is_gone(e):
                raise
            who = None
            text = ""
        if who is None:
            raise TargetNotReady(f"the process of {target} exited while being looked up")
        paths = cgroups.parse_proc_cgroup(text)
        expected = expected_cgroup(runtime.cgroups_path) if runtime.cgroups_path else None
        if not any(
            path is not None and (belongs_to(path, runtime_id) or fold_inner(path) == expected)
            for path in (paths.unified, paths.devices_v1)
        ):
            raise TargetNotReady(
                f"process {pid} is not in the cgroup of {target}'s container "
                f"(it is in {paths.unified or paths.devices_v1}); the container may be restarting"
            )
        cgroup_pair = ContainerCgroups(
            devices_v1=fold_inner(paths.devices_v1)
            if self._hierarchies.devices_v1 is not None
            else None,
            unified=fold_inner(paths.unified) if self._hierarchies.unified is not None else None,
        )
        if cgroup_pair.in_root_cgroup:
            raise Forbidden(f"{target}'s process {pid} runs in a root cgroup")
        if self._mount_ns(pid) == self._agent_mount_ns:
            raise Forbidden(
                f"{target} shares the agent's mount namespace: a device node made for it would "
                "be made on the host"
            )
        if procfs.identity(pid, proc=self._proc) != who:
            raise TargetNotReady(f"the process of {target} exited while being looked up")
        found = HostContainer(
            target=target,
            key=key,
            pid=pid,
            start_time=who.start_time,
            cgroups=cgroup_pair,
            label=f"pod {target.namespace}/{target.name} (container {target.container})",
        )
        self._last[key] = found
        return found

    def _mount_ns(self, pid: int) -> int | None:
        try:
            return os.stat(self._proc / str(pid) / "ns" / "mnt").st_ino
        except OSError:
            return None
