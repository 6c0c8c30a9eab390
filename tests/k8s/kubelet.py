"""A kubelet for one node, simulated over the real containerd: what the GPU agent sees of a
node — pods run as real containers, their status in the API, PodResources on a unix socket.

Why it stays beside the real node (``tests/realnode``): it does on demand what a real kubelet
does not — evict a holder by node pressure (a MIG slice's too), keep a holder Pending, run a
pod "in a VM runtime" — and it serves the tier's idle, sweep and allocator-contract tests in
seconds with no build. What
the real kubelet proves (scheduling, restarts of crashed containers, a kubelet restart) is no
longer simulated here (docs/testing.md).

What it does, as the real kubelet (plus the NVIDIA device plugin) would, for pods bound to its
node (``spec.nodeName``: the agent pins its holders; nothing here schedules):

* **Admission** (pods bound with ``spec.nodeName``, which skip the scheduler): no free GPU →
  phase ``Failed``, reason ``OutOf<resource>``, as the kubelet's predicate admission does.
* **Running**: ``RunPodSandbox`` in the node's network namespace, one container per spec
  container, cgroup parent ``<top>/[burstable|besteffort/]pod<uid>`` (cgroupfs driver). Any
  image maps to the local busybox image: a container with a ``command`` runs it; one without
  runs ``sleep infinity``. Status: Running, ready, ``containerID: containerd://<id>``.
  GPUs are assigned in inventory order and served by PodResources ``List``/``Get``.
* **VM runtimes**: a pod whose RuntimeClass handler is in ``vm_handlers`` (kata, gVisor) is
  reported Running with container ids but never reaches runc: there is nothing the agent
  could inject into, so it must refuse such pods by RuntimeClass before asking CRI.
* **Deletion**: a pod marked for deletion is stopped (containers and sandbox removed), its
  GPUs freed, then deleted with grace 0 (the API object goes).
* **On demand**: ``evict`` (node-pressure eviction: Failed/Evicted, stopped, GPUs freed, the
  object left behind).

Not simulated: scheduling, container restarts (a crashed container is not replaced),
device nodes or environment from the device plugin in the holder's container, init
containers, probes, volumes, CNI, container log files.

Threading: everything runs on the fake apiserver's loop (the kubelet reads and writes the
store directly, never through HTTP); CRI calls run in a thread pool; PodResources
(``podresources.py``) is served by gRPC's own threads from a snapshot taken under a lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import secrets
import threading
from collections.abc import Callable, Coroutine
from concurrent import futures
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, Final, TypeVar

from .apiserver.cluster import Cluster
from .apiserver.pods import TERMINAL, pod_requests
from .apiserver.resources import NAMESPACES, NODES, PODS, RUNTIME_CLASSES
from .apiserver.store import Change, now
from .containerd import Containerd, remove_cgroup_tree
from .cri import ContainerInfo, CriClient, ExecResult, pb
from .image import PAUSE_IMAGE, TOOLS_IMAGE
from .inventory import DeviceGpu
from .kube import FakeKube
from .podresources import ContainerDevices, PodDevices, PodResourcesServer

_T = TypeVar("_T")

VM_HANDLERS: Final = frozenset({"kata", "kata-qemu", "kata-clh", "kata-fc", "runsc", "gvisor"})
HOSTNAME_LABEL: Final = "kubernetes.io/hostname"


@dataclass
class _Container:
    name: str
    id: str
    started_at: str = ""


@dataclass
class _PodRecord:
    """What this kubelet runs for one pod (by uid)."""

    namespace: str
    name: str
    uid: str
    sandbox_id: str = ""
    vm: bool = False
    containers: dict[str, _Container] = field(default_factory=dict)
    devices: dict[str, list[str]] = field(default_factory=dict)
    """Container name → device ids assigned to it."""
    resource: str = ""
    cgroup_parent: str = ""
    stopped: bool = False
    runtime_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held while containers of this pod are created or removed."""


class KubeletSimulator:
    def __init__(
        self,
        kube: FakeKube,
        containerd: Containerd,
        *,
        node_name: str,
        gpus: tuple[DeviceGpu, ...],
        pod_resources_socket: Path,
        vm_handlers: frozenset[str] = VM_HANDLERS,
    ) -> None:
        self.kube = kube
        self.api = kube.server
        self.containerd = containerd
        self.node_name = node_name
        self.gpus = gpus
        self.pod_resources_socket = pod_resources_socket
        self.vm_handlers = vm_handlers
        self.cri = CriClient(containerd.endpoint)
        self._label = {"k8stier.kubelet": secrets.token_hex(6)}
        """On every sandbox this kubelet starts, so ``stop`` finds them all."""
        self._executor = futures.ThreadPoolExecutor(4, thread_name_prefix="kubelet-cri")
        self._records: dict[tuple[str, str], _PodRecord] = {}
        self._lock = threading.Lock()  # guards _records for PodResources' threads
        self._workers: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._dirty: set[tuple[str, str]] = set()
        self._pod_resources = PodResourcesServer(pod_resources_socket, self._snapshot)
        self._stopping = False
        self.errors: list[str] = []
        """Failures of the simulator itself (a test fixture fails the test on any)."""

    @property
    def cluster(self) -> Cluster:
        return self.api.cluster

    @property
    def cri_socket(self) -> Path:
        """containerd's socket, which serves CRI."""
        return self.containerd.address

    @property
    def cri_endpoint(self) -> str:
        """``unix://`` + ``cri_socket``, as kubelet's ``--container-runtime-endpoint``."""
        return self.containerd.endpoint

    # ----- life cycle -------------------------------------------------------------------

    def start(self) -> None:
        self.api.call(self._register)
        self._pod_resources.start()

    def stop(self) -> None:
        """Stop serving and remove every pod this kubelet started (the API objects stay)."""
        self._pod_resources.stop()
        with contextlib.suppress(RuntimeError):
            self.api.call(self._detach)
        # CRI calls already running finish first; a sandbox they made may be in no record.
        self._executor.shutdown(wait=True)
        for sandbox in self.cri.list_pod_sandboxes(self._label):
            self.cri.stop_pod_sandbox(sandbox.id)
            self.cri.remove_pod_sandbox(sandbox.id)
        self.cri.close()

    def _detach(self) -> None:
        self._stopping = True
        for task in self._workers.values():
            task.cancel()

    def _register(self) -> None:
        count: dict[str, int] = {}
        for gpu in self.gpus:
            count[gpu.resource] = count.get(gpu.resource, 0) + 1
        resources = {"cpu": "16", "memory": "128Gi", "pods": "110"} | {
            k: str(v) for k, v in count.items()
        }
        self.cluster.create(
            NODES,
            "",
            {
                "metadata": {
                    "name": self.node_name,
                    "labels": {HOSTNAME_LABEL: self.node_name, "kubernetes.io/os": "linux"},
                },
                "status": {
                    "capacity": resources,
                    "allocatable": resources,
                    "conditions": [
                        {
                            "type": "Ready",
                            "status": "True",
                            "reason": "KubeletReady",
                            "message": "kubelet is posting ready status",
                            "lastHeartbeatTime": now(),
                            "lastTransitionTime": now(),
                        },
                    ],
                    "addresses": [
                        {"type": "InternalIP", "address": "127.0.0.1"},
                        {"type": "Hostname", "address": self.node_name},
                    ],
                    "nodeInfo": _node_info(),
                },
            },
        )
        self.cluster.store.on_change(self._on_change)
        for pod in self.cluster.store.list(PODS):
            self._kick(pod["metadata"]["namespace"], pod["metadata"]["name"])

    # ----- reacting to the API ----------------------------------------------------------

    def _on_change(self, change: Change) -> None:
        if change.resource != PODS or self._stopping:
            return
        meta = change.object["metadata"]
        key = (meta["namespace"], meta["name"])
        if self._mine(change.object) or key in self._records:
            self._kick(*key)

    def _mine(self, pod: dict[str, Any]) -> bool:
        return bool(pod.get("spec", {}).get("nodeName") == self.node_name)

    def _kick(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        if key in self._workers:
            self._dirty.add(key)
            return
        self._workers[key] = asyncio.get_running_loop().create_task(self._worker(key))

    async def _worker(self, key: tuple[str, str]) -> None:
        try:
            while True:
                self._dirty.discard(key)
                try:
                    await self._sync(*key)
                except asyncio.CancelledError:
                    raise
                except Exception as error:  # the fixture turns these into test failures
                    self.errors.append(f"sync {key[0]}/{key[1]}: {error!r}")
                if key not in self._dirty:
                    return
        finally:
            self._workers.pop(key, None)

    async def _cri(self, function: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)

    async def _sync(self, namespace: str, name: str) -> None:
        pod = self.cluster.store.find(PODS, namespace, name)
        record = self._records.get((namespace, name))
        if record is not None and (pod is None or pod["metadata"]["uid"] != record.uid):
            await self._teardown(record)  # deleted (or replaced) behind our back
            record = None
        if pod is None:
            return
        if not self._mine(pod):
            return
        meta, phase = pod["metadata"], pod.get("status", {}).get("phase")
        if meta.get("deletionTimestamp"):
            if record is not None:
                await self._teardown(record)
            self._finish_deletion(namespace, name, meta["uid"])
            return
        if phase in TERMINAL:
            if record is not None and not record.stopped:
                await self._teardown(record, forget=False)
            return
        if record is None:
            await self._admit_and_run(pod)

    # ----- admission --------------------------------------------------------------------

    def _wanted(self, pod: dict[str, Any]) -> dict[str, int]:
        resources = {g.resource for g in self.gpus}
        limits = pod_requests(pod, "limits")
        return {r: int(limits.get(r, Decimal(0))) for r in resources if limits.get(r)}

    def _free(self) -> dict[str, list[DeviceGpu]]:
        with self._lock:
            used = {
                d
                for r in self._records.values()
                if not r.stopped
                for ds in r.devices.values()
                for d in ds
            }
        free: dict[str, list[DeviceGpu]] = {}
        for gpu in self.gpus:
            if gpu.id not in used:
                free.setdefault(gpu.resource, []).append(gpu)
        return free

    def _shortfall(self, pod: dict[str, Any]) -> tuple[str, int, int] | None:
        """(resource, requested, free) for the first resource the pod cannot get."""
        free = {resource: len(gpus) for resource, gpus in self._free().items()}
        for resource, count in sorted(self._wanted(pod).items()):
            if free.get(resource, 0) < count:
                return resource, count, max(free.get(resource, 0), 0)
        return None

    def _reject(self, pod: dict[str, Any], resource: str, requested: int, free: int) -> None:
        capacity = sum(1 for g in self.gpus if g.resource == resource)
        pod["status"] = pod.get("status", {}) | {
            "phase": "Failed",
            "reason": f"OutOf{resource}",
            "message": f"Pod was rejected: Node didn't have enough resource: {resource}, "
            f"requested: {requested}, used: {capacity - free}, capacity: {capacity}",
            "startTime": now(),
        }
        self.cluster.replace(
            PODS, pod["metadata"]["namespace"], pod["metadata"]["name"], pod, "status"
        )

    async def _admit_and_run(self, pod: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        short = self._shortfall(pod)
        if short is not None:
            self._reject(pod, *short)
            return
        handler = ""
        if spec.get("runtimeClassName"):
            runtime_class = self.cluster.store.find(RUNTIME_CLASSES, "", spec["runtimeClassName"])
            if runtime_class is None:
                return  # the real kubelet keeps retrying the sandbox; so do we, on the next change
            handler = runtime_class["handler"]
        record = _PodRecord(
            meta["namespace"], meta["name"], meta["uid"], vm=handler in self.vm_handlers
        )
        free = self._free()
        for container in spec["containers"]:
            for resource, count in sorted(
                self._wanted({"spec": {"containers": [container]}}).items()
            ):
                taken, free[resource] = free[resource][:count], free[resource][count:]
                record.devices.setdefault(container["name"], []).extend(g.id for g in taken)
                record.resource = resource
        with self._lock:
            self._records[(record.namespace, record.name)] = record
        self._write_status(record, pending=True)
        async with record.runtime_lock:
            if record.vm:
                for container in spec["containers"]:
                    record.containers[container["name"]] = _Container(
                        container["name"],
                        _vm_container_id(record, container["name"]),
                        started_at=now(),
                    )
            else:
                record.cgroup_parent = self._cgroup_parent(pod)
                record.sandbox_id = await self._cri(
                    self.cri.run_pod_sandbox, self._sandbox_config(pod), handler
                )
                for container in spec["containers"]:
                    record.containers[container["name"]] = await self._start_container(
                        pod, record, container
                    )
            if not record.stopped:
                self._write_status(record)

    # ----- the runtime ------------------------------------------------------------------

    def _cgroup_parent(self, pod: dict[str, Any]) -> str:
        qos = pod.get("status", {}).get("qosClass", "BestEffort")
        middle = {"Guaranteed": "", "Burstable": "/burstable", "BestEffort": "/besteffort"}[qos]
        return f"{self.containerd.cgroup_top}{middle}/pod{pod['metadata']['uid']}"

    def _labels(self, pod: dict[str, Any]) -> dict[str, str]:
        meta = pod["metadata"]
        return self._label | {
            "io.kubernetes.pod.name": meta["name"],
            "io.kubernetes.pod.namespace": meta["namespace"],
            "io.kubernetes.pod.uid": meta["uid"],
        }

    def _sandbox_config(self, pod: dict[str, Any]) -> Any:
        meta, p = pod["metadata"], pb()
        return p.PodSandboxConfig(
            metadata=p.PodSandboxMetadata(
                name=meta["name"], uid=meta["uid"], namespace=meta["namespace"]
            ),
            labels=self._labels(pod),
            linux=p.LinuxPodSandboxConfig(
                cgroup_parent=self._cgroup_parent(pod),
                security_context=p.LinuxSandboxSecurityContext(
                    namespace_options=p.NamespaceOption(network=p.NODE)
                ),
            ),
        )

    async def _start_container(
        self, pod: dict[str, Any], record: _PodRecord, container: dict[str, Any]
    ) -> _Container:
        p = pb()
        command = list(container.get("command") or [])
        config = p.ContainerConfig(
            metadata=p.ContainerMetadata(name=container["name"], attempt=0),
            image=p.ImageSpec(image=TOOLS_IMAGE if command else PAUSE_IMAGE),
            command=command,
            args=list(container.get("args") or []) if command else [],
            envs=[
                p.KeyValue(key=e["name"], value=str(e.get("value", "")))
                for e in container.get("env") or []
            ],
            labels=self._labels(pod) | {"io.kubernetes.container.name": container["name"]},
        )
        sandbox_config = self._sandbox_config(pod)
        container_id = await self._cri(
            self.cri.create_container, record.sandbox_id, config, sandbox_config
        )
        await self._cri(self.cri.start_container, container_id)
        return _Container(container["name"], container_id, started_at=now())

    async def _teardown(self, record: _PodRecord, *, forget: bool = True) -> None:
        """Stop the pod's containers and sandbox; free its GPUs."""
        async with record.runtime_lock:
            await self._cri(self._remove_runtime, record)
        with self._lock:
            record.stopped = True
            if forget and self._records.get((record.namespace, record.name)) is record:
                del self._records[(record.namespace, record.name)]

    def _release(self, record: _PodRecord) -> None:
        """A terminal pod's devices are free (and out of PodResources) from the moment its
        phase is written, even while its sandbox is still being removed."""
        with self._lock:
            record.stopped = True

    def _remove_runtime(self, record: _PodRecord) -> None:
        sandbox, record.sandbox_id = record.sandbox_id, ""
        if sandbox:
            self.cri.stop_pod_sandbox(sandbox)
            self.cri.remove_pod_sandbox(sandbox)
        if record.cgroup_parent:  # runc removes the containers' cgroups, the kubelet the pod's
            left = remove_cgroup_tree(record.cgroup_parent)
            self.errors.extend(f"pod cgroup not removable: {path}" for path in left)

    def _finish_deletion(self, namespace: str, name: str, uid: str) -> None:
        with contextlib.suppress(Exception):
            self.cluster.delete(
                PODS, namespace, name, {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}}
            )

    # ----- status -----------------------------------------------------------------------

    def _write_status(self, record: _PodRecord, *, pending: bool = False) -> None:
        pod = self.cluster.store.find(PODS, record.namespace, record.name)
        if pod is None or pod["metadata"]["uid"] != record.uid:
            return
        status = pod.setdefault("status", {})
        status.setdefault("startTime", now())
        status["hostIP"] = status["podIP"] = "127.0.0.1"
        status["hostIPs"] = status["podIPs"] = [{"ip": "127.0.0.1"}]
        _set_condition(status, "PodScheduled", "True")
        _set_condition(status, "Initialized", "True")
        for kind in ("ContainersReady", "Ready"):
            _set_condition(status, kind, "False" if pending else "True")
        statuses = []
        for container in pod["spec"]["containers"]:
            running = record.containers.get(container["name"])
            entry: dict[str, Any] = {
                "name": container["name"],
                "image": container["image"],
                "imageID": "",
                "ready": running is not None and not pending,
                "restartCount": 0,
                "started": running is not None and not pending,
            }
            if running is None or pending:
                entry["state"] = {"waiting": {"reason": "ContainerCreating"}}
            else:
                entry["containerID"] = f"containerd://{running.id}"
                entry["imageID"] = _image_id(container)
                entry["state"] = {"running": {"startedAt": running.started_at}}
            statuses.append(entry)
        status["containerStatuses"] = statuses
        status["phase"] = "Pending" if pending else "Running"
        self.cluster.replace(PODS, record.namespace, record.name, pod, "status")

    # ----- on demand --------------------------------------------------------------------

    async def _evict(self, namespace: str, name: str) -> None:
        pod = self.cluster.store.get(PODS, namespace, name)
        pod["status"] = pod.get("status", {}) | {
            "phase": "Failed",
            "reason": "Evicted",
            "message": "The node was low on resource: memory. ",
        }
        for entry in pod["status"].get("containerStatuses") or []:
            entry["ready"], entry["started"] = False, False
            entry["state"] = {
                "terminated": {
                    "exitCode": 137,
                    "reason": "Error",
                    "containerID": entry.get("containerID"),
                    "startedAt": entry.get("state", {}).get("running", {}).get("startedAt"),
                    "finishedAt": now(),
                }
            }
        for condition in pod["status"].get("conditions") or []:
            if condition["type"] in ("Ready", "ContainersReady"):
                condition["status"] = "False"
        record = self._records.get((namespace, name))
        if record is not None:
            self._release(record)
        self.cluster.replace(PODS, namespace, name, pod, "status")
        if record is not None:
            await self._teardown(record, forget=False)

    def _on_loop(self, coroutine: Coroutine[Any, Any, _T]) -> futures.Future[_T]:
        if self.api.on_loop_thread():
            coroutine.close()
            raise RuntimeError("called on the apiserver's own loop: it would wait for itself")
        return asyncio.run_coroutine_threadsafe(coroutine, self.api.loop)

    def evict(self, namespace: str, name: str) -> None:
        """Evict like node-pressure eviction: phase Failed, reason Evicted, containers
        stopped and GPUs freed; the object stays (the kubelet leaves an evicted pod for the
        pod garbage collector), which no real node does on demand. Blocks until done."""
        self._on_loop(self._evict(namespace, name)).result(timeout=120)

    # ----- notebook pods and what is inside ---------------------------------------------

    def run_notebook_pod(
        self,
        namespace: str,
        name: str,
        *,
        runtime_class: str | None = None,
        annotations: dict[str, str] | None = None,
        resources: dict[str, dict[str, str]] | None = None,
    ) -> dict[str, Any]:
        """Create a notebook-like pod on this node through the API (container ``notebook``:
        ``sleep infinity`` in busybox, in namespace ``namespace``, which is created if
        missing) and wait until it runs; returns the pod as the API serves it
        (``status.containerStatuses[*].containerID`` is ``containerd://<id>``)."""
        if self.kube.call(self.cluster.store.find, NAMESPACES, "", namespace) is None:
            self.kube.create_namespace(namespace)
        notebook = {
            "name": "notebook",
            "image": "quay.io/jupyter/base-notebook:latest",
            "command": ["sleep", "infinity"],
            "resources": resources or {},
        }
        spec: dict[str, Any] = {
            "nodeName": self.node_name,
            "serviceAccountName": "default",
            "containers": [notebook],
        }
        if runtime_class is not None:
            spec["runtimeClassName"] = runtime_class
        body = {
            "metadata": {
                "name": name,
                "annotations": annotations or {},
                "labels": {"app": "notebook"},
            },
            "spec": spec,
        }
        self.kube.create_pod(namespace, body)
        pod = self.kube.wait_for_pod(
            namespace, name, lambda p: p is None or p["status"].get("phase") != "Pending", "it runs"
        )
        if pod is None or pod["status"]["phase"] != "Running":
            raise AssertionError(
                f"notebook pod {namespace}/{name} did not run: {pod and pod['status']}"
            )
        return pod

    def container_id(self, namespace: str, pod: str, container: str) -> str:
        """The running container's id (no ``containerd://``), from this kubelet's records."""
        with self._lock:
            return self._records[(namespace, pod)].containers[container].id

    def container_info(self, namespace: str, pod: str, container: str) -> ContainerInfo:
        """containerd's verbose ContainerStatus of the running container (pid, cgroups)."""
        return self.cri.container_status(self.container_id(namespace, pod, container))

    def exec(self, namespace: str, pod: str, container: str, argv: list[str]) -> ExecResult:
        """Run ``argv`` inside the container through CRI ``ExecSync`` (``kubectl exec``):
        the process is in the container's cgroups and mount namespace, so e.g. ``cat
        /dev/nvidia0`` reports ENOENT, ENXIO or EPERM exactly as the workload sees it."""
        return self.cri.exec_sync(self.container_id(namespace, pod, container), argv)

    # ----- PodResources -----------------------------------------------------------------

    def assignments(self) -> dict[tuple[str, str], dict[str, list[str]]]:
        """(namespace, pod) → container → device ids, for running pods (thread-safe)."""
        with self._lock:
            return {
                key: {c: list(ids) for c, ids in r.devices.items()}
                for key, r in self._records.items()
                if not r.stopped
            }

    @property
    def pod_resources_lists(self) -> int:
        """How many PodResources ``List`` calls the simulated kubelet has served."""
        return self._pod_resources.lists

    def _snapshot(self) -> list[PodDevices]:
        """What PodResources reports: every running pod, each container's devices."""
        with self._lock:
            return [
                PodDevices(
                    r.namespace,
                    r.name,
                    tuple(
                        ContainerDevices(name, r.resource, tuple(r.devices.get(name, ())))
                        for name in r.containers or r.devices
                    ),
                )
                for r in self._records.values()
                if not r.stopped
            ]


def _set_condition(status: dict[str, Any], kind: str, value: str) -> None:
    """Set a condition, keeping its lastTransitionTime when its status did not change."""
    condition: dict[str, Any] = {
        "type": kind,
        "status": value,
        "lastTransitionTime": now(),
        "lastProbeTime": None,
    }
    conditions = status.setdefault("conditions", [])
    for i, old in enumerate(conditions):
        if old["type"] == condition["type"]:
            if old.get("status") == condition["status"]:
                condition = condition | {"lastTransitionTime": old.get("lastTransitionTime")}
            conditions[i] = condition
            return
    conditions.append(condition)


def _vm_container_id(record: _PodRecord, container: str) -> str:
    """A stable fake id: a VM runtime's containers are not containerd's to resolve."""
    return hashlib.sha256(f"vm/{record.uid}/{container}".encode()).hexdigest()


def _image_id(container: dict[str, Any]) -> str:
    image = TOOLS_IMAGE if container.get("command") else PAUSE_IMAGE
    return image


def _node_info() -> dict[str, str]:
    return {
        "machineID": "k8stier",
        "systemUUID": "k8stier",
        "bootID": "k8stier",
        "kernelVersion": "",
        "osImage": "Debian GNU/Linux 12 (bookworm)",
        "containerRuntimeVersion": "containerd://1.6.20",
        "kubeletVersion": "v1.34.0-k8stier",
        "kubeProxyVersion": "",
        "operatingSystem": "linux",
        "architecture": "amd64",
    }
