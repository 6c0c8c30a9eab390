"""The JupyterHub configuration of the real node's hub tier, as a platform team writes it.

zero-to-jupyterhub's hub image turns Helm values into ``c.KubeSpawner`` and runs
``hub.extraConfig`` snippets in key order; this file does the same for the part of the values
this tier uses, so that ``k8s/jupyterhub/values.yaml`` — the file we tell platform teams to add
to their z2jh values — runs here exactly as it runs there, unedited. Then it calls
``configure_kubespawner``, as a hub without z2jh does; both are idempotent, so a pod gets each
of our pieces once.

Read from ``HUB_VALUES`` (files separated by ``:``, merged as ``helm -f a -f b`` merges them:
maps key by key, a later list replacing an earlier one). What differs from a cloud's z2jh is
the tier's values file (``hub.py``): images imported into the node (``pullPolicy: Never``),
a fixed-password authenticator for the test users, and addresses by Service environment
variables where z2jh uses cluster DNS names (the tier runs no DNS server).
"""

# ruff: noqa: F821 (``c`` and ``get_config`` are the hub's, defined when it loads this file)

from __future__ import annotations

import os
from typing import Any

import yaml

from jupyter_gpu_hotplug.spawner import configure_kubespawner

c = get_config()  # type: ignore[name-defined]


def _merge(base: Any, over: Any) -> Any:
    """Helm's merge of two values documents: maps merge, anything else is replaced."""
    if isinstance(base, dict) and isinstance(over, dict):
        merged = dict(base)
        for key, value in over.items():
            merged[key] = _merge(base.get(key), value)
        return merged
    return over


values: dict[str, Any] = {}
for path in os.environ["HUB_VALUES"].split(":"):
    with open(path, encoding="utf-8") as file:
        values = _merge(values, yaml.safe_load(file) or {})
hub = values.get("hub", {})
singleuser = values.get("singleuser", {})

# The hub, its database on the node, and the proxy (its own pod) by their Services.
c.JupyterHub.hub_bind_url = "http://0.0.0.0:8081"
c.JupyterHub.hub_connect_url = (
    f"http://{os.environ['HUB_SERVICE_HOST']}:{os.environ['HUB_SERVICE_PORT']}"
)
c.JupyterHub.db_url = "sqlite:////srv/jupyterhub/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = "/srv/jupyterhub/jupyterhub_cookie_secret"
c.JupyterHub.cleanup_servers = False  # a restarted hub finds its users' servers running
c.ConfigurableHTTPProxy.should_start = False
c.ConfigurableHTTPProxy.api_url = (
    f"http://{os.environ['PROXY_API_SERVICE_HOST']}:{os.environ['PROXY_API_SERVICE_PORT']}"
)

# Users: one shared password (JupyterHub's SharedPasswordAuthenticator), named users only.
c.JupyterHub.authenticator_class = "shared-password"
c.SharedPasswordAuthenticator.user_password = os.environ["HUB_USER_PASSWORD"]
c.Authenticator.allowed_users = set(hub.get("allowedUsers", []))
c.Authenticator.admin_users = set(hub.get("adminUsers", []))

# The tier's API client (z2jh's hub.services and hub.loadRoles), its token from the pod's
# Secret: it starts, stops and reaches the users' servers for the tests.
if "JUPYTERHUB_TIER_TOKEN" in os.environ:
    c.JupyterHub.services = [{"name": "tier", "api_token": os.environ["JUPYTERHUB_TIER_TOKEN"]}]
    c.JupyterHub.load_roles = [
        {
            "name": "tier",
            "scopes": ["admin:users", "admin:servers", "access:servers", "read:users"],
            "services": ["tier"],
        }
    ]

# singleuser.* as z2jh maps it.
c.JupyterHub.spawner_class = "kubespawner.KubeSpawner"
c.KubeSpawner.namespace = os.environ["POD_NAMESPACE"]
image = singleuser["image"]
c.KubeSpawner.image = f"{image['name']}:{image['tag']}"
c.KubeSpawner.image_pull_policy = image.get("pullPolicy", "IfNotPresent")
c.KubeSpawner.cmd = singleuser.get("cmd", ["jupyterhub-singleuser"])
c.KubeSpawner.default_url = singleuser.get("defaultUrl", "/lab")
c.KubeSpawner.uid = singleuser.get("uid", 1000)
c.KubeSpawner.fs_gid = singleuser.get("fsGid", 100)
c.KubeSpawner.start_timeout = singleuser.get("startTimeout", 300)
c.KubeSpawner.http_timeout = 120
c.KubeSpawner.environment = dict(singleuser.get("extraEnv", {}))
c.KubeSpawner.extra_annotations = dict(singleuser.get("extraAnnotations", {}))
c.KubeSpawner.extra_pod_config = dict(singleuser.get("extraPodConfig", {}))
storage = singleuser.get("storage", {})
c.KubeSpawner.volumes = list(storage.get("extraVolumes", []))
c.KubeSpawner.volume_mounts = list(storage.get("extraVolumeMounts", []))
if "profileList" in singleuser:
    c.KubeSpawner.profile_list = list(singleuser["profileList"])

# hub.extraConfig, in key order, as z2jh runs it.
for name in sorted(hub.get("extraConfig", {})):
    exec(compile(hub["extraConfig"][name], f"hub.extraConfig.{name}", "exec"), {"c": c})

configure_kubespawner(c, max_gpus=int(hub.get("maxGpus", 1)))
