"""The running agent: its components wired together, started and stopped in order.

Why it exists: the application (``app.py``) deals with configuration; this module deals with
life. ``Agent.create`` builds the real components from ``AgentSettings`` — the local backend's
ledger, resolver and identity, the simulated NVML when asked, inventory and engine — and plugs
them into the core's service and reconciler and the API server;
``start`` reconciles the ledger with the host *before* serving, then serves and runs the
background loops (reconciliation, simulated readings, the cached health probe); ``stop``
stops accepting, lets running operations finish, and closes everything in reverse order.

Tests build an ``Agent`` from fakes through the same constructor, so the wiring they exercise
is the wiring that runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..linux.mig import MigCaps
from . import openapi_document
from .api.handlers import (
    ApiContext,
    Unwell,
    api_only_handlers,
    default_handlers,
    metrics_handlers,
)
from .api.server import AgentServer, make_application
from .core.checkpoints import Checkpoints
from .core.devices import GpuNodes
from .core.idle import IdleBook, IdlePolicy, IdleReleaser, Usage
from .core.injector import EngineInjector, Injector
from .core.inventory import Inventory, NvmlInventory
from .core.lost import LossRules, LostGpus
from .core.metrics import AgentMetrics
from .core.reconcile import Reconciler, ReconcileReport
from .core.seams import Allocator, Identity, Resolver
from .core.service import AgentService, ServiceConfig
from .core.workers import Workers
from .local.allocator import LedgerAllocator
from .local.identity import LocalIdentity, load_or_create_token
from .local.ledger import Ledger
from .local.resolver import ProcResolver
from .local.simulate import Simulation
from .settings import AgentSettings, Backend
from .statedir import prepare_state_dir

if TYPE_CHECKING:
    from ..linux.cgroups import CgroupHierarchies
    from ..linux.engine import HotplugEngine

__all__ = ["Agent", "Components", "HealthProbe"]

log = logging.getLogger(__name__)

_WORKERS = 8
_HEALTH_INTERVAL = 5.0
_DRAIN_TIMEOUT = 30.0


class HealthProbe:
    """The cached verdicts of ``/healthz`` (liveness) and ``/readyz`` (readiness).

    A cheap ledger read every few seconds, cached (as kopf's probes are) so that a probe never
    queues behind slow work and a burst of probes costs nothing. Liveness and readiness differ
    as Kubernetes means them: while the agent starts (reconciling, before the first probe) and
    while it stops, it is alive but not ready; a failed ledger read, or a verdict older than
    three intervals (the probe itself is stuck), makes it neither.
    """

    def __init__(
        self,
        check: Callable[[], Coroutine[Any, Any, None]],
        *,
        interval: float = _HEALTH_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._check = check
        self._interval = interval
        self._clock = clock
        self._problem: str | None = None
        self._at: float | None = None
        self._stopping = False

    def verdict(self) -> Unwell | None:
        """Liveness: None when alive (starting included), else what is wrong."""
        if self._at is not None and self._clock() - self._at > 3 * self._interval:
            return Unwell("failing", f"no health probe for {self._clock() - self._at:.0f} s")
        return None if self._problem is None else Unwell("failing", self._problem)

    def readiness(self) -> Unwell | None:
        """Readiness: None when requests are served, else why not (starting, stopping...)."""
        if self._stopping:
            return Unwell("stopping", "the agent finishes the operations in flight and exits")
        if self._at is None:
            return Unwell("starting", "the agent reconciles its ledger with the host")
        return self.verdict()

    def stopping(self) -> None:
        """From now on, not ready (the agent is shutting down)."""
        self._stopping = True

    async def probe(self) -> None:
        try:
            await self._check()
        except Exception as e:
            if self._problem is None:
                log.error("health probe failed: %s", e)
            self._problem = f"{type(e).__name__}: {e}"
        else:
            self._problem = None
        self._at = self._clock()

    async def run_forever(self) -> None:
        while True:
            await self.probe()
            await asyncio.sleep(self._interval)


class BackendHooks(Protocol):
    """What a backend runs beside the core once the agent serves (Kubernetes: reactions to
    pod events), and stops before the agent closes."""

    def bind(
        self,
        *,
        service: AgentService,
        lost: LostGpus,
        reconciler: Reconciler,
        injector: Injector,
        metrics: AgentMetrics,
        workers: Workers,
    ) -> None:
        """Join the core before the first reconciliation (its node-wide sweeps, listeners)."""

    def start(self, *, reconcile: Callable[[], Awaitable[ReconcileReport]]) -> None: ...

    async def stop(self) -> None: ...


@dataclass
class Components:
    """The parts of an agent; ``Agent.create`` makes the real ones, tests pass fakes."""

    settings: AgentSettings
    ledger: Ledger | None
    """Local mode's ledger (the allocator is built over it); None when ``allocator`` is given."""
    inventory: Inventory
    injector: Injector
    resolver: Resolver
    identity: Identity
    simulation: Simulation | None = None
    usage: Usage = dict
    """GPU utilisation by UUID, for the idle policy (NVML's; tests give their own)."""
    mig_caps: Callable[[], MigCaps] | None = None
    """The host's MIG capability tables (``None``: no slices are handed out)."""
    metrics: AgentMetrics = field(default_factory=AgentMetrics)
    closers: list[Callable[[], None]] = field(default_factory=list)
    """Called in reverse order when the agent stops (after the ledger closes: first)."""
    allocator: Allocator | None = None
    """Another backend's allocator (Kubernetes: holder pods) instead of the ledger's."""
    hooks: BackendHooks | None = None


def _service(components: Components, allocator: Allocator, workers: Workers) -> AgentService:
    """The one ``AgentService`` over the backend's seams, configured from the settings."""
    settings = components.settings
    return AgentService(
        allocator=allocator,
        inventory=components.inventory,
        injector=components.injector,
        resolver=components.resolver,
        identity=components.identity,
        metrics=components.metrics,
        workers=workers,
        config=ServiceConfig(
            max_gpus_per_target=settings.max_gpus_per_target,
            device_major=settings.device_major,
            simulated=settings.simulated,
            mig_profile=None if settings.kubernetes is None else settings.kubernetes.mig_profile,
        ),
        checkpoints=Checkpoints(pause_at=settings.hooks.pause_at, marker_dir=settings.state_dir),
        nodes=GpuNodes(major=settings.device_major, mig_caps=components.mig_caps),
        idle=IdleBook(
            policy=IdlePolicy(
                idle_seconds=settings.idle_release_seconds,
                warning_seconds=settings.idle_warning_seconds,
                max_lease_seconds=settings.max_lease_seconds,
            )
        ),
    )


class Agent:
    """One running agent (see the module docstring)."""

    def __init__(self, components: Components) -> None:
        self.components = components
        settings = components.settings
        self.settings = settings
        self.metrics = components.metrics
        self._workers = Workers(host_threads=_WORKERS)
        self.allocator: Allocator
        if components.allocator is not None:
            self.allocator = components.allocator
        else:
            assert components.ledger is not None, "local mode needs its ledger"
            self.allocator = LedgerAllocator(components.ledger, self._workers)
        self.service = _service(components, self.allocator, self._workers)
        self.lost = LostGpus(
            rules=LossRules(grace_seconds=settings.lost_grace_seconds, policy=settings.lost_policy),
            book=self.service.losses,
            metrics=self.metrics,
        )
        self.idle = IdleReleaser(
            book=self.service.idle,
            allocator=self.allocator,
            resolver=components.resolver,
            injector=components.injector,
            usage=components.usage,
            release=self.service.release_unused,
            locks=self.service.locks,
            metrics=self.metrics,
            workers=self._workers,
            nodes=self.service.nodes,
        )
        self.reconciler = Reconciler(
            allocator=self.allocator,
            inventory=components.inventory,
            injector=components.injector,
            resolver=components.resolver,
            locks=self.service.locks,
            metrics=self.metrics,
            workers=self._workers,
            device_major=settings.device_major,
            on_change=self.service.queue.notify,
            nodes=self.service.nodes,
        )
        self.health = HealthProbe(self._health_check)
        self.server, self.metrics_server = self._api_servers()
        self._tasks: list[asyncio.Task[None]] = []
        self.metrics.simulated.set(1 if settings.simulated else 0)

    def _api_servers(self) -> tuple[AgentServer, AgentServer | None]:
        """The HTTP API over the service, bound to connections by the backend's identity, and
        ``/metrics`` on an address of its own when one is given (its handlers never read a
        caller)."""
        identity = self.components.identity
        context = ApiContext(
            service=self.service,
            identity=identity,
            metrics=self.metrics,
            openapi=openapi_document(),
            health=self.health.verdict,
            readiness=self.health.readiness,
        )
        if not self.settings.metrics_listen:
            api = make_application(context, default_handlers)
            return AgentServer(api, binder=identity.bind_connection), None
        return (
            AgentServer(
                make_application(context, api_only_handlers), binder=identity.bind_connection
            ),
            AgentServer(
                make_application(context, metrics_handlers), binder=identity.bind_connection
            ),
        )

    @classmethod
    def create(cls, settings: AgentSettings) -> Agent:
        """The real components for ``settings``; everything opened is closed on failure."""
        if settings.backend is Backend.KUBERNETES:
            return cls._create_kubernetes(settings)
        closers: list[Callable[[], None]] = []
        try:
            prepare_state_dir(settings.state_dir)
            ledger = Ledger.open(settings.state_dir)
            closers.append(ledger.close)
            token = load_or_create_token(settings.token_path)
            simulation, inventory, hierarchies = cls._host(settings, closers)
            engine = cls._engine(settings, hierarchies, inventory)
            resolver = ProcResolver(
                host_proc=settings.host_proc, hierarchies=hierarchies, agent_pid=os.getpid()
            )
        except BaseException:
            for close in reversed(closers):
                close()
            raise
        return cls(
            Components(
                settings=settings,
                ledger=ledger,
                inventory=inventory,
                injector=EngineInjector(engine),
                resolver=resolver,
                identity=LocalIdentity(token, token_path=settings.token_path, resolver=resolver),
                simulation=simulation,
                usage=inventory.utilization,
                mig_caps=_mig_caps(settings, simulation),
                closers=closers,
            )
        )

    @staticmethod
    def _host(
        settings: AgentSettings, closers: list[Callable[[], None]]
    ) -> tuple[Simulation | None, NvmlInventory, CgroupHierarchies]:
        """What every backend needs of the host: the (simulated) NVML inventory and the
        device-cgroup hierarchies; what must be closed is added to ``closers``."""
        from ..linux import cgroups

        simulation = None
        if settings.simulated:
            simulation = Simulation.prepare(
                settings.simulation_dir or settings.state_dir / "simulation",
                settings.simulate,
                mig_profiles=settings.simulate_mig,
                host_proc_devices=settings.host_proc / "devices",
            )
            simulation.load_in_process()
        inventory = NvmlInventory()
        closers.append(inventory.close)
        # Rebased, the mounts are the host's (its init's mount namespace, seen with hostPID):
        # our own would list the host's hierarchies where we see them, already under the root.
        hierarchies = cgroups.discover(
            host_proc=settings.host_proc,
            pid="self" if settings.cgroup_root is None else 1,
            rebase=settings.cgroup_root,
        )
        log.info("device cgroups: %s layout", hierarchies.layout)
        return simulation, inventory, hierarchies

    @staticmethod
    def _engine(
        settings: AgentSettings, hierarchies: CgroupHierarchies, inventory: NvmlInventory
    ) -> HotplugEngine:
        """The hot-plug engine, asking NVML too which processes hold a GPU open."""
        from ..linux.engine import HotplugEngine

        major = settings.device_major

        def nvml_holders(device: Any) -> list[int]:
            return inventory.running_pids(device.minor) if device.major == major else []

        return HotplugEngine(
            host_proc=settings.host_proc,
            hierarchies=hierarchies,
            extra_holders=nvml_holders,
            terminate_grace=settings.force_grace,
        )

    @classmethod
    def _create_kubernetes(cls, settings: AgentSettings) -> Agent:
        """Kubernetes mode: holder pods, pods as targets, callers by their pods' tokens."""
        try:
            from .kubernetes.backend import KubernetesBackend
        except ModuleNotFoundError as e:
            # The Kubernetes client, grpcio and protobuf are the [agent] extra: notebook images
            # install the package without them (pyproject.toml says why).
            raise RuntimeError(
                f"Kubernetes mode needs the agent's dependencies ({e.name} is not installed):"
                " pip install 'jupyter-gpu-hotplug[agent]'"
            ) from e

        closers: list[Callable[[], None]] = []
        try:
            # Holder pods are the state; the directory keeps only simulation files and the
            # crash tests' checkpoint markers.
            prepare_state_dir(settings.state_dir)
            simulation, inventory, hierarchies = cls._host(settings, closers)
            backend = KubernetesBackend.create(settings, hierarchies)
            closers.append(backend.close)
            injector = EngineInjector(cls._engine(settings, hierarchies, inventory))
        except BaseException:
            for close in reversed(closers):
                close()
            raise
        return cls(
            Components(
                settings=settings,
                ledger=None,
                inventory=inventory,
                injector=injector,
                resolver=backend.resolver,
                identity=backend.identity,
                simulation=simulation,
                usage=inventory.utilization,
                closers=closers,
                allocator=backend.allocator,
                hooks=backend,
                mig_caps=_mig_caps(settings, simulation),
            )
        )

    async def _health_check(self) -> None:
        """The ledger answers (behind whatever is queued for it)."""
        await self.allocator.check()

    async def start(self) -> None:
        """Reconcile, then serve and run the background loops."""
        hooks = self.components.hooks
        if hooks is not None:
            hooks.bind(
                service=self.service,
                lost=self.lost,
                reconciler=self.reconciler,
                injector=self.components.injector,
                metrics=self.metrics,
                workers=self._workers,
            )
        await self.allocator.load()
        report = await self.reconciler.run_once()
        log.info(
            "start-up reconciliation: %s",
            dict(report.actions) if report.changed else "ledger and host agree",
        )
        for failure in report.failures:
            log.error("start-up reconciliation could not fix: %s", failure)
        await self.service.refresh_gpu_metrics()
        if hooks is not None:
            hooks.start(reconcile=self.reconciler.run_once)
        settings = self.settings
        self.server.start(
            settings.listen, socket_mode=settings.socket_mode, socket_group=settings.socket_group
        )
        if self.metrics_server is not None:
            self.metrics_server.start(
                settings.metrics_listen, socket_mode=settings.socket_mode, socket_group=None
            )
        await self.health.probe()
        self._spawn(self.health.run_forever())
        if settings.reconcile_interval > 0:
            self._spawn(self.reconciler.run_forever(settings.reconcile_interval))
        self._spawn(self.idle.run_forever(settings.idle_check_interval))
        simulation = self.components.simulation
        if simulation is not None and settings.simulation_interval > 0:
            self._spawn(
                simulation.animate(
                    interval=settings.simulation_interval, in_use=self.idle.held_gpus
                )
            )

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        self._tasks.append(asyncio.create_task(coroutine))

    async def reconcile_now(self) -> None:
        """One reconciliation pass outside the schedule (SIGHUP); a failure is logged."""
        try:
            report = await self.reconciler.run_once()
        except Exception:
            log.exception("reconciliation on request failed")
            return
        log.info("reconciliation on request: %s", dict(report.actions) or "nothing to do")

    async def stop(self) -> None:
        """Stop serving, let running operations finish, close everything."""
        log.info("stopping: no new connections; waiting for operations in flight")
        self.health.stopping()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        self.server.stop_listening()
        if self.metrics_server is not None:
            self.metrics_server.stop_listening()
        try:
            await asyncio.wait_for(self.service.wait_idle(), _DRAIN_TIMEOUT)
        except TimeoutError:
            log.error("operations still running after %.0f s; stopping anyway", _DRAIN_TIMEOUT)
        await self.server.close_connections()
        if self.metrics_server is not None:
            await self.metrics_server.close_connections()
        if self.components.hooks is not None:
            await self.components.hooks.stop()
        self._workers.shutdown()
        for close in reversed(self.components.closers):
            close()
        log.info("stopped")


def _mig_caps(settings: AgentSettings, simulation: Simulation | None) -> Callable[[], MigCaps]:
    """How to read the MIG capability tables: the simulated node's, or the host's (from the
    host's procfs, read each time: the driver numbers instances when they are created)."""
    proc_devices = settings.host_proc / "devices"
    mig_minors = settings.host_proc / "driver" / "nvidia-caps" / "mig-minors"
    if simulation is not None and simulation.mig_minors is not None:
        proc_devices, mig_minors = simulation.proc_devices or proc_devices, simulation.mig_minors
    return lambda: MigCaps.read(proc_devices=proc_devices, mig_minors=mig_minors)
