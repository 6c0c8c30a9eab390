"""Which pods may get GPUs at all, and how many each may hold: Kubernetes mode's ``TargetPolicy``.

Why it exists: the agent serves every pod of its node, and a token proves only who a pod is,
not that an operator meant it to have GPUs. Left open, a pod in any namespace with no limit
took every GPU of the node (issue 31). So both decisions fail closed:

- **the namespace allowlist**: a pod may get GPUs only in a namespace the operator allowed,
  by name (``--allowed-namespaces``; ``*``: all) or by label (``--allowed-namespace-selector``,
  by default ``gpu-hotplug.jupyter.org/notebooks=true``). A Namespace's labels are trusted because
  changing them needs cluster-scoped rights, which no tenant holds (a pod's own labels, which
  whoever creates the pod writes, would not do). They are read at every attach (RBAC
  ``namespaces get``, nothing listed or watched): a label removed takes effect at once;
- **the per-pod limit**: the pod's ``gpu-hotplug.jupyter.org/max-gpus`` annotation (set by the
  spawner; an unreadable one allows nothing), else ``--default-max-gpus`` (1). It counts every
  container of the pod together, waiting requests included (the service counts:
  ``GpuLimit.covers``).

Only attaching is refused: a pod of a namespace that leaves the allowlist keeps what it has
until it detaches, and operators can still detach it.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Final

from ..._structs import MAX_GPUS_ANNOTATION, PodTarget, Target
from ..core.errors import Forbidden, NotFound
from ..core.seams import GpuLimit, HostContainer
from ..settings import ALL_NAMESPACES, LabelSelector, Match
from .kube import KubeApi, KubeError

__all__ = ["TenantPolicy"]

_NAMES_FLAG: Final = "--allowed-namespaces"
_SELECTOR_FLAG: Final = "--allowed-namespace-selector"


class TenantPolicy:
    """``TargetPolicy`` by the namespace allowlist and the pod's limit (module docstring)."""

    def __init__(
        self,
        kube: KubeApi,
        *,
        default_max_gpus: int,
        allowed_namespaces: Collection[str],
        selector: LabelSelector,
    ) -> None:
        self._kube = kube
        self._default = default_max_gpus
        self._names = frozenset(allowed_namespaces)
        self._selector = selector

    async def gpu_limit(self, container: HostContainer) -> GpuLimit:
        target = container.target
        if not isinstance(target, PodTarget):
            raise Forbidden(f"{container} is not a pod: this agent serves pods only")
        await self._check_namespace(target.namespace)
        try:
            pod = await self._kube.get_pod(target.namespace, target.name)
        except KubeError as e:
            raise _unchecked(f"pod {target.namespace}/{target.name}", e) from e
        if pod is None:
            raise NotFound("pod", f"{target.namespace}/{target.name}")
        annotations = (pod.get("metadata") or {}).get("annotations") or {}
        raw = annotations.get(MAX_GPUS_ANNOTATION)
        if raw is None:
            count = self._default
            source = f"the agent's --default-max-gpus: the pod has no {MAX_GPUS_ANNOTATION}"
        else:
            try:
                count = max(int(raw), 0)
            except ValueError:
                count = 0  # an unreadable limit allows nothing: fail closed
            source = f"its {MAX_GPUS_ANNOTATION} annotation is {raw!r}"
        pod_key = (target.namespace, target.name)

        def covers(other: Target) -> bool:
            return isinstance(other, PodTarget) and (other.namespace, other.name) == pod_key

        return GpuLimit(count=count, source=source, covers=covers)

    async def _check_namespace(self, namespace: str) -> None:
        """``Forbidden`` unless ``namespace`` is allowed by name or by its labels."""
        if ALL_NAMESPACES in self._names or namespace in self._names:
            return
        if self._selector.requirements:
            try:
                labels = await self._kube.namespace_labels(namespace)
            except KubeError as e:
                raise _unchecked(f"namespace {namespace}", e) from e
            if labels is not None and self._selector.matches(labels):
                return
        names = ", ".join(sorted(self._names)) or "none"
        selector = str(self._selector) or "none"
        raise Forbidden(
            f"namespace {namespace!r} may not get GPUs from this agent: it is not in "
            f"{_NAMES_FLAG} ({names}) and its labels do not match {_SELECTOR_FLAG} ({selector})",
            hint=f"an operator allows a namespace {self._how_to_label(namespace)} or by naming "
            "it in the agent's settings (chart values allowedNamespaces, "
            "allowedNamespaceSelector)",
        )

    def _how_to_label(self, namespace: str) -> str:
        """The ``kubectl label`` that admits ``namespace`` when the selector asks for values
        only (the default does); else what its labels must match."""
        wanted = self._selector.requirements
        if wanted and all(r.match is Match.EQUALS for r in wanted):
            pairs = " ".join(f"{r.key}={r.value}" for r in wanted)
            return f"by labelling it (kubectl label namespace {namespace} {pairs})"
        return f"by labels that match {self._selector}" if wanted else "by label"


def _unchecked(what: str, error: KubeError) -> Forbidden:
    """The refusal when the API server did not say what the policy needs: fail closed, and
    say that a retry may help (the API server was busy) or what the agent lacks (RBAC)."""
    return Forbidden(
        f"could not read {what} to check whether it may get GPUs: {error}",
        hint="try again; if it persists, the agent's ClusterRole lacks 'get' on namespaces "
        "or pods, or the API server is unreachable",
        retryable=True,
    )
