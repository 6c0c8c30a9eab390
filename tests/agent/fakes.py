"""In-memory fakes of the agent's host seams: the injector, the resolver and the inventory.

They follow the Protocols of ``agent/injector.py``, ``agent/resolver.py`` and
``agent/inventory.py`` closely enough that the service, the reconciler and the HTTP API run
against them unchanged, and they let a test script what the host does: processes that exit,
grants that fail (cleanly or not), devices held open, GPUs that fall off the bus. Calls block
like the real ones would (they run in the service's thread pool), and ``gate`` lets a test hold
a call until it says so.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from jupyter_gpu_hotplug._structs import (
    GpuUuid,
    PidRef,
    PidTarget,
    PodTarget,
    RequestId,
    Target,
    TargetRef,
)
from jupyter_gpu_hotplug.agent.core.errors import (
    Forbidden,
    InsufficientGpus,
    LookupFailed,
    NotFound,
    Timeout,
)
from jupyter_gpu_hotplug.agent.core.injector import (
    DeviceInUse,
    DeviceState,
    HolderInfo,
    InjectionFailed,
    TargetGone,
)
from jupyter_gpu_hotplug.agent.core.inventory import GpuDevice, InventorySnapshot, LostGpu
from jupyter_gpu_hotplug.agent.core.seams import (
    ContainerCgroups,
    ContainerKey,
    GpuRecord,
    HostContainer,
    Reservation,
    ReservationState,
    Transition,
    plan_transition,
)
from jupyter_gpu_hotplug.agent.local.resolver import LOCAL_TARGET_HINT
from jupyter_gpu_hotplug.linux.devnodes import DeviceNode
from jupyter_gpu_hotplug.linux.devrules import CharDevice

AGENT_PID = 4000
AGENT_CONTAINER = ContainerCgroups(devices_v1="/", unified="/")


def container(name: str) -> ContainerCgroups:
    return ContainerCgroups(devices_v1=f"/sandboxes/{name}", unified=f"/sandboxes/{name}")


def fake_gpus(count: int) -> list[GpuDevice]:
    return [
        GpuDevice(
            uuid=GpuUuid(f"GPU-{index:08x}-0000-4000-8000-000000000000"),
            index=index,
            minor=index,
            name="Fake GPU (simulated)",
            memory_total=80 * 2**30,
            simulated=True,
        )
        for index in range(count)
    ]


@dataclass
class FakeProcess:
    pid: int
    start_time: int
    container: ContainerCgroups

    @property
    def target(self) -> PidTarget:
        return PidTarget(self.pid, self.start_time)

    @property
    def target_ref(self) -> PidRef:
        return PidRef(self.pid)


@dataclass
class FakeHost:
    """The processes of a pretend host; the resolver and the injector share it.

    A container's key is its cgroups plus a generation, bumped when ``replace`` re-creates
    the container under the same cgroups (as a new cgroup gets a new id)."""

    processes: dict[int, FakeProcess] = field(default_factory=dict)
    generations: dict[ContainerCgroups, int] = field(default_factory=dict)
    cgroups: set[ContainerCgroups] = field(default_factory=set)
    """The containers' cgroups that exist (they outlive their processes until removed)."""
    _next_start: int = 1000

    def spawn(self, pid: int, container_name: str | ContainerCgroups) -> FakeProcess:
        self._next_start += 1
        where = container(container_name) if isinstance(container_name, str) else container_name
        process = FakeProcess(pid, self._next_start, where)
        self.processes[pid] = process
        self.cgroups.add(where)
        return process

    def kill(self, pid: int) -> None:
        del self.processes[pid]

    def remove_container(self, name: str) -> None:
        """Every process of the container ends and its cgroups go (a new one under the same
        cgroups is another container)."""
        where = container(name)
        self.empty_container(name)
        self.cgroups.discard(where)
        self.generations[where] = self.generations.get(where, 0) + 1

    def empty_container(self, name: str) -> None:
        """Every process of the container ends; its cgroups stay, with their rules."""
        where = container(name)
        for pid in [p.pid for p in self.processes.values() if p.container == where]:
            self.kill(pid)

    def alive(self, target: PidTarget) -> FakeProcess | None:
        process = self.processes.get(target.pid)
        if process is None or process.start_time != target.start_time:
            return None
        return process

    def key_of(self, where: ContainerCgroups) -> ContainerKey:
        return ContainerKey(f"fake:{where}#{self.generations.get(where, 0)}")

    def host_container(self, process: FakeProcess) -> HostContainer:
        return HostContainer(
            target=process.target,
            key=self.key_of(process.container),
            pid=process.pid,
            start_time=process.start_time,
            cgroups=process.container,
            label=f"process {process.pid}",
        )


class FakeResolver:
    """``Resolver`` over a ``FakeHost``, refusing what ``ProcResolver`` refuses (and what
    ``LocalIdentity`` asks of it)."""

    def __init__(self, host: FakeHost, *, agent_pid: int = AGENT_PID) -> None:
        self.host = host
        self.agent_pid = agent_pid
        self.replacements: dict[str, int] = {}
        """Target key → pid of the process whose container replaced the target's (as a
        restarted Kubernetes container replaces its predecessor under the same name)."""
        self.unanswered = False
        """While True, ``lookup`` and ``current`` cannot tell (``LookupFailed``), as the
        Kubernetes resolver cannot while the API server or the runtime does not answer."""
        self.lookups = 0
        """How many lookups were asked (answered or not)."""
        host.processes.setdefault(agent_pid, FakeProcess(agent_pid, 1, AGENT_CONTAINER))

    @property
    def agent_container(self) -> ContainerCgroups:
        return AGENT_CONTAINER

    def resolve(self, ref: TargetRef) -> HostContainer:
        if isinstance(ref, PodTarget):
            raise NotFound(
                "pod",
                f"{ref.namespace}/{ref.name}",
                hint=f"this agent runs the local backend; {LOCAL_TARGET_HINT}",
            )
        process = self.host.processes.get(ref.pid)
        if process is None:
            raise NotFound("process", str(ref.pid))
        if ref.pid == self.agent_pid:
            raise Forbidden(f"process {ref.pid} is the GPU hot-plug agent itself")
        if process.container.in_root_cgroup:
            raise Forbidden(f"process {ref.pid} is not in a container")
        return self.host.host_container(process)

    def lookup(self, target: Target, key: ContainerKey) -> HostContainer | None:
        self.lookups += 1
        if self.unanswered:
            raise LookupFailed(f"{target}: the container runtime did not answer")
        process = self.host.alive(target) if isinstance(target, PidTarget) else None
        if process is None:
            return None
        found = self.host.host_container(process)
        return found if found.key == key else None

    def current(self, target: Target, key: ContainerKey) -> HostContainer | None:
        found = self.lookup(target, key)
        if found is not None:
            return found
        if target.key in self.replacements:
            return self.host.host_container(self.host.processes[self.replacements[target.key]])
        members = [p for p in self.host.processes.values() if self.host.key_of(p.container) == key]
        if not members:
            return None
        return self.host.host_container(min(members, key=lambda p: (p.start_time, p.pid)))

    def remains(self, key: ContainerKey) -> ContainerCgroups | None:
        return next((c for c in self.host.cgroups if self.host.key_of(c) == key), None)

    def container_of(self, pid: int) -> ContainerCgroups | None:
        process = self.host.processes.get(pid)
        return None if process is None else process.container

    def key_of(self, where: ContainerCgroups) -> ContainerKey:
        return self.host.key_of(where)

    def oldest_member(self, where: ContainerCgroups) -> int | None:
        members = [p for p in self.host.processes.values() if p.container == where]
        if not members:
            return None
        return min(members, key=lambda p: (p.start_time, p.pid)).pid


class Gate:
    """Holds calls until opened; ``entered`` counts callers waiting at it."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._lock = threading.Lock()
        self._entered = 0
        self._arrived = threading.Condition(self._lock)

    def pass_through(self) -> None:
        with self._arrived:
            self._entered += 1
            self._arrived.notify_all()
        if not self._open.wait(timeout=30):
            raise TimeoutError("the test never opened the gate")

    def wait_for(self, count: int, timeout: float = 30) -> None:
        with self._arrived:
            if not self._arrived.wait_for(lambda: self._entered >= count, timeout=timeout):
                raise TimeoutError(f"only {self._entered} of {count} callers reached the gate")

    def open(self) -> None:
        self._open.set()


@dataclass
class FakeInjector:
    """``Injector`` keeping grants per container in memory (as the cgroup would)."""

    host: FakeHost
    granted: dict[ContainerCgroups, set[CharDevice]] = field(default_factory=dict)
    holders_of: dict[tuple[ContainerCgroups, CharDevice], list[HolderInfo]] = field(
        default_factory=dict
    )
    grant_error: Callable[[], Exception] | None = None
    """Raised by the next grants instead of granting (after granting, if ``partial``)."""
    partial: bool = False
    revoke_error: Callable[[], Exception] | None = None
    gate: Gate | None = None
    """Every grant waits here first, when set."""
    calls: list[tuple[str, int, tuple[CharDevice, ...]]] = field(default_factory=list)
    forced: list[HolderInfo] = field(default_factory=list)

    def _container(self, target: HostContainer | PidTarget) -> ContainerCgroups:
        pid_target = target.target if isinstance(target, HostContainer) else target
        process = self.host.alive(pid_target) if isinstance(pid_target, PidTarget) else None
        if process is None:
            raise TargetGone(f"{target} has exited")
        return process.container

    def usable(self, target: HostContainer | PidTarget | ContainerCgroups) -> set[CharDevice]:
        where = target if isinstance(target, ContainerCgroups) else self._container(target)
        return set(self.granted.get(where, set()))

    def grant(self, target: HostContainer, devices: Sequence[DeviceNode]) -> frozenset[str]:
        if self.gate is not None:
            self.gate.pass_through()
        where = self._container(target)
        chars = tuple(node.device for node in devices)
        self.calls.append(("grant", target.pid, chars))
        if self.grant_error is not None:
            if self.partial:
                self.granted.setdefault(where, set()).update(chars)
            raise self.grant_error()
        had = self.granted.setdefault(where, set())
        created = frozenset(node.name for node in devices if node.device not in had)
        had.update(chars)
        return created

    def revoke(
        self,
        target: HostContainer,
        devices: Sequence[DeviceNode],
        *,
        force: bool,
        keep_nodes: Collection[str] = (),
        leave_open: bool = False,
    ) -> None:
        where = self._container(target)
        chars = tuple(node.device for node in devices)
        self.calls.append(("revoke", target.pid, chars))
        if self.revoke_error is not None:
            raise self.revoke_error()
        busy = [h for char in chars for h in self.holders_of.get((where, char), [])]
        if busy and not force and not leave_open:
            raise DeviceInUse(busy)
        if leave_open and not force:
            self.granted.get(where, set()).difference_update(chars)
            return
        for char in chars:
            self.forced.extend(self.holders_of.pop((where, char), []))
        self.granted.get(where, set()).difference_update(chars)

    def withdraw(self, cgroups: ContainerCgroups, devices: Sequence[DeviceNode]) -> None:
        chars = tuple(node.device for node in devices)
        self.calls.append(("withdraw", 0, chars))
        self.granted.get(cgroups, set()).difference_update(chars)

    def status(self, target: HostContainer, devices: Sequence[DeviceNode]) -> list[DeviceState]:
        have = self.usable(target)
        return [
            DeviceState(
                node.device,
                usable=node.device in have,
                exposed=node.device in have,
                permitted=node.device in have,
                node=node.device in have,
                # Every fake container is confined, and every permission is a grant the
                # agent's way (the fake keeps no runtime's rules).
                ours=node.device in have,
                opens=node.device in have,
            )
            for node in devices
        ]

    def present(self, target: HostContainer, devices: Sequence[DeviceNode]) -> frozenset[str]:
        have = self.usable(target)
        return frozenset(node.name for node in devices if node.device in have)

    def holders(
        self, target: HostContainer, devices: Sequence[DeviceNode], *, nvml: bool = True
    ) -> list[HolderInfo]:
        where = self._container(target)
        found = {
            h.pid: h for node in devices for h in self.holders_of.get((where, node.device), [])
        }
        return [found[pid] for pid in sorted(found)]

    def hold(self, process: FakeProcess, minor: int, *, pid: int, command: str = "python") -> None:
        key = (process.container, CharDevice(195, minor))
        self.holders_of.setdefault(key, []).append(HolderInfo(pid, command))


def unclean_failure() -> Exception:
    return InjectionFailed("mknod failed and the rollback too", clean=False)


def clean_failure() -> Exception:
    return InjectionFailed("/dev/nvidia0 is a symlink in the container", clean=True)


@dataclass
class FakeInventory:
    """``Inventory`` over a list the test edits."""

    gpus: list[GpuDevice]
    lost: list[LostGpu] = field(default_factory=list)
    processes: dict[int, list[int]] = field(default_factory=dict)
    memory: dict[int, dict[int, int | None]] = field(default_factory=dict)
    """By minor: NVML's device memory of each process (``used_memory``)."""
    error: Exception | None = None
    """Raised by ``snapshot`` (to provoke an internal error)."""

    def snapshot(self) -> InventorySnapshot:
        if self.error is not None:
            raise self.error
        return InventorySnapshot(gpus=tuple(self.gpus), lost=tuple(self.lost))

    def running_pids(self, minor: int) -> list[int]:
        return list(self.processes.get(minor, []))

    def used_memory(self, minor: int) -> dict[int, int | None]:
        return dict(self.memory.get(minor, {}))

    def lose(self, index: int) -> None:
        """The GPU at ``index`` falls off the bus."""
        (gpu,) = [g for g in self.gpus if g.index == index]
        self.gpus.remove(gpu)
        self.lost.append(LostGpu(index=index, reason="GPU is lost", last_known=gpu))


@dataclass
class MemoryAllocator:
    """``Allocator`` in memory: ``store`` plays the durable state (share it between instances
    to play a restart). It passes the allocator contract, so tests of the reconciler and the
    service over it hold for any allocator that does."""

    store: dict[GpuUuid, Reservation] = field(default_factory=dict)
    _view: dict[GpuUuid, Reservation] | None = None
    selectable: bool = True
    """False plays an allocator whose cluster picks the device (Kubernetes)."""

    async def load(self) -> None:
        self._view = self.store

    @property
    def _entries(self) -> dict[GpuUuid, Reservation]:
        if self._view is None:
            raise RuntimeError("MemoryAllocator.load() must run before it is read")
        return self._view

    async def reserve(
        self,
        container: HostContainer,
        count: int,
        *,
        request_id: RequestId | None,
        deadline: float,
        candidates: Sequence[GpuRecord],
    ) -> list[Reservation]:
        if time.monotonic() > deadline:
            raise Timeout("deadline passed", wait_seconds=0)
        free = [gpu for gpu in candidates if gpu.uuid not in self._entries]
        if len(free) < count:
            raise InsufficientGpus(free=len(free), requested=count)
        now = datetime.now(UTC)
        for gpu in free[:count]:
            self._entries[gpu.uuid] = Reservation(
                gpu=gpu,
                target=container.target,
                container=container.key,
                state=ReservationState.RESERVING,
                request_id=request_id,
                created_at=now,
                granted_at=None,
            )
        return _ordered(self._entries[gpu.uuid] for gpu in free[:count])

    def _change(self, uuid: GpuUuid, **changes: object) -> Reservation:
        entry = dataclasses.replace(self._entries[uuid], **changes)  # type: ignore[arg-type]
        self._entries[uuid] = entry
        return entry

    async def intend_grant(
        self, uuids: Collection[GpuUuid], *, nodes_created: Collection[GpuUuid] = ()
    ) -> None:
        for uuid in nodes_created:
            if self._entries[uuid].state is ReservationState.RESERVING:
                self._change(uuid, node_created=True)

    async def mark_granted(
        self, uuids: Collection[GpuUuid], *, nodes_created: Collection[GpuUuid] = ()
    ) -> list[Reservation]:
        return self._move(Transition.MARK_GRANTED, uuids, nodes_created)

    async def begin_release(self, uuids: Collection[GpuUuid]) -> list[Reservation]:
        return self._move(Transition.BEGIN_RELEASE, uuids)

    async def cancel_release(self, uuids: Collection[GpuUuid]) -> list[Reservation]:
        return self._move(Transition.CANCEL_RELEASE, uuids)

    def _move(
        self,
        transition: Transition,
        uuids: Collection[GpuUuid],
        nodes_created: Collection[GpuUuid] = (),
    ) -> list[Reservation]:
        for uuid, state in plan_transition(transition, uuids, self._entries.get).items():
            entry = self._entries[uuid]
            if entry.state is ReservationState.RESERVING:
                self._change(
                    uuid,
                    state=state,
                    granted_at=datetime.now(UTC),
                    node_created=uuid in nodes_created,
                )
            elif entry.state is not state:
                self._change(uuid, state=state)
        return _ordered(self._entries[uuid] for uuid in uuids)

    async def release(self, uuids: Collection[GpuUuid]) -> None:
        for uuid in uuids:
            self._entries.pop(uuid, None)

    async def rebind(
        self, uuids: Collection[GpuUuid], container: HostContainer
    ) -> list[Reservation]:
        for uuid in uuids:
            self._change(uuid, target=container.target, container=container.key)
        return _ordered(self._entries[uuid] for uuid in uuids)

    def attachments_of(self, target: Target) -> list[Reservation]:
        return _ordered(e for e in self._entries.values() if e.target.key == target.key)

    def all_attachments(self) -> list[Reservation]:
        return _ordered(self._entries.values())

    def get(self, uuid: GpuUuid) -> Reservation | None:
        return self._entries.get(uuid)

    async def available(self, candidates: Sequence[GpuRecord]) -> list[GpuRecord]:
        return [gpu for gpu in candidates if gpu.uuid not in self._entries]

    async def check(self) -> None:
        return None


def _ordered(entries: Iterable[Reservation]) -> list[Reservation]:
    return sorted(entries, key=lambda entry: (entry.gpu.index, entry.gpu.uuid))
