"""A service (and reconciler) wired to the in-memory fakes and a real ledger, for unit tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from jupyter_gpu_hotplug.agent.auth import Authorizer, Caller, PeerCredentials
from jupyter_gpu_hotplug.agent.books import Books
from jupyter_gpu_hotplug.agent.checkpoints import Checkpoints
from jupyter_gpu_hotplug.agent.ledger import Ledger
from jupyter_gpu_hotplug.agent.metrics import AgentMetrics
from jupyter_gpu_hotplug.agent.reconcile import Reconciler
from jupyter_gpu_hotplug.agent.service import AgentService, ServiceConfig
from jupyter_gpu_hotplug.agent.workers import Workers

from .fakes import FakeHost, FakeInjector, FakeInventory, FakeResolver, fake_gpus

MAJOR = 195
ADMIN = Caller(transport="tcp", peer=None, has_token=True)


def peer(pid: int) -> Caller:
    """A caller on the unix socket, without the token."""
    return Caller(transport="unix", peer=PeerCredentials(pid=pid, uid=0, gid=0), has_token=False)


@dataclass
class Harness:
    host: FakeHost
    injector: FakeInjector
    inventory: FakeInventory
    resolver: FakeResolver
    ledger: Ledger
    books: Books
    metrics: AgentMetrics
    service: AgentService
    reconciler: Reconciler
    state_dir: Path

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
) -> Harness:
    host = FakeHost()
    resolver = FakeResolver(host)
    injector = FakeInjector(host)
    inventory = FakeInventory(fake_gpus(gpus))
    ledger = Ledger.open(tmp_path / "state")
    books = Books(ledger, workers)
    await books.load()
    metrics = AgentMetrics()
    service = AgentService(
        books=books,
        inventory=inventory,
        injector=injector,
        resolver=resolver,
        authorizer=Authorizer(resolver),
        metrics=metrics,
        workers=workers,
        config=ServiceConfig(max_gpus_per_target=max_gpus, device_major=MAJOR, simulated=True),
        checkpoints=checkpoints,
    )
    reconciler = Reconciler(
        books=books,
        inventory=inventory,
        injector=injector,
        resolver=resolver,
        locks=service.locks,
        metrics=metrics,
        workers=workers,
        device_major=MAJOR,
    )
    return Harness(
        host,
        injector,
        inventory,
        resolver,
        ledger,
        books,
        metrics,
        service,
        reconciler,
        tmp_path / "state",
    )
