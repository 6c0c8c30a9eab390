"""What a test does on the real node, in the words of a test: namespaces, notebook pods, pod-bound
tokens, exec, PodResources, holders, events — all through the real apiserver, kubelet and
containerd (the official client, CRI ``ExecSync``, the kubelet's PodResources socket).

Why a layer of its own: the scenarios of Kubernetes mode read the same on the fake control plane
(``tests/k8s``) and here; this module gives them the real node's answers without the tests
knowing how a token is minted or where a container's id comes from.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import grpc
from kubernetes import client as k8s

from jupyter_gpu_hotplug.agent.kubernetes.podresources import PodResourcesClient
from jupyter_gpu_hotplug.agent.kubernetes.protos import podresources_pb2 as pb

from ..k8s.cri import CriClient, ExecResult
from ..k8s.image import TOOLS_IMAGE
from ..manifests.support import kubectl as kubectl_binary
from .node import GPU_RESOURCE, RealNode

HOLDER_LABEL: Final = "gpu-hotplug.jupyter.org/holder"
AUDIENCE: Final = "gpu-hotplug"
RESTRICTED_POD: Final = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "seccompProfile": {"type": "RuntimeDefault"},
}
"""The pod-level part of what PodSecurity ``restricted`` requires."""
NOTEBOOKS_LABEL: Final = "gpu-hotplug.jupyter.org/notebooks"
"""The namespace label the agent's default allowlist selects (``--allowed-namespace-selector``)."""
WAIT: Final = 120.0
"""Upper bound, in seconds, of a wait for the cluster to act (never asserted on as a time)."""


def eventually(check: Callable[[], Any], what: str, timeout: float = WAIT) -> Any:
    """Poll ``check()`` until it returns something true; fail after ``timeout`` saying what."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.2)


@dataclass
class Cluster:
    """The real node as tests use it."""

    node: RealNode

    def __post_init__(self) -> None:
        self.api = self.node.api_client()
        # Typed as Any: tests pass plain dicts as bodies, which the client serializes as is.
        self.core: Any = k8s.CoreV1Api(self.api)
        self.cri = CriClient(self.node.cri_endpoint)

    @property
    def node_name(self) -> str:
        return self.node.node_name

    def close(self) -> None:
        self.cri.close()
        self.api.close()

    # ------------------------------------------------------------------ namespaces
    def namespace(
        self, prefix: str = "nb", *, pod_security: str | None = "baseline", gpus: bool = True
    ) -> str:
        """A fresh namespace (PodSecurity ``enforce`` level as given), once its default
        ServiceAccount exists (pods need it). ``gpus``: labelled as the operator guide tells
        operators to label notebook namespaces (``NOTEBOOKS_LABEL``), so the agent's default
        namespace allowlist admits its pods; ``False`` for a namespace the agent must refuse."""
        name = f"{prefix}-{secrets.token_hex(3)}"
        labels = (
            {} if pod_security is None else {"pod-security.kubernetes.io/enforce": pod_security}
        )
        if gpus:
            labels[NOTEBOOKS_LABEL] = "true"
        self.core.create_namespace({"metadata": {"name": name, "labels": labels}})
        eventually(
            lambda: _exists(lambda: self.core.read_namespaced_service_account("default", name)),
            f"the default ServiceAccount of {name}",
        )
        return name

    # ------------------------------------------------------------------ pods
    def run_notebook_pod(
        self,
        namespace: str,
        name: str,
        *,
        annotations: dict[str, str] | None = None,
        resources: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        runtime_class: str | None = None,
        image: str = TOOLS_IMAGE,
        host_files: dict[str, str] | None = None,
        read_only_root: bool = False,
        restricted: bool = False,
        node: str | None = None,
    ) -> dict[str, Any]:
        """A pod with container ``notebook`` (``sleep``, busybox's unless ``image`` says
        otherwise), Running; returns it. ``runtime_class``: its ``runtimeClassName`` (none: the
        node's default, runc); ``host_files``: host path → path in the container, read-only;
        ``restricted``: as PodSecurity ``restricted`` requires (non-root, seccomp, no
        capabilities, no privilege escalation); ``node``: scheduled to that node only (a
        ``nodeSelector`` on its hostname label)."""
        container: dict[str, Any] = {
            "name": "notebook",
            "image": image,
            "imagePullPolicy": "Never",
            "command": ["sleep", "infinity"],
        }
        if resources:
            container["resources"] = resources
        if env:
            container["env"] = [{"name": k, "value": v} for k, v in env.items()]
        context: dict[str, Any] = {"readOnlyRootFilesystem": True} if read_only_root else {}
        if restricted:
            context |= {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
        if context:
            container["securityContext"] = context
        volumes = [
            {"name": f"host-{i}", "hostPath": {"path": host}}
            for i, host in enumerate(host_files or {})
        ]
        if volumes:
            container["volumeMounts"] = [
                {"name": f"host-{i}", "mountPath": path, "readOnly": True}
                for i, path in enumerate((host_files or {}).values())
            ]
        body: dict[str, Any] = {
            "metadata": {"name": name, "annotations": annotations or {}},
            "spec": {
                "containers": [container],
                "terminationGracePeriodSeconds": 1,
                **({"volumes": volumes} if volumes else {}),
                **({"securityContext": RESTRICTED_POD} if restricted else {}),
            },
        }
        if runtime_class is not None:
            body["spec"]["runtimeClassName"] = runtime_class
        if node is not None:
            body["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
        self.core.create_namespaced_pod(namespace, body)
        return self.wait_running(namespace, name)

    def pod(self, namespace: str, name: str) -> dict[str, Any]:
        pod: dict[str, Any] = self.api.sanitize_for_serialization(
            self.core.read_namespaced_pod(name, namespace)
        )
        return pod

    def pods(self, namespace: str, selector: str | None = None) -> list[dict[str, Any]]:
        found = self.core.list_namespaced_pod(namespace, label_selector=selector)
        return [self.api.sanitize_for_serialization(p) for p in found.items]

    def wait_running(self, namespace: str, name: str) -> dict[str, Any]:
        def running() -> dict[str, Any] | None:
            pod = self.pod(namespace, name)
            phase = pod["status"].get("phase")
            assert phase not in ("Failed", "Succeeded"), f"{name}: {pod['status']}"
            statuses = pod["status"].get("containerStatuses") or []
            ready = statuses and all("running" in (s.get("state") or {}) for s in statuses)
            return pod if phase == "Running" and ready else None

        pod: dict[str, Any] = eventually(running, f"pod {namespace}/{name} Running")
        return pod

    def delete_pod(self, namespace: str, name: str, grace: int | None = 0) -> None:
        self.core.delete_namespaced_pod(name, namespace, grace_period_seconds=grace)

    def gone(self, namespace: str, name: str) -> bool:
        return not _exists(lambda: self.core.read_namespaced_pod(name, namespace))

    def holders(self, namespace: str) -> list[dict[str, Any]]:
        return self.pods(namespace, f"{HOLDER_LABEL}=true")

    def event_reasons(self, namespace: str, pod: str) -> list[str]:
        events = self.core.list_namespaced_event(namespace).items
        return [str(e.reason) for e in events if e.involved_object.name == pod]

    # ------------------------------------------------------------------ identity
    def pod_token(
        self, namespace: str, pod: str, *, audience: str = AUDIENCE, seconds: int = 3600
    ) -> str:
        """A token of the pod's ServiceAccount bound to the pod, as the kubelet projects it
        (TokenRequest with a Pod bound object)."""
        target = self.core.read_namespaced_pod(pod, namespace)
        request = {
            "spec": {
                "audiences": [audience],
                "expirationSeconds": seconds,
                "boundObjectRef": {
                    "kind": "Pod",
                    "apiVersion": "v1",
                    "name": pod,
                    "uid": target.metadata.uid,
                },
            }
        }
        answer = self.core.create_namespaced_service_account_token(
            target.spec.service_account_name or "default", namespace, request
        )
        return str(answer.status.token)

    # ------------------------------------------------------------------ containers
    def container_id(self, namespace: str, pod: str, container: str = "notebook") -> str:
        statuses = self.pod(namespace, pod)["status"].get("containerStatuses") or []
        for status in statuses:
            if status["name"] == container and status.get("containerID"):
                return str(status["containerID"]).partition("://")[2]
        raise AssertionError(f"{namespace}/{pod} has no running container {container}")

    def exec(
        self,
        namespace: str,
        pod: str,
        argv: list[str],
        container: str = "notebook",
        *,
        timeout: int = 10,
    ) -> ExecResult:
        """Run ``argv`` in the container (CRI ``ExecSync``, what ``kubectl exec`` ends in),
        for at most ``timeout`` seconds. A pod on another node of the cluster (the VM node) is
        reached as ``kubectl exec`` reaches it: the API server, then that node's kubelet; a
        failure on that way, before the command started, is tried again."""
        found = self.pod(namespace, pod)
        if found["spec"].get("nodeName") == self.node_name:
            return self.cri.exec_sync(self.container_id(namespace, pod, container), argv, timeout)
        command = [kubectl_binary(), f"--kubeconfig={self.node.admin_kubeconfig}", "exec",
                   f"--request-timeout={timeout}s", "-n", namespace, pod, "-c", container,
                   "--", *argv]  # fmt: skip
        result = _run_exec(command, timeout)
        for _ in range(_EXEC_RETRIES):
            if not _exec_never_ran(result):
                break
            time.sleep(_EXEC_RETRY_S)
            result = _run_exec(command, timeout)
        return result

    def open_device(self, namespace: str, pod: str, minor: int) -> str:
        """What opening ``/dev/nvidia<minor>`` in the notebook says (ENXIO: allowed, the
        simulated GPU has no driver; EPERM: the device cgroup denies it)."""
        result = self.exec(namespace, pod, ["cat", f"/dev/nvidia{minor}"])
        return result.stdout + result.stderr

    def open_fresh_node(self, namespace: str, pod: str, minor: int) -> str:
        """Make a node for the device in the container and open it: the cgroup alone decides."""
        script = f"mknod /tmp/probe{minor} c 195 {minor} 2>&1; cat /tmp/probe{minor}"
        result = self.exec(namespace, pod, ["sh", "-c", script])
        return result.stdout + result.stderr

    def restart_container(self, namespace: str, pod: str, container: str = "notebook") -> str:
        """Kill the container's process: the real kubelet restarts it; returns the new id."""
        old = self.container_id(namespace, pod, container)
        self.cri.stop_container(old, timeout=0)

        def restarted() -> str | None:
            current = _maybe(lambda: self.container_id(namespace, pod, container))
            if current is None or current == old:
                return None
            self.wait_running(namespace, pod)
            return current

        new: str = eventually(restarted, f"{namespace}/{pod}/{container} restarted by the kubelet")
        return new

    # ------------------------------------------------------------------ kubelet
    def assignments(
        self, namespace: str | None = None, resource: str = GPU_RESOURCE
    ) -> dict[tuple[str, str], set[str]]:
        """(namespace, pod) → ids of ``resource`` the kubelet's PodResources ``List`` reports."""
        lister = PodResourcesClient(self.node.pod_resources_socket)
        try:
            found: dict[tuple[str, str], set[str]] = {}
            for pod in lister.list():
                if namespace not in (None, pod.namespace):
                    continue
                ids = set(pod.device_ids(resource))
                if ids:
                    found[(pod.namespace, pod.name)] = ids
            return found
        finally:
            lister.close()

    def podresources_get(self, namespace: str, pod: str, resource: str = GPU_RESOURCE) -> set[str]:
        """The ids of ``resource`` of one pod from the kubelet's PodResources ``Get`` itself (no
        fallback to ``List``: this proves the real kubelet serves ``Get``)."""
        channel = grpc.insecure_channel(f"unix://{self.node.pod_resources_socket}")
        try:
            get = channel.unary_unary(
                "/v1.PodResourcesLister/Get",
                request_serializer=pb.GetPodResourcesRequest.SerializeToString,
                response_deserializer=pb.GetPodResourcesResponse.FromString,
            )
            answer = get(
                pb.GetPodResourcesRequest(pod_name=pod, pod_namespace=namespace), timeout=10
            )
        finally:
            channel.close()
        return {
            device_id
            for container in answer.pod_resources.containers
            for devices in container.devices
            if devices.resource_name == resource
            for device_id in devices.device_ids
        }

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        return self.node.kubectl(*args, input=input, check=check)

    def apply(self, objects: list[dict[str, Any]] | dict[str, Any]) -> str:
        """``kubectl apply`` of objects (server-side validation and admission apply)."""
        items = objects if isinstance(objects, list) else [objects]
        return self.kubectl(
            "apply",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}),
        )


def _exists(read: Callable[[], Any]) -> bool:
    try:
        read()
    except k8s.ApiException as error:
        if error.status == 404:
            return False
        raise
    return True


def _maybe(read: Callable[[], str]) -> str | None:
    try:
        return read()
    except (AssertionError, subprocess.SubprocessError):
        return None


_EXEC_RETRIES: Final = 2
_EXEC_RETRY_S: Final = 5.0
_EXEC_NEVER_RAN: Final = (
    "error executing command in container",
    "error dialing backend",
    "unable to upgrade connection",
)
"""What ``kubectl exec`` says when the command was never started: the kubelet or the runtime
failed on the way (the loaded CI machine's VM node once answered "failed to load task:
context deadline exceeded"), not the command."""


def _exec_never_ran(result: ExecResult) -> bool:
    return result.exit_code != 0 and any(sign in result.stderr for sign in _EXEC_NEVER_RAN)


def _run_exec(command: list[str], timeout: int) -> ExecResult:
    """One ``kubectl exec``, bounded; retried only when :func:`_exec_never_ran` says so."""
    done = subprocess.run(command, capture_output=True, timeout=timeout + 30, check=False)
    # Decoded as bytes, not text=True: that would turn the answer's CRLFs into LFs.
    return ExecResult(done.returncode, done.stdout.decode(), done.stderr.decode())
