"""What ``%gpu status``, ``%gpu list`` and ``%gpu queue`` report, as ``tables.Table`` values.

Boundary: pure functions from the agent's answers, this kernel's NVML snapshot and the holder
names to tables; the magic asks, these decide the rows, ``tables`` renders them.

One numbering: the ``GPU`` column is the node's index — what the host's ``nvidia-smi``, the
GPU panel and ``%gpu detach N`` use — and ``CUDA`` is the index this kernel's CUDA and NVML
give the same GPU (the kernel sees only its own GPUs, numbered from 0).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime

from .._structs import TargetRef
from ..client import (
    Attachment,
    Gpu,
    IdleRelease,
    QueuedRequest,
    Suspension,
    plain_free,
    plain_total,
)
from ..nvml.attribution import GpuUse, Usage
from ..nvml.state import GpuState, Snapshot
from .render import human_bytes, model_name, percent, suspended_line
from .tables import Table, Uuid

__all__ = ["attribution_table", "node_table", "queue_table", "status_table"]

_WAIT_HINT = "'%gpu attach N --wait 120' waits in the queue (first come, first served)."


def _local_time(moment: datetime) -> str:
    return moment.astimezone().strftime("%H:%M:%S")


def _plural(count: int, word: str = "GPU") -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def status_table(
    attachments: Sequence[Attachment] | str,
    releases: Sequence[IdleRelease],
    snapshot: Snapshot,
    *,
    cuda_line: str,
    suspended: Suspension | None = None,
) -> Table:
    """This notebook's GPUs with what NVML here says they do; ``attachments`` is the agent's
    list, or its error message when it could not be asked; ``suspended``: the kernel's CUDA
    state the agent keeps without its GPUs (``%gpu release --keep``)."""
    simulated = " (SIMULATED)" if snapshot.simulated else ""
    seen = {gpu.uuid: gpu for gpu in snapshot.gpus if gpu.uuid is not None}
    notes: list[str] = []
    rows: list[tuple[str | Uuid, ...]] = []
    if isinstance(attachments, str):
        title = f"GPU agent: {attachments}"
        empty = "The agent could not say which GPUs this notebook has."
    else:
        title = f"This notebook: {_plural(len(attachments))} attached{simulated}"
        empty = "No GPU attached. '%gpu attach' attaches one; '%gpu list' shows the node's."
        for attachment in attachments:
            gpu = seen.get(attachment.uuid)
            memory = (
                "n/a"
                if gpu is None
                else f"{human_bytes(gpu.memory_used)} / {human_bytes(gpu.memory_total)}"
            )
            rows.append(
                (
                    str(attachment.index),
                    "n/a" if gpu is None else str(gpu.index),
                    Uuid(attachment.uuid),
                    attachment.device,
                    "n/a" if gpu is None else percent(gpu.utilization_gpu),
                    memory,
                    _local_time(attachment.attached_at),
                )
            )
            if attachment.idle_release is not None:
                why = "unused" if attachment.idle_release.reason == "idle" else "its lease ends"
                notes.append(
                    f"! GPU {attachment.index}: the agent releases it at "
                    f"{_local_time(attachment.idle_release.release_at)} ({why}) unless a "
                    "process uses it."
                )
    if suspended is not None:
        notes.append(f"! {suspended_line(suspended)}")
    notes.extend(
        f"Released by the agent's idle policy: GPU {release.uuid} at "
        f"{_local_time(release.released_at)} "
        f"({'unused' if release.reason == 'idle' else 'lease ended'})."
        for release in releases
    )
    notes.append(f"This kernel sees (NVML): {snapshot.message}{simulated}.")
    notes.append(cuda_line)
    return Table(
        title=title,
        columns=("GPU", "CUDA", "ID", "DEVICE", "UTIL", "MEMORY", "SINCE"),
        rows=rows,
        notes=tuple(notes),
        flexible=frozenset({"MEMORY"}),
        empty=empty,
    )


def node_table(gpus: Sequence[Gpu], *, holder: Callable[[TargetRef | None], str]) -> Table:
    """Every GPU of the node and who holds it (``holder`` names them, e.g. by notebook); the
    title counts the GPUs ``%gpu attach N`` may get (``plain_free``: whole ones, not a GPU in
    MIG mode nor its slices)."""
    free, total = plain_free(gpus), plain_total(gpus)
    simulated = " (SIMULATED)" if any(gpu.simulated for gpu in gpus) else ""
    notes = () if free or not gpus else (f"No GPU is free: {_WAIT_HINT}",)
    return Table(
        title=f"GPUs on this node{simulated}: {free} free of {total}",
        columns=("GPU", "ID", "MODEL", "MEMORY", "STATE", "HELD BY"),
        rows=[
            (
                str(gpu.index),
                Uuid(gpu.uuid),
                model_name(gpu.name),
                human_bytes(gpu.memory_total),
                gpu.state,
                holder(gpu.target),
            )
            for gpu in gpus
        ],
        notes=notes,
        flexible=frozenset({"MODEL", "HELD BY"}),
        empty="This node has no GPU.",
    )


def queue_table(waiting: Sequence[QueuedRequest]) -> Table:
    """This notebook's attaches waiting in the agent's queue, with their places."""
    return Table(
        title=f"Waiting for GPUs: {_plural(len(waiting), 'request')} of this notebook",
        columns=("PLACE", "GPUS", "SINCE", "REQUEST"),
        rows=[
            (
                f"{queued.position} of {queued.length}",
                str(queued.count),
                _local_time(queued.queued_at),
                queued.request_id,
            )
            for queued in waiting
        ],
        flexible=frozenset({"REQUEST"}),
        empty=f"This notebook is not waiting for a GPU. {_WAIT_HINT}",
    )


_UNATTRIBUTED_NOTE = (
    "Unattributed: NVML named processes by pids this kernel cannot see (another pid "
    "namespace: in a container NVML may report the host's pids); they are not guessed at."
)
SANDBOXED_NOTE = (
    "This kernel runs in a sandbox with its own pid namespace, so NVML's pids (the host's) "
    "mean nothing here: the GPU panel, which the notebook server feeds, names the kernels."
)


def _most_memory(item: tuple[str, Usage]) -> tuple[int, str]:
    return (-(item[1].memory_bytes or 0), item[0])


def attribution_table(
    uses: Sequence[tuple[GpuState, GpuUse[str]]], *, notes: Sequence[str] = ()
) -> Table:
    """Which notebook uses how much of each GPU this kernel sees (``uses``: each GPU with its
    processes grouped by notebook name); groups nobody can be named for are sums."""
    rows: list[tuple[str | Uuid, ...]] = []
    unattributed = False
    for gpu, use in uses:
        named = sorted(use.by_owner.items(), key=_most_memory)
        groups = [*named, ("other processes", use.others), ("unattributed", use.unattributed)]
        for who, usage in groups:
            if usage.processes:
                rows.append(
                    (
                        str(gpu.index),
                        Uuid(gpu.uuid or "?"),
                        who,
                        human_bytes(usage.memory_bytes),
                        percent(usage.sm_util_percent),
                    )
                )
        unattributed = unattributed or use.unattributed.processes > 0
    return Table(
        title="GPU use by notebook",
        columns=("CUDA", "ID", "WHO", "MEMORY", "SM"),
        rows=rows,
        notes=(*notes, *((_UNATTRIBUTED_NOTE,) if unattributed else ())),
        flexible=frozenset({"WHO"}),
    )
