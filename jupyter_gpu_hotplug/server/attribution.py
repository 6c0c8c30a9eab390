"""Per-kernel attribution: which kernel of this notebook server uses how much of each GPU.

Boundary: from an NVML ``Snapshot`` (the processes on each GPU this server sees, with their
memory and SM samples) and this server's kernels (by the pid of each kernel's outermost
process, with its notebook) to the JSON of ``GET attribution`` and of every reading's
``attribution``. The grouping itself — walking ``/proc`` parent chains — is
``nvml.attribution``; this module only names the groups the way the panel and the API show
them. No I/O besides that walk.

Why here: the server is the one process that knows every kernel (jupyter_server's kernel
manager) and their notebooks (its sessions); a kernel knows only itself. In local mode each
kernel holds GPUs of its own, and another notebook's process on them is still worth seeing;
in Kubernetes mode the pod's GPUs are shared by every kernel of the server, and this is how a
user with several notebooks learns which one to stop.

What is never shown: a process on the GPU that is not below this server is counted only as a
sum of bytes (``other_bytes``), and a pid this server cannot see at all (NVML reported it in
another pid namespace) only as ``unattributed_bytes`` — never a pid or a command of someone
else, and never a guess (``nvml.attribution`` says why).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TypedDict

from .._structs import GpuUuid
from ..nvml.attribution import ProcessTree, Usage, attribute
from ..nvml.state import Snapshot

__all__ = [
    "AttributionJson",
    "GpuAttributionJson",
    "KernelHolder",
    "KernelUseJson",
    "UsageJson",
    "attribution_json",
]


class KernelHolder(TypedDict):
    """What the server knows of one sandboxed kernel: its id and its notebook (if any) — the
    name a process's use is attributed to."""

    kernel_id: str
    path: str | None


class UsageJson(TypedDict):
    """What a group of processes uses of one GPU."""

    memory_bytes: int | None
    """``None``: NVML does not report their memory (common in containers)."""
    sm_util_percent: int | None
    """Their SM utilisation over the last seconds; ``None``: NVML has no sample for them."""
    processes: int


class KernelUseJson(UsageJson):
    """One kernel's processes on one GPU (the kernel itself and its descendants)."""

    kernel_id: str
    notebook: str | None
    """The notebook's path below the server's root; ``None``: a kernel without a session."""


class GpuAttributionJson(TypedDict):
    """One GPU's processes, by kernel of this server."""

    uuid: GpuUuid
    kernels: list[KernelUseJson]
    """Most memory first."""
    server: UsageJson | None
    """Other processes of this notebook server (below it, below none of its kernels: a
    terminal's, for instance); ``None``: there are none."""
    other_bytes: int | None
    """Memory of processes this server can see that are not its own (shown as a sum only);
    ``None``: none, or NVML does not report their memory."""
    unattributed_bytes: int | None
    """Memory of processes whose pid this server cannot see (another pid namespace: NVML in
    a container may report the host's pids); ``None`` as for ``other_bytes``."""
    unattributed_processes: int


class AttributionJson(TypedDict):
    """``GET attribution``: every GPU this server's NVML lists processes for."""

    gpus: list[GpuAttributionJson]
    taken_at: float
    """Seconds since the epoch when NVML was read."""


class _Server(enum.Enum):
    """The owner of processes below the server but below none of its kernels."""

    SERVER = "server"


def _usage(usage: Usage) -> UsageJson:
    return UsageJson(
        memory_bytes=usage.memory_bytes,
        sm_util_percent=usage.sm_util_percent,
        processes=usage.processes,
    )


def _most_memory(use: KernelUseJson) -> tuple[int, str]:
    return (-(use["memory_bytes"] or 0), use["kernel_id"])


def attribution_json(
    snapshot: Snapshot,
    kernels: Mapping[int, KernelHolder],
    *,
    server_pid: int,
    tree: ProcessTree,
) -> list[GpuAttributionJson]:
    """Each GPU of ``snapshot`` whose processes NVML lists, grouped by the kernels of
    ``kernels`` (by the pid of each kernel's outermost process) and the server
    (``server_pid``). ``tree``: the process parents, read once for the whole snapshot."""
    names = {holder["kernel_id"]: holder["path"] for holder in kernels.values()}
    roots: dict[int, str | _Server] = {pid: kernel["kernel_id"] for pid, kernel in kernels.items()}
    roots.setdefault(server_pid, _Server.SERVER)
    found: list[GpuAttributionJson] = []
    for gpu in snapshot.gpus:
        if gpu.uuid is None or gpu.processes is None:
            continue  # NVML cannot say who uses it: nothing to attribute
        use = attribute(gpu.processes, roots.get, tree)
        server = use.by_owner.get(_Server.SERVER)
        by_kernel = [
            KernelUseJson(**_usage(usage), kernel_id=owner, notebook=names.get(owner))
            for owner, usage in use.by_owner.items()
            if isinstance(owner, str)
        ]
        found.append(
            GpuAttributionJson(
                uuid=gpu.uuid,
                kernels=sorted(by_kernel, key=_most_memory),
                server=None if server is None else _usage(server),
                other_bytes=use.others.memory_bytes,
                unattributed_bytes=use.unattributed.memory_bytes,
                unattributed_processes=use.unattributed.processes,
            )
        )
    return found
