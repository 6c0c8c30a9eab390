"""The notebook and hub images of JupyterHub on Kubernetes (issue 34), built by
``image/build.sh --image notebook|hub`` for the tests that run them: their own tests here and the
real node's hub deployment, which imports each archive into the node's containerd
(``ctr images import``), with no registry.

Both are built in podman storage kept under the image cache (``images.py``), so that a session
whose locks did not change rebuilds only the layer of this tree's wheel.
"""

from __future__ import annotations

import functools

from .images import BUILD_TIMEOUT, BuiltImage, build_in_kept_storage

__all__ = ["BUILD_TIMEOUT", "BuiltImage", "hub_image", "notebook_image"]


@functools.cache
def notebook_image() -> BuiltImage:
    """A user's notebook image of this source tree (``jupyterhub-singleuser``, the extension
    enabled), built once per test session."""
    return build_in_kept_storage("notebook")


@functools.cache
def hub_image() -> BuiltImage:
    """JupyterHub with KubeSpawner, this tree's spawner helpers and configurable-http-proxy,
    built once per test session."""
    return build_in_kept_storage("hub")
