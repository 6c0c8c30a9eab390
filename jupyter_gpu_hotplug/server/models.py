"""The JSON the REST API and the stream answer with, and how it is built from the agent's
answers and the local NVML snapshot.

Boundary: pure functions from typed values (``client.Attachment``, ``client.Gpu``,
``nvml.state.Snapshot``) to ``TypedDict`` payloads. No I/O.

Why it exists: the JupyterLab extension mirrors these shapes in TypeScript interfaces, so they
are written down once, here, as exact types; the handlers and the stream only serialise them.
The agent says *which* GPUs a target has and how many are free; NVML, read in this process,
says what each of them is doing. They are joined by UUID: a GPU the local NVML cannot see
(the driver's view in this container is not ready yet, or there is no NVML here) is still
listed, with ``metrics: null``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypedDict

from .._structs import Attachment as AttachmentWire
from .._structs import (
    GpuKind,
    GpuUuid,
    LostHolderWire,
    PidRef,
    PodTarget,
    SuspendedWire,
    TargetRef,
    TargetWire,
    format_timestamp,
)
from .._structs import GpuState as GpuStateName
from ..client import Attachment, Gpu, Suspension, plain_free, plain_total
from ..nvml.state import GpuMetricsJson, GpuState, Snapshot
from .attribution import GpuAttributionJson, KernelHolder
from .releases import ReleasedJson

__all__ = [
    "AttachJson",
    "AttachedGpuJson",
    "GpusJson",
    "HeldByJson",
    "KernelHolder",
    "MetricsJson",
    "Mode",
    "NodeGpuJson",
    "NvmlJson",
    "ProgressJson",
    "ProgressState",
    "QueuedJson",
    "SuspendedWire",
    "WaitingAttach",
    "attachment_json",
    "gpus_json",
    "held_by_json",
    "suspended_json",
]

Mode = Literal["local", "kubernetes"]
"""``local``: GPUs go to one kernel's sandbox; ``kubernetes``: to this notebook's pod."""

ProgressState = Literal["started", "waiting", "attached", "failed"]


MetricsJson = GpuMetricsJson
"""What one GPU is doing now, as this server's NVML sees it: the NVML layer's own shape."""


class HeldByJson(TypedDict):
    """Who holds a GPU, as a user knows it; the technical id stays in ``target``.

    ``kind``: ``notebook`` (local mode: a kernel with a notebook session; ``name`` is the
    notebook's path below the server's root), ``kernel`` (a kernel without a session; ``name``
    is ``kernel <id>``), ``pod`` (Kubernetes mode; ``namespace/name``), ``process`` (a process
    this server did not start; ``process N``)."""

    kind: Literal["notebook", "kernel", "pod", "process"]
    name: str
    kernel_id: str | None


class AttachedGpuJson(AttachmentWire):
    """An attachment (the agent's shape) with its live ``metrics`` and who holds it."""

    metrics: MetricsJson | None
    held_by: HeldByJson


class NvmlJson(TypedDict):
    """Whether this server could read GPUs through NVML, and if not, why."""

    status: str
    message: str
    driver_version: str | None
    cuda_driver_version: str | None


class NodeGpuJson(TypedDict):
    """One GPU of the node, for the panel that shows who holds what."""

    uuid: GpuUuid
    index: int
    minor: int
    name: str
    memory_total: int
    """Bytes."""
    state: GpuStateName
    """``free``; ``attached``: hot-attached by the agent; ``allocated``: held by a pod through
    the device plugin (the scheduler's)."""
    mine: bool
    """Attached to the kernel (or pod) asked about."""
    device: str
    target: TargetWire | None
    """Who holds it, as the agent names it (``None`` when free); the agent tells every
    authenticated caller the same (``GET /v1/gpus``)."""
    held_by: HeldByJson | None
    """The same in words a user knows: a notebook of this server, a pod, a process."""
    metrics: MetricsJson | None
    """What it is doing, as this server's NVML sees it (``None``: NVML here cannot see it),
    so the panel charts every GPU of the node, not only the kernel's."""
    selectable: bool
    """An attach may name it (``gpus``), so its card offers an Attach of its own; false
    where the cluster picks the device (Kubernetes) and for a GPU in MIG mode."""
    kind: GpuKind
    """The agent's word for what it is (``_structs.GpuKind``): a whole GPU, a GPU in MIG mode
    (its card offers no Attach) or a MIG slice."""
    plain_attach: bool
    """The agent's word: an attach of ``count`` alone ("Attach N") may get it when free; only
    such GPUs count in ``free`` and ``total``."""


class QueuedJson(TypedDict):
    """An attach of one of this server's kernels waiting in the agent's queue."""

    request_id: str
    kernel_id: str | None
    held_by: HeldByJson | None
    """The waiting notebook, in words a user knows (``None``: Kubernetes mode, this pod)."""
    count: int
    position: int | None
    """1 is served next; ``None`` until the agent has said."""
    of: int | None
    """How many requests wait on the node."""
    deadline: float | None
    """Seconds since the epoch when the wait ends (``wait_seconds`` after it began);
    ``None`` for a wait this server did not start (``%gpu attach --wait``, the command
    line), whose end only the agent knows."""


class GpusJson(TypedDict):
    """``GET gpus`` and every ``metrics`` event of the stream."""

    mode: Mode
    kernel_id: str | None
    """The kernel asked about; ``None``: no kernel named (local mode: then ``attached`` is
    empty and only the node's counts are given)."""
    attached: list[AttachedGpuJson]
    free: int
    """GPUs of the node that nobody holds and that an attach of ``count`` alone (the toolbar's
    "Attach N") may get now (``client.plain_free``, by the agent's ``plain_attach``): whole
    GPUs; never a GPU in MIG mode; MIG slices only where the agent hands out their profile
    alone (Kubernetes with a MIG resource name)."""
    total: int
    """The GPUs of the node such an attach may get, free or not: the most it could ever get,
    so ``free`` of ``total`` reads as one fact. ``node`` lists every GPU, those others too."""
    node: list[NodeGpuJson]
    """Every GPU of the node, with who holds it (added after ``free`` and ``total``; older
    clients ignore it)."""
    queue: list[QueuedJson]
    """The waiting attaches of this server's kernels, first served first."""
    max_count: int
    """The most GPUs one attach may ask for (``GPUHotplug.max_gpus_per_request``)."""
    simulated: bool
    """The node's GPUs are simulated (``--simulate``): no hardware behind them."""
    nvml: NvmlJson
    taken_at: float
    """Seconds since the epoch when the metrics were read."""
    released: list[ReleasedJson]
    """GPUs the kernel lost in the last minutes, and why (``releases``): what a page says
    when a GPU goes that it did not detach itself."""
    attribution: list[GpuAttributionJson]
    """Which kernel of this server uses how much of each GPU (``attribution``), the same in
    every kernel's view."""
    suspended: SuspendedWire | None
    """The kernel's CUDA state kept in host memory without its GPUs (a detach with ``keep``):
    the agent's own shape, so the lab says what ``%gpu status`` says (its next attach resumes
    it); ``None`` while it is not suspended, and when no kernel is named."""


class AttachJson(TypedDict):
    """The ``201`` answer of ``POST attach``."""

    request_id: str
    kernel_id: str | None
    attachments: list[AttachmentWire]


class _ProgressRequired(TypedDict):
    request_id: str
    kernel_id: str | None
    state: ProgressState
    count: int
    elapsed: float
    """Seconds since the attach started."""


class ProgressJson(_ProgressRequired, total=False):
    """A ``progress`` event: ``attachments`` when ``attached``, ``error`` when ``failed``
    (the same body an HTTP error has); ``position`` and ``of`` while ``waiting`` in the
    agent's queue (1 of 3: served next, three requests wait on the node), when it says."""

    attachments: list[AttachmentWire]
    error: dict[str, object]
    position: int
    of: int


@dataclass(frozen=True)
class WaitingAttach:
    """What the manager knows of one of its attaches while it waits for GPUs."""

    request_id: str
    kernel_id: str | None
    count: int
    deadline: float | None
    """``None``: a wait this server did not start (the magic's, the command line's)."""
    position: int | None = None
    of: int | None = None


def attachment_json(attachment: Attachment) -> AttachmentWire:
    """The agent's attachment shape, rebuilt from the checked value (unknown members of a newer
    agent are not passed on: the browser gets this API's shape, not the agent's)."""
    wire = AttachmentWire(
        uuid=attachment.uuid,
        index=attachment.index,
        minor=attachment.minor,
        name=attachment.name,
        device=attachment.device,
        target=attachment.target.to_wire(),
        holder=attachment.holder,
        attached_at=format_timestamp(attachment.attached_at),
    )
    if attachment.holder_lost is not None:
        # The lab warns with it before the agent revokes the GPU (the live stream carries it).
        wire["holder_lost"] = LostHolderWire(
            reason=attachment.holder_lost.reason,
            revoke_at=format_timestamp(attachment.holder_lost.revoke_at),
        )
    return wire


def suspended_json(suspension: Suspension) -> SuspendedWire:
    """The agent's suspension shape, rebuilt from the checked value (as ``attachment_json``:
    the browser gets this API's members, not whatever a newer agent adds)."""
    return SuspendedWire(
        state="suspending" if suspension.state == "suspending" else "suspended",
        model=suspension.model,
        uuids=list(suspension.uuids),
        pids=list(suspension.pids),
        host_memory=suspension.host_memory,
    )


def held_by_json(target: TargetRef, kernels: Mapping[int, KernelHolder]) -> HeldByJson:
    """``target`` in words a user knows: its pod, or the notebook of the kernel whose sandbox
    it is (``kernels``: this server's sandboxed kernels by pid)."""
    if isinstance(target, PodTarget):
        return HeldByJson(kind="pod", name=f"{target.namespace}/{target.name}", kernel_id=None)
    assert isinstance(target, PidRef)
    kernel = kernels.get(target.pid)
    if kernel is None:
        return HeldByJson(kind="process", name=str(target), kernel_id=None)
    if kernel["path"]:
        return HeldByJson(kind="notebook", name=kernel["path"], kernel_id=kernel["kernel_id"])
    kernel_id = kernel["kernel_id"]
    return HeldByJson(kind="kernel", name=f"kernel {kernel_id}", kernel_id=kernel_id)


def _attached(
    attachment: Attachment,
    seen: Mapping[GpuUuid, GpuState],
    kernels: Mapping[int, KernelHolder],
) -> AttachedGpuJson:
    found = seen.get(attachment.uuid)
    return AttachedGpuJson(
        **attachment_json(attachment),
        metrics=None if found is None else found.metrics_json(),
        held_by=held_by_json(attachment.target, kernels),
    )


def _index(gpu: Gpu) -> int:
    return gpu.index


def _node_gpu(
    gpu: Gpu,
    kernels: Mapping[int, KernelHolder],
    seen: Mapping[GpuUuid, GpuState],
    *,
    mine: bool,
) -> NodeGpuJson:
    found = seen.get(gpu.uuid)
    return NodeGpuJson(
        uuid=gpu.uuid,
        index=gpu.index,
        minor=gpu.minor,
        name=gpu.name,
        memory_total=gpu.memory_total,
        state=gpu.state,
        mine=mine,
        device=gpu.device,
        target=None if gpu.target is None else gpu.target.to_wire(),
        held_by=None if gpu.target is None else held_by_json(gpu.target, kernels),
        metrics=None if found is None else found.metrics_json(),
        selectable=gpu.selectable,
        kind=gpu.kind,
        plain_attach=gpu.plain_attach,
    )


def _queued(waiting: WaitingAttach, kernels: Mapping[int, KernelHolder]) -> QueuedJson:
    holder: HeldByJson | None = None
    for pid, kernel in kernels.items():
        if kernel["kernel_id"] == waiting.kernel_id:
            holder = held_by_json(PidRef(pid), kernels)
    return QueuedJson(
        request_id=waiting.request_id,
        kernel_id=waiting.kernel_id,
        held_by=holder,
        count=waiting.count,
        position=waiting.position,
        of=waiting.of,
        deadline=waiting.deadline,
    )


def _place(entry: QueuedJson) -> tuple[int, float]:
    deadline = entry["deadline"]
    return (entry["position"] or 1_000_000, float("inf") if deadline is None else deadline)


def gpus_json(
    *,
    mode: Mode,
    kernel_id: str | None,
    attachments: Iterable[Attachment],
    node: Sequence[Gpu],
    snapshot: Snapshot,
    max_count: int,
    kernels: Mapping[int, KernelHolder] | None = None,
    queue: Iterable[WaitingAttach] = (),
    released: Sequence[ReleasedJson] = (),
    attribution: Sequence[GpuAttributionJson] = (),
    suspended: Suspension | None = None,
) -> GpusJson:
    """Join the agent's view (``attachments`` of the target, the ``node``'s GPUs) with what
    NVML sees here (``snapshot``) and what this server knows of its kernels (``kernels``, by
    sandbox pid: local mode's holders are named by their notebooks) and its ``queue`` of
    waiting attaches; ``suspended``: the kernel's kept CUDA state, from the agent's answer
    with its ``attachments``."""
    seen = {gpu.uuid: gpu for gpu in snapshot.gpus if gpu.uuid is not None}
    known = kernels or {}
    attached = [_attached(attachment, seen, known) for attachment in attachments]
    mine = {gpu["uuid"] for gpu in attached}
    return GpusJson(
        mode=mode,
        kernel_id=kernel_id,
        attached=attached,
        free=plain_free(node),
        total=plain_total(node),
        node=[
            _node_gpu(gpu, known, seen, mine=gpu.uuid in mine) for gpu in sorted(node, key=_index)
        ],
        queue=sorted((_queued(waiting, known) for waiting in queue), key=_place),
        max_count=max_count,
        simulated=snapshot.simulated or any(gpu.simulated for gpu in node),
        nvml=NvmlJson(
            status=snapshot.status.value,
            message=snapshot.message,
            driver_version=snapshot.driver_version,
            cuda_driver_version=snapshot.cuda_driver_version,
        ),
        taken_at=snapshot.taken_at,
        released=list(released),
        attribution=list(attribution),
        suspended=None if suspended is None else suspended_json(suspended),
    )
