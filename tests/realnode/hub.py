"""A real JupyterHub on the real node, deployed as zero-to-jupyterhub deploys one: a hub pod
with its ServiceAccount and namespaced RBAC (KubeSpawner creates and deletes the users' pods), a
proxy pod (``configurable-http-proxy`` from npm), their Services, and the users' notebook pods
spawned by KubeSpawner from the notebook image — all images built here with no registry
(``image/build.sh --image hub|notebook``) and imported into the node's containerd.

Why: the path a platform team tries first — a hub spawns a CPU notebook that later attaches a
GPU through its node's agent with its own pod-bound token — had never run as a whole. The
hub's configuration is ``hub_config/jupyterhub_config.py`` over two values files, given in
Helm's order: the tier's (below: images, users, the simulation's pieces) and
``k8s/jupyterhub/values.yaml`` unedited, as the operator guide tells platform teams to give it
to z2jh.

What differs from a cloud, and why it does not change what is proven:
- no cluster DNS on this node: the hub's and proxy's addresses come from the Services'
  environment variables (``HUB_SERVICE_HOST``), and notebook pods resolve the agent's Service
  name (``gpu-hotplug-agent.gpu-hotplug.svc``, the product's default URL) through a
  ``hostAliases`` entry naming its ClusterIP. The name, port, Service routing
  (``internalTrafficPolicy: Local``), NetworkPolicy-free path and token are the product's.
- the GPU is simulated: notebook pods get the fake NVML's configuration file (read-only, from
  the host) and the variables that point the fake library at it. The library itself is not
  there at start — the agent mounts it from the node's CDI spec at attach, as it mounts
  ``libnvidia-ml.so.1`` on a GPU Operator >= 25.10 node.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import yaml

from jupyter_gpu_hotplug._structs import IDLE_RELEASE_ANNOTATION
from jupyter_gpu_hotplug.nvml.sim import CONFIG_ENV, DEVICE_FILTER_ENV
from jupyter_gpu_hotplug.spawner import DEFAULT_K8S_AGENT_URL

from ..demo.jupyter_api import JupyterServer
from ..manifests.support import K8S_DIR
from .cluster import Cluster, eventually

if TYPE_CHECKING:
    from ..image.hub_images import BuiltImage

NAMESPACE: Final = "jhub"
USERS: Final = ("alice", "bob")
CONFIG: Final = Path(__file__).parent / "hub_config" / "jupyterhub_config.py"
PRODUCT_VALUES: Final = K8S_DIR / "jupyterhub" / "values.yaml"
HUB_UID: Final = 1000
MAX_GPUS: Final = 4
"""What one server may hold: every whole GPU of the node, so one user can take them all."""
IDLE_PROFILE: Final = "cpu-short-idle"
"""The tier's second CPU profile: an attached GPU unused for ``IDLE_SECONDS`` goes back."""
IDLE_SECONDS: Final = 40
"""Short enough to watch in a test, long enough for a cell to run on the GPU first."""
SERVICE_NAME: Final = "tier"
"""The hub service whose token the tests use for the REST API (admin of servers)."""
HUB_PORT: Final = 8081
PROXY_PORT: Final = 8000
PROXY_API_PORT: Final = 8001
VALUES_ENV: Final = "/etc/jupyterhub/tier-values.yaml:/etc/jupyterhub/gpu-hotplug-values.yaml"
"""``HUB_VALUES`` of the hub pod: the tier's values, then the product's (Helm's ``-f`` order)."""
READY_TIMEOUT: Final = 300.0
"""Upper bound for the hub and proxy pods to be Ready (never asserted on as a time)."""


@dataclass(frozen=True)
class Hub:
    """A running hub: its public URL (the proxy's Service), the users' password and an API
    token of the ``tier`` service, allowed to start, stop and reach every user's server."""

    cluster: Cluster
    url: str
    password: str
    api_token: str

    @property
    def rest(self) -> JupyterServer:
        """The hub's REST API (``hub/api/...``) with the tier's token."""
        return JupyterServer(self.url, self.api_token)

    def user_server(self, user: str) -> UserServer:
        """``user``'s server through the proxy, with the tier's token (``access:servers``)."""
        return UserServer(f"{self.url}/user/{user}", self.api_token)

    def server_pod(self, user: str) -> dict[str, Any] | None:
        """The user's notebook pod (KubeSpawner's labels), or ``None``."""
        pods = self.cluster.pods(
            NAMESPACE, f"component=singleuser-server,hub.jupyter.org/username={user}"
        )
        return pods[0] if pods else None

    def server_stopped(self, user: str) -> bool:
        """Whether the hub is done stopping ``user``'s server: no server, not even a pending
        stop. The pod can be gone before that, and a login in between is sent to "Server not
        running" instead of the spawn form (the CI run of 2026-11-28 met it)."""
        answer = self.rest.request("GET", f"hub/api/users/{user}")
        assert answer.status == 200, answer
        return "" not in answer.body["servers"]


@dataclass(frozen=True)
class UserServer:
    """A user's server behind the hub, as the browser tests' ``LabHost``."""

    base_url: str
    token: str

    @property
    def server(self) -> JupyterServer:
        return JupyterServer(self.base_url, self.token)

    def logs(self) -> str:
        return "--- the user's server runs in its pod: `kubectl logs` has its log ---"


def tier_values(notebook_image: str, config: Path, agent_ip: str) -> dict[str, Any]:
    """The tier's own values (given before the product's, as a hub's own values are): the
    notebook image, the fake NVML's configuration ``config`` and the agent's ClusterIP."""
    repository, _, tag = notebook_image.rpartition(":")
    agent_host = DEFAULT_K8S_AGENT_URL.split("://", 1)[1].rsplit(":", 1)[0]
    return {
        "hub": {"allowedUsers": list(USERS), "maxGpus": MAX_GPUS},
        "singleuser": {
            "image": {"name": repository, "tag": tag, "pullPolicy": "Never"},
            # A hub's own profiles, as a course would have them: the default, and one whose
            # idle GPUs go back soon (the agent honours the pod's stricter annotation).
            "profileList": [
                {"display_name": "CPU only", "slug": "cpu", "default": True},
                {
                    "display_name": "CPU only, idle GPUs released soon",
                    "slug": IDLE_PROFILE,
                    "kubespawner_override": {
                        "extra_annotations": {IDLE_RELEASE_ANNOTATION: str(IDLE_SECONDS)}
                    },
                },
            ],
            # The simulation's part: the fake NVML's configuration, read-only.
            "extraEnv": {CONFIG_ENV: str(config), DEVICE_FILTER_ENV: "/dev"},
            "storage": {
                "extraVolumes": [
                    {"name": "fake-nvml-config", "hostPath": {"path": str(config), "type": "File"}}
                ],
                "extraVolumeMounts": [
                    {"name": "fake-nvml-config", "mountPath": str(config), "readOnly": True}
                ],
            },
            # No cluster DNS here: the agent's Service name, resolved as DNS would.
            "extraPodConfig": {
                "hostAliases": [{"ip": agent_ip, "hostnames": [agent_host]}],
                "terminationGracePeriodSeconds": 5,
            },
        },
    }


def _service(name: str, component: str, port: int, target: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "selector": {"component": component},
            "ports": [{"port": port, "targetPort": target, "protocol": "TCP"}],
        },
    }


def _deployment(
    component: str, image: str, command: list[str], env: list[dict[str, Any]], **pod: Any
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": component,
        "image": image,
        "imagePullPolicy": "Never",
        "command": command,
        "env": env,
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                            "runAsUser": HUB_UID, "runAsNonRoot": True},
        **pod.pop("container", {}),
    }  # fmt: skip
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": component, "namespace": NAMESPACE},
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": {"component": component}},
            "template": {
                "metadata": {"labels": {"component": component}},
                "spec": {"containers": [container], "terminationGracePeriodSeconds": 5, **pod},
            },
        },
    }


def _secret_env(name: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": "hub", "key": key}}}


def hub_objects(
    hub: BuiltImage, db_dir: Path, secrets_: dict[str, str], values: dict[str, str]
) -> list[dict[str, Any]]:
    """Everything of the hub but its namespace and Services (created first, so that the pods
    get their addresses as environment variables)."""
    rules = [
        {"apiGroups": [""], "resources": ["pods", "persistentvolumeclaims", "secrets", "services"],
         "verbs": ["get", "watch", "list", "create", "delete"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["get", "watch", "list"]},
    ]  # fmt: skip
    hub_env: list[dict[str, Any]] = [
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "HUB_VALUES", "value": VALUES_ENV},
        _secret_env("CONFIGPROXY_AUTH_TOKEN", "proxy-token"),
        _secret_env("HUB_USER_PASSWORD", "password"),
        _secret_env("JUPYTERHUB_TIER_TOKEN", "api-token"),
    ]  # fmt: skip
    target = "http://$(HUB_SERVICE_HOST):$(HUB_SERVICE_PORT)"
    proxy_command = [
        "configurable-http-proxy", "--ip=0.0.0.0", f"--port={PROXY_PORT}",
        "--api-ip=0.0.0.0", f"--api-port={PROXY_API_PORT}",
        f"--default-target={target}", f"--error-target={target}/hub/error",
    ]  # fmt: skip
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": "hub", "namespace": NAMESPACE}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": "hub", "namespace": NAMESPACE}, "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "hub", "namespace": NAMESPACE},
         "subjects": [{"kind": "ServiceAccount", "name": "hub", "namespace": NAMESPACE}],
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "hub"}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hub", "namespace": NAMESPACE},
         "stringData": secrets_},
        {"apiVersion": "v1", "kind": "ConfigMap",
         "metadata": {"name": "hub-config", "namespace": NAMESPACE}, "data": values},
        _deployment(
            "hub", hub.name, ["jupyterhub", "-f", "/etc/jupyterhub/jupyterhub_config.py"],
            hub_env, serviceAccountName="hub",
            container={
                "ports": [{"containerPort": HUB_PORT}],
                "readinessProbe": {"httpGet": {"path": "/hub/health", "port": HUB_PORT},
                                   "periodSeconds": 2},
                "volumeMounts": [{"name": "config", "mountPath": "/etc/jupyterhub"},
                                 {"name": "db", "mountPath": "/srv/jupyterhub"}],
            },
            volumes=[{"name": "config", "configMap": {"name": "hub-config"}},
                     {"name": "db", "hostPath": {"path": str(db_dir), "type": "Directory"}}],
        ),
        _deployment(
            "proxy", hub.name, proxy_command,
            [_secret_env("CONFIGPROXY_AUTH_TOKEN", "proxy-token")],
            automountServiceAccountToken=False,
            container={
                "ports": [{"containerPort": PROXY_PORT}, {"containerPort": PROXY_API_PORT}],
                "readinessProbe": {"tcpSocket": {"port": PROXY_PORT}, "periodSeconds": 2},
            },
        ),
    ]  # fmt: skip


def _ready(cluster: Cluster, component: str) -> bool:
    pods = cluster.pods(NAMESPACE, f"component={component}")
    return any(
        p["metadata"].get("deletionTimestamp") is None
        and all(s.get("ready") for s in (p["status"].get("containerStatuses") or [{}]))
        for p in pods
    )


def wait_ready(cluster: Cluster, component: str) -> None:
    eventually(lambda: _ready(cluster, component), f"the {component} pod is Ready", READY_TIMEOUT)


@contextlib.contextmanager
def running_hub(cluster: Cluster, agent_ip: str) -> Iterator[Hub]:
    """The hub and its proxy on the node (the agent's Service at ``agent_ip`` already up);
    everything removed at the end, the users' pods included."""
    from ..image.hub_images import hub_image, notebook_image  # builds them: not at import

    notebook, hub = notebook_image(), hub_image()
    nvml_config = cluster.node.nvml_config_path
    assert nvml_config is not None
    for image in (notebook, hub):
        cluster.node.import_image(image.archive)
    db_dir = cluster.node.directory / "hub-db"
    db_dir.mkdir(exist_ok=True)
    os.chown(db_dir, HUB_UID, HUB_UID)
    tier_secrets = {"proxy-token": secrets.token_hex(32), "password": secrets.token_urlsafe(12),
                    "api-token": secrets.token_hex(32)}  # fmt: skip
    values = {
        "jupyterhub_config.py": CONFIG.read_text(),
        "tier-values.yaml": yaml.safe_dump(tier_values(notebook.name, nvml_config, agent_ip)),
        "gpu-hotplug-values.yaml": PRODUCT_VALUES.read_text(),
    }
    cluster.apply(
        [{"apiVersion": "v1", "kind": "Namespace",
          "metadata": {"name": NAMESPACE,
                       "labels": {"gpu-hotplug.jupyter.org/notebooks": "true"}}},
         _service("hub", "hub", HUB_PORT, HUB_PORT),
         _service("proxy-api", "proxy", PROXY_API_PORT, PROXY_API_PORT),
         _service("proxy-public", "proxy", 80, PROXY_PORT)]
    )  # fmt: skip
    try:
        cluster.apply(hub_objects(hub, db_dir, tier_secrets, values))
        wait_ready(cluster, "proxy")
        wait_ready(cluster, "hub")
        public = cluster.core.read_namespaced_service("proxy-public", NAMESPACE).spec.cluster_ip
        yield Hub(cluster, f"http://{public}", tier_secrets["password"], tier_secrets["api-token"])
    finally:
        print(cluster.kubectl("logs", "-n", NAMESPACE, "deployment/hub", "--tail=200",
                              check=False))  # fmt: skip
        cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=true", "--timeout=180s",
                        check=False)  # fmt: skip
        shutil.rmtree(db_dir, ignore_errors=True)
