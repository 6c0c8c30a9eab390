"""The host half of an attach: make reserved GPUs usable in a container and record it, or roll
the attach back so that nothing is left half-done.

Why it exists: after the decision and the reservation (``service.py``), an attach changes the
host — device nodes made, the cgroup's permission given, the driver's files provided — and each
step can fail. The promise is that a GPU is never usable by a container without a reservation:
so the nodes the grant is about to make are recorded first (``intend_grant``: a crash after the
``mknod`` leaves them known as ours), the grant is recorded (``mark_granted``) only once it is
done, and on any failure the host is put back before the reservation goes — or, where even that
fails, the reservation stays ``reserving`` for the reconciler to finish. Kept apart from the
service's ordering of the whole attach, this is the one place that reads as that promise.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..._structs import GpuUuid
from ...linux.devnodes import DeviceNode
from .bundle import Core
from .devices import flat
from .driver_files import DriverFilesFailed
from .errors import AgentError, NotFound, TargetNotReady
from .injector import InjectionFailed, InjectorError, TargetGone
from .seams import HostContainer, Reservation

__all__ = ["attach_error", "grant_reserved", "undo_reservation"]

log = logging.getLogger(__name__)


async def grant_reserved(
    core: Core,
    container: HostContainer,
    entries: Sequence[Reservation],
    per_entry: Sequence[Sequence[DeviceNode]],
) -> list[Reservation]:
    """Make the reserved ``entries`` (whose nodes are ``per_entry``) usable in ``container``
    and record it (``mark_granted``); on any failure the attach is rolled back
    (``undo_reservation``) and the failure raised as the API's error."""
    uuids = [entry.gpu.uuid for entry in entries]
    nodes = flat(per_entry)
    try:
        await _intend_grant(core, container, entries, per_entry)
        await core.checkpoints.reach("after_intent")
        created = await core.workers.host(core.grant_usable, container, nodes)
    except InjectorError as e:
        await undo_reservation(core, container, uuids, nodes, clean=_is_clean(e))
        raise attach_error(container, e) from e
    except DriverFilesFailed as e:
        await undo_reservation(core, container, uuids, nodes, clean=False)
        raise TargetNotReady(
            f"the GPU could not be made usable in {container}: {e}",
            hint="nothing was left attached; see the agent's log",
            retryable=False,
        ) from e
    except BaseException:
        await undo_reservation(core, container, uuids, nodes, clean=False)
        raise
    await core.checkpoints.reach("after_grant")
    try:
        granted = await core.allocator.mark_granted(
            uuids,
            nodes_created=[
                entry.gpu.uuid
                for entry, own in zip(entries, per_entry, strict=True)
                if all(node.name in created for node in own)
            ],
        )
    except BaseException:
        await undo_reservation(core, container, uuids, nodes, clean=False)
        raise
    await core.checkpoints.reach("after_mark_granted")
    return granted


async def _intend_grant(
    core: Core,
    container: HostContainer,
    entries: Sequence[Reservation],
    per_entry: Sequence[Sequence[DeviceNode]],
) -> None:
    """Record, before the grant, that it is about to happen and which reservations' nodes it
    makes (all of their nodes absent now), so a crash after the ``mknod`` leaves them known as
    ours (``Allocator.intend_grant``)."""
    nodes = flat(per_entry)
    present = await core.workers.host(core.injector.present, container, nodes)
    absent = {node.name for node in nodes} - present
    making = [
        entry.gpu.uuid
        for entry, own in zip(entries, per_entry, strict=True)
        if all(node.name in absent for node in own)
    ]
    await core.allocator.intend_grant([entry.gpu.uuid for entry in entries], nodes_created=making)


async def undo_reservation(
    core: Core,
    target: HostContainer,
    uuids: list[GpuUuid],
    nodes: list[DeviceNode],
    *,
    clean: bool,
) -> None:
    """Roll an attach back after its grant failed or was not recorded.

    ``clean``: the host is known to be as before, so only the reservation goes. Otherwise the
    devices are revoked first; if even that fails the reservation stays, still ``reserving``,
    for the reconciler: releasing it would leave a GPU usable by a container that the
    allocator does not know holds it.
    """
    if not clean:
        try:
            # Which nodes the failed grant created is unknown: none is removed (without the
            # permission, a node left behind opens nothing).
            await core.workers.host(
                core.injector.revoke,
                target,
                nodes,
                force=False,
                keep_nodes=[node.name for node in nodes],
            )
        except TargetGone:
            log.info("%s exited during the attach; nothing left to revoke", target)
        except InjectorError as e:
            log.error(
                "attach of %s to %s failed and its grant could not be undone (%s); the "
                "reservation stays for the reconciler",
                ", ".join(uuids),
                target,
                e,
            )
            return
    await core.release(uuids)


def _is_clean(error: InjectorError) -> bool:
    """Whether a failed grant left the host as it was."""
    if isinstance(error, InjectionFailed):
        return error.clean
    return isinstance(error, TargetGone)


def attach_error(target: HostContainer, error: InjectorError) -> AgentError:
    """What the caller is told of a grant the host refused: the process gone (404), or a
    target whose devices could not be changed (422, nothing left attached)."""
    if isinstance(error, TargetGone):
        return NotFound(
            "process",
            str(target.pid),
            hint="the process exited during the attach; nothing was left behind",
        )
    return TargetNotReady(
        f"the GPU could not be made usable in {target}: {error}",
        hint="nothing was left attached; check that the target is a running container with a "
        "normal /dev, and see the agent's log",
        retryable=False,
    )
