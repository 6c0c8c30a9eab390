"""Which device nodes make a reserved GPU usable in a container: one answer for every caller.

Why it exists: a whole GPU is one node, ``/dev/nvidia<minor>``; a MIG slice is its GPU's node
plus the capability nodes of its GPU instance and compute instance (``linux/mig.py``). The
service (grant, revoke), the reconciler (status, re-grant, strays) and the idle policy (is it
in use?) must agree on that, and taking one slice back must keep what another slice of the
same GPU, still held by the same container, needs. A reservation records a GPU by UUID and
minor only, so a slice's instance ids are learnt from the inventory's snapshots (NVML keeps
listing a slice while it exists, across agent restarts); the capability numbers are read from
the host's tables each time they are needed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from ..._structs import GpuUuid
from ...linux.devnodes import DeviceNode
from ...linux.mig import MigCaps, MigCapsError, revoke_nodes
from ...nvml.state import MigSlice
from .injector import InjectionFailed, gpu_node
from .inventory import InventorySnapshot
from .seams import GpuRecord

__all__ = ["GpuNodes", "flat", "is_mig"]


def is_mig(uuid: str) -> bool:
    """Whether ``uuid`` names a MIG slice (``MIG-…``) rather than a whole GPU."""
    return uuid.startswith("MIG-")


class GpuNodes:
    """The device nodes of reserved GPUs (see the module docstring).

    ``mig_caps`` reads the host's capability tables (``MigCaps.read`` over the host's
    ``/proc``); ``None`` on a node that hands out no slices.
    """

    def __init__(self, *, major: int, mig_caps: Callable[[], MigCaps] | None = None) -> None:
        self._major = major
        self._mig_caps = mig_caps
        self._slices: dict[GpuUuid, MigSlice] = {}

    def learn(self, snapshot: InventorySnapshot) -> None:
        """Remember the instance ids of the slices ``snapshot`` lists."""
        for gpu in snapshot.gpus:
            if gpu.mig is not None:
                self._slices[gpu.uuid] = gpu.mig

    def of(self, gpu: GpuRecord) -> list[DeviceNode]:
        """Every node ``gpu`` needs in a container; ``InjectionFailed`` (clean: nothing was
        touched) when a slice's nodes cannot be told."""
        node = gpu_node(gpu.minor, major=self._major)
        if not is_mig(gpu.uuid):
            return [node]
        where = self._slices.get(gpu.uuid)
        if where is None:
            raise InjectionFailed(f"NVML does not list the MIG device {gpu.uuid} now", clean=True)
        if self._mig_caps is None:
            raise InjectionFailed("this agent hands out no MIG devices", clean=True)
        try:
            access = self._mig_caps().access(
                node,
                gpu_instance_id=where.gpu_instance_id,
                compute_instance_id=where.compute_instance_id,
            )
        except MigCapsError as e:
            raise InjectionFailed(f"the nodes of {gpu.uuid} are unknown: {e}", clean=True) from e
        return list(access.nodes)

    def revocable(
        self, leaving: Sequence[GpuRecord], *, keeping: Iterable[GpuRecord]
    ) -> list[list[DeviceNode]]:
        """The rule of every revoke (detach, lost holder, reconciliation, a sweep's take-back):
        the nodes taking each of ``leaving`` back from a container revokes, when it keeps
        ``keeping`` (what its entitlement still gives it: ``Entitlement.keeping``). Never a
        node that a GPU or slice it keeps needs (the GPU node two of its slices share); what
        other containers hold is theirs and is not asked about. ``InjectionFailed`` (clean)
        when a slice's nodes cannot be told."""
        kept = [node for gpu in keeping for node in self.of(gpu)]
        return [list(revoke_nodes(self.of(gpu), keeping=kept)) for gpu in leaving]

    def known(self, gpus: Iterable[GpuRecord]) -> list[tuple[GpuRecord, list[DeviceNode]]]:
        """Each of ``gpus`` with its nodes, for a judgement of what a container can open
        (``entitlement.judge``); none where they cannot be told (a slice NVML no longer
        lists: nothing to look for)."""
        found = []
        for gpu in gpus:
            try:
                found.append((gpu, self.of(gpu)))
            except InjectionFailed:
                found.append((gpu, []))
        return found


def flat(groups: Iterable[Sequence[DeviceNode]]) -> list[DeviceNode]:
    """The nodes of several GPUs, each once, in order (two slices share their GPU's node)."""
    seen: dict[str, DeviceNode] = {}
    for group in groups:
        for node in group:
            seen.setdefault(node.name, node)
    return list(seen.values())
