"""In-memory fakes of the agent's host seams: the injector, the resolver and the inventory.

They follow the Protocols of ``agent/injector.py``, ``agent/resolver.py`` and
``agent/inventory.py`` closely enough that the service, the reconciler and the HTTP API run
against them unchanged, and they let a test script what the host does: processes that exit,
grants that fail (cleanly or not), devices held open, GPUs that fall off the bus. Calls block
like the real ones would (they run in the service's thread pool), and ``gate`` lets a test hold
a call until it says so.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from jupyter_gpu_hotplug._structs import GpuUuid, PidRef, PidTarget
from jupyter_gpu_hotplug.agent.errors import Forbidden, NotFound
from jupyter_gpu_hotplug.agent.injector import (
    DeviceInUse,
    DeviceState,
    HolderInfo,
    InjectionFailed,
    TargetGone,
)
from jupyter_gpu_hotplug.agent.inventory import GpuDevice, InventorySnapshot, LostGpu
from jupyter_gpu_hotplug.agent.resolver import ContainerId, ResolvedTarget
from jupyter_gpu_hotplug.linux.devnodes import DeviceNode
from jupyter_gpu_hotplug.linux.devrules import CharDevice

AGENT_PID = 4000
AGENT_CONTAINER = ContainerId(devices_v1="/", unified="/")


def container(name: str) -> ContainerId:
    return ContainerId(devices_v1=f"/sandboxes/{name}", unified=f"/sandboxes/{name}")


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
    container: ContainerId

    @property
    def target(self) -> PidTarget:
        return PidTarget(self.pid, self.start_time)

    @property
    def target_ref(self) -> PidRef:
        return PidRef(self.pid)


@dataclass
class FakeHost:
    """The processes of a pretend host; the resolver and the injector share it."""

    processes: dict[int, FakeProcess] = field(default_factory=dict)
    _next_start: int = 1000

    def spawn(self, pid: int, container_name: str | ContainerId) -> FakeProcess:
        self._next_start += 1
        where = container(container_name) if isinstance(container_name, str) else container_name
        process = FakeProcess(pid, self._next_start, where)
        self.processes[pid] = process
        return process

    def kill(self, pid: int) -> None:
        del self.processes[pid]

    def alive(self, target: PidTarget) -> FakeProcess | None:
        process = self.processes.get(target.pid)
        if process is None or process.start_time != target.start_time:
            return None
        return process


class FakeResolver:
    """``Resolver`` over a ``FakeHost``, refusing what ``ProcResolver`` refuses."""

    def __init__(self, host: FakeHost, *, agent_pid: int = AGENT_PID) -> None:
        self.host = host
        self.agent_pid = agent_pid
        host.processes.setdefault(agent_pid, FakeProcess(agent_pid, 1, AGENT_CONTAINER))

    def resolve(self, ref: PidRef) -> ResolvedTarget:
        process = self.host.processes.get(ref.pid)
        if process is None:
            raise NotFound("process", str(ref.pid))
        if ref.pid == self.agent_pid:
            raise Forbidden(f"process {ref.pid} is the GPU hot-plug agent itself")
        if process.container.in_root_cgroup:
            raise Forbidden(f"process {ref.pid} is not in a container")
        return ResolvedTarget(process.target, process.container)

    def lookup(self, target: PidTarget) -> ResolvedTarget | None:
        process = self.host.alive(target)
        return None if process is None else ResolvedTarget(process.target, process.container)

    def container_of(self, pid: int) -> ContainerId | None:
        process = self.host.processes.get(pid)
        return None if process is None else process.container

    def representative(self, pid: int) -> ResolvedTarget:
        process = self.host.processes.get(pid)
        if process is None:
            raise NotFound("process", str(pid))
        members = [p for p in self.host.processes.values() if p.container == process.container]
        oldest = min(members, key=lambda p: (p.start_time, p.pid))
        return self.resolve(PidRef(oldest.pid))


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
    granted: dict[ContainerId, set[CharDevice]] = field(default_factory=dict)
    holders_of: dict[tuple[ContainerId, CharDevice], list[HolderInfo]] = field(default_factory=dict)
    grant_error: Callable[[], Exception] | None = None
    """Raised by the next grants instead of granting (after granting, if ``partial``)."""
    partial: bool = False
    revoke_error: Callable[[], Exception] | None = None
    gate: Gate | None = None
    """Every grant waits here first, when set."""
    calls: list[tuple[str, int, tuple[CharDevice, ...]]] = field(default_factory=list)
    forced: list[HolderInfo] = field(default_factory=list)

    def _container(self, target: PidTarget) -> ContainerId:
        process = self.host.alive(target)
        if process is None:
            raise TargetGone(f"{target} has exited")
        return process.container

    def usable(self, target: PidTarget | ContainerId) -> set[CharDevice]:
        where = target if isinstance(target, ContainerId) else self._container(target)
        return set(self.granted.get(where, set()))

    def grant(self, target: PidTarget, devices: Sequence[DeviceNode]) -> None:
        if self.gate is not None:
            self.gate.pass_through()
        where = self._container(target)
        chars = tuple(node.device for node in devices)
        self.calls.append(("grant", target.pid, chars))
        if self.grant_error is not None:
            if self.partial:
                self.granted.setdefault(where, set()).update(chars)
            raise self.grant_error()
        self.granted.setdefault(where, set()).update(chars)

    def revoke(self, target: PidTarget, devices: Sequence[DeviceNode], *, force: bool) -> None:
        where = self._container(target)
        chars = tuple(node.device for node in devices)
        self.calls.append(("revoke", target.pid, chars))
        if self.revoke_error is not None:
            raise self.revoke_error()
        busy = [h for char in chars for h in self.holders_of.get((where, char), [])]
        if busy and not force:
            raise DeviceInUse(busy)
        for char in chars:
            self.forced.extend(self.holders_of.pop((where, char), []))
        self.granted.get(where, set()).difference_update(chars)

    def status(self, target: PidTarget, devices: Sequence[DeviceNode]) -> list[DeviceState]:
        have = self.usable(target)
        return [
            DeviceState(node.device, usable=node.device in have, exposed=node.device in have)
            for node in devices
        ]

    def holders(self, target: PidTarget, devices: Sequence[DeviceNode]) -> list[HolderInfo]:
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
    error: Exception | None = None
    """Raised by ``snapshot`` (to provoke an internal error)."""

    def snapshot(self) -> InventorySnapshot:
        if self.error is not None:
            raise self.error
        return InventorySnapshot(gpus=tuple(self.gpus), lost=tuple(self.lost))

    def running_pids(self, minor: int) -> list[int]:
        return list(self.processes.get(minor, []))

    def lose(self, index: int) -> None:
        """The GPU at ``index`` falls off the bus."""
        (gpu,) = [g for g in self.gpus if g.index == index]
        self.gpus.remove(gpu)
        self.lost.append(LostGpu(index=index, reason="GPU is lost", last_known=gpu))
