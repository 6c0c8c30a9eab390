"""``entitlement.judge``, table-tested like ``seams.TRANSITIONS``: every row is what a container
is entitled to, what the kernel says it can open, and the verdict on each GPU — the one
classification (accounted / orphan / stray) that detach, take-back, the reconciler and the
node sweep share (``core/entitlement.py``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime

import pytest

from jupyter_gpu_hotplug._structs import GpuUuid, PidTarget
from jupyter_gpu_hotplug.agent.core import seams
from jupyter_gpu_hotplug.agent.core.entitlement import (
    Access,
    Entitlement,
    holds,
    judge,
    to_check,
)
from jupyter_gpu_hotplug.agent.core.injector import DeviceState
from jupyter_gpu_hotplug.agent.core.seams import GpuRecord
from jupyter_gpu_hotplug.linux.devnodes import DeviceNode
from jupyter_gpu_hotplug.linux.devrules import CharDevice


def node(name: str, minor: int, major: int = 195) -> DeviceNode:
    return DeviceNode(name, CharDevice(major, minor))


def gpu(uuid: str, minor: int) -> GpuRecord:
    return GpuRecord(GpuUuid(uuid), minor, minor, "H100")


WHOLE_0, WHOLE_1 = gpu("GPU-0", 0), gpu("GPU-1", 1)
PARENT_2 = gpu("GPU-2", 2)
SLICE_A, SLICE_B = gpu("MIG-a", 2), gpu("MIG-b", 2)
"""Two slices of GPU 2: each needs GPU 2's node and two capability nodes of its own."""
NODES: Mapping[GpuUuid, tuple[DeviceNode, ...]] = {
    WHOLE_0.uuid: (node("nvidia0", 0),),
    WHOLE_1.uuid: (node("nvidia1", 1),),
    PARENT_2.uuid: (node("nvidia2", 2),),
    SLICE_A.uuid: (node("nvidia2", 2), node("caps/a-gi", 11, 237), node("caps/a-ci", 12, 237)),
    SLICE_B.uuid: (node("nvidia2", 2), node("caps/b-gi", 21, 237), node("caps/b-ci", 22, 237)),
}

OPEN_OURS = "open, our grant"
OPEN_THEIRS = "open, somebody else's rule"
CLOSED = "cannot open"


def states(**by_name: str) -> dict[str, str]:
    """Node name → what the kernel says (``caps__b_gi`` names ``caps/b-gi``)."""
    return {name.replace("__", "/").replace("_", "-"): what for name, what in by_name.items()}


def device_states(given: Mapping[str, str]) -> dict[CharDevice, DeviceState]:
    """What ``Injector.status`` would say of each node named in ``given``."""
    found = {}
    for gpu_nodes in NODES.values():
        for each in gpu_nodes:
            what = given.get(each.name, CLOSED)
            opens = what != CLOSED
            found[each.device] = DeviceState(
                each.device,
                usable=opens,
                exposed=opens,
                permitted=what == OPEN_OURS,
                node=opens,
                ours=what == OPEN_OURS,
                opens=opens,
            )
    return found


Row = tuple[str, Entitlement, Sequence[GpuRecord], dict[str, str], dict[str, Access]]

TABLE: list[Row] = [
    (
        "reserved: accounted, whatever the kernel says",
        Entitlement((WHOLE_0,)),
        [WHOLE_0],
        {},
        {"GPU-0": Access.ACCOUNTED},
    ),
    (
        "assigned by the runtime or plugin: accounted",
        Entitlement((), frozenset({GpuUuid("GPU-1")})),
        [WHOLE_1],
        states(nvidia1=OPEN_THEIRS),
        {"GPU-1": Access.ACCOUNTED},
    ),
    (
        "our grant, nothing reserves it: orphan",
        Entitlement((WHOLE_0,)),
        [WHOLE_0, WHOLE_1],
        states(nvidia0=OPEN_OURS, nvidia1=OPEN_OURS),
        {"GPU-0": Access.ACCOUNTED, "GPU-1": Access.ORPHAN},
    ),
    (
        "somebody else's rule: stray",
        Entitlement(()),
        [WHOLE_1],
        states(nvidia1=OPEN_THEIRS),
        {"GPU-1": Access.STRAY},
    ),
    ("cannot open it: not judged", Entitlement(()), [WHOLE_1], {}, {}),
    (
        "a slice whose capability nodes do not open: not judged",
        Entitlement(()),
        [SLICE_B],
        states(nvidia2=OPEN_THEIRS, caps__b_gi=OPEN_THEIRS),
        {},
    ),
    (
        "the parent GPU's node a reserved slice needs: accounted",
        Entitlement((SLICE_A,)),
        [SLICE_A, PARENT_2],
        states(nvidia2=OPEN_OURS),
        {"MIG-a": Access.ACCOUNTED, "GPU-2": Access.ACCOUNTED},
    ),
    (
        "another slice of a reserved slice's GPU, our grant: orphan (its caps alone)",
        Entitlement((SLICE_A,)),
        [SLICE_A, SLICE_B],
        states(nvidia2=OPEN_THEIRS, caps__b_gi=OPEN_OURS, caps__b_ci=OPEN_OURS),
        {"MIG-a": Access.ACCOUNTED, "MIG-b": Access.ORPHAN},
    ),
    (
        "ours on one node, somebody else's on the other: stray",
        Entitlement(()),
        [SLICE_B],
        states(nvidia2=OPEN_OURS, caps__b_gi=OPEN_OURS, caps__b_ci=OPEN_THEIRS),
        {"MIG-b": Access.STRAY},
    ),
]


@pytest.mark.parametrize(
    ("entitlement", "known", "kernel", "expected"),
    [row[1:] for row in TABLE],
    ids=[row[0] for row in TABLE],
)
def test_every_row_of_the_table(
    entitlement: Entitlement,
    known: Sequence[GpuRecord],
    kernel: dict[str, str],
    expected: dict[str, Access],
) -> None:
    nodes = [(each, NODES[each.uuid]) for each in known]
    verdicts = judge(entitlement, nodes, device_states(kernel))
    assert {v.gpu.uuid: v.access for v in verdicts} == expected


def test_a_verdict_names_only_the_nodes_nothing_entitled_needs() -> None:
    """What a take-back of the orphan revokes: slice B's capability nodes, never GPU 2's node,
    which the reserved slice A needs too."""
    nodes = [(each, NODES[each.uuid]) for each in (SLICE_A, SLICE_B)]
    kernel = states(nvidia2=OPEN_OURS, caps__b_gi=OPEN_OURS, caps__b_ci=OPEN_OURS)
    (_, orphan) = judge(Entitlement((SLICE_A,)), nodes, device_states(kernel))
    assert [n.name for n in orphan.nodes] == ["caps/b-gi", "caps/b-ci"]


def test_only_what_it_is_not_entitled_to_is_checked_each_node_once() -> None:
    nodes = [(each, NODES[each.uuid]) for each in (WHOLE_0, SLICE_A, SLICE_B, PARENT_2)]
    checked = to_check(Entitlement((WHOLE_0,)), nodes)
    assert [n.name for n in checked] == [
        "nvidia2",
        "caps/a-gi",
        "caps/a-ci",
        "caps/b-gi",
        "caps/b-ci",
    ]


def test_unknown_nodes_are_not_judged() -> None:
    """A slice NVML no longer lists has no nodes to look for (``GpuNodes.of`` failed)."""
    assert judge(Entitlement(()), [(SLICE_B, ())], {}) == []


CONTAINER = seams.ContainerCgroups(devices_v1=None, unified="/sandbox/a")


def container(key: str, pid: int = 100) -> seams.HostContainer:
    return seams.HostContainer(
        target=PidTarget(pid, 1),
        key=seams.ContainerKey(key),
        pid=pid,
        start_time=1,
        cgroups=CONTAINER,
        label=f"process {pid}",
    )


def reservation(record: GpuRecord, key: str, pid: int = 100) -> seams.Reservation:
    return seams.Reservation(
        gpu=record,
        target=PidTarget(pid, 1),
        container=seams.ContainerKey(key),
        state=seams.ReservationState.GRANTED,
        request_id=None,
        created_at=datetime.now(UTC),
        granted_at=None,
    )


def test_a_container_is_entitled_to_its_own_reservations_and_what_it_was_assigned() -> None:
    """Two targets in one container share its reservations; another container's are not its
    own; a reservation recorded without a container belongs to its target's container."""
    mine = container("c-a")
    reservations = [
        reservation(WHOLE_0, "c-a"),
        reservation(WHOLE_1, "c-a", pid=101),
        reservation(PARENT_2, "c-b", pid=100),
        reservation(SLICE_A, "", pid=100),
        reservation(SLICE_B, "", pid=102),
    ]
    entitlement = Entitlement.of(mine, reservations, assigned={GpuUuid("GPU-9")})
    assert entitlement.uuids == {"GPU-0", "GPU-1", "MIG-a", "GPU-9"}
    assert [holds(entry, mine) for entry in reservations] == [True, True, False, True, False]


def test_what_a_container_keeps_when_some_gpus_leave() -> None:
    entitlement = Entitlement((WHOLE_0, SLICE_A), frozenset({GpuUuid("MIG-b")}))
    kept = entitlement.keeping({GpuUuid("GPU-0")}, known=[SLICE_B, WHOLE_1])
    assert kept == [SLICE_A, SLICE_B]
    assert entitlement.keeping({GpuUuid("MIG-a"), GpuUuid("MIG-b")}, known=[SLICE_B]) == [WHOLE_0]
