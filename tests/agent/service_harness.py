"""A core, and the service and reconciler over it, wired to the in-memory fakes and a real
ledger, for unit tests."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

from jupyter_gpu_hotplug.agent.core.bundle import Core
from jupyter_gpu_hotplug.agent.core.checkpoints import Checkpoints
from jupyter_gpu_hotplug.agent.core.hooks import BackendHooks
from jupyter_gpu_hotplug.agent.core.metrics import AgentMetrics
from jupyter_gpu_hotplug.agent.core.reconcile import Reconciler
from jupyter_gpu_hotplug.agent.core.seams import Caller, ConnectionInfo, PeerCredentials
from jupyter_gpu_hotplug.agent.core.service import AgentService, ServiceConfig
from jupyter_gpu_hotplug.agent.core.workers import Workers
from jupyter_gpu_hotplug.agent.kubernetes.allocator import HolderAllocator
from jupyter_gpu_hotplug.agent.kubernetes.holders import HolderSpec
from jupyter_gpu_hotplug.agent.local.allocator import LedgerAllocator
from jupyter_gpu_hotplug.agent.local.identity import LocalIdentity
from jupyter_gpu_hotplug.agent.local.ledger import Ledger

from .fakes import (
    FakeHost,
    FakeInjector,
    FakeInventory,
    FakeResolver,
    MemoryAllocator,
    fake_gpus,
)

MAJOR = 195
TOKEN = "service-harness-token-0123456789"
ADMIN = Caller(description="token", privileged=True, connection=ConnectionInfo(transport="tcp"))


@dataclass
class Harness:
    host: FakeHost
    injector: FakeInjector
    inventory: FakeInventory
    resolver: FakeResolver
    ledger: Ledger
    """The ledger under ``allocator``; unused when the harness runs over ``MemoryAllocator``."""
    allocator: LedgerAllocator | MemoryAllocator
    identity: LocalIdentity
    metrics: AgentMetrics
    core: Core
    """The bundle the service and the reconciler share (its locks, queue, idle book...)."""
    service: AgentService
    reconciler: Reconciler
    state_dir: Path

    async def peer(self, pid: int) -> Caller:
        """A caller on the unix socket, without the token, as ``pid`` connected now (its
        container bound at accept; ``pid`` may be gone later)."""
        pidfd = os.pidfd_open(os.getpid())  # stands in for the peer's: alive
        try:
            info = self.identity.bind_connection(
                peer=PeerCredentials(pid=pid, uid=0, gid=0), pidfd=pidfd
            )
        finally:
            os.close(pidfd)
        return await self.identity.authenticate(authorization=None, connection=info)

    def sample(self, name: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


async def build(
    tmp_path: Path,
    *,
    gpus: int = 4,
    max_gpus: int = 8,
    checkpoints: Checkpoints | None = None,
    workers: Workers,
    allocator: Literal["ledger", "memory"] = "ledger",
    hooks: BackendHooks | None = None,
) -> Harness:
    host = FakeHost()
    resolver = FakeResolver(host)
    injector = FakeInjector(host)
    inventory = FakeInventory(fake_gpus(gpus))
    ledger = Ledger.open(tmp_path / "state")
    chosen: LedgerAllocator | MemoryAllocator = (
        LedgerAllocator(ledger, workers) if allocator == "ledger" else MemoryAllocator()
    )
    await chosen.load()
    identity = LocalIdentity(TOKEN, token_path=tmp_path / "token", resolver=resolver)
    metrics = AgentMetrics()
    core = Core.build(
        allocator=chosen,
        inventory=inventory,
        injector=injector,
        resolver=resolver,
        identity=identity,
        metrics=metrics,
        workers=workers,
        device_major=MAJOR,
        checkpoints=checkpoints,
        hooks=hooks,
    )
    service = AgentService(
        core,
        config=ServiceConfig(max_gpus_per_target=max_gpus, simulated=True),
    )
    return Harness(
        host,
        injector,
        inventory,
        resolver,
        ledger,
        chosen,
        identity,
        metrics,
        core,
        service,
        Reconciler(core, suspender=service.suspender),
        tmp_path / "state",
    )


def device_plugin_allocator() -> HolderAllocator:
    """Kubernetes' allocator with the device plugin (``selectable`` False), with no API
    server, kubelet or pods: any use of them fails, so a test over it shows that the service
    refused a request before the allocator was asked."""
    return HolderAllocator(
        kube=cast(Any, None),
        pods=cast(Any, None),
        podresources=cast(Any, None),
        spec=HolderSpec(node_name="gpu-node-1", resource_name="nvidia.com/gpu"),
        blocking=cast(Any, None),
    )


@contextlib.asynccontextmanager
async def built(
    tmp_path: Path, workers: Workers, *, hooks: BackendHooks | None = None
) -> AsyncIterator[Harness]:
    """A harness with 4 fake GPUs and a real ledger in ``tmp_path`` (``hooks``: a backend's
    part in the core, given at construction as ``runtime.py`` gives it); afterwards, whatever
    the test did, the service's in-memory books still equal the database."""
    harness = await build(tmp_path, workers=workers, hooks=hooks)
    try:
        yield harness
        assert harness.allocator.all_attachments() == harness.ledger.attachments()
    finally:
        harness.ledger.close()
