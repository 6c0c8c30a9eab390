"""KubeSpawner reads a kubeconfig when it is constructed (it never calls the API in these
tests): give it one that names an unreachable server, never the developer's own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

KUBECONFIG = """\
apiVersion: v1
kind: Config
clusters: [{name: none, cluster: {server: "http://127.0.0.1:9"}}]
users: [{name: none, user: {}}]
contexts: [{name: none, context: {cluster: none, user: none}}]
current-context: none
"""


@pytest.fixture(autouse=True)
def unreachable_kubeconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from kubernetes_asyncio.config import kube_config
    from kubespawner.clients import load_config

    path = tmp_path / "kubeconfig"
    path.write_text(KUBECONFIG)
    # Read from $KUBECONFIG once, when kubernetes_asyncio is imported.
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    load_config.cache_clear()
    yield
    load_config.cache_clear()
